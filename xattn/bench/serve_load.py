"""Closed-loop HTTP load on a running `xattn serve`: N clients, each posting the next image as soon as its last
answer came back, for a fixed time; every request's latency and outcome kept, and the server's resident memory
sampled from /proc while it runs (Linux)."""

from __future__ import annotations

import asyncio
import mimetypes
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Level:
    server: str
    clients: int
    seconds: float  # from the first request to the last answer (the answers still due at the end are waited for)
    requests: int  # answered with 200 and a caption
    failed: int  # any other answer or a transport error: nothing is retried
    requests_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    failures: dict[str, int] = field(default_factory=dict)  # status or exception name -> count
    rss_mb: list[float] = field(default_factory=list)  # the server's RSS, one sample per second of the level


def images(paths: list[str]) -> list[tuple[str, bytes, str]]:
    """(name, bytes, content type) of each image file, read once (every request sends the same bytes)."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            out.append((os.path.basename(path), f.read(), mimetypes.guess_type(path)[0] or "application/octet-stream"))
    return out


class RssSampler:
    """The resident set size of a process (and its children, for --workers), once a second, in a thread."""

    def __init__(self, pid: int):
        self.pid, self.samples = pid, []  # (monotonic time, MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_mb(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            self._stop.wait(1.0)

    def between(self, start: float, end: float) -> list[float]:
        return [mb for t, mb in self.samples if start <= t <= end]


def rss_mb(pid: int) -> float | None:
    """VmRSS of pid in MB (None when the process is gone or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_level(url: str, server: str, clients: int, seconds: float, pictures: list[tuple[str, bytes, str]],
              fields: dict[str, str], sampler: RssSampler | None = None, headers: dict | None = None) -> Level:
    """`clients` concurrent clients posting to url for `seconds`; a Level of what came back."""
    started = time.monotonic()
    outcomes = asyncio.run(_load(url, clients, seconds, pictures, fields, headers or {}))
    ended = time.monotonic()
    latencies = np.array([ms for ok, _, ms in outcomes if ok]) if outcomes else np.array([])
    failures: dict[str, int] = {}
    for ok, kind, _ in outcomes:
        if not ok:
            failures[kind] = failures.get(kind, 0) + 1
    ok_count = len(latencies)

    def pct(q: float) -> float:
        return float(np.percentile(latencies, q)) if ok_count else float("nan")

    return Level(server=server, clients=clients, seconds=round(ended - started, 3), requests=ok_count,
                 failed=len(outcomes) - ok_count, requests_per_s=ok_count / (ended - started),
                 p50_ms=pct(50), p95_ms=pct(95), p99_ms=pct(99), failures=failures,
                 rss_mb=sampler.between(started, ended) if sampler else [])


async def _load(url, clients, seconds, pictures, fields, headers) -> list[tuple[bool, str, float]]:
    import httpx

    outcomes: list[tuple[bool, str, float]] = []  # (ok, status or error name, latency ms)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(None)  # the server's own deadline decides; a request is never dropped by the client
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        await asyncio.gather(*(_client(client, url, i, deadline, pictures, fields, outcomes)
                               for i in range(clients)))
    return outcomes


async def _client(client, url, index, deadline, pictures, fields, outcomes) -> None:
    import httpx

    n = index  # clients start on different images
    while time.monotonic() < deadline:
        name, data, kind = pictures[n % len(pictures)]
        n += 1
        sent = time.monotonic()
        try:
            answer = await client.post(url, files={"file": (name, data, kind)}, data=fields)
            ok = answer.status_code == 200 and isinstance(answer.json().get("text"), str)
            outcome = "200" if ok else str(answer.status_code)
        except (httpx.HTTPError, ValueError) as error:  # ValueError: a body that is not JSON
            ok, outcome = False, type(error).__name__
        outcomes.append((ok, outcome, (time.monotonic() - sent) * 1000))
