"""The `xattn` command."""

from __future__ import annotations

import argparse
import sys


def _bench(args) -> int:
    from . import bench

    rows = list(bench.ROWS)[:1] if args.quick else list(bench.ROWS)
    short, long = (4, 8) if args.quick else (args.short, args.long)
    results = bench.run(rows=rows, short=short, long=long, repeats=args.repeats, compiled=args.compile,
                        threads=args.threads)
    print()
    print(bench.table(results))
    if args.json:
        bench.save(results, args.json)
        print(f"\nwrote {args.json}")
    return 0 if all(m.tokens_equal_to_transformers is not False for m in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="decode speed side by side with transformers (ViT-B/16 + GPT-2 small)")
    bench.add_argument("--quick", action="store_true", help="one row (B=1 greedy), short runs")
    bench.add_argument("--compile", action="store_true", help="add a column with the torch.compile'd decode step")
    bench.add_argument("--short", type=int, default=8, help="generation length of the short run")
    bench.add_argument("--long", type=int, default=24, help="generation length of the long run")
    bench.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
    bench.add_argument("--threads", type=int, default=2, help="torch threads")
    bench.add_argument("--json", help="also write the results here (JSON)")
    bench.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
