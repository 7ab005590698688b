"""A job's live events over Server-Sent Events (``GET /v1/videos/{id}/events``).

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the tenant dependency, which
is built per app, from them.
"""

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from ..events import CLOSED, DONE
from ..http import ApiError
from ..jobs import TERMINAL
from .deps import Deps, JobId
from .schema import job_view, responses


def router(deps: Deps) -> APIRouter:
    service = deps.service
    Tenant = Annotated[str, Depends(deps.tenant_of)]
    r = APIRouter(tags=["videos"])

    @r.get("/v1/videos/{video_id}/events", response_class=EventSourceResponse,
           responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events: queued, "
                            "in_progress, decision, progress, done (data: JSON)"}, **responses(401, 404, 422)})
    async def video_events(video_id: JobId, tenant: Tenant, request: Request):
        """The job's live events: its state now (``queued`` or ``in_progress``), then ``decision`` (reuse or not, and
        why), ``progress`` at every denoising step, and ``done`` with the finished job; the stream then ends."""
        job = await run_in_threadpool(service.store.get, tenant, video_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video job {video_id!r}")
        sub = service.hub.subscribe(video_id)

        async def stream():
            try:
                now = await run_in_threadpool(service.store.get, tenant, video_id)
                if now is None or now.status in TERMINAL:
                    yield {"event": DONE, "data": json.dumps(job_view(now or job))}
                    return
                yield {"event": now.status, "data": json.dumps(job_view(now))}
                while True:
                    item = await sub.get(timeout=10.0)
                    if item is None:  # quiet: check the state (a finish published elsewhere)
                        now = await run_in_threadpool(service.store.get, tenant, video_id)
                        if now is None or now.status in TERMINAL:
                            yield {"event": DONE, "data": json.dumps(job_view(now or job))}
                            return
                        continue
                    kind, data = item
                    if kind == CLOSED:
                        yield {"event": "closed", "data": json.dumps({"reason": "the server is stopping"})}
                        return
                    if kind == DONE:
                        now = await run_in_threadpool(service.store.get, tenant, video_id)
                        if now is not None and now.status in TERMINAL:
                            yield {"event": DONE, "data": json.dumps(job_view(now))}
                            return
                        continue
                    yield {"event": kind, "data": json.dumps(data)}
            finally:
                service.hub.unsubscribe(sub)

        return EventSourceResponse(stream(), ping=15, send_timeout=30)

    return r
