"""The service's published schema: the request body, the job as the API shows it, the list page and the error body.

Annotations here are evaluated (no ``from __future__ import annotations``): the request model is built per app, from
the server's policies and step limit, and pydantic reads its fields from them.
"""

import math
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from pydantic_core import PydanticCustomError

from ...request import SEED_MAX, SEED_MIN, Params
from ..jobs import Job


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


def request_model(policies: tuple[str, ...], max_steps: int) -> type[BaseModel]:
    """The body of ``POST /v1/videos`` on a server of these policies and this step limit."""
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
    """A job as the API shows it (:class:`VideoJob`)."""
    return {
        "id": job.id, "object": "video", "status": job.status, "progress": int(job.progress),
        "created_at": int(job.created_at), "started_at": None if job.started_at is None else int(job.started_at),
        "completed_at": None if job.completed_at is None else int(job.completed_at), "error": job.error,
        "stats": job.stats, "prompt": str(job.params.get("prompt", "")), "request": job.params,
        "attempts": job.attempts, "cancel_requested": job.cancel_requested,
    }


_ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 415, 422, 429, 503)}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The documented error answers of a route: these status codes, each with the error body."""
    return {c: _ERRORS[c] for c in codes}


__all__ = ["ErrorBody", "ErrorDetail", "JobStats", "VideoJob", "VideoList", "job_view", "request_model", "responses", "to_params"]
