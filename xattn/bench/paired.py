"""A decode step's ratio to its floor probe, measured in pairs: before every step of a generate call one probe pass
runs, and each step is set against the pass just before it.

On a shared machine the memory bandwidth a process gets moves by tens of percent within minutes, so a step timed
in one window and a probe in another can put their ratio anywhere in that range. A pair is ~10 ms apart: the median
of many pairs' ratios is what the step costs over the floor at whatever bandwidth the machine gave at that moment.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Paired:
    steps: int  # pairs measured
    step_ms: float  # median step (from its call to the next step's call: the search's bookkeeping included)
    probe_ms: float  # median probe pass
    ratio: float  # median over the pairs of step / the probe pass just before it


def paired_ratio(engine, generate: Callable[[], object], probe: Callable[[], None], calls: int) -> Paired:
    """generate() `calls` times on `engine` (an XattnModel), with `probe` run before each of its decode steps."""
    steps, probes = [], []
    marks: list[float] = []

    def paired(step):
        def run(*args):
            now = time.perf_counter()
            if marks:  # the step before, with its search's bookkeeping, less the probe that ran before it
                steps.append(now - marks[-1])
            start = time.perf_counter()
            probe()
            probes.append(time.perf_counter() - start)
            marks.append(time.perf_counter())
            return step(*args)
        return run

    with wrapped_steps(engine, paired):
        for _ in range(calls):
            generate()
            probes.pop()  # the last step's interval ends in the call's return: not a step
            marks.clear()
    if not steps:
        raise ValueError("paired_ratio needs generate calls of at least two decode steps")
    return Paired(len(steps), statistics.median(steps) * 1000, statistics.median(probes) * 1000,
                  statistics.median(s / p for s, p in zip(steps, probes)))


@contextlib.contextmanager
def wrapped_steps(engine, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside the block, an XattnModel's decode steps (the greedy one too, where it has one) are wrap(step); after
    it, its own again."""
    real = engine._decode_step, engine._greedy_step
    engine._decode_step = wrap(real[0])
    engine._greedy_step = None if real[1] is None else wrap(real[1])
    try:
        yield
    finally:
        engine._decode_step, engine._greedy_step = real
