"""Blobs on shared storage through fsspec (a local or NFS directory, ``s3://`` through s3fs, ``gs://``, ...), and the
bounded local read-through cache every replica keeps in front of them.

Blobs are immutable and every tensor in them is checked against its sha256 when read, so a cached copy never
goes stale and a damaged one is caught like a damaged original. Keys and their two states are those of
:class:`~carnator.cache.store.BlobStore`: ``<key>`` published, ``.<key>.part`` staged.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Any

from .store import STAGED_SUFFIX, BlobInfo, BlobStore, parse_blob_name

QUARANTINE = "quarantine"


class FsspecBlobStore(BlobStore):
    """Blobs under one fsspec URL or path. ``bytes_read`` counts the bytes read from the (shared) storage."""

    def __init__(self, url: str, *, read_only: bool = False) -> None:
        import fsspec

        self.url = str(url)
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.read_only = read_only
        self.bytes_read = 0
        self.reads = 0
        if not read_only:
            self.fs.makedirs(f"{self.root}/{QUARANTINE}", exist_ok=True)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def staged_path(self, key: str) -> str:
        return f"{self.root}/.{key}{STAGED_SUFFIX}"

    def stage(self, key: str, data: bytes) -> None:
        tmp = self.staged_path(key)
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                _fsync(f)
        except BaseException:
            self._rm(tmp)
            raise

    def publish(self, key: str) -> bool:
        src = self.staged_path(key)
        try:
            self.fs.mv(src, self.path(key))
        except FileNotFoundError:
            return False
        return True

    def is_staged(self, key: str) -> bool:
        return bool(self.fs.exists(self.staged_path(key)))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else offset + length
        try:
            data = self.fs.cat_file(self.path(key), start=offset or None, end=end)
        except FileNotFoundError:
            if not self.is_staged(key):
                raise
            if not self.read_only:
                self.publish(key)  # committed but never published (its writer died): finish the job
                data = self.fs.cat_file(self.path(key), start=offset or None, end=end)
            else:
                data = self.fs.cat_file(self.staged_path(key), start=offset or None, end=end)
        self.bytes_read += len(data)
        self.reads += 1
        return bytes(data)

    def delete(self, key: str) -> None:
        for p in (self.path(key), self.staged_path(key)):
            self._rm(p)

    def quarantine(self, key: str) -> str | None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for src in (self.path(key), self.staged_path(key)):
            dest = f"{self.root}/{QUARANTINE}/{key}.{stamp}.{secrets.token_hex(2)}"
            try:
                if self.fs.isdir(src):
                    self.fs.mv(src, dest, recursive=True)
                else:
                    self.fs.mv(src, dest)
            except FileNotFoundError:
                continue
            return dest
        return None

    def scan(self) -> list[BlobInfo]:
        try:
            listing = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        out: list[BlobInfo] = []
        for info in listing:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            parsed = parse_blob_name(name)
            if parsed is None:
                continue
            key, staged = parsed
            out.append(BlobInfo(key, staged, _mtime(info), name))
        return out

    def remove(self, blob: BlobInfo) -> bool:
        p = self.staged_path(blob.key) if blob.staged else self.path(blob.key)
        return self._rm(p)

    def _rm(self, path: str) -> bool:
        try:
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            else:
                self.fs.rm(path)
        except FileNotFoundError:
            return False
        return True


class ReadThroughBlobs(BlobStore):
    """A bounded in-memory LRU of byte ranges read from ``inner`` (immutable blobs: a cached range never goes stale).
    Writes, scans and removals pass through; deleting or quarantining a blob drops its cached ranges."""

    def __init__(self, inner: BlobStore, capacity_bytes: int = 256 << 20) -> None:
        self.inner = inner
        self.capacity_bytes = int(capacity_bytes)
        self.read_only = inner.read_only
        self._ranges: OrderedDict[tuple[str, int, int | None], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        k = (key, offset, length)
        with self._lock:
            data = self._ranges.get(k)
            if data is not None:
                self._ranges.move_to_end(k)
                self.hits += 1
                return data
        data = self.inner.read(key, offset, length)
        with self._lock:
            self.misses += 1
            if len(data) <= self.capacity_bytes and k not in self._ranges:
                self._ranges[k] = data
                self._bytes += len(data)
                while self._bytes > self.capacity_bytes:
                    _, old = self._ranges.popitem(last=False)
                    self._bytes -= len(old)
        return data

    def forget(self, key: str) -> None:
        with self._lock:
            for k in [k for k in self._ranges if k[0] == key]:
                self._bytes -= len(self._ranges.pop(k))

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def stage(self, key: str, data: bytes) -> None:
        self.inner.stage(key, data)

    def publish(self, key: str) -> bool:
        return self.inner.publish(key)

    def is_staged(self, key: str) -> bool:
        return self.inner.is_staged(key)

    def delete(self, key: str) -> None:
        self.forget(key)
        self.inner.delete(key)

    def quarantine(self, key: str) -> str | None:
        self.forget(key)
        return self.inner.quarantine(key)

    def scan(self) -> list[BlobInfo]:
        return self.inner.scan()

    def remove(self, blob: BlobInfo) -> bool:
        self.forget(blob.key)
        return self.inner.remove(blob)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _fsync(f: Any) -> None:
    """fsync a local file written through fsspec (other filesystems make a closed object durable themselves)."""
    import os

    try:
        f.flush()
        fd = f.fileno()
    except (AttributeError, OSError, ValueError, NotImplementedError):
        return
    try:
        os.fsync(fd)
    except OSError:
        pass


def _mtime(info: dict[str, Any]) -> float:
    for k in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return time.time()  # unknown: treat as new (never swept early)
