"""Intelligibility of a TTS model: it speaks held-out digit strings (the TTS test split's texts, seed 23, less
any text that also occurs in the train split next to it), the shipped recognizer transcribes them, and we
count exact transcripts.

    python recipes/make_tts_data.py build/tts
    python recipes/eval_tts.py --data build/tts/test --model data/models/speaker --count 100

--draw SEED speaks digit strings drawn as make_tts_data.py draws a split, from a seed no split uses (21-23 are
train, validation and test), less those of the train split (seed 21, 6000 drawn): more held-out strings than the
test split has (144 unseen ones), and no audio files needed.

    python recipes/eval_tts.py --draw 24 --count 300 --model data/models/speaker
"""

import argparse
import json
import os
import time

import torch

from xattn.files import save_json


def main():
    from dataclasses import asdict

    from xattn.datasets.digits import (
        DIGITS,
        TTS_SPLIT_SEEDS,
        TTS_TRAIN_SIZE,
        read_split,
        tts_utterance_for,
        tts_voice_name,
    )
    from xattn.tasks.audio_codes import SAMPLE_RATE
    from xattn.tasks.speech_synthesis import Speaker
    from xattn.tasks.transcription import Transcriber, transcription_scores

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a TTS split: its digit-string texts are spoken")
    source.add_argument("--draw", type=int, metavar="SEED", help="draw the digit strings from this seed instead")
    parser.add_argument("--model", default=None, help="TTS checkpoint (default: the shipped one)")
    parser.add_argument("--recognizer", default=None, help="recognizer checkpoint (default: the shipped one)")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    speaker, transcriber = Speaker(args.model), Transcriber(args.recognizer)
    if args.draw is None:
        trained = {r["text"] for r in read_split(os.path.join(os.path.dirname(os.path.abspath(args.data)), "train"))}
        drawn = read_split(args.data)
    else:
        if args.draw in TTS_SPLIT_SEEDS.values():
            parser.error(f"--draw {args.draw} is the seed of a split ({TTS_SPLIT_SEEDS}): choose another")
        trained = {tts_utterance_for(TTS_SPLIT_SEEDS["train"], i).text for i in range(TTS_TRAIN_SIZE)}
        drawn = (asdict(tts_utterance_for(args.draw, i)) for i in range(100 * args.count))
    rows = [r for r in drawn if set(r["text"].split()) <= set(DIGITS) and r["text"] not in trained]
    rows = rows[: args.count]  # digit strings the TTS never heard spoken (a short one can recur by chance)
    truths, guesses, voices, seconds, start = [], [], [], 0.0, time.perf_counter()
    for i, row in enumerate(rows):
        voice = tts_voice_name(row)
        voices.append(voice)
        audio = speaker.speak(row["text"], voice, generator=torch.Generator().manual_seed(args.seed + i))
        seconds += len(audio) / SAMPLE_RATE
        truths.append(row["text"])
        guesses.append(transcriber.transcribe([audio])[0] if len(audio) else "")
        print(f"{voice:10s} {row['text']!r:40s} -> {guesses[-1]!r}", flush=True)
    scores = transcription_scores(truths, guesses)
    scores.update(utterances=len(rows), audio_seconds=seconds, wall_seconds=time.perf_counter() - start)
    scores["per_voice"] = {}
    for name in sorted(set(voices)):
        mine = [i for i, v in enumerate(voices) if v == name]
        scores["per_voice"][name] = {**transcription_scores([truths[i] for i in mine], [guesses[i] for i in mine]),
                                     "utterances": len(mine)}
    print(json.dumps(scores, indent=1))
    if args.json:
        save_json(scores, args.json)


if __name__ == "__main__":
    main()
