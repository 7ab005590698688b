"""Which store a URL names: ``sqlite:///path`` or a plain path (the local :class:`CacheBank`, the default) or
``postgresql://...`` with a blob location (the :class:`SharedStore` that replicas on many hosts share)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CacheError
from .paths import default_cache_dir

SCHEMES = ("sqlite", "postgresql", "postgres")


def is_shared(url: str | os.PathLike[str] | None) -> bool:
    """Whether ``url`` names a PostgreSQL store."""
    return isinstance(url, str) and url.split("://", 1)[0].lower() in ("postgresql", "postgres") and "://" in url


def local_path(url: str | os.PathLike[str] | None) -> Path:
    """The directory of a local store URL (``sqlite:///path``, a path, or None for the default)."""
    if url is None:
        return default_cache_dir()
    text = os.fspath(url)
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme.lower() != "sqlite":
            raise CacheError(f"--store {text!r}: unknown scheme {scheme!r}; use sqlite:///PATH, a path, or postgresql://...")
        if not rest:
            raise CacheError("--store sqlite:// needs a directory: sqlite:///path/to/cache")
        text = rest
    return Path(text).expanduser()


def open_store(url: str | os.PathLike[str] | None = None, *, blobs: str | os.PathLike[str] | None = None,
               **kwargs: Any):
    """The store ``url`` names (None: the default local directory). ``blobs`` is required for, and only taken by, a
    PostgreSQL store. ``CacheError`` for an unusable URL or store."""
    if is_shared(url):
        if blobs is None:
            raise CacheError("--store postgresql://... needs --blobs PATH_OR_URL (where the shared blobs live)")
        from .shared import SharedStore

        return SharedStore(str(url), os.fspath(blobs), **kwargs)
    if blobs is not None:
        raise CacheError("--blobs is only for a postgresql:// store (a local store keeps its blobs in its directory)")
    from .bank import CacheBank

    return CacheBank(local_path(url), **kwargs)
