"""The shadow audits' live state (``GET /audit``; the audits themselves: :mod:`carnator.service.audit`)."""

from typing import Any

from fastapi import APIRouter

from .deps import Deps


def router(deps: Deps) -> APIRouter:
    service = deps.service
    r = APIRouter(tags=["operations"])

    @r.get("/audit")
    def audit() -> dict[str, Any]:
        """The shadow audits' live state: per kind of change and tier, the verdicts, the unsafe among them, the upper
        (live) and lower Clopper-Pearson bounds and whether the tier is disabled (no tenant, prompt or job id)."""
        return service.auditor.report()

    return r
