"""Calibrate a captioner's or recognizer's low-confidence threshold on its validation data (never its test data)
and save it as confidence.json in the checkpoint's folder: results whose avg_logprob falls below it, or whose
words repeat degenerately, are marked low-confidence by `xattn caption` / `xattn transcribe`.

    python recipes/calibrate_confidence.py data/models/scene-captioner     # 1000 validation scenes (seed 2)
    python recipes/calibrate_confidence.py data/models/digit-recognizer    # 300 validation utterances (seed 12,
                                                                           # held-out voices; needs espeak-ng)
The threshold leaves --unmarked (default 99%) of the validation results unmarked; the repetition count is one
more than the longest run of repeated words in the validation texts (3 at least).
"""

import argparse
import tempfile

import torch

from xattn.hf.loading import checkpoint_model_type
from xattn.tasks.confidence import REPEATS, calibrate, longest_run, save_calibration


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the checkpoint folder (confidence.json is written into it)")
    parser.add_argument("--count", type=int, default=None, help="validation examples (default 1000 scenes or "
                        "300 utterances)")
    parser.add_argument("--unmarked", type=float, default=0.99, help="share of validation results left unmarked")
    parser.add_argument("--batch-size", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    if checkpoint_model_type(args.model) == "vision-encoder-decoder":
        task, inputs, truths, about = _captioner_inputs(args.model, args.count or 1000)
    else:
        task, inputs, truths, about = _recognizer_inputs(args.model, args.count or 300)
    scores, texts = [], []
    for start in range(0, len(inputs), args.batch_size):
        out = task.engine.generate(**task.encoder_inputs(inputs[start: start + args.batch_size]),
                                   return_dict_in_generate=True)
        scores += out.avg_logprob.tolist()
        texts += [t.strip() for t in task.tokenizer.batch_decode(out.sequences, skip_special_tokens=True)]
    threshold = calibrate(scores, args.unmarked)
    repeats = max(REPEATS, longest_run(truths) + 1)
    right = sum(t == truth for t, truth in zip(texts, truths)) / len(texts)
    path = save_calibration(args.model, threshold, repeats, {
        "unmarked_on_calibration": args.unmarked, "calibrated_on": about, "exact_on_calibration": round(right, 4),
        "made_by": "recipes/calibrate_confidence.py"})
    print(f"wrote {path}: avg_logprob threshold {threshold:.4f}, repeats {repeats} ({about}; {right:.1%} exact)")


def _captioner_inputs(model: str, count: int):
    from xattn.datasets.scenes import draw, scene_for
    from xattn.tasks.captioning import Captioner
    from xattn.tasks.vision import pixel_values

    captioner = Captioner(model)
    scenes = [scene_for(2, i) for i in range(count)]
    pixels = [pixel_values(captioner.processor, [draw(s)])[0] for s in scenes]
    return captioner, pixels, [s.caption for s in scenes], \
        f"{count} validation scenes (seed 2, as recipes/make_scenes.py's validation split)"


def _recognizer_inputs(model: str, count: int):
    from xattn.datasets.digits import HELD_OUT_VARIANTS, read_split, utterance_for, write_split
    from xattn.tasks.transcription import Transcriber

    transcriber = Transcriber(model)
    with tempfile.TemporaryDirectory() as folder:
        write_split(folder, count, lambda i: utterance_for(12, i, HELD_OUT_VARIANTS))
        rows = read_split(folder)
        waveforms = [transcriber.load(r["path"]) for r in rows]
    return transcriber, waveforms, [r["text"] for r in rows], \
        f"{count} validation utterances (seed 12, held-out voices, as recipes/make_digits.py's validation split)"


if __name__ == "__main__":
    main()
