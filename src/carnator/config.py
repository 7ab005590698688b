"""The engine's settings as plain data (:class:`EngineConfig`, :class:`EngineSpec`), apart from the engine so that
reading them (the command line's options are made from their fields, :mod:`carnator.fieldargs`) imports no torch.
:mod:`carnator.engine` exports both."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .fieldargs import opt

__all__ = ["LATENT_DTYPES", "EngineConfig", "EngineSpec", "parse_size"]

#: the dtypes stored latents may have (``EngineConfig.latent_dtype``)
LATENT_DTYPES = ("float32", "float16", "bfloat16")

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int | None:
    """A size like ``40MB`` (decimal), ``2GiB`` (binary), ``500000`` (bytes) or ``none`` (None: unbounded) in bytes;
    ValueError saying what was expected otherwise."""
    t = str(text).strip().lower()
    if t in ("none", "unbounded"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", t)
    if m is None or m.group(2) not in _SIZE_UNITS:
        raise ValueError(f"expected a size like 40MB, 2GiB, 500000 or none, got {text!r}")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if n <= 0:
        raise ValueError(f"a cache capacity must be more than 0 bytes, got {text!r}")
    return n


def _bound(text: str) -> int:
    """A cache capacity a command that generates sets (a size: lifting a bound is `carnator cache config`'s)."""
    n = parse_size(text)
    if n is None:
        raise ValueError(f"{text}: a command that generates only sets a bound; lift it with "
                         "`carnator cache config --capacity none`")
    return n


def _intra_cache_help() -> str:
    from .backbones.intra_cache import describe_kinds  # imports torch: only when the help is shown

    return ("also run one of diffusers' per-request caches on the transformer, under every policy (dense: the cache "
            f"alone). Kinds (options, defaults): {describe_kinds()}. Ranges are LO..HI; mag ratios R0/R1/... or "
            "@file.json. See docs/METHOD.md.")


@dataclass
class EngineConfig:
    """Engine-wide settings.

    capture_steps: which post-scheduler latents are stored with every entry ("auto": those the policy
        that generated it can resume from, ``Policy.stored_steps``; "all", "none", or a
        list of step indices). Reuse needs the latents at the steps policies resume from.
    latent_dtype: dtype of stored latents (default float16: half the bytes of float32, and on the embedded model a
        re-roll hit's frames differ from float32 storage's by at most 1/255 at a few pixels, lab/scripts/entry_dtype.py;
        "float32" keeps them exact).
    store_video: keep the decoded video with the entry, so an identical request is an exact hit.
    capacity_bytes, eviction, tenant_quota_bytes: when set, stored as the cache's own capacity (bytes), eviction
        policy ("lru", "lcbfu") and per-tenant quota (bytes: past it a tenant's admission evicts its own oldest
        entries) with ``CacheBank.configure`` when the engine opens it; None (default) keeps what the cache has.
    policy_options: per policy name, its config fields (``{"carnator": {"modifiers": 1}}``).
    intra_cache: one of diffusers' per-request caches applied to the transformer under every policy
        (None = off): a kind name, "KIND:opt=value,...", or {"kind": KIND, opt: value}; kinds first_block,
        pab, faster, taylorseer, mag (see :mod:`carnator.backbones.intra_cache` and docs/METHOD.md). Its hooks keep state on
        the transformer, so an engine with one runs its requests one at a time.
    cuda_graphs: replay the transformer's forward as a CUDA graph at every step where no policy records or
        applies anything in it (the embedded model on a CUDA device; with no intra-request cache). For small,
        launch-bound models; the results are the eager forward's. None (the default): on where the model runs on a
        CUDA device, its family supports it and no intra-request cache runs (:func:`cuda_graphs_for`); off on the CPU.
        True asks for it (refused for a family without it); False turns it off.
    admission_judge: the quality judge (a :func:`~carnator.judges.get_judge` spec; "auto", the default: ``shapes``, the
        embedded model's own judge, on the embedded model, else none)
        that scores every stored request's own output, after decode; its scores go into the entry (``quality``) and the
        entry is ``admitted`` as a reuse source only if they pass ``admission_rule`` (a re-roll is
        unsafe mostly when its source was itself a failed generation). None: no judge, every entry admitted.
    admission_rule: per score, the bar its output must pass: a higher-is-better score must be ``>=`` its value, a
        lower-is-better one ``<=`` (directions from the judge). Default: fidelity >= 0.75, artifact <= 0.1, i.e. the
        source would itself be an acceptable reuse of a perfect dense clip under the calibration's rule (Delta 0.25 /
        0.1).
    write_behind: store the entry (and run the admission judge) in a background thread after the result is returned,
        off the request's critical path; a request that starts before the write ends does not see the entry yet, and
        the result's ``stats.entry_id`` is set when the write ends. :meth:`Carnator.flush` waits for the writes.
        None (the default): on where the model runs on a CUDA device (there the store and the judge cost a miss about
        60 % of a dense embedded request), off on the CPU (where they cost about 1 %, and a result comes back stored).
    allow_uncertified: whether approximate reuse may rest on a decision that no certified thresholds file backs (the
        paper's thresholds on a model they were not calibrated for, or a text-similarity baseline). False (what
        ``carnator serve`` uses unless ``--allow-uncertified``): such a decision becomes a miss; exact hits are always
        allowed.
    """

    capture_steps: str | list[int] = "auto"
    latent_dtype: str = field(default="float16", metadata=opt(
        "dtype of the latents stored with every entry; float32 doubles the cache for exact latents", choices=LATENT_DTYPES))
    store_video: bool = True
    capacity_bytes: int | None = field(default=None, metadata=opt(
        "bound the cache to SIZE (e.g. 40MB, 2GiB, 500000 bytes) before generating: stored in the cache, so later runs "
        "keep it (see `carnator cache config`)", flag="capacity", metavar="SIZE", parse=_bound))
    eviction: str | None = None
    tenant_quota_bytes: int | None = field(default=None, metadata=opt(
        "cache bytes one tenant may keep, e.g. 2GiB: an admission past it evicts that tenant's oldest entries first, "
        "never another tenant's (stored in the cache for every process that opens it; default: no quota, only the "
        "cache's capacity)", flag="tenant-quota", metavar="SIZE", parse=parse_size))
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=opt(
        "set one field of a policy's config, e.g. carnator.modifiers=1, carnator.region='{\"high\": 0.4}' or "
        "carnator.thresholds=PATH (thresholds certified by `carnator calibrate` for this model, docs/CALIBRATION.md); "
        "VALUE is JSON, else a string; repeatable; fields: docs/METHOD.md", flag="option", metavar="POLICY.FIELD=VALUE",
        append=True))
    intra_cache: str | dict[str, Any] | None = field(default=None, metadata=opt(_intra_cache_help, metavar="KIND[:OPT=VAL,...]"))
    cuda_graphs: bool | None = field(default=None, metadata=opt(
        "replay the embedded model's idle forwards as CUDA graphs (launch-bound on a GPU at this size; default: on a "
        "CUDA device)"))
    allow_uncertified: bool = True
    admission_judge: str | None = "auto"
    admission_rule: dict[str, float] = field(default_factory=lambda: {"fidelity": 0.75, "artifact": 0.1})
    write_behind: bool | None = None

    def __post_init__(self) -> None:
        cs = self.capture_steps
        if isinstance(cs, str):
            if cs not in ("auto", "all", "none"):
                raise ValueError(f'EngineConfig.capture_steps must be "auto", "all", "none" or a list of step indices, got {cs!r}')
        elif not all(isinstance(i, int) and not isinstance(i, bool) for i in cs):
            raise ValueError(f"EngineConfig.capture_steps: a list of step indices must hold ints, got {list(cs)!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise ValueError(f'EngineConfig.latent_dtype must be "float32", "float16" or "bfloat16", got {self.latent_dtype!r}')


@dataclass(frozen=True)
class EngineSpec:
    """Everything that builds an engine, as plain data: the CLI, bench workers, the service and its replicas build
    identical engines from one spec (:meth:`Carnator.from_spec`). ``model``: "embedded" or a local diffusers
    directory; ``cache_dir``: the cache store: a directory or ``sqlite:///path`` (None: the default directory) or a
    ``postgresql://`` URL of a shared store; ``blobs``: where a shared store's blobs live (a path or fsspec URL);
    ``config``: :class:`EngineConfig` fields."""

    model: str = field(default="embedded", metadata=opt(
        '"embedded" (default: the shapes-world model shipped inside carnator) or a local diffusers pipeline directory'))
    device: str | None = field(default=None, metadata=opt("cpu or cuda (default: cuda when available)"))
    cache_dir: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    blobs: str | None = field(default=None, metadata=opt(
        "where a postgresql:// store keeps its tensors and videos: a shared directory (NFS) or an fsspec URL "
        "(s3://bucket/prefix with s3fs installed)", metavar="PATH_OR_URL"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineSpec:
        return cls(**d)
