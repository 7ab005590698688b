"""Where the cache bank lives when the user does not say."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that overrides the default cache directory.
CACHE_DIR_ENV = "CARNATOR_CACHE_DIR"


def default_cache_dir() -> Path:
    """The default cache directory (not created here).

    ``$CARNATOR_CACHE_DIR`` if set and non-empty; otherwise ``$XDG_CACHE_HOME/carnator`` when
    ``XDG_CACHE_HOME`` is an absolute path (the XDG spec says to ignore relative ones); otherwise
    ``~/.cache/carnator``.
    """
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "carnator"
    return Path.home() / ".cache" / "carnator"
