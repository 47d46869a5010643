"""`python -m xattn`: the `xattn` command (what the benchmarks start their servers with)."""

import sys

from .cli import main

sys.exit(main())
