"""The engine: it runs every stage of one request, top to bottom, and holds no request state between them.

``Carnator.generate``::

    resolve -> exact tier (store.lookup_exact) -> encode -> recall -> probe -> signature
            -> policy.decide -> policy.plan -> bind the plan to the source's tensors -> denoise -> decode
            -> store.admit

Policies only decide and plan over plain data (:mod:`carnator.plan`); the loop in :mod:`carnator.denoise` only
executes plans; the store (:class:`~carnator.cache.CacheStore`) only stores. Everything a request changes (its
scheduler, attention plan and record) belongs to the request, so one engine serves requests from several threads at
once; with an intra-request cache (diffusers hooks, state on the transformer) its requests take turns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import denoise
from .backbones.base import BackboneAdapter
from .backbones.registry import adapter_for
from .cache.keys import content_key
from .cache.protocol import CacheStore
from .config import EngineConfig, EngineSpec
from .errors import CarnatorError, GenerationError, InvalidRequestError, ModelLoadError
from .plan import Decision, DecisionInputs
from .policies import ModelInfo, Policy, get_policy_class, policy_names
from .request import CACHE_MODES, Params, Request, Result, Stats, to_uint8
from .stages.store import first_line
from .stages import RequestState, decide, exact_hit, near_keys, plan, probe, read_signature, recall, recall_content, store

log = logging.getLogger("carnator")

__all__ = ["CACHE_MODES", "Carnator", "EngineConfig", "EngineSpec"]


def cuda_graphs_for(setting: bool | None, *, device: str | torch.device, supported: bool, intra_cache: bool) -> bool:
    """Whether an engine replays idle forwards as CUDA graphs: ``setting`` (``EngineConfig.cuda_graphs``) when given,
    else (None) the fast configuration where it applies: a CUDA ``device``, a family that ``supported`` them, no
    ``intra_cache``."""
    if setting is not None:
        return bool(setting)
    return torch.device(device).type == "cuda" and supported and not intra_cache


class Carnator:
    """Cross-request reuse around a diffusers text-to-video pipeline.

    >>> eng = Carnator.from_pretrained("embedded")
    >>> res = eng.generate("a red ball moving left on grass", seed=7)
    >>> res.frames.shape, res.stats.hit
    """

    def __init__(self, pipe: Any, cache_dir: str | os.PathLike | CacheStore | None = None, *, config: EngineConfig | None = None,
                 embedder: Callable[[str], np.ndarray] | None = None, adapter: BackboneAdapter | None = None, nouns: Callable[[str], list[str]] | None = None,
                 thresholds: str | os.PathLike | None = None,
                 model_identity: str | None = None):
        """``cache_dir``: the cache directory (default: ``$CARNATOR_CACHE_DIR`` or ``~/.cache/carnator``) or an open
        :class:`~carnator.cache.CacheStore`. ``embedder``: the recall embedder (default MiniLM). ``nouns``: the noun
        extractor (default: the adapter's, :meth:`~carnator.backbones.base.BackboneAdapter.noun_extractor`).
        ``thresholds``: a thresholds file from ``carnator calibrate`` for the carnator policy (the same as
        ``policy_options={"carnator": {"thresholds": PATH}}``; refused, in one line, for another model or reading).
        ``model_identity``: the model's identity as an engine with its weights computed it (for a pipeline whose
        transformer has no weights here, see ``from_pretrained(dit=False)``)."""
        self.pipe = pipe
        self.adapter = adapter if adapter is not None else adapter_for(pipe)
        self.config = config or EngineConfig()
        if thresholds is not None:
            opts = dict(self.config.policy_options)
            opts["carnator"] = {**opts.get("carnator", {}), "thresholds": str(thresholds)}
            self.config = dataclasses.replace(self.config, policy_options=opts)
        self.store: CacheStore = _open_store(cache_dir, self.config)
        self._embedder = embedder
        self.nouns = nouns or self.adapter.noun_extractor()
        self.content = self.adapter.content_reader()
        self._judge = None
        spec = self.config.admission_judge
        if spec == "auto":
            spec = "shapes" if self.adapter.family == "embedded" else None
        if spec is not None:
            from .judges import get_judge

            self._judge = get_judge(spec)
            unknown = sorted(set(self.config.admission_rule) - set(self._judge.directions))
            if unknown:
                raise ValueError(f"EngineConfig.admission_rule names scores the judge {self._judge.name} lacks: {unknown}")
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Stats, Future]] = []  # write-behind stores not yet known to have ended
        wb = self.config.write_behind
        #: whether entries are stored on a background thread (``EngineConfig.write_behind``; None: on a CUDA device)
        self.write_behind = bool(wb) if wb is not None else torch.device(self.adapter.device).type == "cuda"
        self._policies: dict[str, Policy] = {}
        self._lock = threading.Lock()
        self._text_lock = threading.Lock()  # fast tokenizers refuse concurrent calls with other settings ("Already borrowed")
        self._warned: set[str] = set()
        self._loader: ThreadPoolExecutor | None = None
        #: whether the pipeline's transformer has its weights here (False: ``from_pretrained(dit=False)``, no generation)
        self.dit = _device_type(self.adapter.transformer) != "meta"
        self.model_identity = model_identity or self.adapter.model_identity()
        from .backbones.intra_cache import IntraCacheSpec

        self.intra_cache_spec = IntraCacheSpec.parse(self.config.intra_cache)
        self.adapter.use_intra_cache(self.intra_cache_spec)  # an unsupported kind fails here, before any request
        #: whether idle forwards replay as CUDA graphs (``EngineConfig.cuda_graphs``; None: on a CUDA device)
        self.cuda_graphs = cuda_graphs_for(self.config.cuda_graphs, device=self.adapter.device,
                                           supported=self.adapter.supports_cuda_graphs,
                                           intra_cache=self.intra_cache_spec is not None)
        self.adapter.use_cuda_graphs(self.cuda_graphs)
        # diffusers' intra-request caches keep their state in hooks on the transformer: their requests take turns
        self._serial = threading.Lock() if self.intra_cache_spec is not None else None
        for name, opts in self.config.policy_options.items():  # a bad option or thresholds file fails here, not later
            if get_policy_class(name) is not None:
                self.policy(name)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "embedded", cache_dir: str | os.PathLike | None = None, *, device: str | None = None,
                        torch_dtype: torch.dtype | None = None, blobs: str | os.PathLike | None = None, dit: bool = True,
                        **kwargs: Any) -> Carnator:
        """Load ``model``: "embedded" (the shipped shapes-world model) or a local diffusers directory. ``cache_dir``: a
        directory, ``sqlite:///path`` or a ``postgresql://`` URL (then ``blobs`` says where its blobs live).

        ``dit=False``: an engine that resolves and checks requests, reads their text and embeds them for recall, but
        never generates (``carnator serve --replicas``' ingress): the transformer is built on the meta device (its
        shapes and config, no weights, no memory), and so, for a diffusers model, are the text encoder and the VAE;
        pass the ``model_identity`` an engine with the weights reports (the embedded model's is its checksum's)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_device(device)
        class_name = None if model == "embedded" else _pipeline_class(model)
        # Open the cache before loading the model, so that a bad cache directory fails fast.
        store = _open_store(cache_dir, kwargs.get("config") or EngineConfig(), blobs)
        if class_name is None:
            from .backbones.embedded import EmbeddedAdapter
            from .embedded import load_pipeline

            pipe = load_pipeline(device=device, dit=dit)
            return cls(pipe, store, adapter=EmbeddedAdapter(pipe), **kwargs)
        import diffusers

        try:
            parts = {} if dit else _meta_components(Path(model), ("transformer", "text_encoder", "vae"))
            pipe = getattr(diffusers, class_name).from_pretrained(str(model), torch_dtype=torch_dtype, local_files_only=True,
                                                                  **parts)
        except Exception as e:  # diffusers raises many types for broken directories
            raise ModelLoadError(f"could not load {class_name} from {model}: {_first_line(e)}") from e
        if dit:
            pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, store, **kwargs)

    @classmethod
    def from_spec(cls, spec: EngineSpec, **kwargs: Any) -> Carnator:
        """The engine ``spec`` describes (``kwargs``: an ``embedder`` or ``nouns`` that are not data)."""
        return cls.from_pretrained(spec.model, spec.cache_dir, device=spec.device, config=EngineConfig(**spec.config),
                                   blobs=spec.blobs, **kwargs)

    @property
    def embedder(self) -> Callable[[str], np.ndarray]:
        if self._embedder is None:
            from .recall.embedder import default_embedder

            self._embedder = default_embedder()
        return self._embedder

    @property
    def embedder_identity(self) -> str:
        """What recall embeddings are keyed by (entries of another embedder are never recalled)."""
        if self._embedder is None:
            from .recall.embedder import DEFAULT_EMBEDDER_IDENTITY

            return DEFAULT_EMBEDDER_IDENTITY
        e = self._embedder
        return getattr(e, "identity", None) or f"{getattr(e, 'name', type(e).__name__)}:{getattr(e, 'dim', '?')}"

    def embed(self, prompt: str) -> np.ndarray:
        """``prompt``'s recall embedding (the engine's embedder)."""
        with self._text_lock:
            return self.embedder(prompt)

    def policy(self, name: str) -> Policy:
        """The policy ``name``, built once per engine with its ``EngineConfig.policy_options`` (thresholds loaded and
        checked now: a missing or mismatched file fails here)."""
        with self._lock:
            if name not in self._policies:
                klass = get_policy_class(name)
                if klass is None:
                    raise InvalidRequestError(f"unknown policy {name!r}; available: {', '.join(policy_names())}")
                pol = klass(**self.config.policy_options.get(name, {}))
                pol.prepare(self.model_info)
                self._policies[name] = pol
            return self._policies[name]

    def use_policy(self, policy: Policy) -> None:
        """Make a policy instance available as ``generate(..., policy=policy.name)`` (a custom policy,
        or a registered one with non-default settings); it replaces any earlier one of that name."""
        name = getattr(policy, "name", None)
        if not isinstance(name, str) or not callable(getattr(policy, "decide", None)):
            raise InvalidRequestError("use_policy needs a Policy instance (with a name and a decide method)")
        policy.prepare(self.model_info)
        with self._lock:
            self._policies[name] = policy

    @property
    def model_info(self) -> ModelInfo:
        """What policies may know of the model and of this engine's admission gate."""
        adm = None if self._judge is None else {"judge": self._judge.name, "rule": dict(self.config.admission_rule)}
        return ModelInfo(self.model_identity, self.adapter.family, adm)

    @property
    def cache_identity(self) -> str:
        """What cache entries are keyed by: the model, and the intra-request cache if one runs (an approximate
        trajectory is reused, and an exact hit returned, only under the same intra-request cache)."""
        spec = self.intra_cache_spec
        return self.model_identity if spec is None else f"{self.model_identity}+intra:{spec.label()}"

    def compat_key(self, req: Request, policy: str | Policy = "carnator") -> str:
        """The key of the entries ``req`` may reuse under ``policy``: model, scheduler, settings, the recall embedder and
        the policy's signature reading (entries read another way are never compared)."""
        from .cache import compat_key

        pol = self.policy(policy) if isinstance(policy, str) else policy
        spec = pol.probe_spec()
        extra = {"embedder": self.embedder_identity, "reading": None if spec is None else spec.reading()}
        return compat_key(self.cache_identity, self.adapter.scheduler_name(), req.settings(), extra=extra)

    def _capture(self, num_steps: int, pol: Policy, store: bool) -> set[int]:
        if not store:
            return set()
        if self.config.capture_steps == "auto":
            return pol.stored_steps(num_steps)
        return denoise.capture_set(self.config.capture_steps, num_steps)

    # ---- generation --------------------------------------------------------------------------
    def resolve(self, prompt: str, *, seed: int, tenant: str = "default", **request: Any) -> Request:
        """The request ``generate`` would run (every setting filled in and checked)."""
        return self.adapter.resolve(prompt, seed=seed, tenant=tenant, **request)

    def is_cached(self, prompt: str, *, seed: int, tenant: str = "default", **request: Any) -> bool:
        """Whether the store holds this exact request (same prompt, seed and settings: ``request`` takes
        :meth:`generate`'s ``negative_prompt``, ``num_inference_steps``, ...), i.e. whether it would be an exact hit."""
        req = self.resolve(prompt, seed=seed, tenant=tenant, **request)
        return self.store.lookup_exact(req.tenant, req.exact_key(self.cache_identity)) is not None

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
        cache: str | None = None,
        decision: Decision | None = None,
        progress: Callable[[int, int], None] | None = None,
        cancel: Callable[[], bool] | None = None,
        events: Callable[[str, dict], None] | None = None,
    ) -> Result:
        """Generate one video; reuse cached work where ``policy`` finds it safe (:meth:`run` of these
        :class:`~carnator.request.Params`).

        ``cache`` says what the request may read from the cache: "reuse" (exact hits and approximate reuse), "exact"
        (exact hits only) or "off" (nothing: the request runs in full as a miss); default: the policy's (``dense``:
        "off"). ``store`` says whether it writes: keep the result for later requests (default; with ``cache="off"``
        this fills a cache). ``cache="off", store=False`` touches no cache at all. ``decision``: a decision to execute instead of the policy's (a replay). ``progress(done,
        total)`` after every denoising step; ``cancel()`` before every step (True stops the request with
        :class:`~carnator.errors.Cancelled`, storing nothing); ``events(kind, data)`` at each stage ("decision").
        Returns a :class:`Result` with ``frames`` (uint8, T x H x W x 3) and ``stats``.
        """
        params = Params(prompt=prompt, seed=seed, policy=policy, negative_prompt=negative_prompt,
                        num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
                        guidance_scale=guidance_scale, tenant=tenant, cache=cache, store=store)
        return self.run(params, decision=decision, progress=progress, cancel=cancel, events=events)

    def run(self, params: Params, *, decision: Decision | None = None, progress: Callable[[int, int], None] | None = None,
            cancel: Callable[[], bool] | None = None, events: Callable[[str, dict], None] | None = None,
            policy: Policy | None = None) -> Result:
        """Generate the video ``params`` asks for (the one entry every caller goes through: :meth:`generate`, the CLI,
        the service's workers and replicas); the hooks as for :meth:`generate`. ``policy``: the instance of the policy
        ``params.policy`` names to run this request by instead of the engine's own (a prepared one, e.g.
        ``engine.policy("carnator").with_disabled(...)``: a replica runs a job by the tiers its ingress disabled). The
        stages, in order: exact -> recall -> probe -> decide -> plan -> denoise -> store (:mod:`carnator.stages`)."""
        if not isinstance(params, Params):
            raise TypeError(f"Carnator.run takes a carnator.request.Params, got {type(params).__name__}")
        if not self.dit:
            raise CarnatorError("this engine was built without its transformer (dit=False): it resolves, checks and "
                                "embeds requests, it does not generate them")
        t_start = time.perf_counter()
        pol = self.policy(params.policy) if policy is None else policy
        if policy is not None and getattr(policy, "name", None) != params.policy:
            raise InvalidRequestError(f"the policy instance given is {getattr(pol, 'name', None)!r}, the request asks "
                                      f"{params.policy!r}")
        mode = pol.default_cache if params.cache is None else params.cache
        if mode not in CACHE_MODES:
            raise InvalidRequestError(f"cache must be one of {', '.join(CACHE_MODES)}, got {params.cache!r}")
        req = self.adapter.resolve(params.prompt, seed=params.seed, **params.settings())
        rs = RequestState(params=params, req=req, policy=pol, mode=mode, exact_key=req.exact_key(self.cache_identity),
                          stats=Stats(policy=params.policy), t_start=t_start, cancel=cancel)
        stats = rs.stats
        if mode != "off":
            t0 = time.perf_counter()
            res = exact_hit(self.store, req, pol, rs.exact_key, stats)
            rs.timed("exact_lookup", t0)
            if res is not None:
                rs.timed("total", t_start)
                return res
        flight: contextlib.AbstractContextManager[bool] = contextlib.nullcontext(False)
        if mode != "off" and params.store and self.config.store_video:
            flight = self.store.single_flight(req.tenant, rs.exact_key)  # the same request elsewhere: wait for its video
        with contextlib.ExitStack() as lease:
            waited = lease.enter_context(flight)
            if waited:
                res = exact_hit(self.store, req, pol, rs.exact_key, stats)
                if res is not None:
                    rs.timed("total", t_start)
                    return res
            with self._serial or contextlib.nullcontext():
                # (a write-behind store takes the lease over: the same request elsewhere waits until it is written)
                return self._generate(rs, decision, progress, events, lease)

    def _generate(self, rs: RequestState, injected: Decision | None, progress: Callable[[int, int], None] | None,
                  events: Callable[[str, dict], None] | None, lease: contextlib.ExitStack | None) -> Result:
        """A request the exact tier did not serve: encode, recall, probe, decide, plan, denoise, decode, store."""
        ad, pol, stats = self.adapter, rs.policy, rs.stats
        # (Engines sharing one adapter may differ in their intra-request cache and CUDA graphs: apply this engine's.)
        intra = ad.use_intra_cache(self.intra_cache_spec)
        ad.use_cuda_graphs(self.cuda_graphs)
        if intra is not None:
            intra.start_request()  # diffusers resets hook state at the end of a pipeline call; we drive the loop, so here
        self._encode(rs, progress)
        self._recall(rs, injected)
        self._probe(rs)

        t0 = time.perf_counter()
        dec = decide(rs, injected=injected, allow_uncertified=self.config.allow_uncertified)
        rs.timed("decision", t0)
        if events:
            events("decision", {"reuse": dec.reuse, "source_id": dec.source_id, "reason": dec.reason})

        t0 = time.perf_counter()
        plan_, program = plan(rs, ad, self.store)
        dec = rs.decision or dec
        if plan_.hit:
            rs.timed("plan", t0)
        stats.hit, stats.source_id, stats.reason = plan_.hit, plan_.source_id, dec.reason
        stats.resume_step = plan_.resume_step if plan_.hit else None
        stats.certified = dec.certified if plan_.hit else None
        stats.notes.update(_notes(dec))
        if plan_.hit and dec.certified is not True and f"uncertified:{pol.name}" not in self._warned:
            self._warned.add(f"uncertified:{pol.name}")  # said once per engine and policy; every such hit has certified False
            log.warning("approximate reuse under policy %s rests on uncertified thresholds (%s); its hits are marked "
                        "certified: false. Certify them for this model: carnator calibrate (docs/CALIBRATION.md)",
                        pol.name, getattr(pol, "thresholds_source", "no thresholds file"))

        video, frames = self._denoise(rs, intra)

        if rs.params.store:
            t0 = time.perf_counter()
            if self.write_behind:
                self._write_behind(lease.pop_all() if lease is not None else None, rs, frames)
            else:
                self._store(rs, frames)
            rs.timed("store", t0)
        if plan_.hit and plan_.source_id is not None:
            self.store.touch(plan_.source_id)
        rs.timed("total", rs.t_start)
        return Result(frames=frames, stats=stats, request=rs.req, video=video)

    # ---- the stages' engine side: what they need of the model, the text lock and the threads ----------------------
    def _encode(self, rs: RequestState, progress: Callable[[int, int], None] | None) -> None:
        """The text conditioning, the fresh denoising state, and the captured steps."""
        t0 = time.perf_counter()
        with self._text_lock:
            rs.cond = self.adapter.encode(rs.req)
        rs.denoise = denoise.start(self.adapter, rs.req)
        rs.timed("encode", t0)
        n = rs.state.num_steps
        rs.capture = self._capture(n, rs.policy, rs.params.store)
        rs.progress = (lambda i: progress(i + 1, n)) if progress else None

    def _recall(self, rs: RequestState, injected: Decision | None) -> None:
        """What the policy needs (nouns, word positions, block-mask capture: the :class:`DecisionInputs`), why it runs
        densely if it must, and the recalled candidates, with a read of the first one's tensors started."""
        ad, pol, req, state, n = self.adapter, rs.policy, rs.req, rs.state, rs.state.num_steps
        spec = pol.probe_spec()
        needs_attention = spec is not None or pol.needs_attention
        if needs_attention and not ad.supports_attention:
            rs.fallback = f"{pol.name} needs attention processors, not yet available for {ad.family}"
            if pol.name not in self._warned:
                log.warning("%s: generating densely", rs.fallback)
                self._warned.add(pol.name)
        elif spec is not None and n <= spec.steps:
            rs.fallback = f"{n} steps <= the {spec.steps}-step probe"
        if needs_attention and rs.fallback is None:
            ad.ensure_attention()
        nouns = tuple(self.nouns(req.prompt))
        content = tuple(self.content(req.prompt))
        words = pol.words(req.prompt, nouns) if rs.fallback is None else ()
        with self._text_lock:
            word_positions = {w: tuple(ad.word_token_positions(req.prompt, w)) for w in words}
        sparse = None
        sc = pol.sparse_config() if rs.fallback is None else None
        grid = ad.token_grid(req)
        if sc is not None:
            sc = sc.for_tokens(int(np.prod(grid)))
            sparse = sc if sc.applies(state.latents.device) else None
        inputs = DecisionInputs(request=req, num_steps=n, grid=grid, num_layers=ad.num_layers(), nouns=nouns,
                                word_positions=word_positions, sparse=sparse, reuse=rs.mode == "reuse", content=content)
        rs.compat_key = self.compat_key(req, pol)
        if rs.mode == "reuse" and rs.fallback is None and pol.recall_k() > 0:
            t0 = time.perf_counter()
            by_content = content_key(content) if pol.recall_by_content() else None
            if by_content is not None and not pol.recall_by_sentence() and hasattr(self.store, "same_content"):
                # the embedding is computed only to store the entry (on the writer thread with write-behind)
                found = recall_content(self.store, req.tenant, rs.compat_key, by_content, pol.recall_k())
            else:
                rs.embedding = self.embed(req.prompt)
                near = near_keys(self.content, content, pol.recall_near()) if by_content is not None else []
                found = recall(self.store, req.tenant, rs.compat_key, rs.embedding, pol.recall_k(), content_key=by_content,
                               near_keys=near)
            inputs = dataclasses.replace(inputs, candidates=found)
            rs.timed("recall", t0)
        rs.inputs = inputs
        rs.prefetched = self._prefetch(pol.prefetch(inputs)) if inputs.candidates and injected is None else None
        if spec is not None and rs.fallback is None \
                and not (pol.probe_needed(inputs) if injected is None else pol.plan_reads_probe(injected)):
            spec = None  # the probe cannot change this decision (or an injected one's plan): the request runs its steps as dense does
            rs.stats.notes["probe"] = "skipped"
        rs.spec = spec if rs.fallback is None else None

    def _probe(self, rs: RequestState) -> None:
        """The policy's dense probe and the signature read from it, into the inputs (none when it needs none)."""
        spec, ad, req = rs.spec, self.adapter, rs.req
        if spec is None:
            return
        assert rs.cond is not None
        t0 = time.perf_counter()
        with self._text_lock:
            positions = {w: tuple(ad.word_token_positions(req.prompt, w, spec.modifiers)) for w in rs.decision_inputs.nouns}
        ev = probe(ad, rs.state, rs.cond, req, spec, positions, capture=rs.capture, sparse=rs.decision_inputs.sparse,
                   progress=rs.progress, cancel=rs.cancel)
        rs.timed("probe", t0)
        t0 = time.perf_counter()
        sig, regions = read_signature(ad, rs.state, req, ev, spec)
        rs.timed("signature", t0)
        rs.inputs = dataclasses.replace(rs.decision_inputs, signature=sig, regions=regions)

    def _denoise(self, rs: RequestState, intra: Any) -> tuple[np.ndarray, np.ndarray]:
        """The plan's steps (the program bound to the source), then the decode: (float video, uint8 frames)."""
        ad, state, stats, tm = self.adapter, rs.state, rs.stats, rs.stats.timings
        program, plan_, cond = rs.program, rs.plan, rs.cond
        assert program is not None and plan_ is not None and cond is not None, "plan runs first"
        n = state.num_steps
        dit_before = state.dit_seconds
        denoise.run_steps(ad, state, cond, rs.req, program=program, capture=rs.capture, progress=rs.progress,
                          cancel=rs.cancel)
        tm["dit"] = state.dit_seconds
        tm["dit_after_plan"] = state.dit_seconds - dit_before
        stats.dit_forwards = state.dit_forwards
        stats.dense_forwards = n * (2 if cond.do_cfg else 1)
        stats.active_fraction = program.active_fraction
        stats.mask_density = program.mask_density
        if program.localized is not None and plan_.region is not None and plan_.region.recorded is not None:
            stats.notes["localized"] = bool(program.localized)
        if intra is not None:
            stats.notes["intra_cache"] = intra.summary()
            intra.end()
        if not bool(torch.isfinite(state.latents).all()):
            raise GenerationError("the model produced non-finite values (NaN or inf) for this request; nothing was stored "
                                  "(try a smaller guidance_scale)")
        t0 = time.perf_counter()
        with ad.vae_lock:
            video = ad.decode(state.latents, rs.req)
        frames = to_uint8(video)
        rs.timed("decode", t0)
        return video, frames

    def _store(self, rs: RequestState, frames: np.ndarray) -> None:
        store(rs, frames, cache=self.store, embed=self.embed, judge=self._judge, admission_rule=self.config.admission_rule,
              latent_dtype=self.config.latent_dtype, store_video=self.config.store_video)

    def _write_behind(self, release: contextlib.ExitStack | None, rs: RequestState, frames: np.ndarray) -> None:
        """Queue :meth:`_store` of a finished request on the writer thread; ``release`` (the request's
        single-flight lease) is closed when the write ends. At most :data:`MAX_PENDING_WRITES` writes wait: each holds its request's latents,
        so a writer that falls behind makes the next request wait instead of memory growing."""

        def write() -> None:
            try:
                self._store(rs, frames)
            finally:
                if release is not None:
                    release.close()

        with self._lock:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carnator-store")
            self._pending = [(s, f) for s, f in self._pending if not f.done()]
            oldest = self._pending[0][1] if len(self._pending) >= MAX_PENDING_WRITES else None
        if oldest is not None:
            futures.wait([oldest])
        fut = self._writer.submit(write)
        fut.add_done_callback(_log_write_error)
        with self._lock:
            self._pending.append((rs.stats, fut))

    def flush(self, result: Result | None = None) -> None:
        """Wait until the write-behind stores (``EngineConfig.write_behind``) have ended: ``result``'s own (its
        ``stats.entry_id`` is then set), or every one queued so far. A write's failure is logged, never raised here."""
        with self._lock:
            wait = [f for s, f in self._pending if result is None or s is result.stats]
        futures.wait(wait)
        with self._lock:
            self._pending = [(s, f) for s, f in self._pending if not f.done()]

    def _prefetch(self, what: tuple[str, list[str] | None] | None) -> tuple[str, Future] | None:
        """Read a candidate's tensors in a background thread while the probe runs."""
        if what is None:
            return None
        entry_id, names = what
        with self._lock:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carnator-prefetch")
        return entry_id, self._loader.submit(self._load_quietly, entry_id, names)

    def _load_quietly(self, entry_id: str, names: list[str] | None) -> dict[str, torch.Tensor] | None:
        try:
            return self.store.load(entry_id, names)
        except KeyError:  # names the entry never had: read what it has
            return self.store.load(entry_id)


def _notes(dec: Decision) -> dict[str, Any]:
    """The decision's JSON-able evidence for ``Stats.notes``."""
    out = {}
    for k, v in dec.details.items():
        try:
            json.dumps(v)
        except TypeError:
            continue
        out[k] = v
    if dec.similarity is not None:
        out.setdefault("similarity", float(dec.similarity))
    return out


def _device_type(module: Any) -> str | None:
    p = next(iter(module.parameters()), None) if isinstance(module, torch.nn.Module) else None
    return None if p is None else p.device.type


def _meta_components(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The pipeline's components ``names``, each built from its config on the meta device (no weights read)."""
    index = json.loads((path / "model_index.json").read_text())
    out: dict[str, Any] = {}
    for name in names:
        lib, klass = (index.get(name) or (None, None))[:2]
        if lib is None or klass is None:
            continue
        with torch.device("meta"):
            if lib == "diffusers":
                import diffusers

                cls_ = getattr(diffusers, klass)
                out[name] = cls_.from_config(cls_.load_config(str(path / name)))
            elif lib == "transformers":
                import transformers

                cls_ = getattr(transformers, klass)
                out[name] = cls_(transformers.AutoConfig.from_pretrained(str(path / name), local_files_only=True))
    return out


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
    from .backbones.registry import supported_pipelines

    if not isinstance(class_name, str) or class_name not in supported_pipelines():
        raise ModelLoadError(f"unsupported pipeline class {class_name}; supported: {', '.join(supported_pipelines())}")
    return class_name


def _open_store(cache_dir: str | os.PathLike | CacheStore | None, config: EngineConfig,
                blobs: str | os.PathLike | None = None) -> CacheStore:
    from .cache import open_store

    if cache_dir is None or isinstance(cache_dir, (str, os.PathLike)):
        store = open_store(cache_dir, blobs=blobs)
    else:
        store = cache_dir
    settings = {k: v for k, v in (("capacity_bytes", config.capacity_bytes), ("eviction", config.eviction),
                                  ("tenant_quota_bytes", config.tenant_quota_bytes)) if v is not None}
    if settings:
        store.configure(**settings)  # the cache's own settings, for every process that opens it
    return store


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


_first_line = first_line


#: write-behind stores that may wait at once (:meth:`Carnator._write_behind`)
MAX_PENDING_WRITES = 2


def _log_write_error(fut: Future) -> None:
    exc = fut.exception()
    if exc is not None:
        log.error("a write-behind store failed: %s", _first_line(exc), exc_info=exc)
