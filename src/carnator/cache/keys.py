"""Canonical compatibility keys.

Two requests may share cached computation only when their trajectories are comparable: same model,
same scheduler and same generation settings (resolution, frames, steps, guidance). The bank treats
the key as an opaque string; :func:`compat_key` builds it by hashing a canonical JSON form, so the
same inputs always give the same key regardless of dict order or ``50`` vs ``50.0``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

_KEY_VERSION = 1


def compat_key(
    model_identity: str, scheduler: Any, settings: Mapping[str, Any], extra: Mapping[str, Any] | None = None
) -> str:
    """Hash of ``(model_identity, scheduler, settings, extra)`` in canonical form (64 hex chars).

    ``scheduler`` may be a string (e.g. a class name), a mapping (a scheduler config), or a
    diffusers scheduler object (its class name and ``config`` are used). In configs, keys that start
    with ``_`` (``_class_name``, ``_diffusers_version``, ...) are bookkeeping and are ignored.
    ``settings`` is typically :meth:`carnator.request.Request.settings`. ``extra`` holds whatever else must match
    for two requests to share work, e.g. ``{"embedder": "minilm-l6@<hash>", "reading": {...}}``: the recall
    embedder's identity (the recall index is per key, so entries of two embedders never mix) and the policy's
    reading of signatures. ``None`` and ``{}`` give the key without extras (keys built before ``extra`` existed).
    """
    if not isinstance(model_identity, str) or not model_identity:
        raise ValueError("model_identity must be a non-empty string")
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a mapping, not {type(settings).__name__}")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping or None, not {type(extra).__name__}")
    payload = {
        "v": _KEY_VERSION,
        "model": model_identity,
        "scheduler": _scheduler_form(scheduler),
        "settings": _canonical(settings),
    }
    if extra:
        payload["extra"] = _canonical(extra)
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _scheduler_form(scheduler: Any) -> Any:
    if isinstance(scheduler, str):
        return scheduler
    if isinstance(scheduler, Mapping):
        return _canonical(_public(scheduler))
    config = getattr(scheduler, "config", None)
    if isinstance(config, Mapping):
        return {"class": type(scheduler).__name__, "config": _canonical(_public(config))}
    raise TypeError(f"cannot build a compatibility key from a scheduler of type {type(scheduler).__name__}")


def _public(config: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in config.items() if not str(k).startswith("_")}


def _canonical(value: Any) -> Any:
    """JSON-ready canonical form: sorted mappings, lists for sequences, integral floats as ints."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return repr(value)
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if hasattr(value, "tolist"):
        return _canonical(value.tolist())
    raise TypeError(f"cannot use a value of type {type(value).__name__} in a compatibility key")


def content_key(content: Iterable[str]) -> str | None:
    """Hash of a prompt's content items (:mod:`carnator.signature.content`) as a multiset (64 hex chars): equal for
    two prompts that ask the same in other words. None for an empty content (a prompt that asks for nothing known
    would otherwise match every other such prompt)."""
    items = sorted(str(i) for i in content)
    if not items:
        return None
    text = json.dumps(items, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
