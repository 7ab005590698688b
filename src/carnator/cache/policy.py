"""What both cache stores decide the same way: the local bank (:class:`~carnator.cache.bank.CacheBank`, SQLite and a
directory) and the shared store (:class:`~carnator.cache.shared.SharedStore`, PostgreSQL and fsspec blobs) inherit
:class:`StorePolicy`: an admission's checks and row, the eviction victims in the policy's order, the single-flight
wait, a load that quarantines a bad entry or drops one whose blob is gone, and verify's pass over the entries. Each
store supplies its metadata and blobs through the hooks named below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import tenacity
import torch

from ..errors import CacheError, CorruptEntryError
from . import _faults
from .entry import VIDEO, CacheSettings, EntryMeta, VerifyReport
from .eviction import EvictionPolicy, get_eviction
from .index import ScopeIndex
from .metadb import FORMAT_VERSION, Lease, MetaQueries, dump_extra
from .protocol import StoreSpec
from .store import TENSORS_BLOB, VIDEO_BLOB, BlobStore, blob_key, check_blobs, pack_tensors, read_tensors, sha256

log = logging.getLogger("carnator.cache")

HOST = socket.gethostname()


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: ``configure``'s default: leave the setting as stored.
UNSET: Any = _Unset()


class NoRoom(Exception):
    """The eviction policy could not free enough room: the admission is rolled back."""


@dataclass
class Scope:
    """This process's recall index of one ``(tenant, compat_key)`` and how far it has read the store."""

    index: ScopeIndex
    epoch: str
    entry_seq: int
    removal_seq: int


class StorePolicy:
    """The rules both cache stores share. Hooks: ``read_only``, ``_blobs`` (a :class:`BlobStore`), ``_db`` (its
    :class:`~carnator.cache.metadb.MetaQueries`), ``_writing()``, ``_victims``, ``_blob_place()``, ``_warn_once``,
    ``_layout(entry_id)``, ``_drop_missing(entry_id, layout)``, ``_quarantine(entry_id, layout, reason)``,
    ``_take_lease(tenant, exact_key, me, ttl_s)`` and ``_drop_lease(tenant, exact_key, holder)``."""

    read_only: bool
    _blobs: BlobStore
    _clock: Callable[[], float]
    _db: MetaQueries

    _backend: str
    _warned: set[str]

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]

    @property
    def index_backend(self) -> str:
        return self._backend

    def __len__(self) -> int:
        return self.stats().count  # type: ignore[attr-defined]

    def __contains__(self, entry_id: object) -> bool:
        return isinstance(entry_id, str) and self.get(entry_id) is not None  # type: ignore[attr-defined]

    def _origin(self) -> BlobStore:
        """Hook: the blobs themselves (the shared storage, not a replica's read-through copy)."""
        return self._blobs

    @property
    def bytes_read(self) -> int:
        """Blob bytes this process read from the store's storage (a replica's read-through hits not counted;
        benchmarks compare the two stores by it)."""
        return int(self._origin().bytes_read)  # type: ignore[attr-defined]

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, msg, *args)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise CacheError(f"cache {self._label()} is read-only: cannot {what}")

    # -- settings ------------------------------------------------------------------------------------

    def configure(self, *, capacity_bytes: int | None = UNSET, eviction: str | EvictionPolicy | None = None,
                  tenant_quota_bytes: int | None = UNSET) -> CacheSettings:
        """Store the cache's capacity (bytes; None: unbounded), eviction policy (a registered name, or an
        instance of a registered policy) and per-tenant quota (bytes; None: none) in its database, for every process
        (every replica) that opens it; arguments left out keep their stored value. A lowered capacity evicts down to
        it at once; a quota applies at each tenant's next admission. Returns the settings now in force."""
        self._check_writable("configure")
        for what, value in (("cache capacity", capacity_bytes), ("tenant quota", tenant_quota_bytes)):
            if value is not UNSET and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                             or value <= 0):
                raise CacheError(f"{what} must be a positive number of bytes or None (unbounded), got {value!r}")
        name = None if eviction is None else policy_name(eviction)
        removed: list[tuple[str, dict[str, Any]]] = []
        with self._writing() as conn:
            new = self._db.settings(conn)
            if capacity_bytes is not UNSET:
                new = dataclasses.replace(new, capacity_bytes=capacity_bytes)
            if name is not None:
                new = dataclasses.replace(new, eviction=name)
            if tenant_quota_bytes is not UNSET:
                new = dataclasses.replace(new, tenant_quota_bytes=tenant_quota_bytes)
            self._db.set_settings(conn, new)
            if new.capacity_bytes is not None:
                need = self._db.total_bytes(conn) - new.capacity_bytes
                victims, enough = self._victims(conn, need, new)
                if not enough:
                    log.warning("eviction policy %s could not bring the cache down to %d bytes", new.eviction, new.capacity_bytes)
                removed = self._db.delete(conn, victims)
        self._delete_blobs(removed)
        if removed:
            log.info("evicted %d entries to fit the new capacity of %d bytes", len(removed), new.capacity_bytes)
        return new

    # -- recall --------------------------------------------------------------------------------------

    def _reading(self) -> contextlib.AbstractContextManager[Any]:
        """Hook: a read transaction (one snapshot for every query in it), yielding its connection."""
        raise NotImplementedError

    _scopes: dict[tuple[str, str], Scope]

    def _add_rows(self, conn: Any, index: ScopeIndex, tenant: str, compat_key: str, after: int) -> None:
        """Hook: add the scope's rows after sequence ``after`` to ``index``."""
        raise NotImplementedError

    def _scope_index(self, conn: Any, tenant: str, compat_key: str, dim: int) -> ScopeIndex:
        """This process's index of one scope, brought up to date with the snapshot ``conn`` sees: the entry sequence
        gives what was added since, the removal log what was removed; a new epoch (``clear``), a changed size or a
        log that no longer reaches back far enough rebuilds it."""
        state = self._db.sync_state(conn)
        key = (tenant, compat_key)
        scope = self._scopes.get(key)
        covers = state.oldest_logged_removal is not None and scope is not None and \
            state.oldest_logged_removal <= scope.removal_seq + 1
        if (scope is None or scope.epoch != state.epoch or scope.index.dim != dim
                or (state.removal_seq > scope.removal_seq and not covers)):
            index = ScopeIndex(dim, self._backend)
            self._add_rows(conn, index, tenant, compat_key, 0)
            self._scopes[key] = Scope(index, state.epoch, state.entry_seq, state.removal_seq)
            return index
        if state.removal_seq > scope.removal_seq:
            scope.index.remove(self._db.scope_removals(conn, tenant, compat_key, scope.removal_seq))
            scope.removal_seq = state.removal_seq
        if state.entry_seq > scope.entry_seq:
            self._add_rows(conn, scope.index, tenant, compat_key, scope.entry_seq)
            scope.entry_seq = state.entry_seq
        return scope.index

    def recall(self, tenant: str, compat_key: str, embedding: np.ndarray, k: int = 10,
               content_key: str | None = None, near_keys: Sequence[str] = ()) -> list[tuple[EntryMeta, float]]:
        """The ``k`` entries of ``(tenant, compat_key)`` most cosine-similar to ``embedding``, best first; with
        ``content_key``, then the newest ``k`` entries admitted under it that are not among them, best first; with
        ``near_keys`` (the content keys one edit away), then the newest ``k`` entries admitted under any of them that are
        not among those, best first.

        Ties are broken by admission order (older first). Entries of other tenants or compatibility keys are never
        returned. Raises :class:`CacheError` when ``embedding``'s size differs from the scope's. The process's index
        is first brought up to date with the store.
        """
        check_scope(tenant, compat_key)
        if k <= 0:
            return []
        query = as_vector(embedding)
        with self._reading() as conn:
            dim = self._db.scope_dim(tenant, compat_key, conn)
            if dim is None:
                return []
            if dim != query.size:
                raise CacheError(dim_message(tenant, compat_key, dim, query.size))
            index = self._scope_index(conn, tenant, compat_key, dim)
            hits = index.search(query, k)
            for keys in ([content_key] if content_key is not None else [], near_keys):
                seen = {h[0] for h in hits}
                same = self._db.content_ids(conn, tenant, compat_key, keys, k + len(hits))
                hits += index.score([i for i in same if i not in seen][:k], query)
            metas = self._db.get_many(conn, [h[0] for h in hits])
        return [(metas[i], score) for i, score in hits if i in metas]

    def same_content(self, tenant: str, compat_key: str, content_key: str, k: int = 10) -> list[EntryMeta]:
        """The newest ``k`` entries of ``(tenant, compat_key)`` admitted under ``content_key``, newest first (no index
        sync: no embedding is searched)."""
        check_scope(tenant, compat_key)
        if k <= 0:
            return []
        with self._reading() as conn:
            ids = self._db.content_ids(conn, tenant, compat_key, [content_key], k)
            metas = self._db.get_many(conn, ids)
        return [metas[i] for i in ids if i in metas]

    # -- admission -----------------------------------------------------------------------------------

    @staticmethod
    def _checked(spec: StoreSpec) -> tuple[dict[str, Any], np.ndarray]:
        """An admission's arguments checked before anything is written: its extras and recall vector."""
        if not isinstance(spec, StoreSpec):
            raise TypeError(f"admit takes a StoreSpec, not {type(spec).__name__}")
        check_scope(spec.tenant, spec.compat_key)
        if not isinstance(spec.prompt, str):
            raise TypeError("prompt must be a string")
        if not finite(spec.steps_saved):
            raise ValueError(f"steps_saved must be a finite number, got {spec.steps_saved!r}")
        if VIDEO in spec.tensors:
            raise ValueError(f"tensor name {VIDEO!r} is reserved for the video: pass it as StoreSpec.video")
        extra = dict(spec.extra or {})
        dump_extra(extra)  # fail on unserializable extras before writing anything
        return extra, as_vector(spec.embedding)

    @staticmethod
    def _fits(nbytes: int, capacity_bytes: int | None) -> bool:
        if capacity_bytes is not None and nbytes > capacity_bytes:
            log.warning("not caching a %d-byte entry: it is larger than the cache's whole capacity of %d bytes", nbytes,
                        capacity_bytes)
            return False
        return True

    @staticmethod
    def _entry_meta(spec: StoreSpec, entry_id: str, nbytes: int, vec: np.ndarray, extra: dict[str, Any],
                    now: float) -> EntryMeta:
        return EntryMeta(
            id=entry_id, tenant=spec.tenant, compat_key=spec.compat_key, exact_key=spec.exact_key, prompt=spec.prompt,
            negative_prompt=spec.negative_prompt, seed=None if spec.seed is None else int(spec.seed), created=now,
            last_used=now, use_count=0, steps_saved=float(spec.steps_saved), nbytes=nbytes, embedding=vec, extra=extra,
            content_key=spec.content_key,
        )

    def _label(self) -> str:
        """Hook: the store in messages ("at DIR", "store URL")."""
        raise NotImplementedError

    def _blob_words(self) -> str:
        """Hook: where blobs are written, in messages."""
        raise NotImplementedError

    def _scope_state(self, tenant: str, compat_key: str) -> tuple[int | None, CacheSettings]:
        """Hook: the scope's embedding size (None: any) and the store's settings, read before staging."""
        raise NotImplementedError

    def admit(self, spec: StoreSpec) -> str | None:
        """Store one completed request; returns its id, or None when it cannot fit the store's capacity (larger than
        the whole capacity, or the eviction policy freed too little) or the store is read-only: each logged as a
        WARNING (and for the shared store, when PostgreSQL is unreachable: counted). Raises :class:`CacheError` when
        it cannot be written (full disk, locked database) or when its embedding's size differs from its scope's
        (another embedder under the same compatibility key).

        An entry with the same ``(tenant, exact_key, compat_key)`` is replaced (the same request stored under another
        policy's reading is another entry: each policy keeps what it resumes from). When over capacity, entries are
        evicted in the eviction policy's order until the new one fits. Blobs are durable before the row that makes
        them an entry is committed, and published after.
        """
        extra, vec = self._checked(spec)
        if self.read_only:
            self._warn_once("admit", "cache %s is read-only: results are not stored", self._label())
            return None
        return self._admit(spec, vec, extra)

    def _admit(self, spec: StoreSpec, vec: np.ndarray, extra: dict[str, Any]) -> str | None:
        dim, settings = self._scope_state(spec.tenant, spec.compat_key)
        if dim is not None and dim != vec.size:
            raise CacheError(dim_message(spec.tenant, spec.compat_key, dim, vec.size))
        entry_id = uuid.uuid4().hex
        blobs, layout = pack(entry_id, spec.tensors, spec.video)
        nbytes = sum(len(b) for b in blobs.values())
        if not self._fits(nbytes, settings.capacity_bytes):
            return None
        meta = self._entry_meta(spec, entry_id, nbytes, vec, extra, self._clock())
        try:
            self._stage(blobs, self._blob_words())
            del blobs
            removed = self._commit(meta, layout)
        except BaseException:
            self._discard_staged(layout)
            raise
        if removed is None:
            self._discard_staged(layout)
            return None
        _faults.fault_point("after_commit")
        self._publish(layout)
        _faults.fault_point("blob_published")
        self._delete_blobs(removed)
        return entry_id

    def _commit(self, meta: EntryMeta, layout: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
        """Insert the row of a staged entry (:meth:`_insert`); the removed entries, or None when the eviction policy
        cannot make room."""
        try:
            return self._insert(meta, layout)
        except NoRoom as exc:
            log.warning("not caching a %d-byte entry: %s", meta.nbytes, exc)
            return None

    def _discard_staged(self, layout: dict[str, Any]) -> None:
        for key in layout["blobs"]:
            try:
                self._blobs.delete(key)
            except OSError as exc:  # an orphan: removed after the grace period
                log.debug("could not delete staged cache blob %s: %s", key, exc)

    def _delete_blobs(self, removed: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Delete the blobs of entries whose rows are gone for good (a failure leaves an orphan, removed later)."""
        for _, layout in removed:
            for key in layout["blobs"]:
                try:
                    self._blobs.delete(key)
                except OSError as exc:
                    log.warning("could not delete cache blob %s: %s", key, exc)

    def _writing(self) -> contextlib.AbstractContextManager[Any]:
        """Hook: a write transaction (serialised with every other writer of the store), yielding its connection."""
        raise NotImplementedError

    def _blob_place(self) -> str:
        """Hook: where the store's blobs are (for messages)."""
        raise NotImplementedError

    def _victims(self, conn: Any, need: int, settings: CacheSettings) -> tuple[list[str], bool]:
        """Hook: ids to evict to free ``need`` bytes (in the policy's order), and whether they free enough."""
        raise NotImplementedError

    def _insert(self, meta: EntryMeta, layout: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Commit the row of an entry whose blobs are staged, in one write transaction: the entry of the same exact key
        is replaced and entries are evicted for room (:class:`NoRoom` when the policy cannot make enough). Returns
        the entries removed (their blobs are the caller's to delete once the row is committed)."""
        with self._writing() as conn:
            for key in layout["blobs"]:
                if not self._blobs.is_staged(key):
                    # The orphan sweep (which runs under the writers' lock) took it: we stalled past the grace period.
                    raise CacheError(f"cache blob {key} of a new entry vanished from {self._blob_place()}")
            dim = self._db.scope_dim(meta.tenant, meta.compat_key, conn)
            if dim is not None and dim != meta.embedding.size:
                raise CacheError(dim_message(meta.tenant, meta.compat_key, dim, meta.embedding.size))
            settings = self._db.settings(conn)
            replaced = (self._db.exact_key_ids(conn, meta.tenant, meta.exact_key, meta.compat_key)
                        if meta.exact_key is not None else [])
            removed = self._db.delete(conn, replaced)
            quota = settings.tenant_quota_bytes
            if quota is not None:  # the tenant's own oldest entries first, down to its quota
                over = self._db.tenant_bytes(conn, meta.tenant) + meta.nbytes - quota
                if over > 0:
                    own, enough = self._db.tenant_oldest(conn, meta.tenant, over)
                    if not enough:
                        raise NoRoom(f"the entry ({meta.nbytes} bytes) is larger than a tenant's quota of {quota} bytes")
                    removed += self._db.delete(conn, own)
            need = self._db.total_bytes(conn) + meta.nbytes - settings.capacity_bytes if settings.capacity_bytes is not None else 0
            victims, enough = self._victims(conn, need, settings)
            if not enough:
                raise NoRoom(f"eviction policy {settings.eviction} freed too little room in a cache of capacity "
                             f"{settings.capacity_bytes} bytes")
            removed += self._db.delete(conn, victims)
            self._db.insert(conn, meta, layout)
            self._db.set_scope_dim(conn, meta.tenant, meta.compat_key, meta.embedding.size)
            _faults.fault_point("before_commit")
        return removed

    def _stage(self, blobs: dict[str, bytes], where: str) -> None:
        try:
            for key, data in blobs.items():
                self._blobs.stage(key, data)
        except OSError as exc:
            raise CacheError(f"cannot write to {where}: {exc.strerror or exc}") from exc

    def _publish(self, layout: dict[str, Any]) -> None:
        for key in layout["blobs"]:
            try:
                self._blobs.publish(key)
            except OSError as exc:  # readers publish it; nothing is lost
                log.debug("could not publish cache blob %s: %s", key, exc)

    # -- single flight -------------------------------------------------------------------------------

    def _take_lease(self, tenant: str, exact_key: str, me: Lease, ttl_s: float) -> bool:
        raise NotImplementedError

    def _drop_lease(self, tenant: str, exact_key: str, holder: str) -> None:
        raise NotImplementedError

    def _lease_unavailable(self, exc: Exception) -> None:
        self._warn_once("lease", "single-flight lease unavailable (%s); generating without it", exc)

    @contextmanager
    def single_flight(self, tenant: str, exact_key: str, timeout_s: float = 600.0) -> Iterator[bool]:
        """Hold the right to generate the request ``exact_key`` of ``tenant`` while the block runs (across threads and
        processes sharing the store): a lease row naming its holder (host, pid) and its expiry (``timeout_s`` from
        now). A caller that finds the lease held waits until it is released, expires, or its holder's process is gone
        (on this host), then takes it; the value is True when it waited (look the exact key up again: the holder has
        probably stored it). After ``timeout_s`` of waiting it enters without the lease (warning). A read-only store,
        or one whose metadata cannot be written or reached, enters at once (value False)."""
        if not isinstance(tenant, str) or not tenant or not isinstance(exact_key, str) or not exact_key:
            raise ValueError("tenant and exact_key must be non-empty strings")
        if not finite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a non-negative number, got {timeout_s!r}")
        me = Lease(f"{uuid.uuid4().hex[:12]}:{threading.get_ident()}", HOST, os.getpid(), 0.0)
        held = waited = False
        if not self.read_only:
            tries = 0

            def take() -> bool:
                nonlocal tries
                tries += 1
                return self._take_lease(tenant, exact_key, me, timeout_s)

            try:  # every 10 ms at first, then 1.5 times longer, at most 200 ms, until timeout_s
                held = tenacity.Retrying(
                    retry=tenacity.retry_if_result(lambda got: not got), stop=tenacity.stop_after_delay(timeout_s),
                    wait=tenacity.wait_exponential(multiplier=0.01, exp_base=1.5, max=0.2),
                    retry_error_callback=lambda _: False)(take)
                if not held:
                    log.warning("waited %.0f s for another worker generating the same request; generating it too", timeout_s)
            except (CacheError, OSError) as exc:
                self._lease_unavailable(exc)
            waited = tries > 1
        try:
            yield waited
        finally:
            if held:
                try:
                    self._drop_lease(tenant, exact_key, me.holder)
                except (CacheError, OSError) as exc:  # it expires by itself
                    log.debug("could not release a single-flight lease: %s", exc)

    # -- reading and checking ------------------------------------------------------------------------

    def _layout(self, entry_id: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def _quarantine(self, entry_id: str, layout: dict[str, Any], reason: str) -> bool:
        """Move a bad entry's blobs aside (``quarantine/``) and delete its row; whether the row existed. Read-only:
        only warns (the entry stays, a miss)."""
        if self.read_only:
            log.warning("cache entry %s is corrupt (%s); the cache is read-only, so it stays in place (a miss)", entry_id,
                        reason)
            return self._exists(entry_id)
        dests = []
        for key in layout["blobs"]:
            try:
                dest = self._blobs.quarantine(key)
            except OSError as exc:
                log.warning("could not move cache blob %s aside: %s", key, exc)
                continue
            if dest:
                dests.append(dest)
        with self._writing() as conn:
            existed = bool(self._db.delete(conn, [entry_id]))
        log.warning("cache entry %s is corrupt (%s); %s and dropped it from the cache", entry_id, reason,
                    f"moved its blobs to {', '.join(dests)}" if dests else "its blobs were already gone")
        return existed

    def _drop_missing(self, entry_id: str, layout: dict[str, Any]) -> bool:
        """Delete the row of an entry whose blob vanished (unless another process already removed it) and its other
        blobs; whether the row existed. Read-only: only warns."""
        if self.read_only:
            log.warning("cache entry %s lost a blob; the cache is read-only, so its row stays (a miss)", entry_id)
            return self._exists(entry_id)
        with self._writing() as conn:
            removed = self._db.delete(conn, [entry_id])
        self._delete_blobs(removed)
        if removed:
            log.warning("cache entry %s lost a blob; dropped it from the cache", entry_id)
        return bool(removed)

    def _exists(self, entry_id: str) -> bool:
        with self._reading() as conn:
            return self._db.get(entry_id, conn) is not None

    def load(self, entry_id: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor] | None:
        """The entry's tensors (all, or only ``names``; :data:`~carnator.cache.VIDEO` for its video), or None if it is
        gone or fails a check.

        Every tensor read is checked against its sha256. A tensor that fails, or a blob that cannot be read, gets
        the entry quarantined (its blobs moved to ``quarantine/``, its row deleted) with a warning; a blob that is
        gone drops the entry. Raises ``KeyError`` if ``names`` asks for tensors the entry lacks
        (:attr:`EntryMeta.tensor_names` lists them).
        """
        if isinstance(names, str):
            raise TypeError("names must be a collection of tensor names, not one string")
        layout = self._layout(entry_id)
        if layout is None:
            return None
        available = layout["tensors"]
        wanted = list(available) if names is None else list(names)
        missing = [n for n in wanted if n not in available]
        if missing:
            raise KeyError(f"cache entry {entry_id} has no tensors named {missing}; it has {sorted(available)}")
        try:
            return read_tensors(self._blobs, layout, wanted)
        except FileNotFoundError:
            self._drop_missing(entry_id, layout)
        except CorruptEntryError as exc:
            self._quarantine(entry_id, layout, str(exc))
        return None

    def _check_entries(self, report: VerifyReport, layouts: list[tuple[str, dict[str, Any]]]) -> None:
        """Verify's pass: read every blob of these entries whole from :meth:`_origin` and check it; quarantine bad ones,
        drop entries whose blob is gone; counted in ``report``."""
        for entry_id, layout in layouts:
            try:
                check_blobs(self._origin(), layout)
            except FileNotFoundError:
                if self._drop_missing(entry_id, layout):
                    report.missing.append(entry_id)
                continue
            except CorruptEntryError as exc:
                if self._quarantine(entry_id, layout, str(exc)):
                    report.quarantined.append(entry_id)
                continue
            report.checked += 1


def lease_held(lease: Lease | None, now: float) -> bool:
    """Whether ``lease`` still holds: unexpired, and its holder alive when it runs on this host."""
    return lease is not None and lease.expires > now and not (lease.host == HOST and not pid_alive(lease.pid))


def choose_victims(entries: list[EntryMeta], need: int, eviction: str) -> tuple[list[str], bool]:
    """Ids to evict from ``entries`` to free ``need`` bytes, in the eviction policy's order, and whether they free
    enough."""
    if need <= 0:
        return [], True
    candidates = {e.id: e for e in entries}
    chosen: list[str] = []
    freed = 0
    for victim in get_eviction(eviction).victims(list(candidates.values()), need):
        entry = candidates.pop(victim, None)
        if entry is None:
            continue
        chosen.append(victim)
        freed += entry.nbytes
        if freed >= need:
            return chosen, True
    return chosen, False


def pack(entry_id: str, tensors: Any, video: Any) -> tuple[dict[str, bytes], dict[str, Any]]:
    """An entry's blobs (key -> bytes) and its layout (what the row records of them)."""
    blobs: dict[str, bytes] = {}
    layout: dict[str, Any] = {"blobs": {}, "tensors": {}}
    parts: list[tuple[str, Any]] = [(TENSORS_BLOB, tensors)]
    if video is not None:
        if isinstance(video, np.ndarray):
            video_t = torch.from_numpy(np.ascontiguousarray(video))
        elif isinstance(video, torch.Tensor):
            video_t = video
        else:
            raise TypeError(f"video must be a numpy array (uint8, T x H x W x 3), not {type(video).__name__}")
        parts.append((VIDEO_BLOB, {VIDEO: video_t}))
    for kind, group in parts:
        key = blob_key(entry_id, kind)
        data, index = pack_tensors(group, {"carnator_cache_format": str(FORMAT_VERSION), "entry_id": entry_id})
        blobs[key] = data
        layout["blobs"][key] = {"nbytes": len(data), "sha256": sha256(data)}
        for name, spec in index.items():
            layout["tensors"][name] = {"blob": key, **spec}
    return blobs, layout


def policy_name(eviction: str | EvictionPolicy) -> str:
    policy = get_eviction(eviction)  # CacheError for an unknown name
    name = type(policy).name
    if not name or get_eviction(name).__class__ is not type(policy):
        raise CacheError(
            f"eviction policy {type(policy).__name__} is not registered; the cache stores its policy by name, so "
            "register it with @register_eviction(name)"
        )
    return name


def dim_message(tenant: str, compat_key: str, dim: int, got: int) -> str:
    return (
        f"cache scope (tenant {tenant!r}, compat key {compat_key[:12]}) holds {dim}-d recall embeddings, not {got}-d: "
        "entries of another embedder need a compat key that names it (keys.compat_key(..., extra=...)) or another cache"
    )


def as_vector(embedding: Any) -> np.ndarray:
    if isinstance(embedding, torch.Tensor):
        embedding = embedding.detach().to("cpu", torch.float32).numpy()
    vec = np.asarray(embedding, dtype=np.float32).reshape(-1)
    if vec.size == 0 or not np.all(np.isfinite(vec)):
        raise ValueError("embedding must be a non-empty vector of finite numbers")
    return vec.copy()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def check_scope(tenant: str, compat_key: str) -> None:
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    if not isinstance(compat_key, str) or not compat_key:
        raise ValueError("compat_key must be a non-empty string")


def finite(x: object) -> bool:
    try:
        return not isinstance(x, bool) and math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
