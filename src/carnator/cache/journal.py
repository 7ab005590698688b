"""The recovery journal: a small file beside the database that records every time the database was lost.

A database that is recovered (moved aside as corrupt) or recreated (deleted, emptied) takes its own record of
what it held with it, so the journal lives outside it: ``RECOVERY.jsonl`` in the bank directory, one JSON object
per line, each appended with a single ``write`` on an ``O_APPEND`` descriptor and fsynced (so concurrent writers
never interleave; a crash leaves at worst a torn last line, which is skipped, and since every record starts with a
newline the next one is never glued to it). ``verify`` reports the events it
has not reported before, then appends a ``{"reported_through": n}`` line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("carnator.cache")

JOURNAL_FILE = "RECOVERY.jsonl"


class RecoveryJournal:
    """``RECOVERY.jsonl`` of one bank directory."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def record(self, event: str, detail: str, *, rows: int | None, blobs: int, moved_to: str | None = None) -> None:
        """Append one event: ``event`` (``corrupt``, ``missing``, ``emptied``), what happened, how many rows the
        lost database held as far as known (None: unknown) and how many entries still have blobs on disk."""
        self._append({
            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "event": event,
            "detail": detail,
            "rows": rows,
            "blobs": int(blobs),
            "moved_to": moved_to,
        })

    def unreported(self) -> tuple[list[dict[str, Any]], int]:
        """The events not yet reported, and the number of events in all."""
        events, reported = self._read()
        return events[reported:], len(events)

    def mark_reported(self, through: int) -> None:
        self._append({"reported_through": int(through)})

    @staticmethod
    def describe(event: dict[str, Any]) -> str:
        """One line for a person."""
        rows = event.get("rows")
        held = "an unknown number of entries" if rows is None else f"{rows} entries"
        where = f"; the old file is {event['moved_to']}" if event.get("moved_to") else ""
        return (f"{event.get('at', '?')}: {event.get('detail', event.get('event', '?'))}; it held {held} "
                f"({event.get('blobs', 0)} with blobs on disk at the time){where}")

    def _read(self) -> tuple[list[dict[str, Any]], int]:
        try:
            text = self.path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return [], 0
        except OSError as exc:
            log.warning("cannot read the cache recovery journal %s: %s", self.path, exc)
            return [], 0
        events: list[dict[str, Any]] = []
        reported = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a torn last line
            if not isinstance(obj, dict):
                continue
            if "reported_through" in obj:
                reported = max(reported, int(obj["reported_through"]))
            elif "event" in obj:
                events.append(obj)
        return events, min(reported, len(events))

    def _append(self, obj: dict[str, Any]) -> None:
        line = ("\n" + json.dumps(obj, sort_keys=True) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot write the cache recovery journal %s: %s", self.path, exc)
