"""Carnator: fast text-to-video generation by compatibility-guided cross-request reuse."""

from .engine import Carnator, EngineConfig
from .errors import CarnatorError
from .request import Request, Result, Stats

__version__ = "0.1.0"
__all__ = ["Carnator", "CarnatorError", "EngineConfig", "Request", "Result", "Stats", "__version__"]
