"""Live job events for Server-Sent Events subscribers: the worker thread publishes, asyncio handlers read.

Events are not stored, but for a running job's decision: a subscriber first reads the job's state from the job store
(subscribing before it reads, so nothing falls between), then the attempt's decision if it was already taken (a
decision comes within milliseconds of the start when nothing needs probing), then what happens next. A slow subscriber
loses old ``progress`` events, never others.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: events that end a job's stream
DONE = "done"
#: the hub is closing (server shutdown): every stream ends
CLOSED = "closed"


@dataclass(eq=False)
class Subscription:
    job_id: str
    loop: asyncio.AbstractEventLoop
    _items: deque = field(default_factory=lambda: deque(maxlen=256))
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def _put(self, item: tuple[str, dict[str, Any]]) -> None:  # on the loop's thread
        if len(self._items) == self._items.maxlen:  # drop the oldest progress event rather than a state change
            for i, (kind, _) in enumerate(self._items):
                if kind == "progress":
                    del self._items[i]
                    break
        self._items.append(item)
        self._ready.set()

    async def get(self, timeout: float | None = None) -> tuple[str, dict[str, Any]] | None:
        """The next event, or None after ``timeout`` seconds without one."""
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self._items.popleft()


class EventHub:
    """Per job, the subscriptions of its open event streams."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._decisions: dict[str, dict[str, Any]] = {}   # a running attempt's decision, for late subscribers
        self._lock = threading.Lock()
        self.closed = False

    def subscribe(self, job_id: str) -> Subscription:
        sub = Subscription(job_id, asyncio.get_running_loop())
        with self._lock:
            self._subs.setdefault(job_id, set()).add(sub)
            if job_id in self._decisions:
                sub._put(("decision", self._decisions[job_id]))
            if self.closed:
                sub._put((CLOSED, {}))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.job_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.job_id]

    def publish(self, job_id: str, kind: str, data: dict[str, Any]) -> None:
        """From any thread."""
        with self._lock:
            if kind == "decision":
                self._decisions[job_id] = data
            elif kind in (DONE, "queued", "in_progress"):  # the attempt ended, or a new one begins
                self._decisions.pop(job_id, None)
            subs = list(self._subs.get(job_id, ()))
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub._put, (kind, data))
            except RuntimeError:  # its loop has closed
                pass

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        with self._lock:
            self.closed = True
            subs = [s for ss in self._subs.values() for s in ss]
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub._put, (CLOSED, {}))
            except RuntimeError:
                pass
