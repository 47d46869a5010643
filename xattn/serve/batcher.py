"""The server's batcher: requests wait in an asyncio queue; one loop takes the oldest, groups with it those waiting
that may share its batch (equal key: same task options) up to max_batch_size, runs the batch through the task's
batched API in its own worker thread, and resolves each request's future.

The app only calls `submit()` and reads `pending`: xattn/serve/inflight.py's InflightBatcher (requests joining and
leaving one running decode batch) takes this class's place for captioning without the endpoints changing."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """More requests wait than --max-queue allows (429); retry_after: seconds to suggest."""

    def __init__(self, pending: int, retry_after: int):
        super().__init__(f"the server is busy: {pending} requests are waiting; retry in {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)
class _Request:
    key: Hashable | None  # requests with equal keys may share a batch; None: runs alone
    item: Any  # what the task's batch function takes for this request
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


# run(key, items) -> one result per item, in order; called in the batcher's worker thread
BatchFunction = Callable[[Hashable | None, list], list]


class QueuePolicy:
    """What a batcher and the in-flight batcher share: refusing past max_queue waiting requests, the Retry-After they
    suggest, and the queue-length metric. A subclass has name, max_batch_size, max_queue, metrics, `pending` and
    _turn_seconds: the running mean time for max_batch_size places to turn over (a batch; a request's decoding)."""

    name: str
    max_batch_size: int
    max_queue: int
    metrics: Any
    _turn_seconds: float = 1.0
    pending: int

    @property
    def full(self) -> bool:
        return self.pending >= self.max_queue

    def retry_after(self) -> int:
        """Seconds until the requests ahead of a new one have likely been taken (the mean turn time so far)."""
        turns = math.ceil((self.pending + 1) / self.max_batch_size)
        return max(1, math.ceil(turns * self._turn_seconds))

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length(self.name, self.pending)


class Batcher(QueuePolicy):
    def __init__(self, name: str, run: BatchFunction, max_batch_size: int = 16, max_queue: int = 64,
                 metrics=None):
        self.name = name  # the task, for metrics and messages
        self.run = run
        self.max_batch_size = max_batch_size  # 1: one request at a time (--no-batching)
        self.max_queue = max_queue  # requests waiting (not yet in a batch) beyond which submit() refuses
        self.metrics = metrics
        self._waiting: deque[_Request] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"xattn-{name}")
        self._loop_task: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        """Requests waiting for a batch (a cancelled one, its client gone or its deadline passed, is not counted)."""
        return sum(not r.future.done() for r in self._waiting)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for request in self._waiting:
            request.future.cancel()
        self._executor.shutdown(wait=True)

    async def submit(self, key: Hashable | None, item: Any) -> Any:
        """The request's result (or its exception). Cancelling the caller (deadline, client gone) cancels the
        request: a request not yet in a batch is dropped and never runs."""
        if self.full:
            raise QueueFull(self.pending, self.retry_after())
        request = _Request(key, item, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        self._arrived.set()
        self._report_queue()
        return await request.future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._next_batch()
            self._report_queue()
            if not batch:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            start = time.monotonic()
            if self.metrics is not None:
                self.metrics.batch_started(self.name, len(batch), [start - r.arrived for r in batch])
            outcomes = await loop.run_in_executor(self._executor, self._run_isolated, batch[0].key,
                                                  [r.item for r in batch])
            seconds = time.monotonic() - start
            self._turn_seconds = 0.8 * self._turn_seconds + 0.2 * seconds  # a batch: for Retry-After
            if self.metrics is not None:
                self.metrics.batch_done(self.name, len(batch), seconds)
            for request, (ok, value) in zip(batch, outcomes):
                if request.future.done():  # its client left or its deadline passed while it ran
                    continue
                if ok:
                    request.future.set_result(value)
                else:
                    request.future.set_exception(value)

    def _next_batch(self) -> list[_Request]:
        """The oldest live request and those waiting with its key, up to max_batch_size, in arrival order."""
        live = deque(r for r in self._waiting if not r.future.done())
        if not live:
            self._waiting = live
            return []
        first = live.popleft()
        batch, rest = [first], deque()
        for request in live:
            if first.key is not None and request.key == first.key and len(batch) < self.max_batch_size:
                batch.append(request)
            else:
                rest.append(request)
        self._waiting = rest
        return batch

    def _run_isolated(self, key, items: list) -> list[tuple[bool, Any]]:
        """(True, result) or (False, exception) per item: a batch that fails is retried one item at a time, so
        only the item that breaks it gets the error (as `xattn caption` does with a batch of files)."""
        try:
            results = self.run(key, items)
            if len(results) != len(items):
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(items)} requests")
            return [(True, r) for r in results]
        except Exception as error:
            if len(items) == 1:
                return [(False, error)]
            return [self._run_isolated(key, [item])[0] for item in items]

