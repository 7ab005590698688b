"""Diffusers' per-request (intra-request) caches, as peers of carnator's cross-request policies.

One engine-level setting, :attr:`EngineConfig.intra_cache <carnator.engine.EngineConfig>`, names a
kind and its options; the engine applies it to the adapter's transformer through diffusers' public
API (``transformer.enable_cache(<Config>)``, ``disable_cache()``, ``cache_context(name)``), so every
policy runs with it: ``dense`` is the intra-request cache alone, ``carnator`` composes the two.

=============  ==========================================  =====================================
kind           diffusers config                            what it reuses within one request
=============  ==========================================  =====================================
first_block    ``FirstBlockCacheConfig``                   all blocks after the first, when the
                                                           first block's residual barely changed
pab            ``PyramidAttentionBroadcastConfig``         attention outputs, every N-th call
faster         ``FasterCacheConfig``                       self-attention outputs (extrapolated)
                                                           and the uncond CFG branch (from cond)
taylorseer     ``TaylorSeerCacheConfig``                   attention / FFN outputs, predicted by a
                                                           Taylor series between full steps
mag            ``MagCacheConfig``                          all blocks, while the accumulated
                                                           residual-magnitude ratio error is small
=============  ==========================================  =====================================

The hook state is per request: it is reset at the start of every request, at every resume from a
cached latent (``adapter.seek``), whenever the carnator attention window switches on or off or
changes (the shapes inside the window layers change), and before the forward in which a policy
records probe evidence (so that forward runs in full). After any reset the first forward of every
kind computes everything. Model knowledge (which modules to hook, the output layout) lives in the
adapters' ``intra_cache_options`` / ``intra_cache_unsupported``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CarnatorError

if TYPE_CHECKING:
    from .base import BackboneAdapter


class IntraCacheError(CarnatorError):
    """An intra-request cache that this model, request or option set cannot run."""


# ---- options --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One documented option of a kind: its type ("float", "int", "bool", "range", "floats"), default, help."""

    type: str
    default: Any
    help: str
    optional: bool = False  # None is a valid value ("off")


def _parse_value(kind: str, name: str, opt: Option, value: Any) -> Any:
    bad = IntraCacheError(f"intra cache {kind}: option {name} must be {_TYPE_WORDS[opt.type]}, got {value!r}")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "off", "")):
        if opt.optional:
            return None
        raise bad
    try:
        if opt.type == "float":
            v = float(value)
            if not math.isfinite(v):
                raise ValueError
            return v
        if opt.type == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if opt.type == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no"):
                return False
            raise ValueError
        if opt.type == "range":
            if isinstance(value, str):
                lo, hi = value.split("..")
            else:
                lo, hi = value
            return (float(lo), float(hi))
        if opt.type == "floats":
            if isinstance(value, str):
                p = Path(value[1:] if value.startswith("@") else value)
                if value.startswith("@") or p.suffix == ".json":
                    try:
                        value = json.loads(p.read_text())
                    except (OSError, ValueError) as e:
                        raise IntraCacheError(f"intra cache {kind}: cannot read {name} from {str(p)!r}: {e}") from None
                else:
                    value = [x for x in value.replace(" ", "/").split("/") if x]
            vals = [float(x) for x in value]
            if not vals or not all(math.isfinite(x) and x > 0 for x in vals):
                raise ValueError
            return tuple(vals)
    except IntraCacheError:
        raise
    except (TypeError, ValueError):
        raise bad from None
    raise AssertionError(opt.type)


_TYPE_WORDS = {
    "float": "a number",
    "int": "an integer",
    "bool": "true or false",
    "range": "LO..HI (two numbers)",
    "floats": "positive numbers separated by '/' or a JSON list file (@file.json)",
}


# ---- the kinds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """The part of one request's schedule that the hook state covers (from ``start`` to the end)."""

    start: int
    num_steps: int
    do_cfg: bool
    dtype: torch.dtype


class Kind:
    """One of diffusers' caches: its options, its requirements, and how to build its config."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    title: str = ""
    source: str = ""
    options: dict[str, Option] = {}
    #: the hooks keep one state per ``cache_context`` (else one state for every call, whatever the branch)
    context_aware: bool = True
    #: every CFG branch must go through one batched forward (state shared across calls would mix branches)
    one_forward_cfg: bool = False
    #: a batched CFG forward must put the uncond rows first (FasterCache splits ``chunk(2)`` = (uncond, cond))
    uncond_first: bool = False

    def validate(self, opts: dict) -> str | None:
        """What is wrong with these options, whatever the model (None if nothing)."""
        return None

    def check(self, adapter: "BackboneAdapter", opts: dict) -> str | None:
        """Why this kind cannot run on ``adapter`` (None if it can)."""
        return None

    def key(self, opts: dict, seg: Segment) -> tuple:
        """What of the segment the config depends on: a new key rebuilds the config, else the state is reset."""
        return ()

    def config(self, opts: dict, family: dict, seg: Segment, timestep: Callable[[], float]):
        raise NotImplementedError

    def describe(self) -> str:
        parts = [f"{n}={_show(o.default)}" for n, o in self.options.items()]
        return f"{self.name} ({', '.join(parts)})" if parts else self.name


def _show(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return f"{_num(v[0])}..{_num(v[1])}"
    return str(v).lower() if isinstance(v, bool) else _num(v) if isinstance(v, float) else str(v)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_BLOCK_LISTS = ("blocks", "transformer_blocks", "single_transformer_blocks", "layers", "temporal_transformer_blocks", "visual_transformer_blocks")


def transformer_blocks(transformer: torch.nn.Module) -> list[str]:
    """Names of the blocks diffusers' block-level caches hook (the ModuleLists it recognises, in order)."""
    return [f"{n}.{i}" for n, m in transformer.named_children() if n in _BLOCK_LISTS and isinstance(m, torch.nn.ModuleList) for i in range(len(m))]


class FirstBlock(Kind):
    name, aliases = "first_block", ("fbc", "first_block_cache", "firstblockcache")
    title = "First Block Cache"
    source = "ParaAttention's First Block Cache (after TeaCache, arXiv 2411.19108)"
    options = {
        "threshold": Option("float", 0.05, "skip every block after the first while |first-block residual change| / |residual| stays below this (diffusers' default)"),
    }

    def check(self, adapter, opts):
        n = len(transformer_blocks(adapter.transformer))
        return None if n >= 2 else f"it needs at least 2 transformer blocks (the first decides, the rest are skipped); this transformer has {n}"

    def config(self, opts, family, seg, timestep):
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=opts["threshold"], **family)


class PAB(Kind):
    name, aliases = "pab", ("pyramid_attention_broadcast", "pyramid")
    title = "Pyramid Attention Broadcast"
    source = "Zhao et al., Real-Time Video Generation with Pyramid Attention Broadcast (arXiv 2408.12588)"
    options = {
        "spatial": Option("int", 2, "compute self-attention every N-th call inside the timestep range, else reuse the last output (diffusers' example)", optional=True),
        "cross": Option("int", None, "the same for cross-attention (wan and the embedded model have separate cross-attention layers)", optional=True),
        "timesteps": Option("range", (100.0, 800.0), "broadcast only while LO < t < HI (t in 0..1000; diffusers' default)"),
    }
    context_aware = False
    one_forward_cfg = True

    def validate(self, opts):
        if opts["spatial"] is None and opts["cross"] is None:
            return "set spatial=N or cross=N"
        if any(opts[k] is not None and opts[k] < 1 for k in ("spatial", "cross")):
            return "spatial and cross must be at least 1"
        return None

    def config(self, opts, family, seg, timestep):
        from diffusers.hooks import PyramidAttentionBroadcastConfig

        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=opts["spatial"], cross_attention_block_skip_range=opts["cross"],
            spatial_attention_timestep_skip_range=opts["timesteps"], cross_attention_timestep_skip_range=opts["timesteps"],
            current_timestep_callback=timestep, **family,
        )


class Faster(Kind):
    name, aliases = "faster", ("fastercache", "faster_cache")
    title = "FasterCache"
    source = "Lv et al., FasterCache: Training-Free Video Diffusion Model Acceleration with High Quality Cache (arXiv 2410.19355)"
    options = {
        "spatial": Option("int", 2, "compute self-attention every N-th call inside `timesteps`, else extrapolate from the last two (diffusers' default)"),
        "timesteps": Option("range", (-1.0, 681.0), "self-attention reuse only while LO < t < HI (diffusers' default)"),
        "uncond": Option("int", 5, "compute the uncond CFG branch every N-th step inside `uncond_timesteps`, else derive it from cond (CFG-Cache; diffusers' default)"),
        "uncond_timesteps": Option("range", (-1.0, 641.0), "uncond-branch reuse only while LO < t < HI (diffusers' default)"),
        "weight": Option("float", 0.5, "extrapolation weight w in out_t + w (out_t - out_t-2) (diffusers' default)"),
    }
    context_aware = False
    one_forward_cfg = True
    uncond_first = True

    def validate(self, opts):
        return "spatial and uncond must be at least 1" if min(opts["spatial"], opts["uncond"]) < 1 else None

    def key(self, opts, seg):
        return (seg.do_cfg,)

    def config(self, opts, family, seg, timestep):
        from diffusers.hooks import FasterCacheConfig

        w = opts["weight"]
        return FasterCacheConfig(
            spatial_attention_block_skip_range=opts["spatial"], spatial_attention_timestep_skip_range=opts["timesteps"],
            unconditional_batch_skip_range=opts["uncond"], unconditional_batch_timestep_skip_range=opts["uncond_timesteps"],
            attention_weight_callback=lambda _module: w, current_timestep_callback=timestep,
            # Without CFG there is no uncond branch to skip (diffusers' "guidance-distilled" mode).
            is_guidance_distilled=not seg.do_cfg, **family,
        )


class TaylorSeer(Kind):
    name, aliases = "taylorseer", ("taylor_seer", "taylorseer_cache")
    title = "TaylorSeer"
    source = "Liu et al., From Reusing to Forecasting: Accelerating Diffusion Models with TaylorSeers (arXiv 2503.06923)"
    options = {
        "interval": Option("int", 5, "a full forward every N steps; the steps between are predicted (diffusers' default)"),
        "warmup": Option("int", 3, "full forwards at the first N steps of a segment, to fit the series (diffusers' default; at least 1)"),
        "order": Option("int", 1, "Taylor order (diffusers' default)"),
        "stop": Option("int", None, "full forwards again from this step of the segment on (none: never)", optional=True),
        "lite": Option("bool", False, "TaylorSeer-Lite: predict only proj_out's output and skip every block (diffusers' use_lite_mode)"),
    }

    def validate(self, opts):
        if opts["warmup"] < 1:
            return "warmup must be at least 1 (a prediction needs a computed step)"
        if opts["interval"] < 1 or opts["order"] < 0:
            return "interval must be at least 1 and order at least 0"
        return None

    def config(self, opts, family, seg, timestep):
        from diffusers.hooks import TaylorSeerCacheConfig

        if opts["lite"]:  # lite mode brings its own module patterns
            family = {k: v for k, v in family.items() if k not in ("cache_identifiers", "skip_predict_identifiers")}
        return TaylorSeerCacheConfig(
            cache_interval=opts["interval"], disable_cache_before_step=opts["warmup"], disable_cache_after_step=opts["stop"],
            max_order=opts["order"], use_lite_mode=opts["lite"],
            # diffusers defaults to bfloat16 factors; keep the model's own precision (float32 on the CPU).
            taylor_factors_dtype=seg.dtype, **family,
        )


class Mag(Kind):
    name, aliases = "mag", ("magcache", "mag_cache")
    title = "MagCache"
    source = "Ma et al., MagCache: Fast Video Generation with Magnitude-Aware Cache (arXiv 2506.09045)"
    options = {
        "threshold": Option("float", 0.06, "skip the blocks while the accumulated |1 - magnitude ratio| error stays below this (diffusers' default)"),
        "max_skip": Option("int", 3, "at most this many consecutive skipped steps (K; diffusers' default)"),
        "retention": Option("float", 0.2, "never skip the first fraction of the schedule (diffusers' default)"),
        "ratios": Option("floats", None, "the model's per-step magnitude ratios (model-specific; get them with calibrate=true)", optional=True),
        "calibrate": Option("bool", False, "skip nothing; record this model's ratios in stats.notes['intra_cache']['mag_ratios']"),
    }

    def validate(self, opts):
        if opts["ratios"] is None and not opts["calibrate"]:
            return ("it needs the model's magnitude ratios: run one request with calibrate=true "
                    "(they are recorded in stats.notes['intra_cache']['mag_ratios']) and pass them as ratios=R0/R1/... or ratios=@file.json")
        if opts["max_skip"] < 0 or not 0 <= opts["retention"] <= 1 or opts["threshold"] < 0:
            return "max_skip must be at least 0, retention within 0..1 and threshold at least 0"
        return None

    def check(self, adapter, opts):
        if not transformer_blocks(adapter.transformer):
            return "it found no transformer blocks to hook"
        return None

    def key(self, opts, seg):
        return (seg.start, seg.num_steps)

    def config(self, opts, family, seg, timestep):
        from diffusers.hooks import MagCacheConfig

        if opts["calibrate"]:
            return None  # carnator records the ratios itself (diffusers' calibration mode prints them)
        n, s = seg.num_steps, seg.start
        ratios = _interp(torch.tensor(opts["ratios"], dtype=torch.float32), n)[s:]
        keep = int(opts["retention"] * n + 0.5)  # retention counted in steps of the whole schedule
        m = max(n - s, 1)
        return MagCacheConfig(threshold=opts["threshold"], max_skip_steps=opts["max_skip"], retention_ratio=max(keep - s, 0) / m,
                              num_inference_steps=m, mag_ratios=ratios if len(ratios) else torch.ones(1), **family)


def _interp(ratios: torch.Tensor, n: int) -> torch.Tensor:
    from diffusers.hooks.mag_cache import nearest_interp

    return ratios if len(ratios) == n else nearest_interp(ratios, n)


KINDS: dict[str, Kind] = {k.name: k for k in (FirstBlock(), PAB(), Faster(), TaylorSeer(), Mag())}
_ALIASES = {a: k.name for k in KINDS.values() for a in (k.name, *k.aliases)}


def kind_names() -> list[str]:
    return list(KINDS)


def describe_kinds() -> str:
    """One line per kind with its options and defaults (for --help)."""
    return "; ".join(k.describe() for k in KINDS.values())


# ---- the spec -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IntraCacheSpec:
    """A kind and its options (every option filled in with its default)."""

    kind: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    def label(self) -> str:
        return f"{self.kind}(" + ", ".join(f"{k}={_show(v)}" for k, v in self.options) + ")"

    @classmethod
    def parse(cls, spec: "str | dict | IntraCacheSpec | None") -> "IntraCacheSpec | None":
        """None / "none" -> None; "KIND" or "KIND:opt=value,opt=value"; {"kind": KIND, opt: value, ...}."""
        if spec is None or isinstance(spec, IntraCacheSpec):
            return spec
        if isinstance(spec, str):
            text = spec.strip()
            if text.lower() in ("", "none", "off"):
                return None
            name, _, rest = text.partition(":")
            raw: dict[str, Any] = {}
            for item in filter(None, (s.strip() for s in rest.split(","))):
                k, eq, v = item.partition("=")
                if not eq:
                    raise IntraCacheError(f"intra cache option {item!r} must be NAME=VALUE")
                raw[k.strip()] = v.strip()
        elif isinstance(spec, dict):
            raw = dict(spec)
            name = raw.pop("kind", None)
            if not isinstance(name, str):
                raise IntraCacheError("an intra cache spec needs a 'kind'")
        else:
            raise IntraCacheError(f"intra_cache must be None, a string or a dict, got {type(spec).__name__}")
        canon = _ALIASES.get(name.strip().lower().replace("-", "_"))
        if canon is None:
            raise IntraCacheError(f"unknown intra cache {name!r}; available: {', '.join(KINDS)}")
        kind = KINDS[canon]
        unknown = sorted(set(raw) - set(kind.options))
        if unknown:
            raise IntraCacheError(f"intra cache {canon} has no option {', '.join(unknown)}; its options: {kind.describe()}")
        opts = {n: _parse_value(canon, n, o, raw[n]) if n in raw else o.default for n, o in kind.options.items()}
        problem = kind.validate(opts)
        if problem is not None:
            raise IntraCacheError(f"intra cache {canon}: {problem}")
        return cls(canon, tuple(opts.items()))


def supported_kinds(adapter: "BackboneAdapter") -> list[str]:
    """Kinds that can run on ``adapter`` (with valid options)."""
    out = []
    for name, kind in KINDS.items():
        opts = {n: o.default for n, o in kind.options.items()}
        if _why_not(adapter, kind, opts) is None:
            out.append(name)
    return out


def _why_not(adapter: "BackboneAdapter", kind: Kind, opts: dict) -> str | None:
    from diffusers.models.cache_utils import CacheMixin

    if not isinstance(adapter.transformer, CacheMixin):
        return f"{type(adapter.transformer).__name__} is not a diffusers CacheMixin"
    reason = adapter.intra_cache_unsupported.get(kind.name)
    return reason if reason is not None else kind.check(adapter, opts)


# ---- the runtime ----------------------------------------------------------------------------------
@dataclass
class IntraCache:
    """One spec applied to one adapter's transformer, with its per-request state handling."""

    adapter: "BackboneAdapter"
    spec: IntraCacheSpec
    _pending: bool = True
    _applied: tuple | None = None  # config key of the hooks installed now (None: none installed)
    _sig: tuple | None = None
    _reset_step: int | None = None
    _t: float = 1000.0
    resets: int = 0
    _recorder: "_MagRatioRecorder | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        kind = self.kind
        reason = _why_not(self.adapter, kind, self.spec.opts)
        if reason is not None:
            works = [k for k in supported_kinds(self.adapter) if k != kind.name]
            raise IntraCacheError(
                f"intra cache {kind.name} cannot run on this {self.adapter.family} model: {reason}; "
                f"kinds that work here: {', '.join(works) if works else 'none'}"
            )

    @property
    def kind(self) -> Kind:
        return KINDS[self.spec.kind]

    # -- lifecycle, driven by the engine and the adapter --
    def start_request(self) -> None:
        """A new request: reset the state before its first forward and restart the per-request record."""
        self.resets = 0
        if self._recorder is not None:
            self._recorder.clear()
        self.begin()

    def begin(self) -> None:
        """A new trajectory segment starts (a request, or a resume): reset the state before the next forward."""
        self._pending = True

    def end(self) -> None:
        """The request is done: drop the cached tensors (the next request resets anyway)."""
        if self._applied is not None:
            self._reset_hooks()
        self._pending = True

    def remove(self) -> None:
        """Take the hooks off the transformer (they are put back lazily on the next forward)."""
        tr = self.adapter.transformer
        if self._applied is not None and getattr(tr, "_cache_config", None) is not None:
            tr.disable_cache()
        self._applied = None
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        self._pending = True

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.spec.kind, "options": {k: _jsonable(v) for k, v in self.spec.options}, "resets": self.resets}
        if self._recorder is not None:
            out["mag_ratios"] = self._recorder.ratios()
        return out

    # -- per forward --
    def before_forward(self, branch: str, step: int, t: torch.Tensor | float, req, do_cfg: bool, recording: bool, window: tuple | None) -> None:
        """Reset (or rebuild) the hook state where the computation it caches starts anew; note the timestep."""
        self._t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float(t)
        sig = (req.num_inference_steps, do_cfg, window)
        if self._pending or sig != self._sig or (recording and self._reset_step != step):
            self._start_segment(step, req, do_cfg, sig)
        if self._recorder is not None:
            self._recorder.context = branch

    def _start_segment(self, step: int, req, do_cfg: bool, sig: tuple) -> None:
        if do_cfg and self.kind.one_forward_cfg and not self.adapter.batches_cfg:
            raise IntraCacheError(
                f"intra cache {self.kind.name} keeps one state for every call, so it needs all CFG branches in one forward, "
                f"and this {self.adapter.family} model runs them separately; kinds that work here: "
                + ", ".join(k for k in supported_kinds(self.adapter) if not KINDS[k].one_forward_cfg)
            )
        seg = Segment(start=step, num_steps=req.num_inference_steps, do_cfg=do_cfg, dtype=self.adapter.transformer.dtype)
        key = (self.spec, self.kind.key(self.spec.opts, seg))
        if key != self._applied:
            self._install(seg, key)
        else:
            self._reset_hooks()
        if self._recorder is not None:
            self._recorder.restart()
        self._pending, self._sig, self._reset_step = False, sig, step
        self.resets += 1

    def _install(self, seg: Segment, key: tuple) -> None:
        tr = self.adapter.transformer
        if getattr(tr, "_cache_config", None) is not None:
            if self._applied is None:
                raise IntraCacheError(
                    f"the transformer already has a diffusers cache enabled ({type(tr._cache_config).__name__}); "
                    "call transformer.disable_cache() or leave intra_cache unset"
                )
            tr.disable_cache()
        family = dict(self.adapter.intra_cache_options.get(self.kind.name, {}))
        cfg = self.kind.config(self.spec.opts, family, seg, lambda: self._t)
        if cfg is not None:
            tr.enable_cache(cfg)
        elif self.kind.name == "mag" and self._recorder is None:
            self._recorder = _MagRatioRecorder(tr)
        self._applied = key

    def _reset_hooks(self) -> None:
        from diffusers.hooks import HookRegistry

        HookRegistry.check_if_exists_or_initialize(self.adapter.transformer).reset_stateful_hooks(recurse=True)


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


class _MagRatioRecorder:
    """MagCache's calibration, recorded instead of printed: per forward of a context (CFG branch), the mean over
    tokens of |residual_t| / |residual_t-1|, where residual = last block's output - first block's input (diffusers'
    formula). Torch hooks only observe; nothing is skipped."""

    def __init__(self, transformer: torch.nn.Module):
        names = transformer_blocks(transformer)
        mods = dict(transformer.named_modules())
        head, tail = mods[names[0]], mods[names[-1]]
        self.context = "cond"
        self._input: torch.Tensor | None = None
        self._prev: dict[str, torch.Tensor] = {}
        self._ratios: dict[str, list[float]] = {}
        self._handles = [head.register_forward_pre_hook(self._pre, with_kwargs=True), tail.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        self._input = kwargs.get("hidden_states", args[0] if args else None)

    def _post(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        x, self._input = self._input, None
        if x is None or not torch.is_tensor(out) or out.shape != x.shape:
            return
        res = (out - x).float()
        prev = self._prev.get(self.context)
        ratio = 1.0 if prev is None else float((res.norm(dim=-1) / (prev.norm(dim=-1) + 1e-8)).mean())
        self._ratios.setdefault(self.context, []).append(ratio)
        self._prev[self.context] = res

    def restart(self) -> None:
        """A new trajectory segment: the next ratio has no predecessor."""
        self._prev.clear()

    def clear(self) -> None:
        self._prev.clear()
        self._ratios.clear()

    def ratios(self) -> list[float]:
        """The cond branch's ratios (or those of the first context seen), one per step."""
        vals = self._ratios.get("cond") or next(iter(self._ratios.values()), [])
        return [round(r, 5) for r in vals]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
