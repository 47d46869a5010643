"""Score a captioner on held-out scenes: exact-match and token accuracy of greedy captions decoded by xattn,
and how many equal transformers' own generate on the same model.

    python recipes/make_scenes.py build/scenes          # the test split uses seed 3, never seen in training
    python recipes/eval_captioner.py --data build/scenes/test --model data/models/scene-captioner
"""

import argparse
import json
import time

import torch

from xattn.files import save_json


def main():
    import datasets

    from xattn.tasks.captioning import Captioner, caption_accuracy
    from xattn.tasks.vision import pixel_values

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an imagefolder (file_name + text)")
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped scene captioner)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    captioner = Captioner(args.model)
    data = datasets.load_dataset("imagefolder", data_dir=args.data, split="train")
    n = len(data) if args.limit is None else min(args.limit, len(data))
    start = time.perf_counter()
    scores = caption_accuracy(captioner.engine, captioner.processor, captioner.tokenizer, data, limit=n,
                              batch_size=args.batch_size, progress=True)
    scores["seconds"] = time.perf_counter() - start
    same = 0
    hf = captioner.engine.hf_model
    with torch.no_grad():
        for begin in range(0, n, args.batch_size):
            rows = [data[i] for i in range(begin, min(begin + args.batch_size, n))]
            pixels = pixel_values(captioner.processor, [r["image"].convert("RGB") for r in rows])
            ours, theirs = captioner.engine.generate(pixel_values=pixels), hf.generate(pixel_values=pixels)
            pad = captioner.tokenizer.pad_token_id
            same += sum(_strip(a, pad) == _strip(b, pad) for a, b in zip(ours, theirs))
    scores.update(images=n, equal_to_transformers=same / n)
    print(json.dumps(scores, indent=1))
    if args.json:
        save_json(scores, args.json)


def _strip(ids, pad):
    ids = ids.tolist()
    while ids and ids[-1] == pad:
        ids.pop()
    return ids


if __name__ == "__main__":
    main()
