"""Decode benchmark, xattn vs transformers side by side on one machine, one run.

    python recipes/bench.py                     # all rows, table on stdout
    python recipes/bench.py --compile --json bench/$(date +%F)-cpu.json
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
