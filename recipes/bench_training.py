"""Gradient checkpointing, measured: step time and peak memory training ViT-B/16 + GPT-2 small (batch 8,
32 caption tokens, AdamW, fp32, 2 threads), with and without it, each in a fresh process, in one run.

    python recipes/bench_training.py --json bench/$(date +%F)-gradient-checkpointing.json
"""

import argparse
import json
import subprocess
import sys

from xattn.files import save_json


def measure(checkpointing: bool, batch: int) -> dict:
    code = ("import json; from xattn.bench import training_step_cost; "
            f"print(json.dumps(training_step_cost({checkpointing}, batch={batch})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    plain, checkpointed = measure(False, args.batch), measure(True, args.batch)
    print(f"{'gradient checkpointing':24s} {'s/step':>8s} {'peak RSS MB':>12s}")
    for row in (plain, checkpointed):
        print(f"{str(row['gradient_checkpointing']):24s} {row['seconds_per_step']:8.2f} {row['peak_rss_mb']:12.0f}")
    print(f"checkpointed / plain: time x{checkpointed['seconds_per_step'] / plain['seconds_per_step']:.2f}, "
          f"peak memory x{checkpointed['peak_rss_mb'] / plain['peak_rss_mb']:.2f}")
    if args.json:
        save_json({"plain": plain, "checkpointed": checkpointed}, args.json)


if __name__ == "__main__":
    main()
