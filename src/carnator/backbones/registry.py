"""Which adapter serves which diffusers pipeline class.

The built-in families are named here by module and class and imported on first use, so that no adapter module
imports this one and importing ``carnator.backbones`` loads no family. A third-party adapter registers itself with
:func:`register_adapter` (its ``pipeline_classes`` name the pipelines it serves); a registered class wins over a
built-in one of the same pipeline name.
"""

from __future__ import annotations

import importlib

from ..errors import ModelLoadError
from .base import BackboneAdapter

#: pipeline class name -> (module under carnator.backbones, adapter class)
_BUILTIN: dict[str, tuple[str, str]] = {
    "WanPipeline": ("wan", "WanAdapter"),
    "CogVideoXPipeline": ("cogvideox", "CogVideoXAdapter"),
    "HunyuanVideoPipeline": ("hunyuan", "HunyuanVideoAdapter"),
    "LTXPipeline": ("ltx", "LTXAdapter"),
    "EmbeddedPipeline": ("embedded", "EmbeddedAdapter"),
}

_REGISTERED: dict[str, type[BackboneAdapter]] = {}


def register_adapter(cls: type[BackboneAdapter]) -> type[BackboneAdapter]:
    """Serve every pipeline class named in ``cls.pipeline_classes`` with ``cls`` (usable as a decorator)."""
    for name in cls.pipeline_classes:
        _REGISTERED[name] = cls
    return cls


def _adapter_class(pipeline_class: str) -> type[BackboneAdapter] | None:
    if pipeline_class in _REGISTERED:
        return _REGISTERED[pipeline_class]
    if pipeline_class in _BUILTIN:
        module, name = _BUILTIN[pipeline_class]
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return None


def adapter_for(pipe) -> BackboneAdapter:
    """The adapter for ``type(pipe)`` (or the nearest of its base classes that has one)."""
    for klass in type(pipe).__mro__:
        cls = _adapter_class(klass.__name__)
        if cls is not None:
            return cls(pipe)
    raise ModelLoadError(f"unsupported pipeline class {type(pipe).__name__}; supported: {', '.join(supported_pipelines())}")


def supported_pipelines() -> list[str]:
    """Names of the pipeline classes an adapter serves."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))
