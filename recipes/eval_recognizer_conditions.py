"""Score a recognizer under the conditions real files bring, each condition on its own: word error rate and exact
transcripts of held-out speech, and the share of files without speech transcribed as empty text.

    apt-get install espeak-ng
    python recipes/eval_recognizer_conditions.py --work build/eval-conditions \\
        --json data/models/digit-recognizer/eval-conditions.json      # 300 per condition; --model DIR

Speech is spoken by the held-out voice variants only, with seeds no data set uses (data/README.md): the clean
utterances (seed 14, 120-200 wpm, the speeds the first recognizer trained on) are also heard with 0.5 s of
digital silence before and after, with white noise 20 dB below their power and through the 8 kHz band, so those
conditions differ from `clean` in the condition alone; fast speech is its own utterances (seed 15, 201-260 wpm).
Files without speech are 1-3 s of digital zeros, of a faint noise floor (-60 to -40 dBFS) or of white noise at
-30 dBFS (seed 16). The corruptions are xattn.datasets.augment_audio's, applied at the model's rate after
loading; transcripts are the Transcriber's (transformers' pipeline features, greedy). --work keeps the
synthesized speech, so a rerun only transcribes.
"""

import argparse
import os
import tempfile
import time

import numpy as np

from xattn.argtypes import integer
from xattn.datasets.augment_audio import Corruption, apply_corruption
from xattn.datasets.digits import (
    HELD_OUT_VARIANTS,
    NoSpeech,
    no_speech_samples,
    read_split,
    utterance_for,
    write_split,
)
from xattn.files import save_json
from xattn.tasks.transcription import Transcriber, transcription_scores

CLEAN_SEED, FAST_SEED, NO_SPEECH_SEED = 14, 15, 16  # 11-13 are the data set's splits
# name: (what it is, utterance seed, speeds, corruption)
SPEECH = {
    "clean": ("120-200 wpm as espeak-ng writes it", CLEAN_SEED, (120, 200), Corruption()),
    "silence 0.5 s": ("the clean utterances, 0.5 s of digital zeros before and after", CLEAN_SEED, (120, 200),
                      Corruption(lead_seconds=0.5, trail_seconds=0.5)),
    "201-260 wpm": ("fast utterances", FAST_SEED, (201, 260), Corruption()),
    "noise 20 dB SNR": ("the clean utterances, white noise 20 dB below their power", CLEAN_SEED, (120, 200),
                        Corruption(snr_db=20.0)),
    "8 kHz band": ("the clean utterances, resampled to 8 kHz and back", CLEAN_SEED, (120, 200),
                   Corruption(telephone=True)),
}
# name: (what it is, the noise's RMS range in dBFS, or None for digital zeros)
NO_SPEECH = {
    "silence only": ("1-3 s of digital zeros", None),
    "noise floor only": ("1-3 s of white noise at -60 to -40 dBFS", (-60.0, -40.0)),
    "noise only": ("1-3 s of white noise at -30 dBFS", (-30.0, -30.0)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped digit recognizer)")
    parser.add_argument("--count", type=integer(1), default=300, help="files per condition")
    parser.add_argument("--work", help="keep the synthesized speech here (default: a temporary folder)")
    parser.add_argument("--batch-size", type=integer(1), default=32)
    parser.add_argument("--json", help="also write the figures here (eval-conditions.json in the model's folder)")
    args = parser.parse_args()

    transcriber = Transcriber(args.model)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or scratch
        results = {}
        for name, (what, seed, speeds, corruption) in SPEECH.items():
            rows = spoken_rows(work, seed, speeds, args.count)
            waveforms = [apply_corruption(transcriber.load(r["path"]), transcriber.sampling_rate, corruption,
                                          np.random.default_rng([seed, i])) for i, r in enumerate(rows)]
            guesses = transcribe(transcriber, waveforms, args.batch_size)
            scores = transcription_scores([r["text"] for r in rows], guesses)
            results[name] = {"what": what, "seed": seed, "files": len(rows), **scores}
        for kind, (name, (what, levels)) in enumerate(NO_SPEECH.items()):
            waveforms = [no_speech_samples(no_speech_for(kind, i, levels), transcriber.sampling_rate)
                         for i in range(args.count)]
            guesses = transcribe(transcriber, waveforms, args.batch_size)
            results[name] = {"what": what, "seed": NO_SPEECH_SEED, "files": len(guesses),
                             "empty": sum(not g for g in guesses) / len(guesses),
                             "transcripts": sorted({g for g in guesses if g})[:10]}
    report = {"model": args.model or "data/models/digit-recognizer", "voice_variants": list(HELD_OUT_VARIANTS),
              "conditions": results, "seconds": round(time.perf_counter() - start, 1)}
    print(markdown_table(results))
    if args.json:
        save_json(report, args.json)


def spoken_rows(work: str, seed: int, speeds: tuple[int, int], count: int) -> list[dict]:
    """The first `count` utterances of (seed, speeds) by the held-out variants, synthesized once into `work`."""
    folder = os.path.join(work, f"seed-{seed}-{speeds[0]}-{speeds[1]}-wpm")
    write_split(folder, count, lambda i: utterance_for(seed, i, HELD_OUT_VARIANTS, speeds), progress=False)
    return read_split(folder)[:count]


def no_speech_for(kind: int, index: int, levels: tuple[float, float] | None) -> NoSpeech:
    rng = np.random.default_rng([NO_SPEECH_SEED, kind, index])
    seconds = float(rng.uniform(1.0, 3.0))
    level = None if levels is None else float(rng.uniform(*levels))
    return NoSpeech(seconds, level, int(rng.integers(2**32)))


def transcribe(transcriber: Transcriber, waveforms: list[np.ndarray], batch_size: int) -> list[str]:
    guesses = []
    for begin in range(0, len(waveforms), batch_size):
        guesses += transcriber.transcribe(waveforms[begin : begin + batch_size])
    return guesses


def markdown_table(results: dict) -> str:
    lines = ["| condition | files | WER | exact | empty text |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if "wer" in r:
            lines.append(f"| {name}: {r['what']} | {r['files']} | {r['wer']:.1%} | {r['exact_match']:.1%} | |")
        else:
            lines.append(f"| {name}: {r['what']} | {r['files']} | | | {r['empty']:.1%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
