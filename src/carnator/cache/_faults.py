"""Fault-injection seam for crash-safety tests.

The bank calls :func:`fault_point` at the moments where a crash would be most damaging (a tensor
file half in place, a metadata transaction open but not committed). In production it does nothing;
a test may replace it in a child process (``carnator.cache._faults.fault_point = ...``) to block or
kill the process exactly there.
"""

from __future__ import annotations

#: The points the bank reports, in the order an admission passes them.
POINTS = ("tensor_written", "tensor_replaced", "before_commit")


def fault_point(name: str) -> None:
    """Called by the bank at the crash-sensitive point ``name``; a no-op unless a test patches it."""
    del name
