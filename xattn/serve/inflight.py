"""In-flight batching in the server: the Batcher's interface (submit, pending, full, retry_after, start, stop) over
xattn's Scheduler (xattn/inflight.py). A request joins the decode batch that is running at its next step, on its own
options (no grouping by options: each request has its own search and, seeded, its own generator), and its rows are
freed as soon as it finishes, its client leaves or its deadline passes.

One worker thread owns the scheduler (which is not thread-safe): it takes new requests and cancellations from an
inbox, steps while anything runs (blocking on the inbox when nothing does) and settles each request's future on the
event loop. `runs` is the task's side (xattn/serve/runners.py, CaptionRequests): scheduler(max_rows), request(key,
item) -> the engine's request, record(key, item, result) -> the answer."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .batcher import QueueFull, QueuePolicy


@dataclass(eq=False)
class _Request:
    key: Any  # the app's batch key: (options, attention_map, ...)
    item: Any  # what runs.request takes (CaptionItem)
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    handle: Any = None  # the scheduler's, once the worker submitted it
    started: float | None = None  # when it joined the decode batch


class InflightBatcher(QueuePolicy):
    def __init__(self, name: str, runs, max_rows: int = 16, max_queue: int = 64, metrics=None):
        self.name, self.runs, self.metrics = name, runs, metrics
        self.max_batch_size = max_rows  # decoding rows (a request of k beams or samples takes k)
        self.max_queue = max_queue  # requests waiting to join beyond which submit() refuses
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit" | "cancel", request), or None: stop
        self._open: set[_Request] = set()  # submitted and not settled; the worker marks them started
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        """Requests not yet in the decode batch (a cancelled one is not counted)."""
        with self._lock:
            return sum(r.started is None and not r.future.done() for r in self._open)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name=f"xattn-{self.name}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join)
        with self._lock:
            for request in self._open:
                request.future.cancel()

    async def submit(self, key, item) -> Any:
        """The request's result (or its exception). Cancelling the caller (deadline, client gone) cancels the
        request: waiting, it never runs; running, its rows are freed at the next step."""
        if self.full:
            raise QueueFull(self.pending, self.retry_after())
        request = _Request(key, item, asyncio.get_running_loop().create_future())
        with self._lock:
            self._open.add(request)
        request.future.add_done_callback(lambda f: f.cancelled() and self._inbox.put(("cancel", request)))
        self._inbox.put(("submit", request))
        self._report_queue()
        return await request.future

    # ---- the worker thread ----------------------------------------------------------------------------------------
    def _work(self) -> None:
        scheduler = self.runs.scheduler(self.max_batch_size)
        live: dict[int, _Request] = {}  # id(handle) -> request
        while True:
            busy = bool(scheduler.running or scheduler.waiting)
            messages = [] if busy else [self._inbox.get()]  # idle: sleep until something comes
            while True:
                try:
                    messages.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for message in messages:
                if message is None:
                    return
                self._take(scheduler, live, *message)
            if not (scheduler.running or scheduler.waiting):
                continue
            start = time.monotonic()
            try:
                finished = scheduler.step()
            except Exception as error:  # a decode step failed: the requests in it fail, and the batch starts anew
                for request in live.values():
                    self._settle(request, error=error)
                live.clear()
                scheduler = self.runs.scheduler(self.max_batch_size)
                continue
            self._measure(scheduler, live, start, time.monotonic() - start)
            for handle in finished:
                self._finish(live.pop(id(handle)), handle)
            self._report_queue()

    def _take(self, scheduler, live: dict, kind: str, request: _Request) -> None:
        if kind == "cancel":
            if request.handle is not None:
                scheduler.cancel(request.handle)
                live.pop(id(request.handle), None)
            with self._lock:
                self._open.discard(request)
            return
        if request.future.done():  # cancelled before the worker saw it: never runs
            return
        try:
            request.handle = scheduler.submit(self.runs.request(request.key, request.item))
        except Exception as error:  # options the model refuses (ValueError: 422)
            self._settle(request, error=error)
            return
        live[id(request.handle)] = request

    def _measure(self, scheduler, live: dict, start: float, seconds: float) -> None:
        """Mark the requests that joined in this step; a step is a 'batch' in the metrics (its size: requests)."""
        waiting = {id(handle) for handle in scheduler.waiting}
        joined = [r for r in live.values() if r.started is None and id(r.handle) not in waiting]
        with self._lock:
            for request in joined:
                request.started = start
        if self.metrics is not None:
            self.metrics.batch_started(self.name, len(scheduler.running), [start - r.arrived for r in joined])
            self.metrics.batch_done(self.name, len(scheduler.running), seconds)

    def _finish(self, request: _Request, handle) -> None:
        if request.started is not None:
            # rows turn over about once per request: its time from joining to finishing, for Retry-After
            self._turn_seconds = 0.8 * self._turn_seconds + 0.2 * (time.monotonic() - request.started)
        if handle.error is not None:
            return self._settle(request, error=handle.error)
        try:
            record = self.runs.record(request.key, request.item, handle.result)
        except Exception as error:
            return self._settle(request, error=error)
        self._settle(request, value=record)

    def _settle(self, request: _Request, value=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._open.discard(request)

        def settle():
            if request.future.done():  # its client left or its deadline passed meanwhile
                return
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(value)
        self._loop.call_soon_threadsafe(settle)

