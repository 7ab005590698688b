"""The HTTP layer of ``carnator serve``: FastAPI routes, authentication, errors, metrics and the web page.

Every error is JSON ``{"error": {"type", "message"}}`` with a one-line message, never a traceback. A job of another
tenant answers 404, like a job that does not exist. Routes call the :class:`~carnator.service.jobs.JobStore` and the
:class:`~carnator.service.worker.WorkerPool` only.

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the request model and the
tenant dependency, which are built per app, from them.
"""

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from pydantic_core import PydanticCustomError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ..errors import CarnatorError
from ..request import SEED_MAX, SEED_MIN, Params
from .events import CLOSED, DONE
from .jobs import (
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    STATUSES,
    TERMINAL,
    VARIANTS,
    IdempotencyConflict,
    Job,
    JobStoreUnavailable,
    QueueFull,
    StorageFull,
    request_hash,
)

if TYPE_CHECKING:
    from .server import Service

log = logging.getLogger("carnator.service")

CACHE_MODES = ("reuse", "exact", "off")
#: how long DELETE waits for a running job to reach its next step before answering
CANCEL_WAIT_S = 5.0


class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.headers = status, type, message, dict(headers or {})


def error_response(status: int, type: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type, "message": message}}, status_code=status, headers=dict(headers or {}))


# ---- schema ----------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    type: str = Field(description="what kind of error: invalid_request, unauthorized, not_found, conflict, ...")
    message: str = Field(description="one line for people")


class ErrorBody(BaseModel):
    error: ErrorDetail


class JobStats(BaseModel):
    """What the engine did for the job (only the caller's own data)."""

    tier: Literal["exact", "reuse", "miss"] = Field(description="exact: the stored video of an identical earlier request; "
                                                    "reuse: resumed from a compatible cached request; miss: generated")
    hit: bool
    exact_hit: bool
    resume_step: int | None = Field(None, description="the step a reuse resumed from")
    steps: int = Field(description="denoising steps of the request")
    steps_computed: int = Field(description="denoising steps computed (the rest came from the cache)")
    speedup: float | None = Field(None, description="estimated dense seconds / seconds (this tenant's recent misses of the "
                                  "same settings, or this job's own seconds per step); none for an exact hit, which is "
                                  "served from the cache")
    seconds: float
    seconds_saved: float
    reason: str = Field(description="why the engine reused or not")
    certified: bool | None = None
    source_id: str | None = Field(None, description="the caller's cache entry reused")
    entry_id: str | None = Field(None, description="the cache entry this job stored")
    stored: bool
    timings: dict[str, float] = Field(description="seconds per engine stage")
    replica: str | None = Field(None, description="the engine replica that ran the job (carnator serve --replicas only)")


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int = Field(ge=0, le=100)
    created_at: int = Field(description="Unix seconds")
    started_at: int | None = None
    completed_at: int | None = None
    error: ErrorDetail | None = None
    stats: JobStats | None = None
    prompt: str
    request: dict[str, Any] = Field(description="the request as run: the seed and the model's defaults filled in where not given")
    attempts: int = Field(description="times a worker started the job (a restart may requeue it once)")
    cancel_requested: bool


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


def _finite(v: Any) -> Any:
    """NaN and infinities (JSON's ``NaN``, ``Infinity``) are no number a setting takes: say so, before the bounds."""
    if isinstance(v, float) and not math.isfinite(v):
        raise PydanticCustomError("finite_number", "Input should be a finite number")
    return v


def _request_model(policies: tuple[str, ...], max_steps: int) -> type[BaseModel]:
    Policy = Literal[policies]  # type: ignore[valid-type]

    class VideoRequest(BaseModel):
        """A video to generate. Unset settings take the model's defaults."""

        model_config = ConfigDict(extra="forbid")
        prompt: str = Field(min_length=1, max_length=20_000, description="what the video shows")
        negative_prompt: str | None = Field(None, max_length=20_000)
        seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = Field(
            None, description="seed of the initial noise (default: a random one, returned in the job's request)")
        num_frames: Annotated[StrictInt, Field(ge=1, le=1024)] | None = None
        height: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
        width: Annotated[StrictInt, Field(ge=1, le=4096)] | None = None
        num_inference_steps: Annotated[StrictInt, Field(ge=1, le=max_steps)] | None = None
        guidance_scale: Annotated[StrictFloat | StrictInt, Field(ge=0, le=100, allow_inf_nan=False),
                                  BeforeValidator(_finite)] | None = None
        policy: Policy = Field("carnator", description="how cached work is reused")
        cache: Literal["reuse", "exact", "off"] = Field("reuse", description="what the job may take from the cache: reuse "
                                                        "(exact hits and approximate reuse), exact (exact hits only), off "
                                                        "(nothing: the job runs in full)")
        store: StrictBool = Field(True, description="keep the result in the cache for later jobs (false: the job "
                                                    "writes nothing; with cache off it touches no cache at all)")

    return VideoRequest


def to_params(body: BaseModel, tenant: str) -> Params:
    """The request parameters a validated body asks for, as the engine takes them: the caller's tenant, and a
    random seed where the body gives none."""
    fields = body.model_dump()
    seed = fields.pop("seed")
    return Params(**fields, seed=secrets.randbelow(2**31) if seed is None else seed, tenant=tenant)


def job_view(job: Job) -> dict[str, Any]:
    return {
        "id": job.id, "object": "video", "status": job.status, "progress": int(job.progress),
        "created_at": int(job.created_at), "started_at": None if job.started_at is None else int(job.started_at),
        "completed_at": None if job.completed_at is None else int(job.completed_at), "error": job.error,
        "stats": job.stats, "prompt": str(job.params.get("prompt", "")), "request": job.params,
        "attempts": job.attempts, "cancel_requested": job.cancel_requested,
    }


_ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: _ERRORS[c] for c in codes}


# ---- the app ---------------------------------------------------------------------------------------
def create_app(service: "Service") -> FastAPI:
    cfg = service.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(service.start)
        try:
            yield
        finally:
            await run_in_threadpool(service.stop)

    app = FastAPI(title="Carnator video jobs", version=service.version, lifespan=lifespan,
                  description="Text-to-video jobs with a cross-request cache scoped by tenant (carnator serve).",
                  docs_url=None, redoc_url=None)  # (their pages load scripts from a CDN; the schema is at /openapi.json)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes,
                       on_reject=lambda: service.metrics.rejections.labels(reason="too_large").inc())
    VideoRequest = _request_model(service.policies, service.max_steps)

    # -- auth ---------------------------------------------------------------------------------
    tenant_of: Callable[..., str]
    if cfg.keys is None:
        def open_tenant() -> str:
            return "default"
        tenant_of = open_tenant
    else:
        bearer = HTTPBearer(auto_error=False, description="an API key of keys.json")
        keys = {k.encode(): t for k, t in cfg.keys.items()}

        def keyed_tenant(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> str:
            if creds is None or not creds.credentials:
                service.metrics.rejections.labels(reason="unauthorized").inc()
                raise ApiError(401, "unauthorized", "missing API key: send the header Authorization: Bearer KEY",
                               {"WWW-Authenticate": "Bearer"})
            given, found = creds.credentials.encode(), None
            for k, t in keys.items():  # every key compared, in constant time
                if hmac.compare_digest(k, given):
                    found = t
            if found is None:
                service.metrics.rejections.labels(reason="unauthorized").inc()
                raise ApiError(401, "unauthorized", "unknown API key", {"WWW-Authenticate": "Bearer"})
            return found
        tenant_of = keyed_tenant

    Tenant = Annotated[str, Depends(tenant_of)]

    def json_body(request: Request) -> None:
        """A body sent as anything but JSON (curl's -d sends a form; no Content-Type at all) is not read as JSON."""
        given = request.headers.get("content-type", "")
        kind = given.split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            service.metrics.rejections.labels(reason="invalid").inc()
            raise ApiError(415, "unsupported_media_type", "send the body as JSON with the header Content-Type: "
                           f"application/json (this request's: {given or 'none'})")
    JobId = Annotated[str, Path(min_length=1, max_length=100, description="the job's id")]

    # -- errors -------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            service.metrics.rejections.labels(reason="bad_json").inc()
            return error_response(400, "bad_request", "the body is not valid JSON")
        e = errs[0] if errs else {}
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "request"
        msg = str(e.get("msg", "invalid")).splitlines()[0]
        service.metrics.rejections.labels(reason="invalid").inc()
        return error_response(422, "invalid_request", f"{where}: {msg}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        msg = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail).splitlines()[0])
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # every method of every route of this path (Starlette names the first route's)
            allowed = set()
            for route in app.router.routes:
                if route.matches(request.scope)[0] != Match.NONE:
                    allowed |= set(getattr(route, "methods", None) or ())
            headers["Allow"] = ", ".join(sorted(allowed))
        return error_response(exc.status_code, kind, msg, headers)

    @app.exception_handler(JobStoreUnavailable)
    async def _store_down(request: Request, exc: JobStoreUnavailable):  # reads and cancels while the job table is down
        return error_response(503, "unavailable", f"{exc}; try again shortly", {"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("internal error on %s %s: %r", request.method, request.url.path, exc, exc_info=exc)
        return error_response(500, "server_error", "internal error; the server's log has the details")

    def _get(tenant: str, job_id: str) -> Job:
        job = service.store.get(tenant, job_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video job {job_id!r}")
        return job

    # -- routes -------------------------------------------------------------------------------
    @app.post("/v1/videos", status_code=202, response_model=VideoJob, tags=["videos"],
              responses={200: {"model": VideoJob, "description": "an Idempotency-Key replay: the job it created"},
                         **_responses(400, 401, 409, 413, 415, 422, 429, 503)})
    def create_video(body: VideoRequest, tenant: Tenant, _json: Annotated[None, Depends(json_body)],  # type: ignore[valid-type]
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

    @app.get("/v1/videos", response_model=VideoList, tags=["videos"], responses=_responses(401, 422))
    def list_videos(tenant: Tenant, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                    after: Annotated[str | None, Query(max_length=100, description="the last id of the previous page")] = None,
                    order: Literal["desc", "asc"] = "desc"):
        """The caller's jobs, newest first (``order=asc``: oldest first), a page at a time."""
        jobs, more = service.store.list(tenant, limit=limit, after=after, order=order)
        data = [job_view(j) for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/videos/{video_id}", response_model=VideoJob, tags=["videos"], responses=_responses(401, 404, 422))
    def get_video(video_id: JobId, tenant: Tenant):
        """One of the caller's jobs."""
        return job_view(_get(tenant, video_id))

    @app.get("/v1/videos/{video_id}/content", tags=["videos"], response_class=FileResponse,
             responses={200: {"content": {"video/mp4": {}, "image/gif": {}}, "description": "the video"},
                        **_responses(401, 404, 409, 422)})
    def get_content(video_id: JobId, tenant: Tenant, variant: Literal["video", "mp4", "gif"] = "video"):
        """The finished video: ``video/mp4`` (``variant=gif``: an animated GIF)."""
        job = _get(tenant, video_id)
        if job.status in (CANCELLED, FAILED):
            raise ApiError(409, "conflict", f"job {video_id} was {job.status}: it has no video")
        if job.status != COMPLETED:
            raise ApiError(409, "conflict", f"job {video_id} is {job.status.replace('_', ' ')}: its video is ready when it is completed")
        v = "gif" if variant == "gif" else "mp4"
        path = service.store.video_path(tenant, video_id, v)
        if path is None:
            raise ApiError(404, "not_found", f"the {v} of job {video_id} is gone")
        return FileResponse(path, media_type=VARIANTS[v], filename=f"{video_id}.{v}")

    @app.delete("/v1/videos/{video_id}", response_model=VideoJob, tags=["videos"],
                responses={202: {"model": VideoJob, "description": "cancellation asked; the job stops at its next step"},
                           **_responses(401, 404, 409, 422)})
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

    @app.get("/v1/videos/{video_id}/events", tags=["videos"], response_class=EventSourceResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events: queued, "
                              "in_progress, decision, progress, done (data: JSON)"}, **_responses(401, 404, 422)})
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

    @app.get("/metrics", tags=["operations"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text format"}})
    def metrics():
        """Prometheus metrics (no tenant, prompt or job id in any label)."""
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/audit", tags=["operations"])
    def audit() -> dict[str, Any]:
        """The shadow audits' live state: per kind of change and tier, the verdicts, the unsafe among them, the upper
        (live) and lower Clopper-Pearson bounds and whether the tier is disabled (no tenant, prompt or job id)."""
        return service.auditor.report()

    @app.get("/healthz", tags=["operations"])
    def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], responses=_responses(503))
    def readyz() -> dict[str, str]:
        """Ready to take jobs: workers alive, job store writable, not shutting down."""
        why = service.not_ready()
        if why:
            raise ApiError(503, "unavailable", why, {"Retry-After": "5"})
        return {"status": "ready"}

    page = resources.files("carnator.service").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index():
        return HTMLResponse(page.replace("{{AUTH}}", "true" if cfg.keys is not None else "false"))

    return app


def json_http_protocol() -> type:
    """uvicorn's HTTP protocol, answering a request it cannot parse (a bad Content-Length, a broken header) with the
    service's JSON error instead of its plain-text 400; the connection then closes, as uvicorn's does."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrorProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"type": "bad_request", "message": "the request is not valid HTTP/1.1 (a bad "
                                         "Content-Length, request line or header)"}}).encode()
            head = (f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n").encode()
            self.transport.write(head + body)
            self.transport.close()

    return JsonErrorProtocol


class BodyLimit:
    """413 for a request body over ``limit`` bytes (declared or streamed); 400 for a bad Content-Length."""

    def __init__(self, app, limit: int, on_reject=None):
        self.app, self.limit, self.on_reject = app, limit, on_reject or (lambda: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await error_response(400, "bad_request", "bad Content-Length")(scope, receive, send)
            if int(declared) > self.limit:
                self.on_reject()
                return await _too_large(self.limit)(scope, receive, send)
        seen = 0
        started = False

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited, tracking_send)
        except _TooLarge:
            self.on_reject()
            if not started:
                await _too_large(self.limit)(scope, receive, send)


class _TooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return error_response(413, "too_large", f"the request body is over {limit} bytes")


__all__ = ["create_app", "json_http_protocol", "ApiError", "VideoJob", "VideoList", "JobStats", "STATUSES"]
