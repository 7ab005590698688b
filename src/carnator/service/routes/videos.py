"""The video jobs: create (``POST /v1/videos``), list, get, download and cancel.

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the request model and the
tenant dependency, which are built per app, from them.
"""

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ...errors import CarnatorError
from ..events import DONE
from ..http import ApiError
from ..jobs import (
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    TERMINAL,
    VARIANTS,
    IdempotencyConflict,
    JobStoreUnavailable,
    QueueFull,
    StorageFull,
    request_hash,
)
from .deps import Deps, JobId
from .schema import VideoJob, VideoList, job_view, responses, to_params

#: how long DELETE waits for a running job to reach its next step before answering
CANCEL_WAIT_S = 5.0


def router(deps: Deps) -> APIRouter:
    service = deps.service
    cfg = service.config
    VideoRequest = deps.video_request
    Tenant = Annotated[str, Depends(deps.tenant_of)]
    r = APIRouter(tags=["videos"])

    @r.post("/v1/videos", status_code=202, response_model=VideoJob,
            responses={200: {"model": VideoJob, "description": "an Idempotency-Key replay: the job it created"},
                       **responses(400, 401, 409, 413, 415, 422, 429, 503)})
    def create_video(body: VideoRequest, tenant: Tenant, _json: Annotated[None, Depends(deps.json_body)],  # type: ignore[valid-type]
                     idempotency_key: Annotated[str | None, Header(max_length=255, pattern=r"^[\x21-\x7e]+$")] = None):
        """Queue a video job; 202 with the job. Poll it, stream its events, download it when completed."""
        if service.pool.draining:
            raise ApiError(503, "unavailable", "the server is shutting down", {"Retry-After": "5"})
        sent: BaseModel = body  # (the model is built per app: mypy sees no class)
        given = sent.model_dump(exclude_unset=True)
        try:
            params = service.validate(to_params(sent, tenant))
        except CarnatorError as e:
            service.metrics.rejections.labels(reason="invalid").inc()
            raise ApiError(422, "invalid_request", str(e)) from None
        try:
            job, created = service.store.submit(
                tenant, params.to_dict(tenant=False), idempotency_key=idempotency_key, request_hash=request_hash(given),
                max_queued=cfg.max_queue, max_queued_per_tenant=service.max_queue_per_tenant)
        except QueueFull as e:
            service.metrics.rejections.labels(reason=e.reason).inc()
            raise ApiError(429, "rate_limited", str(e), {"Retry-After": str(service.pool.retry_after())}) from None
        except IdempotencyConflict as e:
            service.metrics.rejections.labels(reason="idempotency_conflict").inc()
            raise ApiError(409, "conflict", str(e)) from None
        except StorageFull as e:
            service.metrics.rejections.labels(reason="storage_full").inc()
            raise ApiError(503, "unavailable", f"{e}: no new jobs until there is room", {"Retry-After": "30"}) from None
        except JobStoreUnavailable as e:
            service.metrics.rejections.labels(reason="store_unavailable").inc()
            raise ApiError(503, "unavailable", f"{e}: no new jobs until it is back", {"Retry-After": "5"}) from None
        if not created:
            return JSONResponse(job_view(job), status_code=200, headers={"Idempotent-Replayed": "true"})
        service.metrics.requests.labels(status=QUEUED, policy=job.policy).inc()
        service.hub.publish(job.id, QUEUED, {"id": job.id, "status": QUEUED})
        service.pool.notify()
        return JSONResponse(job_view(job), status_code=202, headers={"Location": f"/v1/videos/{job.id}"})

    @r.get("/v1/videos", response_model=VideoList, responses=responses(401, 422))
    def list_videos(tenant: Tenant, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    after: Annotated[str | None, Query(max_length=100, description="the last id of the previous page")] = None,
                    order: Literal["desc", "asc"] = "desc"):
        """The caller's jobs, newest first (``order=asc``: oldest first), a page at a time."""
        jobs, more = service.store.list(tenant, limit=limit, after=after, order=order)
        data = [job_view(j) for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @r.get("/v1/videos/{video_id}", response_model=VideoJob, responses=responses(401, 404, 422))
    def get_video(video_id: JobId, tenant: Tenant):
        """One of the caller's jobs."""
        return job_view(deps.job(tenant, video_id))

    @r.get("/v1/videos/{video_id}/content", response_class=FileResponse,
           responses={200: {"content": {"video/mp4": {}, "image/gif": {}}, "description": "the video"},
                      **responses(401, 404, 409, 422)})
    def get_content(video_id: JobId, tenant: Tenant, variant: Literal["video", "mp4", "gif"] = "video"):
        """The finished video: ``video/mp4`` (``variant=gif``: an animated GIF)."""
        job = deps.job(tenant, video_id)
        if job.status in (CANCELLED, FAILED):
            raise ApiError(409, "conflict", f"job {video_id} was {job.status}: it has no video")
        if job.status != COMPLETED:
            raise ApiError(409, "conflict", f"job {video_id} is {job.status.replace('_', ' ')}: its video is ready when it is completed")
        v = "gif" if variant == "gif" else "mp4"
        path = service.store.video_path(tenant, video_id, v)
        if path is None:
            raise ApiError(404, "not_found", f"the {v} of job {video_id} is gone")
        return FileResponse(path, media_type=VARIANTS[v], filename=f"{video_id}.{v}")

    @r.delete("/v1/videos/{video_id}", response_model=VideoJob,
              responses={202: {"model": VideoJob, "description": "cancellation asked; the job stops at its next step"},
                         **responses(401, 404, 409, 422)})
    async def cancel_video(video_id: JobId, tenant: Tenant):
        """Cancel a job: a queued one at once; a running one stops at its next denoising step, storing nothing, and
        frees its worker. A finished job answers 409."""
        before = await run_in_threadpool(service.store.get, tenant, video_id)
        job = await run_in_threadpool(service.store.cancel, tenant, video_id) if before is not None else None
        if job is None or before is None:
            raise ApiError(404, "not_found", f"no video job {video_id!r}")
        if job.status in (COMPLETED, FAILED):
            raise ApiError(409, "conflict", f"job {video_id} already {job.status}: nothing to cancel")
        if job.status == IN_PROGRESS:
            service.pool.cancel(video_id)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CANCEL_WAIT_S
            while job.status == IN_PROGRESS and loop.time() < deadline:
                await asyncio.sleep(0.05)
                job = await run_in_threadpool(service.store.get, tenant, video_id)
                if job is None:  # removed meanwhile
                    raise ApiError(404, "not_found", f"no video job {video_id!r}")
        if job.status == CANCELLED and before.status == QUEUED:  # (the worker counts the jobs it stops)
            service.metrics.requests.labels(status=CANCELLED, policy=job.policy).inc()
            service.hub.publish(video_id, DONE, {"id": video_id, "status": CANCELLED})
        return JSONResponse(job_view(job), status_code=200 if job.status in TERMINAL else 202)

    return r
