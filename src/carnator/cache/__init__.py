"""The persistent cache bank that lets requests reuse each other's computation.

    from carnator.cache import CacheBank, compat_key, default_cache_dir

    bank = CacheBank(default_cache_dir(), capacity_bytes=20 << 30, eviction="lcbfu")
    key = compat_key(model_identity, pipe.scheduler, request.settings())
    entry_id = bank.admit(tenant="default", compat_key=key, prompt=request.prompt,
                          embedding=emb, tensors={"latents": z}, steps_saved=10)
    for meta, cosine in bank.recall("default", key, emb, k=5):
        tensors = bank.load(meta.id)  # None if the entry went bad or away: treat as a miss

See :mod:`carnator.cache.bank` for the on-disk layout and the crash-safety and concurrency rules.
"""

from .bank import CacheBank
from .entry import BankStats, EntryMeta, TenantStats, VerifyReport
from .eviction import LCBFU, LRU, EvictionPolicy, RankedEviction, eviction_policies, get_eviction, register_eviction
from .index import available_backends
from .keys import compat_key
from .metadb import FORMAT_VERSION
from .paths import CACHE_DIR_ENV, default_cache_dir

__all__ = [
    "CACHE_DIR_ENV",
    "FORMAT_VERSION",
    "LCBFU",
    "LRU",
    "BankStats",
    "CacheBank",
    "EntryMeta",
    "EvictionPolicy",
    "RankedEviction",
    "TenantStats",
    "VerifyReport",
    "available_backends",
    "compat_key",
    "default_cache_dir",
    "eviction_policies",
    "get_eviction",
    "register_eviction",
]
