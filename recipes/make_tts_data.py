"""Make the TTS training data: espeak-ng speech in the TTS voices (xattn.datasets.digits.TTS_VOICES), digit
strings and a few words, as wav files + metadata.jsonl.

    python recipes/make_tts_data.py build/tts     # train 6000 (seed 21), validation 200 (22), test 300 (23)
"""

import argparse
import os

from xattn.datasets.digits import TTS_SPLIT_SEEDS, TTS_TRAIN_SIZE, tts_utterance_for, write_split


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=TTS_TRAIN_SIZE)
    parser.add_argument("--validation", type=int, default=200)
    parser.add_argument("--test", type=int, default=300)
    args = parser.parse_args()
    for split, seed in TTS_SPLIT_SEEDS.items():
        write_split(os.path.join(args.out, split), getattr(args, split),
                    lambda i, seed=seed: tts_utterance_for(seed, i))


if __name__ == "__main__":
    main()
