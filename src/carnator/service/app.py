"""The HTTP layer of ``carnator serve``: the FastAPI app, assembled from the feature routers of :mod:`.routes`, the
dependencies they share (the service, authentication, the request body) and the error handlers.

Every error is JSON ``{"error": {"type", "message"}}`` with a one-line message, never a traceback (:mod:`.http`). A
job of another tenant answers 404, like a job that does not exist.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from .http import ApiError, BodyLimit, error_response
from .jobs import JobStoreUnavailable
from .routes import FEATURES
from .routes.deps import Deps, json_body_dependency, tenant_dependency
from .routes.schema import request_model

if TYPE_CHECKING:
    from .server import Service

log = logging.getLogger("carnator.service")


def create_app(service: Service) -> FastAPI:
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
    deps = Deps(service, tenant_of=tenant_dependency(service), json_body=json_body_dependency(service),
                video_request=request_model(service.policies, service.max_steps))
    routers = [feature.router(deps) for feature in FEATURES]
    for router in routers:
        app.include_router(router)

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
            allowed = set()  # (the routers' own routes: FastAPI may keep an included router as one route of no methods)
            for route in [*app.router.routes, *(route for router in routers for route in router.routes)]:
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

    return app


__all__ = ["create_app"]
