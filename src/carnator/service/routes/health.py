"""Liveness (``GET /healthz``) and readiness (``GET /readyz``)."""

from fastapi import APIRouter

from ..http import ApiError
from .deps import Deps
from .schema import responses


def router(deps: Deps) -> APIRouter:
    service = deps.service
    r = APIRouter(tags=["operations"])

    @r.get("/healthz")
    def healthz() -> dict[str, str]:
        """The process answers."""
        return {"status": "ok"}

    @r.get("/readyz", responses=responses(503))
    def readyz() -> dict[str, str]:
        """Ready to take jobs: workers alive, job store writable, not shutting down."""
        why = service.not_ready()
        if why:
            raise ApiError(503, "unavailable", why, {"Retry-After": "5"})
        return {"status": "ready"}

    return r
