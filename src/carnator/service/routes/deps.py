"""What the routers of one app share: the service, the caller's tenant (authentication), the JSON body check, a job
id in a path and the lookup of the caller's job.

The tenant dependency differs per app (open, or bearer keys: the schema then names the security scheme) and the
request body is built per app: :func:`~carnator.service.app.create_app` assembles a :class:`Deps` and hands it to each
feature's ``router(deps)``.

Annotations here are evaluated (no ``from __future__ import annotations``): FastAPI reads the dependencies' parameters
from them.
"""

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from ..http import ApiError
from ..jobs import Job

if TYPE_CHECKING:
    from ..server import Service

JobId = Annotated[str, Path(min_length=1, max_length=100, description="the job's id")]


@dataclass(frozen=True)
class Deps:
    service: "Service"
    #: the dependency answering the caller's tenant (401 for a missing or unknown key)
    tenant_of: Callable[..., str]
    #: the dependency refusing (415) a body not sent as JSON
    json_body: Callable[..., None]
    #: the body of ``POST /v1/videos`` (:func:`~carnator.service.routes.schema.request_model`)
    video_request: type[BaseModel]

    def job(self, tenant: str, job_id: str) -> Job:
        """The caller's job; 404 for a job that does not exist or is another tenant's."""
        job = self.service.store.get(tenant, job_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video job {job_id!r}")
        return job


def tenant_dependency(service: "Service") -> Callable[..., str]:
    """Without keys every caller is the tenant ``default``; with keys, the bearer key's tenant, every key compared in
    constant time."""
    cfg = service.config
    if cfg.keys is None:
        def open_tenant() -> str:
            return "default"
        return open_tenant
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
    return keyed_tenant


def json_body_dependency(service: "Service") -> Callable[..., None]:
    def json_body(request: Request) -> None:
        """A body sent as anything but JSON (curl's -d sends a form; no Content-Type at all) is not read as JSON."""
        given = request.headers.get("content-type", "")
        kind = given.split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            service.metrics.rejections.labels(reason="invalid").inc()
            raise ApiError(415, "unsupported_media_type", "send the body as JSON with the header Content-Type: "
                           f"application/json (this request's: {given or 'none'})")
    return json_body


__all__ = ["Deps", "JobId", "json_body_dependency", "tenant_dependency"]
