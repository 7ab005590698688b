"""Fault-injection seam for crash-safety tests and ``scripts/fault_suite.py``.

The bank calls :func:`fault_point` at the moments where a crash (or a failed write) would be most damaging. In
production it does nothing; a test may replace it in a child process (``carnator.cache._faults.fault_point = ...``)
to block, kill the process or raise (e.g. ``OSError(errno.ENOSPC)``) exactly there.
"""

from __future__ import annotations

#: The points an admission passes, in order: about to write a blob's bytes into its staging file; the blob
#: fsynced there (not visible); the row's transaction open but not committed; the row committed, the blobs not
#: yet published under their names; the blobs published.
POINTS = ("blob_write", "blob_written", "before_commit", "after_commit", "blob_published")


def fault_point(name: str) -> None:
    """Called by the bank at the crash-sensitive point ``name``; a no-op unless a test patches it."""
    del name
