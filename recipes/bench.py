"""Speed side by side on one machine, in one run: xattn (exact, packed fp32, bf16, int8; eager and compiled)
vs transformers' generate (dynamic and static cache) vs CTranslate2 (when installed), the weight-streaming
floor, end-to-end batch captioning, and compile-cache reuse.

    python recipes/bench.py --quick                         # one row (B=1 greedy), a minute or two
    python recipes/bench.py --compile --end-to-end --repeats 3 \\
        --json bench/$(date +%F)-cpu-2threads.json --chart bench/$(date +%F)-cpu-2threads.png   # ~30 min
"""

import sys

from xattn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
