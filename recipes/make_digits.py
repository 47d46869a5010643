"""Make the spoken-digits data set (espeak-ng speech, wav + metadata.jsonl) and its transcript tokenizer.

    apt-get install espeak-ng
    python recipes/make_digits.py build/digits   # train 10000 (seed 11, training variants, 3% of them
                                                 # files without speech), validation 300 (seed 12) and
                                                 # test 500 (seed 13), both spoken by held-out variants
                                                 # only; tokenizer/
Re-running resumes an interrupted run. The spec is in data/README.md.
"""

import argparse
import os

from xattn.datasets.digits import HELD_OUT_VARIANTS, NO_SPEECH_SHARE, TRAIN_VARIANTS, utterance_for, write_split
from xattn.datasets.tokenizer import train_caption_tokenizer
from xattn.hf.portable import save_tokenizer

# split: (seed, voice variants, share of files without speech)
SPLITS = {"train": (11, TRAIN_VARIANTS, NO_SPEECH_SHARE), "validation": (12, HELD_OUT_VARIANTS, 0.0),
          "test": (13, HELD_OUT_VARIANTS, 0.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory")
    parser.add_argument("--train", type=int, default=10000)
    parser.add_argument("--validation", type=int, default=300)
    parser.add_argument("--test", type=int, default=500)
    args = parser.parse_args()
    for split, (seed, variants, no_speech) in SPLITS.items():
        write_split(os.path.join(args.out, split), getattr(args, split),
                    lambda i, seed=seed, variants=variants, no_speech=no_speech: utterance_for(
                        seed, i, variants, no_speech=no_speech))
    seed, variants, no_speech = SPLITS["train"]
    texts = (utterance_for(seed, i, variants, no_speech=no_speech).text for i in range(args.train))
    tokenizer = train_caption_tokenizer(texts, vocab_size=300)
    save_tokenizer(tokenizer, os.path.join(args.out, "tokenizer"))
    print(f"wrote {args.out}: {len(tokenizer)} tokens in the tokenizer")


if __name__ == "__main__":
    main()
