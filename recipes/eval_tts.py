"""Intelligibility of a TTS model: it speaks held-out digit strings (the TTS test split's texts, seed 23, less
any text that also occurs in the train split next to it), the shipped recognizer transcribes them, and we
count exact transcripts.

    python recipes/make_tts_data.py build/tts
    python recipes/eval_tts.py --data build/tts/test --model data/models/speaker --count 100
"""

import argparse
import json
import os
import time

import torch

from xattn.files import save_json


def main():
    from xattn.datasets.digits import DIGITS, read_split, tts_voice_name
    from xattn.tasks.audio_codes import SAMPLE_RATE
    from xattn.tasks.speech_synthesis import Speaker
    from xattn.tasks.transcription import Transcriber, transcription_scores

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a TTS split: its digit-string texts are spoken")
    parser.add_argument("--model", default=None, help="TTS checkpoint (default: the shipped one)")
    parser.add_argument("--recognizer", default=None, help="recognizer checkpoint (default: the shipped one)")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    speaker, transcriber = Speaker(args.model), Transcriber(args.recognizer)
    trained = {r["text"] for r in read_split(os.path.join(os.path.dirname(os.path.abspath(args.data)), "train"))}
    rows = [r for r in read_split(args.data) if set(r["text"].split()) <= set(DIGITS) and r["text"] not in trained]
    rows = rows[: args.count]  # digit strings the TTS never heard spoken (a short one can recur by chance)
    truths, guesses, seconds, start = [], [], 0.0, time.perf_counter()
    for i, row in enumerate(rows):
        voice = tts_voice_name(row)
        audio = speaker.speak(row["text"], voice, generator=torch.Generator().manual_seed(args.seed + i))
        seconds += len(audio) / SAMPLE_RATE
        truths.append(row["text"])
        guesses.append(transcriber.transcribe([audio])[0] if len(audio) else "")
        print(f"{voice:10s} {row['text']!r:40s} -> {guesses[-1]!r}", flush=True)
    scores = transcription_scores(truths, guesses)
    scores.update(utterances=len(rows), audio_seconds=seconds, wall_seconds=time.perf_counter() - start)
    print(json.dumps(scores, indent=1))
    if args.json:
        save_json(scores, args.json)


if __name__ == "__main__":
    main()
