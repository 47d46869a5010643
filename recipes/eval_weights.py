"""Weight formats on the shipped captioner: how often a caption decoded with packed fp32, bf16 or int8
weights equals the exact fp32 one, on held-out scenes (the test split's seed, 3; never seen in training), in
batches of 100 (the decoder's blocks with oneDNN's and fbgemm's products), of 16 (xattn's fused step with xattn's
fp32 and fbgemm's int8 products) and one image at a time (the fused step with xattn's fp32 and int8 products).

    python recipes/eval_weights.py --scenes 1000 --json data/models/scene-captioner/eval-weights.json
"""

import argparse
import json

from xattn.datasets.scenes import draw, scene_for
from xattn.files import save_json
from xattn.tasks.captioning import Captioner, weight_format_agreement

FORMATS = ["packed", "bf16", "int8", "int8+int8", "int8+bf16"]  # "+int8", "+bf16": the encoder in that format too


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the shipped scene captioner)")
    parser.add_argument("--scenes", type=int, default=1000, help="held-out scenes 0..N-1 of seed 3")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[100, 16, 1])
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS, help="weight formats to compare")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    scenes = [scene_for(3, i) for i in range(args.scenes)]
    captioner, images, truths = Captioner(args.model), [draw(s) for s in scenes], [s.caption for s in scenes]
    report = {"scenes": args.scenes}
    for batch_size in args.batch_sizes:
        report[f"batch {batch_size}"] = weight_format_agreement(captioner, images, truths, args.formats, batch_size)
    print(json.dumps(report, indent=1))
    if args.json:
        save_json(report, args.json)


if __name__ == "__main__":
    main()
