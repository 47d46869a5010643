"""Gradient checkpointing, measured: step time and memory training ViT-B/16 + GPT-2 small (batch 8, 32 caption
tokens, AdamW, fp32, 2 threads), with and without it (with it, the LM-head loss in chunks, as `xattn train
--gradient-checkpointing` does), each in a fresh process, in one run. Activation memory is measured apart from
weights, gradients and optimizer state: the peak RSS of forward + backward above the RSS that holds those (see
xattn.bench.training_step_cost).

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
    print(f"{'gradient checkpointing':24s} {'s/step':>7s} {'activations':>11s} {'(live)':>6s} {'optimizer step':>14s} "
          f"{'held':>6s} {'weights':>7s} {'grads':>6s} {'Adam':>6s} {'peak RSS':>8s}  (MB)")
    for row in (plain, checkpointed):
        print(f"{str(row['gradient_checkpointing']):24s} {row['seconds_per_step']:7.2f} {row['activation_mb']:11.0f} "
              f"{row['activation_live_mb']:6.0f} "
              f"{row['optimizer_peak_mb']:14.0f} {row['held_rss_mb']:6.0f} {row['weights_mb']:7.0f} "
              f"{row['gradients_mb']:6.0f} {row['optimizer_state_mb']:6.0f} {row['peak_rss_mb']:8.0f}")
    print(f"checkpointed / plain: time x{checkpointed['seconds_per_step'] / plain['seconds_per_step']:.2f}, "
          f"activation memory / {plain['activation_mb'] / checkpointed['activation_mb']:.2f} "
          f"(live tensors / {plain['activation_live_mb'] / checkpointed['activation_live_mb']:.2f}), "
          f"peak RSS x{checkpointed['peak_rss_mb'] / plain['peak_rss_mb']:.2f}")
    if args.json:
        from xattn.bench.decode import machine

        save_json({"machine": machine(), "plain": plain, "checkpointed": checkpointed}, args.json)


if __name__ == "__main__":
    main()
