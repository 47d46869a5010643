"""Write the sample images shipped in data/samples/ (scenes from the held-out test seed) with their captions.

    python recipes/make_samples.py data/samples
"""

import argparse
import json
import os

from xattn.datasets.scenes import draw, scene_for

TEST_SEED = 3  # the test split's seed: never seen in training


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=8)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metadata.jsonl"), "w") as f:
        for i in range(args.count):
            scene = scene_for(TEST_SEED, i)
            name = f"scene-{i}.png" if i % 4 else f"scene-{i}.jpg"  # a few JPEGs too
            image = draw(scene)
            image.save(os.path.join(args.out, name), **({"quality": 95} if name.endswith(".jpg") else {}))
            f.write(json.dumps({"file_name": name, "text": scene.caption}) + "\n")
    print(f"wrote {args.count} samples to {args.out}")


if __name__ == "__main__":
    main()
