"""Prometheus metrics of one app (its own registry, so tests can build many apps in one process). With --workers N
each worker process counts its own; `PROMETHEUS_MULTIPROC_DIR` set (xattn serve sets it for N > 1) makes
/metrics answer the sum over the workers, prometheus_client's multiprocess mode."""

from __future__ import annotations

import os
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("xattn_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("xattn_request_latency_seconds", "time from request to the last byte of the answer",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("xattn_queue_length", "requests waiting for a batch", ["task"], registry=r,
                           multiprocess_mode="livesum")
        self.queue_wait = Histogram("xattn_queue_wait_seconds", "time a request waited before its batch ran",
                                    ["task"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("xattn_batch_size", "requests per batch run", ["task"], buckets=BATCH_BUCKETS,
                                    registry=r)
        self.batch_seconds = Histogram("xattn_batch_seconds", "time to run one batch", ["task"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("xattn_generated_tokens", "tokens generated (audio codes for speech); rate() of it is "
                              "tokens/s", ["task"], registry=r)
        self.tokens_per_second = Gauge("xattn_tokens_per_second", "tokens/s of the last batch", ["task"], registry=r,
                                       multiprocess_mode="livesum")
        self._last_tokens: dict[str, int] = {}

    # ---- called by the batcher and the task runners ----
    def queue_length(self, task: str, n: int) -> None:
        self.queue.labels(task).set(n)

    def batch_started(self, task: str, size: int, waits: list[float]) -> None:
        self.batch_size.labels(task).observe(size)
        for wait in waits:
            self.queue_wait.labels(task).observe(wait)
        self._last_tokens[task] = 0

    def generated(self, task: str, tokens: int) -> None:
        self.tokens.labels(task).inc(tokens)
        self._last_tokens[task] = self._last_tokens.get(task, 0) + tokens

    def batch_done(self, task: str, size: int, seconds: float) -> None:
        self.batch_seconds.labels(task).observe(seconds)
        if seconds > 0:
            self.tokens_per_second.labels(task).set(self._last_tokens.get(task, 0) / seconds)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text: this process's, or all workers' in multiprocess mode."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MeasuredMiddleware:
    """Pure ASGI: each answer's status and time to its last byte, per endpoint, into the metrics."""

    ENDPOINTS = ("/v1/caption", "/v1/audio/transcriptions", "/v1/audio/speech", "/health", "/metrics")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [500]
        endpoint = scope["path"] if scope["path"] in self.ENDPOINTS else "other"

        async def measured_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.metrics.answered(endpoint, status[0], time.monotonic() - start)

        await self.app(scope, receive, measured_send)
