"""Score a captioner on held-out scenes as real files bring them, each condition separately: exact-match and
token accuracy of greedy captions decoded by xattn, on scenes drawn from a seed no training run saw (default
4; make_scenes.py uses 1, 2 and 3), the same scenes under every file condition; also the three-shape scenes
alone, drawn as the spec says (small shapes x 0.8) and as the generator drew them before (small shapes
unscaled), and the shipped samples (data/samples, against their metadata.jsonl).

    python recipes/eval_captioner_conditions.py --model data/models/scene-captioner \\
        --json data/models/scene-captioner/eval-conditions.json
"""

import argparse
import json
import os

from xattn.argtypes import integer
from xattn.files import save_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(REPO, "data", "samples")
TRAINING_SEEDS = (1, 2)  # make_scenes.py's train and validation splits: seen while training or choosing a model


def main():
    from xattn.datasets.augment import FILE_CONDITIONS
    from xattn.datasets.scenes import THREE_SHAPE_SCALE, draw, scene_for
    from xattn.tasks.captioning import Captioner, caption_accuracy

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped scene captioner)")
    parser.add_argument("--count", type=integer(1), default=500, help="scenes per condition (default 500)")
    parser.add_argument("--seed", type=integer(0), default=4, help="the scenes' seed (default 4)")
    parser.add_argument("--batch-size", type=integer(1), default=64)
    parser.add_argument("--json", help="also write the figures here (e.g. MODEL/eval-conditions.json)")
    args = parser.parse_args()
    if args.seed in TRAINING_SEEDS:
        parser.error(f"--seed {args.seed} drew training or validation scenes: choose another (default 4)")

    captioner = Captioner(args.model)

    def score(rows):
        result = caption_accuracy(captioner.engine, captioner.processor, captioner.tokenizer, rows,
                                  batch_size=args.batch_size)
        return {**result, "images": len(rows)}

    scenes = [scene_for(args.seed, i) for i in range(args.count)]
    drawn = [draw(scene) for scene in scenes]
    conditions = {name: score([{"image": change(image), "text": scene.caption} for image, scene in zip(drawn, scenes)])
                  for name, change in FILE_CONDITIONS.items()}
    threes = _three_shape_indices(args.seed, args.count)
    for name, small_scale in (("PNG, three-shape scenes", THREE_SHAPE_SCALE),
                              ("PNG, three-shape scenes, small shapes unscaled", 1.0)):  # the drawing before
        chosen = [scene_for(args.seed, i, small_scale) for i in threes]
        conditions[name] = score([{"image": draw(scene), "text": scene.caption} for scene in chosen])
    report = {"model": _model_name(args.model), "seed": args.seed, "conditions": conditions,
              "samples": _samples(captioner)}
    print(markdown(report))
    if args.json:
        save_json(report, args.json)


def _three_shape_indices(seed: int, count: int) -> list[int]:
    """The first `count` scenes of the seed that hold three shapes."""
    from xattn.datasets.scenes import scene_for

    found, index = [], 0
    while len(found) < count:
        if len(scene_for(seed, index).shapes) == 3:
            found.append(index)
        index += 1
    return found


def _samples(captioner) -> dict:
    from xattn.tasks.vision import load_image

    with open(os.path.join(SAMPLES, "metadata.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    captions = captioner.caption([load_image(os.path.join(SAMPLES, s["file_name"])) for s in samples])
    wrong = [{"file_name": s["file_name"], "caption": c, "truth": s["text"]}
             for s, c in zip(samples, captions) if c != s["text"]]
    return {"right": len(samples) - len(wrong), "images": len(samples), "wrong": wrong}


def _model_name(model) -> str:
    from xattn.tasks.captioning import DEFAULT_MODEL

    return os.path.relpath(DEFAULT_MODEL, REPO) if model is None else model


def markdown(report: dict) -> str:
    lines = [f"scenes of seed {report['seed']}, captioned by {report['model']}", "",
             "| condition | exact match | token accuracy | images |", "|---|---|---|---|"]
    for name, row in report["conditions"].items():
        lines.append(f"| {name} | {row['exact_match']:.1%} | {row['token_accuracy']:.1%} | {row['images']} |")
    samples = report["samples"]
    lines.append(f"| shipped samples (data/samples) | {samples['right']} of {samples['images']} | | "
                 f"{samples['images']} |")
    if samples["wrong"]:
        lines += ["", "wrong samples:"] + [f"- {w['file_name']}: {w['caption']!r}, truth {w['truth']!r}"
                                           for w in samples["wrong"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
