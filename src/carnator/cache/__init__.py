"""The persistent cache store ("bank") that lets requests reuse each other's computation.

    from carnator.cache import VIDEO, CacheBank, StoreSpec, compat_key, default_cache_dir

    bank = CacheBank(default_cache_dir())
    bank.configure(capacity_bytes=20 << 30, eviction="lcbfu")  # stored: every process opening it keeps the bound
    key = compat_key(model_identity, pipe.scheduler, request.settings(), extra={"embedder": embedder_id})
    entry_id = bank.admit(StoreSpec(tenant="default", compat_key=key, prompt=request.prompt, embedding=emb,
                                    tensors={"traj.29": z}, video=frames, exact_key=exact, steps_saved=10))
    for meta, cosine in bank.recall("default", key, emb, k=5):
        tensors = bank.load(meta.id, ["traj.29"])  # None if the entry went bad or away: treat as a miss
    hit = bank.lookup_exact("default", exact)
    frames = bank.load(hit.id, [VIDEO])  # reads the video's bytes only

:class:`CacheBank` implements the :class:`CacheStore` protocol the engine calls; ``open_store(url, blobs=...)``
opens it or, for ``postgresql://`` URLs, the :class:`~carnator.cache.shared.SharedStore` that replicas share. See :mod:`carnator.cache.bank` for
the on-disk layout and the crash-safety and concurrency rules, and docs/FAULTS.md for what it guarantees.
"""

from .bank import CacheBank
from .entry import VIDEO, BankStats, CacheSettings, EntryMeta, TenantStats, VerifyReport
from .eviction import LCBFU, LRU, EvictionPolicy, RankedEviction, eviction_policies, get_eviction, register_eviction
from .index import available_backends
from .keys import compat_key, content_key
from .metadb import FORMAT_VERSION
from .paths import CACHE_DIR_ENV, default_cache_dir
from .protocol import CacheStore, StoreSpec
from .store import BlobStore, LocalBlobStore
from .urls import is_shared, open_store

__all__ = [
    "CACHE_DIR_ENV",
    "FORMAT_VERSION",
    "LCBFU",
    "LRU",
    "VIDEO",
    "BankStats",
    "BlobStore",
    "CacheBank",
    "CacheSettings",
    "CacheStore",
    "EntryMeta",
    "EvictionPolicy",
    "LocalBlobStore",
    "RankedEviction",
    "StoreSpec",
    "TenantStats",
    "VerifyReport",
    "available_backends",
    "compat_key",
    "content_key",
    "default_cache_dir",
    "eviction_policies",
    "get_eviction",
    "is_shared",
    "open_store",
    "register_eviction",
]
