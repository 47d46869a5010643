"""Score a recognizer on held-out speech: word error rate and exact match of greedy transcripts decoded by
xattn, and how many equal transformers' own generate on the same model.

    python recipes/make_digits.py build/digits        # test: seed 13, voice variants never heard in training
    python recipes/eval_recognizer.py --data build/digits/test --model data/models/digit-recognizer
"""

import argparse
import json
import time

import torch

from xattn.files import save_json


def main():
    from xattn.datasets.digits import read_split
    from xattn.tasks.transcription import Transcriber, transcription_scores

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a folder of audio files + metadata.jsonl (file_name, text)")
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped digit recognizer)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    transcriber = Transcriber(args.model)
    rows = read_split(args.data)[: args.limit]
    start = time.perf_counter()
    guesses, same = [], 0
    hf = transcriber.engine.hf_model
    for begin in range(0, len(rows), args.batch_size):
        waveforms = [transcriber.load(r["path"]) for r in rows[begin : begin + args.batch_size]]
        texts = transcriber.transcribe(waveforms)
        with torch.no_grad():
            theirs = hf.generate(**transcriber.features(waveforms))
        same += sum(a == b.strip() for a, b in zip(texts, transcriber.tokenizer.batch_decode(
            theirs, skip_special_tokens=True)))
        guesses += texts
    scores = transcription_scores([r["text"] for r in rows], guesses)
    scores.update(utterances=len(rows), equal_to_transformers=same / len(rows),
                  seconds=time.perf_counter() - start)
    by_variant = {}
    for variant in sorted({r["variant"] for r in rows}):
        pairs = [(r["text"], g) for r, g in zip(rows, guesses) if r["variant"] == variant]
        by_variant[variant] = round(transcription_scores(*zip(*pairs))["wer"], 4)
    scores["wer_by_variant"] = by_variant
    errors = [(r["text"], g, r["voice"], r["variant"]) for r, g in zip(rows, guesses) if r["text"] != g]
    print(json.dumps(scores, indent=1))
    for truth, guess, voice, variant in errors[:20]:
        print(f"  {voice}+{variant}: {truth!r} -> {guess!r}")
    if args.json:
        save_json(scores, args.json)


if __name__ == "__main__":
    main()
