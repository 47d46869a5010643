"""Make the synthetic scenes data set (Hugging Face imagefolders) and its caption tokenizer.

    python recipes/make_scenes.py build/scenes            # train 30000 (seed 1), validation 1000 (seed 2),
                                                          # test 1000 (seed 3), tokenizer/
    python recipes/make_scenes.py build/scenes-v3 --train-small-scale 0.8 1.0   # training scenes whose small
                                                          # shapes in three-shape scenes are drawn at x0.8-1.0
Re-running resumes an interrupted run. The spec of the scenes is in data/README.md.
"""

import argparse
import os

from xattn.datasets.scenes import scene_for, write_imagefolder
from xattn.datasets.tokenizer import train_caption_tokenizer
from xattn.hf.portable import save_tokenizer

SPLITS = {"train": 1, "validation": 2, "test": 3}  # split -> seed; a seed is never shared between splits


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output directory")
    parser.add_argument("--train", type=int, default=30000)
    parser.add_argument("--validation", type=int, default=1000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--train-small-scale", nargs=2, type=float, metavar=("LOW", "HIGH"),
                        help="draw the train split's small shapes in three-shape scenes at a factor from LOW to HIGH "
                             "(the spec's 0.8 and the older drawing's 1.0 both; validation and test keep the spec)")
    args = parser.parse_args()
    if args.train_small_scale and not 0 < args.train_small_scale[0] <= args.train_small_scale[1] <= 1.5:
        parser.error("--train-small-scale: need 0 < LOW <= HIGH <= 1.5")
    for split, seed in SPLITS.items():
        scales = tuple(args.train_small_scale) if split == "train" and args.train_small_scale else None
        write_imagefolder(os.path.join(args.out, split), getattr(args, split), seed, small_scales=scales)
    captions = (scene_for(SPLITS["train"], i).caption for i in range(args.train))
    tokenizer = train_caption_tokenizer(captions, vocab_size=360)
    save_tokenizer(tokenizer, os.path.join(args.out, "tokenizer"))
    print(f"wrote {args.out}: {len(tokenizer)} tokens in the tokenizer")


if __name__ == "__main__":
    main()
