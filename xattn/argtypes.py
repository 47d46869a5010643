"""argparse types that range-check numbers, so a bad option is argparse's one-line usage error (exit 2) before
any work, never a traceback or a silently ignored limit."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An int in [low, high] (either bound optional)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        _check_range(value, low, high, text)
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] ((low, high] with low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if low_open and low is not None and value <= low:
            raise argparse.ArgumentTypeError(f"must be greater than {low:g}, got {text}")
        _check_range(value, low, high, text)
        return value

    parse.__name__ = "number"
    return parse


def _check_range(value, low, high, text: str) -> None:
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high}, got {text}")


POSITIVE = integer(1)
SEED = integer(0, 2**63 - 1)  # torch.manual_seed takes 64-bit seeds
THREADS = integer(1, 4096)
