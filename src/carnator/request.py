"""The types one request passes through: :class:`Request` in, :class:`Result` (frames + :class:`Stats`) out.

:func:`resolve_request` is the one place a request is checked: every adapter's ``resolve`` calls it with the
model's defaults and :class:`RequestLimits`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .backbones.base import GenerationDefaults

log = logging.getLogger("carnator")

#: the seeds ``torch.Generator.manual_seed`` takes without aliasing, and the cache's SQLite INTEGER holds (signed 64-bit)
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


#: what a request may read from the cache: "reuse" (exact hits and approximate reuse), "exact" (exact hits only), "off"
CACHE_MODES = ("reuse", "exact", "off")


@dataclass(frozen=True)
class Params:
    """What one generation asks, as its caller gave it: built once at each edge (``Carnator.generate``'s keywords,
    the CLI's flags, the HTTP body, a job read back from the job table) and handed on as itself through every hop
    (worker, Ray replica, engine). Unset settings (None) take the model's defaults when the engine resolves it into a
    :class:`Request`; ``cache`` None takes the policy's. JSON-able: :meth:`to_dict` / :meth:`from_dict`."""

    prompt: str
    seed: int
    policy: str = "carnator"
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    guidance_scale: float | None = None
    tenant: str = "default"
    #: what the request may read from the cache (:data:`CACHE_MODES`; None: the policy's default)
    cache: str | None = None
    #: whether the result is kept in the cache for later requests
    store: bool = True

    def settings(self) -> dict[str, Any]:
        """The keywords of ``adapter.resolve`` beside the prompt and seed (each None: the model's default)."""
        return {"negative_prompt": self.negative_prompt, "num_inference_steps": self.num_inference_steps,
                "num_frames": self.num_frames, "height": self.height, "width": self.width,
                "guidance_scale": self.guidance_scale, "tenant": self.tenant}

    def to_dict(self, *, tenant: bool = True) -> dict[str, Any]:
        """The fields as JSON-able plain data (``tenant=False``: without the tenant, which a job row keeps apart)."""
        d = asdict(self)
        if not tenant:
            del d["tenant"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], **override: Any) -> Params:
        """The parameters ``d`` holds (:meth:`to_dict`'s keys; keys of no field are left out, so a row written by a
        later version still reads), with ``override`` on top."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, **override})


@dataclass(frozen=True)
class Request:
    """A fully resolved generation request (every optional setting filled in from the model's defaults)."""

    prompt: str
    seed: int
    num_inference_steps: int
    num_frames: int
    height: int
    width: int
    guidance_scale: float
    negative_prompt: str | None = None
    tenant: str = "default"

    def settings(self) -> dict:
        """The generation settings that decide whether two requests' trajectories are comparable."""
        return {
            "num_inference_steps": self.num_inference_steps,
            "num_frames": self.num_frames,
            "height": self.height,
            "width": self.width,
            "guidance_scale": float(self.guidance_scale),
        }

    def exact_key(self, model_identity: str) -> str:
        """Key of the exact-hit tier: identical prompt, negative prompt, seed, settings, model and tenant."""
        payload = {
            "model": model_identity,
            "tenant": self.tenant,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": int(self.seed),
            **self.settings(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class Stats:
    """What happened to one request. Timings are seconds per stage.

    ``hit``: reused cached work (``exact_hit``: returned a stored video); ``source_id``: the entry reused;
    ``reason``: the decision in one line; ``certified``: whether the thresholds that accepted an approximate hit were
    certified (None: not a thresholded decision); ``resume_step``: the first step computed after the reuse;
    ``dit_forwards`` / ``dense_forwards``: transformer forwards run, and what a dense run of the request runs;
    ``entry_id``: the entry this request was stored as; ``notes``: the decision's evidence (candidates, signature,
    discrepancies, similarity, ...), JSON-able.
    """

    policy: str = "dense"
    hit: bool = False
    exact_hit: bool = False
    source_id: str | None = None
    reason: str = ""
    certified: bool | None = None
    resume_step: int | None = None
    active_fraction: float | None = None
    mask_density: float | None = None
    entry_id: str | None = None
    dit_forwards: int = 0
    dense_forwards: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    """Generated video and what it cost."""

    frames: np.ndarray  # uint8 (T, H, W, 3)
    stats: Stats
    request: Request
    video: np.ndarray | None = None  # float32 (T, H, W, 3) in [0, 1], as the diffusers pipeline returns with output_type="np"


def to_uint8(video: np.ndarray) -> np.ndarray:
    """Float video in [0, 1] to uint8, rounding like diffusers' ``numpy_to_pil``."""
    return (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)


# ---- checking a request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What a model accepts; :func:`resolve_request` refuses anything beyond it (adapters: ``limits()``).

    The bounds keep a request to what the model can take and this machine's memory can hold: a step count of
    10**9 would allocate gigabytes of timesteps before the first step, a prompt of megabytes would be tokenized
    and stored in full although the text encoder reads its first few hundred tokens.
    """

    max_steps: int = 1000
    max_frames: int = 1024
    max_height: int = 4096
    max_width: int = 4096
    #: frames x height x width: the decoded float32 video takes 12 bytes per pixel (2**28: 3 GiB)
    max_pixels: int = 2**28
    min_guidance: float = 0.0
    max_guidance: float = 100.0
    #: longer prompts are refused (the text encoders read a few thousand characters at most)
    max_prompt_chars: int = 20_000
    #: tokens of a prompt the text encoder reads (None: no limit known); longer prompts are cut, with a warning
    max_prompt_tokens: int | None = None
    #: a prompt's tokens as that encoder counts them against ``max_prompt_tokens``
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False, repr=False)
    seed_min: int = SEED_MIN
    seed_max: int = SEED_MAX


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _type_name(v: object) -> str:
    return type(v).__name__


def _check_text(name: str, text: object, limits: RequestLimits, *, label: str) -> str:
    """``text`` as the model will read it: a string of valid Unicode within ``max_prompt_chars``, cut to what the text
    encoder reads (with a warning)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{name} must be a string, got {_type_name(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: on the command line, bytes that are not UTF-8
        raise InvalidRequestError(
            f"{label} is not valid text: character {e.start} is U+{ord(text[e.start]):04X}, a lone surrogate "
            "(from a command line: bytes that are not UTF-8)"
        ) from None
    if len(text) > limits.max_prompt_chars:
        raise InvalidRequestError(
            f"{label} is {len(text):,} characters long; at most {limits.max_prompt_chars:,} are accepted"
            + (f" (the text encoder reads its first {limits.max_prompt_tokens} tokens)" if limits.max_prompt_tokens else "")
        )
    if limits.max_prompt_tokens is not None and limits.count_tokens is not None:
        text = truncate_to_tokens(text, limits.max_prompt_tokens, limits.count_tokens, label=label)
    return text


def truncate_to_tokens(text: str, max_tokens: int, count: Callable[[str], int], *, label: str = "the prompt") -> str:
    """``text`` cut after its last whole word that the text encoder still reads (``count(prefix) <= max_tokens``),
    with a warning; unchanged when it fits. ``count`` must not decrease as the prefix grows (a tokenizer's count):
    two binary searches over word ends, so O(log words) calls of ``count``."""
    n = count(text)
    if n <= max_tokens:
        return text
    ends = [m.end() for m in re.finditer(r"\S+", text)]

    def fits(k: int) -> bool:
        return count(text[: ends[k]]) <= max_tokens

    lo, hi = -1, len(ends) - 1  # the largest k with fits(k) (-1: not even the first word fits)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    if lo < 0:  # one word longer than the whole budget: cut it by characters
        a, b = 0, ends[0]
        while a < b:
            mid = (a + b + 1) // 2
            if count(text[:mid]) <= max_tokens:
                a = mid
            else:
                b = mid - 1
        cut = text[:a]
    else:
        # The shortest prefix the encoder reads alike (the embedded model drops unknown words: do not keep a tail of them).
        full = count(text[: ends[lo]])
        a, b = 0, lo
        while a < b:
            mid = (a + b) // 2
            if count(text[: ends[mid]]) >= full:
                b = mid
            else:
                a = mid + 1
        cut = text[: ends[a]]
    tail = cut[-40:]
    log.warning(
        "%s has %d tokens and the text encoder reads %d: cut to its first %d of %d characters (ending %r)",
        label, n, max_tokens, len(cut), len(text), tail,
    )
    return cut


def resolve_request(
    defaults: GenerationDefaults,
    limits: RequestLimits,
    prompt: str,
    *,
    seed: int,
    negative_prompt: str | None = None,
    num_inference_steps: int | None = None,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    guidance_scale: float | None = None,
    tenant: str = "default",
) -> Request:
    """Fill unset settings from ``defaults`` (a :class:`~carnator.backbones.base.GenerationDefaults`) and check every
    field against ``limits``; raises :class:`~carnator.errors.InvalidRequestError` naming the field, and the type
    where the type is wrong. The model's own geometry rules (frame counts, size multiples) are the adapter's
    ``check_geometry``."""
    prompt = _check_text("prompt", prompt, limits, label="the prompt")
    if not prompt.strip():
        raise InvalidRequestError("the prompt is empty")
    neg = defaults.negative_prompt if negative_prompt is None else negative_prompt
    if neg is not None:
        neg = _check_text("negative_prompt", neg, limits, label="the negative prompt")
    if not _is_int(seed):
        raise InvalidRequestError(f"seed must be an integer, got {_type_name(seed)}")
    if not limits.seed_min <= int(seed) <= limits.seed_max:
        raise InvalidRequestError(f"seed must lie in [-2**63, 2**63 - 1], got {int(seed)}")
    if not isinstance(tenant, str):
        raise InvalidRequestError(f"tenant must be a string, got {_type_name(tenant)}")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", tenant):
        raise InvalidRequestError("tenant must be 1-64 characters of letters, digits, '.', '_' or '-'")
    values = {
        "num_inference_steps": (defaults.num_inference_steps if num_inference_steps is None else num_inference_steps, limits.max_steps),
        "num_frames": (defaults.num_frames if num_frames is None else num_frames, limits.max_frames),
        "height": (defaults.height if height is None else height, limits.max_height),
        "width": (defaults.width if width is None else width, limits.max_width),
    }
    for name, (v, most) in values.items():
        if not _is_int(v):
            raise InvalidRequestError(f"{name} must be a positive integer, got {_type_name(v)}")
        if v <= 0:
            raise InvalidRequestError(f"{name} must be a positive integer, got {v}")
        if v > most:
            raise InvalidRequestError(f"{name} must be at most {most} for this model, got {v}")
    steps, frames, h, w = (int(values[k][0]) for k in values)
    if frames * h * w > limits.max_pixels:
        raise InvalidRequestError(
            f"num_frames x height x width = {frames} x {h} x {w} = {frames * h * w:,} pixels; this model's limit is {limits.max_pixels:,}"
        )
    g = defaults.guidance_scale if guidance_scale is None else guidance_scale
    if not isinstance(g, numbers.Real) or isinstance(g, (bool, np.bool_)):
        raise InvalidRequestError(f"guidance_scale must be a number, got {_type_name(g)}")
    if not (math.isfinite(float(g)) and limits.min_guidance <= float(g) <= limits.max_guidance):
        raise InvalidRequestError(f"guidance_scale must be a finite number in [{limits.min_guidance:g}, {limits.max_guidance:g}], got {float(g)!r}")
    return Request(
        prompt=prompt, seed=int(seed), num_inference_steps=steps, num_frames=frames, height=h, width=w,
        guidance_scale=float(g), negative_prompt=neg, tenant=tenant,
    )
