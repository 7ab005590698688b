"""Carnator: fast text-to-video generation by compatibility-guided cross-request reuse.

The public names are imported on first use (PEP 562), so that ``import carnator.cli`` and
``carnator --help`` do not pay for torch and diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Carnator", "CarnatorError", "EngineConfig", "Request", "Result", "Stats", "__version__"]

_LAZY = {
    "Carnator": ".engine",
    "EngineConfig": ".engine",
    "CarnatorError": ".errors",
    "Request": ".request",
    "Result": ".request",
    "Stats": ".request",
}

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Carnator, EngineConfig
    from .errors import CarnatorError
    from .request import Request, Result, Stats


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'carnator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
