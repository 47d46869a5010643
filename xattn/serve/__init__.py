"""`xattn serve`: the HTTP service (FastAPI + uvicorn) in front of the three tasks: the app (app.py), its
batcher (batcher.py: the piece an in-flight engine scheduler replaces), generation options as request fields
(options.py), limits and refusals (limits.py), Prometheus metrics (metrics.py) and the task calls (runners.py)."""

from .app import Settings, create_app

__all__ = ["Settings", "create_app"]
