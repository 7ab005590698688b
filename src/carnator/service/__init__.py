"""``carnator serve``: an OpenAI-style video jobs service over the engine (docs/SERVING.md).

Layers: :mod:`.jobs` (the :class:`~.jobs.JobStore` protocol and its SQLite implementation), :mod:`.worker` (one
worker thread per device, fair across tenants), :mod:`.events` (live events for SSE), :mod:`.metrics` (Prometheus),
:mod:`.routes` (the HTTP routes, one router per feature), :mod:`.app` (the FastAPI app assembling them) and
:mod:`.server` (wiring, uvicorn, start-up and shutdown). Needs the ``serve`` extra (``pip install carnator[serve]``).
"""

from __future__ import annotations

__all__ = ["ServeConfig", "Service", "run"]


def __getattr__(name: str):
    if name == "ServeConfig":  # light: the command line reads it
        from .config import ServeConfig

        return ServeConfig
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module 'carnator.service' has no attribute {name!r}")
