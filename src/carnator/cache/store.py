"""Tensor files: one ``<id>.safetensors`` per entry, written atomically, checksummed on every read.

Files are immutable once in place. A write goes to a temp file in the same directory, is fsynced,
then renamed over the final name (``os.replace``) and the directory is fsynced, so a reader sees
either no file or the complete file. The bank stores the file's sha256 in its metadata row and
:meth:`TensorStore.read` refuses bytes that do not match it.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from ..errors import CorruptEntryError
from . import _faults

TENSOR_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".part"


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``: the checksum kept for every tensor file."""
    return hashlib.sha256(data).hexdigest()


def serialize_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` as safetensors bytes (moved to CPU, made contiguous, storage sharing undone)."""
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
    return _st_save(prepared, metadata=dict(metadata) if metadata else None)


def deserialize_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_tensors`; raises :class:`CorruptEntryError` on unparsable bytes."""
    try:
        return _st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CorruptEntryError(f"unreadable safetensors data: {exc}") from exc


@dataclass(frozen=True)
class StrayFile:
    """A file in the tensor directory: an entry file (``entry_id`` set) or a temp file."""

    path: Path
    entry_id: str | None
    mtime: float


class TensorStore:
    """The ``tensors/`` directory of a bank, plus the ``quarantine/`` directory bad files go to."""

    def __init__(self, directory: Path, quarantine_dir: Path) -> None:
        self.directory = directory
        self.quarantine_dir = quarantine_dir

    def path(self, entry_id: str) -> Path:
        return self.directory / f"{entry_id}{TENSOR_SUFFIX}"

    def write(self, entry_id: str, data: bytes) -> None:
        """Atomically place ``data`` as the tensor file of ``entry_id``."""
        final = self.path(entry_id)
        tmp = self.directory / f".{entry_id}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            _faults.fault_point("tensor_written")
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(self.directory)
        _faults.fault_point("tensor_replaced")

    def read(self, entry_id: str, checksum: str) -> bytes:
        """The file's bytes, checked against ``checksum``.

        Raises ``FileNotFoundError`` if the file is gone and :class:`CorruptEntryError` if its bytes
        do not match.
        """
        data = self.path(entry_id).read_bytes()
        actual = sha256(data)
        if actual != checksum:
            raise CorruptEntryError(f"checksum mismatch (expected {checksum[:12]}..., got {actual[:12]}...)")
        return data

    def delete(self, entry_id: str) -> None:
        _unlink(self.path(entry_id))

    def quarantine(self, entry_id: str) -> Path | None:
        """Move the entry's file into ``quarantine/``; returns its new path (None if it was gone)."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = self.quarantine_dir / f"{entry_id}.{stamp}.{secrets.token_hex(2)}{TENSOR_SUFFIX}"
        try:
            os.replace(self.path(entry_id), dest)
        except FileNotFoundError:
            return None
        return dest

    def scan(self) -> list[StrayFile]:
        """Every entry file and temp file currently in the directory."""
        out: list[StrayFile] = []
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            return out
        with it:
            for de in it:
                name = de.name
                if name.endswith(TEMP_SUFFIX):
                    entry_id = None
                elif name.endswith(TENSOR_SUFFIX) and not name.startswith("."):
                    entry_id = name[: -len(TENSOR_SUFFIX)]
                else:
                    continue
                try:
                    mtime = de.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                out.append(StrayFile(Path(de.path), entry_id, mtime))
        return out


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
