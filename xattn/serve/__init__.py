"""`xattn serve`: the HTTP service (FastAPI + uvicorn) in front of the three tasks: the app (app.py), its
batchers (batcher.py: micro-batches of the requests that wait together; inflight.py: requests joining the running
decode batch, xattn/inflight.py's scheduler in a thread), generation options as request fields (options.py), limits
and refusals (limits.py), Prometheus metrics (metrics.py) and the task calls (runners.py)."""

from .app import Settings, create_app

__all__ = ["Settings", "create_app"]
