"""``carnator serve``'s routes, one router per feature: :mod:`.videos` (the jobs), :mod:`.events` (their live events,
SSE), :mod:`.metrics`, :mod:`.audit` (the shadow audits' state), :mod:`.health` and :mod:`.page` (the web page).

Each module's ``router(deps)`` builds its :class:`fastapi.APIRouter` for one app from the :class:`~.deps.Deps` that
:func:`~carnator.service.app.create_app` assembles; :mod:`.schema` is the published schema they answer with. Routes
call the service's :class:`~carnator.service.jobs.JobStore` and :class:`~carnator.service.worker.WorkerPool` only.
"""

from __future__ import annotations

from . import audit, events, health, metrics, page, videos

#: the routers in the order the app includes them (the order of the schema's paths)
FEATURES = (videos, events, metrics, audit, health, page)

__all__ = ["FEATURES"]
