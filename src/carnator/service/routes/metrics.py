"""Prometheus metrics (``GET /metrics``)."""

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .deps import Deps


def router(deps: Deps) -> APIRouter:
    service = deps.service
    r = APIRouter(tags=["operations"])

    @r.get("/metrics", response_class=Response,
           responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text format"}})
    def metrics():
        """Prometheus metrics (no tenant, prompt or job id in any label)."""
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return r
