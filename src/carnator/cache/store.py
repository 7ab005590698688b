"""Blobs: the immutable byte strings that hold an entry's tensors and video, and how tensors are packed into them.

An entry has up to two blobs, ``<id>.tensors.safetensors`` (trajectory, masks, evidence, ...) and
``<id>.video.safetensors`` (the decoded video alone). Both are ordinary safetensors files, readable by any
safetensors tool. At admission the bank records, per tensor, its byte range inside its blob, dtype, shape and
sha256 (and per blob its size and sha256), so that :func:`read_tensors` reads only the tensors asked for (an exact
hit reads the video's bytes, not a 17 MB trajectory) and checks each against its checksum.

All file I/O goes through a :class:`BlobStore`. :class:`LocalBlobStore` keeps blobs as files in one directory; a
shared implementation (fsspec: S3, GCS, NFS) needs the same few operations. A blob is written in two steps:
:meth:`BlobStore.stage` makes it durable but invisible, the bank commits the entry's row, then
:meth:`BlobStore.publish` gives it its name. So a published blob without a row means the row was lost (reported by
``verify``), while a staged one without a row is an admission that never committed (cleaned up quietly).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as _st_save

from ..errors import CorruptEntryError
from . import _faults

BLOB_SUFFIX = ".safetensors"
STAGED_SUFFIX = ".part"
TENSORS_BLOB = "tensors"
VIDEO_BLOB = "video"

#: safetensors dtype names -> torch dtypes (those this torch build has).
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"),
        ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        ("C64", "complex64"),
    )
    if hasattr(torch, attr)
}


def sha256(data: bytes | memoryview) -> str:
    """Hex sha256 of ``data``: the checksum kept for every blob and every tensor."""
    return hashlib.sha256(data).hexdigest()


def blob_key(entry_id: str, kind: str) -> str:
    """The key of an entry's blob of ``kind`` (``"tensors"`` or ``"video"``)."""
    return f"{entry_id}.{kind}{BLOB_SUFFIX}"


def entry_of(key: str) -> str:
    """The entry id a blob key belongs to."""
    return key.split(".", 1)[0]


# -- packing -------------------------------------------------------------------------------------


def pack_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """``tensors`` as safetensors bytes, and per tensor ``{offset, nbytes, dtype, shape, sha256}`` (absolute byte
    range in those bytes). Tensors are moved to CPU and made contiguous; storage sharing is undone."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> torch.Tensor, not {type(tensors).__name__}")
    prepared: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        prepared[name] = t
    data = _st_save(prepared, metadata=dict(metadata) if metadata else None)
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start = 8 + header_len
    view = memoryview(data)
    index: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        index[name] = {
            "offset": start + lo,
            "nbytes": hi - lo,
            "dtype": info["dtype"],
            "shape": list(info["shape"]),
            "sha256": sha256(view[start + lo : start + hi]),
        }
    return data, index


def decode_tensor(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """One tensor from its raw little-endian bytes (as safetensors stores them)."""
    dt = _DTYPES.get(dtype)
    if dt is None:
        raise CorruptEntryError(f"unknown tensor dtype {dtype!r}")
    if not data:
        return torch.empty(shape, dtype=dt)
    try:
        return torch.frombuffer(bytearray(data), dtype=dt).reshape(shape)
    except (RuntimeError, ValueError) as exc:
        raise CorruptEntryError(f"tensor bytes do not fit dtype {dtype} and shape {shape}: {exc}") from exc


def read_tensors(store: BlobStore, layout: Mapping[str, Any], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the entry described by ``layout``, each read alone and checked against its sha256.

    Raises ``FileNotFoundError`` when a blob is gone and :class:`CorruptEntryError` when a tensor fails its
    checksum or its blob cannot be read (is a directory, permission denied, I/O error)."""
    specs = layout["tensors"]
    out: dict[str, torch.Tensor] = {}
    by_blob: dict[str, list[str]] = {}
    for name in names:
        by_blob.setdefault(specs[name]["blob"], []).append(name)
    for key, group in by_blob.items():
        # One read per blob when the wanted tensors fill most of the span between them; else one read per tensor.
        lo = min(specs[n]["offset"] for n in group)
        hi = max(specs[n]["offset"] + specs[n]["nbytes"] for n in group)
        wanted = sum(specs[n]["nbytes"] for n in group)
        if len(group) > 1 and wanted * 2 >= hi - lo:
            span = _read(store, key, lo, hi - lo)
            chunks = {n: span[specs[n]["offset"] - lo : specs[n]["offset"] - lo + specs[n]["nbytes"]] for n in group}
        else:
            chunks = {n: _read(store, key, specs[n]["offset"], specs[n]["nbytes"]) for n in group}
        for n in group:
            spec = specs[n]
            chunk = chunks[n]
            if len(chunk) != spec["nbytes"] or sha256(chunk) != spec["sha256"]:
                raise CorruptEntryError(f"tensor {n!r} in blob {key} failed its checksum")
            out[n] = decode_tensor(chunk, spec["dtype"], spec["shape"])
    return out


def check_blobs(store: BlobStore, layout: Mapping[str, Any]) -> None:
    """Read every blob of an entry whole and check its size and sha256 (what ``verify`` does); raises like
    :func:`read_tensors`."""
    for key, info in layout["blobs"].items():
        data = _read(store, key, 0, None)
        if len(data) != info["nbytes"] or sha256(data) != info["sha256"]:
            raise CorruptEntryError(f"blob {key} failed its checksum ({len(data)} bytes, expected {info['nbytes']})")


def _read(store: BlobStore, key: str, offset: int, length: int | None) -> bytes:
    try:
        return store.read(key, offset, length)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptEntryError(f"cannot read blob {key}: {exc.strerror or exc}") from exc


# -- storage -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobInfo:
    """One blob found by :meth:`BlobStore.scan`: published under ``key``, or ``staged`` (not yet visible)."""

    key: str
    staged: bool
    mtime: float
    name: str

    @property
    def entry_id(self) -> str:
        return entry_of(self.key)


def parse_blob_name(name: str) -> tuple[str, bool] | None:
    """A file name in a blob directory as ``(key, staged)``: ``KEY.BLOB_SUFFIX`` a published blob, ``.KEY.STAGED_SUFFIX``
    one being written; None for anything else."""
    if name.startswith(".") and name.endswith(STAGED_SUFFIX):
        return name[1 : -len(STAGED_SUFFIX)], True
    if not name.startswith(".") and name.endswith(BLOB_SUFFIX):
        return name, False
    return None


class BlobStore(ABC):
    """Immutable named blobs. Keys are plain names (``[0-9a-z._-]``); a key is written once and never rewritten."""

    read_only: bool = False

    @abstractmethod
    def stage(self, key: str, data: bytes) -> None:
        """Write ``data`` durably for ``key`` without making it visible under ``key`` yet (OSError on failure)."""

    @abstractmethod
    def publish(self, key: str) -> bool:
        """Make the staged blob of ``key`` visible under ``key``; False if nothing was staged (already published)."""

    @abstractmethod
    def is_staged(self, key: str) -> bool:
        """Whether a staged (unpublished) blob of ``key`` exists."""

    @abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of the blob (to its end when ``length`` is None). A blob that is
        staged but not published is read (and published, when writable): its row was committed. ``FileNotFoundError``
        when it does not exist; any other ``OSError`` when it cannot be read."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob (published or staged); a missing blob is not an error."""

    @abstractmethod
    def quarantine(self, key: str) -> str | None:
        """Move the blob aside for inspection; where it went, or None when it was gone."""

    @abstractmethod
    def scan(self) -> list[BlobInfo]:
        """Every blob present, published or staged."""

    @abstractmethod
    def remove(self, blob: BlobInfo) -> bool:
        """Remove one blob found by :meth:`scan` (whatever it has become); False if it was already gone."""


class LocalBlobStore(BlobStore):
    """Blobs as files in one directory: ``<key>`` published, ``.<key>.part`` staged. Staging writes and fsyncs the
    file (and its directory); publishing renames it (``os.replace``, atomic), so a reader sees a whole blob or none."""

    def __init__(self, directory: Path, quarantine_dir: Path, *, read_only: bool = False) -> None:
        self.directory = Path(directory)
        self.quarantine_dir = Path(quarantine_dir)
        self.read_only = read_only
        self.bytes_read = 0  # bytes read by this process (benchmarks compare it with a shared store's)

    def path(self, key: str) -> Path:
        return self.directory / key

    def staged_path(self, key: str) -> Path:
        return self.directory / f".{key}{STAGED_SUFFIX}"

    def stage(self, key: str, data: bytes) -> None:
        tmp = self.staged_path(key)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _faults.fault_point("blob_write")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            _faults.fault_point("blob_written")
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(self.directory)

    def publish(self, key: str) -> bool:
        try:
            os.replace(self.staged_path(key), self.path(key))
        except FileNotFoundError:
            return False
        _fsync_dir(self.directory)
        return True

    def is_staged(self, key: str) -> bool:
        return self.staged_path(key).exists()

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self._read(key, offset, length)
        self.bytes_read += len(data)
        return data

    def _read(self, key: str, offset: int, length: int | None) -> bytes:
        try:
            return _read_range(self.path(key), offset, length)
        except FileNotFoundError:
            if self.read_only:
                return _read_range(self.staged_path(key), offset, length)
        try:
            self.publish(key)  # committed but never published (its writer died): finish the job
        except OSError:
            return _read_range(self.staged_path(key), offset, length)
        return _read_range(self.path(key), offset, length)

    def delete(self, key: str) -> None:
        for p in (self.path(key), self.staged_path(key)):
            _remove_path(p)

    def quarantine(self, key: str) -> str | None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for src in (self.path(key), self.staged_path(key)):
            dest = self.quarantine_dir / f"{key}.{stamp}.{secrets.token_hex(2)}"
            try:
                os.replace(src, dest)
            except FileNotFoundError:
                continue
            return str(dest)
        return None

    def scan(self) -> list[BlobInfo]:
        out: list[BlobInfo] = []
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            return out
        with it:
            for de in it:
                name = de.name
                parsed = parse_blob_name(name)
                if parsed is None:
                    continue
                key, staged = parsed
                try:
                    mtime = de.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                out.append(BlobInfo(key, staged, mtime, name))
        return out

    def remove(self, blob: BlobInfo) -> bool:
        return _remove_path(self.staged_path(blob.key) if blob.staged else self.path(blob.key))


def _read_range(path: Path, offset: int, length: int | None) -> bytes:
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read() if length is None else f.read(length)


def _remove_path(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except PermissionError:
        if not path.is_dir():
            raise
        shutil.rmtree(path, ignore_errors=True)  # unlink() of a directory is EPERM on some systems
    return True


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
