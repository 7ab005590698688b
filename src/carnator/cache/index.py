"""Exact cosine top-k over one scope's recall embeddings, with FAISS or plain numpy.

Vectors are L2-normalized to ``float32`` once, when added. The numpy backend scores every vector;
the FAISS backend (``IndexFlatIP``) shortlists candidates, which are then re-scored the same way the
numpy backend scores them. If the shortlist cannot be proven to contain the true top-k (near-ties at
its edge), the search falls back to scoring everything. So both backends return the same ids, in
the same order, with bit-identical scores: ordering is by descending score, ties by insertion order.

Removals are tombstones: a removed id's row stays in place (and in the FAISS index), marked dead and left out of
every search, so an eviction costs a replica O(1) instead of a copy of the scope and a FAISS rebuild (0.47 s at 10^6
entries). The rows are compacted once the dead are a quarter of them (:data:`COMPACT_FRACTION`): amortised O(1) per
removal.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

BACKENDS = ("faiss", "numpy")
#: the share of dead (removed) rows at which a scope's rows are compacted
COMPACT_FRACTION = 0.25


@functools.cache
def _faiss() -> Any | None:
    try:
        import faiss
    except Exception:  # ImportError, or a broken native install
        return None
    return faiss


def available_backends() -> list[str]:
    """Backends usable in this environment (``numpy`` always is)."""
    return [b for b in BACKENDS if b != "faiss" or _faiss() is not None]


def resolve_backend(name: str) -> str:
    """``"auto"`` -> ``"faiss"`` when importable, else ``"numpy"``; explicit names are checked."""
    if name == "auto":
        return "faiss" if _faiss() is not None else "numpy"
    if name not in BACKENDS:
        raise ValueError(f"unknown index backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "faiss" and _faiss() is None:
        raise ValueError("index backend 'faiss' requested but faiss is not importable (pip install faiss-cpu)")
    return name


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (computed in float64, returned as float32; zero rows stay zero)."""
    v = np.asarray(vectors, dtype=np.float64)
    squeeze = v.ndim == 1
    v = np.atleast_2d(v)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    out = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    out = out.astype(np.float32)
    return out[0] if squeeze else out


class ScopeIndex:
    """The embeddings of one ``(tenant, compat_key)`` scope, searchable by cosine similarity."""

    def __init__(self, dim: int, backend: str = "numpy") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown index backend {backend!r}")
        self.dim = int(dim)
        self.backend = backend
        self.ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._vecs = np.zeros((0, self.dim), dtype=np.float32)
        self._flat: Any | None = None  # faiss.IndexFlatIP of every row (dead ones too), built lazily
        self._buf: np.ndarray | None = None  # rows [0, len(ids)) are _vecs; the rest is room to grow
        self._dead: set[int] = set()  # positions of removed ids (tombstones), until the next compaction
        self._live: np.ndarray | None = None  # positions not dead, computed when needed
        self._selector: Any | None = None  # FAISS search parameters leaving the dead out

    def __len__(self) -> int:
        return len(self.ids) - len(self._dead)

    @property
    def tombstones(self) -> int:
        """Removed rows not yet compacted away."""
        return len(self._dead)

    def add(self, ids: Sequence[str], vectors: np.ndarray) -> None:
        """Append ``ids`` with their (unnormalized) ``vectors``, shape ``(len(ids), dim)``."""
        if not ids:
            return
        vecs = normalize(np.asarray(vectors).reshape(len(ids), -1))
        if vecs.shape[1] != self.dim:
            raise ValueError(f"expected {self.dim}-d vectors, got {vecs.shape[1]}-d")
        self._pos.update((e, len(self.ids) + j) for j, e in enumerate(ids))
        self.ids.extend(ids)
        # Amortised growth: one admission appends one row instead of copying the whole scope (at 10^6 x 384-d that
        # copy is 1.5 GB per admission).
        n, m = len(self._vecs), len(vecs)
        if self._buf is None or n + m > len(self._buf):
            buf = np.empty((max(2 * (n + m), 64), self.dim), dtype=np.float32)
            buf[:n] = self._vecs
            self._buf = buf
        self._buf[n : n + m] = vecs
        self._vecs = self._buf[: n + m]
        self._live = None
        if self._flat is not None:
            self._flat.add(np.ascontiguousarray(vecs))

    def remove(self, ids: Iterable[str]) -> int:
        """Drop ``ids`` (unknown ids are ignored); returns how many were present. Their rows become tombstones
        (left out of every search), compacted away once they are :data:`COMPACT_FRACTION` of the rows."""
        removed = 0
        for e in set(ids):
            p = self._pos.pop(e, None)
            if p is not None:
                self._dead.add(p)
                removed += 1
        if removed:
            self._live, self._selector = None, None
            if len(self._dead) >= COMPACT_FRACTION * len(self.ids):
                self.compact()
        return removed

    def compact(self) -> None:
        """Drop the dead rows for good (one copy of the live ones; the FAISS index is rebuilt when next needed)."""
        if not self._dead:
            return
        keep = self._live_positions()
        self.ids = [self.ids[i] for i in keep]
        self._pos = {e: j for j, e in enumerate(self.ids)}
        self._vecs = self._vecs[keep]
        self._buf = None
        self._flat = None
        self._dead, self._live, self._selector = set(), None, None

    def _live_positions(self) -> np.ndarray:
        if self._live is None:
            live = np.ones(len(self.ids), dtype=bool)
            if self._dead:
                live[np.fromiter(self._dead, dtype=np.int64, count=len(self._dead))] = False
            self._live = np.flatnonzero(live)
        return self._live

    def search(self, query: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Top ``k`` ``(id, cosine)`` pairs, best first (ties: earlier-added first)."""
        n = len(self)
        if k <= 0 or n == 0:
            return []
        q = normalize(np.asarray(query).reshape(-1))
        if q.shape[0] != self.dim:
            raise ValueError(f"query is {q.shape[0]}-d, index is {self.dim}-d")
        if self.backend == "faiss":
            positions = self._faiss_shortlist(q, k)
        else:
            positions = None
        if positions is None:
            positions = self._live_positions()
        order, scores = self._rank(positions, q, k)
        return [(self.ids[p], float(s)) for p, s in zip(order, scores, strict=True)]

    def score(self, ids: Iterable[str], query: np.ndarray) -> list[tuple[str, float]]:
        """``(id, cosine)`` of those ``ids`` the index holds, scored as :meth:`search` scores, best first."""
        positions = np.array(sorted({self._pos[e] for e in ids if e in self._pos}), dtype=np.int64)
        if positions.size == 0:
            return []
        q = normalize(np.asarray(query).reshape(-1))
        order, scores = self._rank(positions, q, positions.size)
        return [(self.ids[p], float(s)) for p, s in zip(order, scores, strict=True)]

    # -- internals -------------------------------------------------------------------------------

    def _rank(self, positions: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact float64 scores of ``positions``; the top ``k`` by (score desc, position asc)."""
        positions = np.sort(np.asarray(positions, dtype=np.int64))
        # Row-wise products and sums (not a BLAS matmul, whose blocking depends on the number of
        # rows): a vector's score must not depend on which other vectors are scored with it.
        # float32 x float32 products are exact in float64.
        scores = np.sum(self._vecs[positions].astype(np.float64) * q.astype(np.float64), axis=1)
        order = np.lexsort((positions, -scores))[:k]
        return positions[order], scores[order]

    def _faiss_shortlist(self, q: np.ndarray, k: int) -> np.ndarray | None:
        """Candidate positions (live ones) that provably contain the exact top-k, or None to score everything."""
        n = len(self)
        m = min(n, k + max(k, 16))
        if m >= n:
            return None  # the shortlist would be everything anyway
        faiss = _faiss()
        assert faiss is not None
        if self._flat is None:
            self._flat = faiss.IndexFlatIP(self.dim)
            self._flat.add(np.ascontiguousarray(self._vecs))
        if self._dead and self._selector is None:  # the tombstones are left out by FAISS itself
            dead = np.fromiter(self._dead, dtype=np.int64, count=len(self._dead))
            batch = faiss.IDSelectorBatch(dead)
            inverse = faiss.IDSelectorNot(batch)
            # (the selectors are held here too: FAISS's objects point at each other, Python owns them)
            self._selector = (faiss.SearchParameters(sel=inverse), inverse, batch)
        params = self._selector[0] if self._dead and self._selector is not None else None
        dist, idx = self._flat.search(np.ascontiguousarray(q[None, :]), m, params=params)
        cand = idx[0][idx[0] >= 0]
        if len(cand) < m:
            return None
        _, exact = self._rank(cand, q, k)
        # Anything outside the shortlist scored <= dist[0][-1] in float32; bound float32 error.
        tol = self.dim * 2.0**-22 + 1e-6
        if len(exact) < k or float(dist[0][-1]) + tol >= float(exact[-1]):
            return None
        return cand
