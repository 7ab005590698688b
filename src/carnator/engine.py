"""The request lifecycle: resolve -> exact tier -> policy plan -> denoise -> decode -> store."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import denoise
from .backbones.base import BackboneAdapter, Conditioning, adapter_for
from .cache.protocol import VIDEO, StoreSpec
from .errors import CacheError, InvalidRequestError, ModelLoadError
from .policies import Plan, Policy, get_policy_class, policy_names
from .request import Request, Result, Stats, to_uint8

if TYPE_CHECKING:
    from .cache import CacheBank

log = logging.getLogger("carnator")


@dataclass
class EngineConfig:
    """Engine-wide settings.

    capture_steps: which post-scheduler latents are stored with every entry ("auto": those the policy
        that generated it can resume from, ``Policy.stored_steps``; "all", "none", or a
        list of step indices). Reuse needs the latents at the steps policies resume from.
    latent_dtype: dtype of stored latents (float16 halves the bytes; float32 keeps them exact).
    store_video: keep the decoded video with the entry, so an identical request is an exact hit.
    capacity_bytes, eviction: when set, stored as the cache's own capacity (bytes) and eviction policy ("lru",
        "lcbfu") with ``CacheBank.configure`` when the engine opens it; None (default) keeps what the cache has.
    intra_cache: one of diffusers' per-request caches applied to the transformer under every policy
        (None = off): a kind name, "KIND:opt=value,...", or {"kind": KIND, opt: value}; kinds first_block,
        pab, faster, taylorseer, mag (see :mod:`carnator.intra_cache` and docs/METHOD.md).
    cuda_graphs: replay the transformer's forward as a CUDA graph at every step where no policy records or
        applies anything in it (the embedded model on a CUDA device; with no intra-request cache). For small,
        launch-bound models; the results are the eager forward's (checked on the H200, docs/RESULTS.md).
    """

    capture_steps: str | list[int] = "auto"
    latent_dtype: str = "float32"
    store_video: bool = True
    capacity_bytes: int | None = None
    eviction: str | None = None
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    intra_cache: str | dict[str, Any] | None = None
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        cs = self.capture_steps
        if isinstance(cs, str):
            if cs not in ("auto", "all", "none"):
                raise ValueError(f'EngineConfig.capture_steps must be "auto", "all", "none" or a list of step indices, got {cs!r}')
        elif not all(isinstance(i, int) and not isinstance(i, bool) for i in cs):
            raise ValueError(f"EngineConfig.capture_steps: a list of step indices must hold ints, got {list(cs)!r}")
        if self.latent_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f'EngineConfig.latent_dtype must be "float32", "float16" or "bfloat16", got {self.latent_dtype!r}')


@dataclass
class RequestContext:
    """Everything a policy may look at or ask for while planning one request."""

    engine: "Carnator"
    request: Request
    cond: Conditioning
    state: denoise.DenoiseState
    compat_key: str
    timings: dict[str, float]
    #: the steps whose post-scheduler latents this request keeps (for its cache entry)
    capture: set[int] = field(default_factory=set)
    #: False: plan a miss whatever the cache holds (``generate(..., reuse=False)``, e.g. to fill a cache)
    reuse: bool = True
    _embedding: np.ndarray | None = None

    @property
    def adapter(self) -> BackboneAdapter:
        return self.engine.adapter

    @property
    def bank(self):
        return self.engine.bank

    def embedding(self) -> np.ndarray:
        if self._embedding is None:
            self._embedding = self.engine.embedder(self.request.prompt)  # the bank checks its size against the scope's
        return self._embedding

    def recall(self, k: int) -> list:
        """The ``k`` cached entries nearest this request by recall embedding, within its tenant and compatibility
        key, nearest first; none when this request must not reuse."""
        if not self.reuse:
            return []
        return self.bank.recall(self.request.tenant, self.compat_key, self.embedding(), k=k)

    def run_steps(self, stop: int, hooks: denoise.StepHooks | None = None) -> denoise.DenoiseState:
        """Advance this request's own trajectory (a probe): its steps count toward its latency."""
        return denoise.run_steps(self.adapter, self.state, self.cond, self.request, stop, capture=self.capture, hooks=hooks)


class Carnator:
    """Cross-request reuse around a diffusers text-to-video pipeline.

    >>> eng = Carnator.from_pretrained("embedded")
    >>> res = eng.generate("a red ball moving left on grass", seed=7)
    >>> res.frames.shape, res.stats.hit
    """

    def __init__(self, pipe, cache_dir: str | os.PathLike | CacheBank | None = None, *, config: EngineConfig | None = None, embedder=None, adapter: BackboneAdapter | None = None):
        """``cache_dir``: the cache directory (default: ``$CARNATOR_CACHE_DIR`` or ``~/.cache/carnator``)
        or an open :class:`~carnator.cache.CacheBank`."""
        self.pipe = pipe
        self.adapter = adapter if adapter is not None else adapter_for(pipe)
        self.config = config or EngineConfig()
        self.bank = _open_bank(cache_dir, self.config)
        self._embedder = embedder
        self._policies: dict[str, Any] = {}
        self.model_identity = self.adapter.model_identity()
        from .intra_cache import IntraCacheSpec

        self.intra_cache_spec = IntraCacheSpec.parse(self.config.intra_cache)
        self.adapter.use_intra_cache(self.intra_cache_spec)  # an unsupported kind fails here, before any request
        self.adapter.use_cuda_graphs(self.config.cuda_graphs)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "embedded", cache_dir: str | os.PathLike | None = None, *, device: str | None = None, torch_dtype: torch.dtype | None = None, **kwargs) -> "Carnator":
        """Load ``model``: "embedded" (the shipped shapes-world model) or a local diffusers directory."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_device(device)
        class_name = None if model == "embedded" else _pipeline_class(model)
        # Open the cache before loading the model, so that a bad cache directory fails fast.
        bank = _open_bank(cache_dir, kwargs.get("config") or EngineConfig())
        if class_name is None:
            from .backbones.embedded import EmbeddedAdapter
            from .embedded import load_pipeline

            pipe = load_pipeline(device=device)
            return cls(pipe, bank, adapter=EmbeddedAdapter(pipe), **kwargs)
        import diffusers

        try:
            pipe = getattr(diffusers, class_name).from_pretrained(str(model), torch_dtype=torch_dtype, local_files_only=True)
        except Exception as e:  # diffusers raises many types for broken directories
            raise ModelLoadError(f"could not load {class_name} from {model}: {_first_line(e)}") from e
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, bank, **kwargs)

    @property
    def embedder(self):
        if self._embedder is None:
            from .embed import default_embedder

            self._embedder = default_embedder()
        return self._embedder

    def policy(self, name: str):
        if name not in self._policies:
            klass = get_policy_class(name)
            if klass is None:
                raise InvalidRequestError(f"unknown policy {name!r}; available: {', '.join(policy_names())}")
            self._policies[name] = klass(**self.config.policy_options.get(name, {}))
        return self._policies[name]

    def use_policy(self, policy) -> None:
        """Make a policy instance available as ``generate(..., policy=policy.name)`` (a custom policy,
        or a registered one with non-default settings); it replaces any earlier one of that name."""
        name = getattr(policy, "name", None)
        if not isinstance(name, str) or not callable(getattr(policy, "plan", None)):
            raise InvalidRequestError("use_policy needs a Policy instance (with a name and a plan method)")
        self._policies[name] = policy

    @property
    def cache_identity(self) -> str:
        """What cache entries are keyed by: the model, and the intra-request cache if one runs (an approximate
        trajectory is reused, and an exact hit returned, only under the same intra-request cache)."""
        spec = self.intra_cache_spec
        return self.model_identity if spec is None else f"{self.model_identity}+intra:{spec.label()}"

    def compat_key(self, req: Request) -> str:
        from .cache import compat_key

        return compat_key(self.cache_identity, self.adapter.scheduler_name(), req.settings())

    def _capture(self, state: denoise.DenoiseState, pol: Policy, store: bool) -> set[int]:
        if not store:
            return set()
        if self.config.capture_steps == "auto":
            return pol.stored_steps(state.num_steps)
        return denoise.capture_set(self.config.capture_steps, state.num_steps)

    # ---- generation --------------------------------------------------------------------------
    def is_cached(self, prompt: str, *, seed: int, tenant: str = "default", **request) -> bool:
        """Whether the bank holds this exact request (same prompt, seed and settings: ``request`` takes
        :meth:`generate`'s ``negative_prompt``, ``num_inference_steps``, ...), i.e. whether it would be an exact hit."""
        return self._exact_entry(self.adapter.resolve(prompt, seed=seed, tenant=tenant, **request)) is not None

    def _exact_entry(self, req: Request):
        """The bank's entry for exactly this request, or None."""
        return self.bank.lookup_exact(req.tenant, req.exact_key(self.cache_identity))

    def generate(
        self,
        prompt: str,
        *,
        seed: int,
        policy: str = "carnator",
        negative_prompt: str | None = None,
        num_inference_steps: int | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        guidance_scale: float | None = None,
        tenant: str = "default",
        store: bool = True,
        reuse: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> Result:
        """Generate one video; reuse cached work where ``policy`` finds it safe.

        ``reuse=False`` generates it as a miss (no exact or approximate reuse) that still records and, with
        ``store``, stores what ``policy`` keeps for later requests: how a cache is filled with completed requests.
        Returns a :class:`Result` with ``frames`` (uint8, T x H x W x 3) and ``stats``.
        """
        t_start = time.perf_counter()
        pol = self.policy(policy)
        req = self.adapter.resolve(
            prompt, seed=seed, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
            num_frames=num_frames, height=height, width=width, guidance_scale=guidance_scale, tenant=tenant,
        )
        stats = Stats(policy=policy)
        timings = stats.timings

        # Exact tier: an identical request returns the stored video without denoising.
        exact_key = req.exact_key(self.cache_identity)
        t0 = time.perf_counter()
        hit = self._exact_entry(req) if reuse else None
        if hit is not None and hit.extra.get("approximate") and not pol.accepts_approximate_exact:
            hit = None
        if hit is not None:
            tensors = self.bank.load(hit.id, [VIDEO])
            if tensors is not None:
                self.bank.touch(hit.id)
                stats.hit = stats.exact_hit = True
                stats.source_id = hit.id
                stats.resume_step = req.num_inference_steps
                timings["exact_lookup"] = time.perf_counter() - t0
                timings["total"] = time.perf_counter() - t_start
                frames = tensors[VIDEO].numpy()
                return Result(frames=frames, stats=stats, request=req)
        timings["exact_lookup"] = time.perf_counter() - t0

        if self.adapter._controller is not None:
            self.adapter._controller.reset()  # nothing of the previous request's attention plan leaks
        # (Engines sharing one adapter may differ in their intra-request cache and CUDA graphs: apply this engine's.)
        intra = self.adapter.use_intra_cache(self.intra_cache_spec)
        self.adapter.use_cuda_graphs(self.config.cuda_graphs)
        if intra is not None:
            intra.start_request()  # diffusers resets hook state at the end of a pipeline call; we drive the loop, so here
        t0 = time.perf_counter()
        cond = self.adapter.encode(req)
        state = denoise.start(self.adapter, req)
        timings["encode"] = time.perf_counter() - t0
        capture = self._capture(state, pol, store)
        ctx = RequestContext(self, req, cond, state, self.compat_key(req), timings, capture, reuse=reuse)

        plan: Plan = pol.plan(ctx)  # may run a probe (advancing state) and records its own stage timings
        if plan.init_latents is not None:
            state.latents = plan.init_latents.to(state.latents.device, state.latents.dtype)
            state.next_step = int(plan.resume_step)
            self.adapter.seek(state.next_step)
        stats.hit = plan.hit
        stats.source_id = plan.source_id
        stats.resume_step = plan.resume_step
        stats.active_fraction = plan.active_fraction
        stats.mask_density = plan.mask_density
        stats.notes.update(plan.notes)

        dit_before = state.dit_seconds
        cb = (lambda i: progress(i + 1, state.num_steps)) if progress else None
        denoise.run_steps(self.adapter, state, cond, req, capture=capture, hooks=plan.hooks, progress=cb)
        timings["dit"] = state.dit_seconds
        timings["dit_after_plan"] = state.dit_seconds - dit_before
        stats.dit_forwards = state.dit_forwards
        if intra is not None:
            stats.notes["intra_cache"] = intra.summary()
            intra.end()

        t0 = time.perf_counter()
        video = self.adapter.decode(state.latents, req)
        frames = to_uint8(video)
        timings["decode"] = time.perf_counter() - t0

        if store:
            t0 = time.perf_counter()
            plan.entry_tensors.update(pol.entry_tensors(ctx))
            stats.entry_id = self._admit(ctx, plan, state, frames, exact_key, stats)
            timings["store"] = time.perf_counter() - t0
        if plan.source_id is not None:
            self.bank.touch(plan.source_id)
        timings["total"] = time.perf_counter() - t_start
        return Result(frames=frames, stats=stats, request=req, video=video)

    def _admit(self, ctx: RequestContext, plan: Plan, state: denoise.DenoiseState, frames: np.ndarray, exact_key: str, stats: Stats) -> str | None:
        """Store the request's trajectory and video; a cache that cannot take it costs the entry, not the video."""
        req = ctx.request
        dtype = getattr(torch, self.config.latent_dtype)
        tensors: dict[str, torch.Tensor] = {f"traj.{i}": z.to(dtype) for i, z in state.trajectory.items()}
        tensors["final"] = state.latents.detach().to("cpu", dtype)
        tensors.update(plan.entry_tensors)
        # "approximate": the video came from reuse, not from every step of this request's own trajectory.
        extra = {"steps": req.num_inference_steps, "approximate": bool(plan.hit), **plan.entry_extra}
        try:
            return self.bank.admit(StoreSpec(
                tenant=req.tenant, compat_key=ctx.compat_key, exact_key=exact_key if self.config.store_video else None,
                prompt=req.prompt, negative_prompt=req.negative_prompt, seed=req.seed,
                steps_saved=float(req.num_inference_steps), embedding=ctx.embedding(), tensors=tensors, extra=extra,
                video=np.ascontiguousarray(frames) if self.config.store_video else None,
            ))
        except (CacheError, OSError) as e:  # unwritable or full disk, locked database, another embedder's cache
            log.warning("could not store the result in the cache: %s", _first_line(e))
            stats.notes["store_error"] = _first_line(e)
            return None


def _pipeline_class(model: str | os.PathLike) -> str:
    """The supported diffusers pipeline class named by the local directory ``model``; ModelLoadError otherwise."""
    path = Path(model)
    if not path.is_dir():
        raise ModelLoadError(f"model not found: {str(model)!r} is neither 'embedded' nor a local diffusers directory")
    index = path / "model_index.json"
    if not index.is_file():
        raise ModelLoadError(f"{path} is not a diffusers pipeline directory (no model_index.json)")
    try:
        class_name = json.loads(index.read_text())["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index} is not a valid diffusers model index") from e
    from .backbones.base import supported_pipelines

    if not isinstance(class_name, str) or class_name not in supported_pipelines():
        raise ModelLoadError(f"unsupported pipeline class {class_name}; supported: {', '.join(supported_pipelines())}")
    return class_name


def _open_bank(cache_dir, config: EngineConfig):
    from .cache import CacheBank, default_cache_dir

    if isinstance(cache_dir, CacheBank):
        bank = cache_dir
    else:
        bank = CacheBank(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    settings = {k: v for k, v in (("capacity_bytes", config.capacity_bytes), ("eviction", config.eviction)) if v is not None}
    if settings:
        bank.configure(**settings)  # the cache's own settings, for every process that opens it
    return bank


def _check_device(device: str) -> None:
    """A device string torch cannot parse, or a CUDA device this machine lacks, is a ModelLoadError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise ModelLoadError(f"device {device!r} is not available here ({count} CUDA device(s))")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
