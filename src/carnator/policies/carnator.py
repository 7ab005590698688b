"""``carnator``: compatibility-guided cross-request reuse (PAPER steps 1-10).

recall (text index + noun filter) -> dense probe of the first steps, recording attention evidence
-> Evidence Regions + Early Signature -> compatibility test against the recalled entries ->
ReusePlan: resume from the winner's latent, blend outside the target region, recompute only
Active tokens in the middle layers, and attend only where the winner's block masks allow.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..attention.blockmask import BlockMaskSet
from ..attention.controller import SparseConfig, WindowPlan
from ..denoise import StepHooks
from ..errors import CarnatorError
from ..reuse import CompatConfig, ScopeConfig, Thresholds, compatible, discrepancies, noun_diff, reuse_scope
from ..signature import EarlySignature, RegionConfig, early_signature, evidence_region, select_seeds
from ..signature.nouns import extract_nouns
from .base import Plan, Policy, register_policy

log = logging.getLogger("carnator")

MASK_PREFIX = "attn."
EVIDENCE_PREFIX = "evidence."


@dataclass
class CarnatorConfig:
    """Every knob of the method. Paper values are marked; others are chosen defaults (docs/METHOD.md).

    top_k: recalled candidates (paper: 10). probe_steps: dense probe steps (paper: 4).
    tested: how many of the recalled candidates that pass the noun filter the compatibility test tries, in
        recall order, the first compatible winning (paper: all; None = all). Thresholds are calibrated on one
        (query, cached request) pair at a time, and every further candidate tried is one more chance for an
        incompatible one to pass them (session 6, docs/RESULTS.md).
    probe_layer: layer whose attention is read (paper: not given; None = the middle layer).
    modifiers: each noun's evidence is read from its own tokens plus those of up to this many words modifying it
        ("big red ball": 2), found by :func:`~carnator.signature.nouns.noun_phrase_spans` (paper: the noun's
        tokens, 0). Chosen default 1: on the embedded model it reads the objects better (IoU 0.331 vs 0.291, colour
        57 % vs 46 %; 2 and 3 the same; docs/PROBE.md, session 10), every signature dimension separates calibration
        pairs better (docs/RESULTS.md, session 10), and the shipped thresholds are calibrated with it (session 11).
    resume_step: first step taken from the cached trajectory (paper: not given; 30 of 50 chosen by the
        session-6 sweep on the embedded world, docs/METHOD.md).
    window: fraction of layers [start, end) where only Active tokens are recomputed (paper: 6..25 of
        30 layers is the knee, i.e. (0.2, 0.867)).
    sparse: capture of this request's block masks and reuse of the source's (PAPER step 9); ``sparse.apply``
        says where ("auto": only where a block-sparse kernel makes them save time).
    thresholds: a threshold file from ``carnator calibrate``; None = the shipped file for the
        embedded model if it matches, else the paper's tau.
    prefetch: read the first recalled candidate's entry from the bank in a background thread while the probe
        runs, so that a hit on it does not wait for the disk (a miss discards it). Not in the paper; chosen
        default on (docs/BENCHMARKS.md, session 8).
    """

    top_k: int = 10
    tested: int | None = 1
    probe_steps: int = 4
    probe_layer: int | None = None
    modifiers: int = 1
    resume_step: int = 30
    window: tuple[float, float] = (0.2, 0.867)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    thresholds: str | None = None
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.modifiers < 0:
            raise ValueError(f"CarnatorConfig.modifiers must be >= 0, got {self.modifiers}")
        if self.tested is not None and self.tested < 1:
            raise ValueError(f"CarnatorConfig.tested must be >= 1 or None (all), got {self.tested}")
        # Nested settings may come as plain dicts (EngineConfig.policy_options read from JSON or a CLI).
        for name, klass in (("sparse", SparseConfig), ("region", RegionConfig), ("scope", ScopeConfig), ("compat", CompatConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, klass(**value))


@register_policy
class CarnatorPolicy(Policy):
    name = "carnator"

    def __init__(self, config: CarnatorConfig | None = None, **overrides):
        self.cfg = config or CarnatorConfig(**overrides)
        self._tau: Thresholds | None = None
        self._loader: ThreadPoolExecutor | None = None

    # ---- thresholds -----------------------------------------------------------------------------
    def reading(self) -> dict:
        """The settings that shape this policy's signatures and so the discrepancies its thresholds apply to; a
        thresholds file records them (``Thresholds.save(reading=...)``) and loads only for a policy that reads alike."""
        c = self.cfg
        return {"probe_steps": c.probe_steps, "probe_layer": c.probe_layer, "modifiers": c.modifiers, "region": asdict(c.region)}

    def thresholds(self, engine) -> Thresholds:
        if self._tau is None:
            path = self.cfg.thresholds
            if path is not None:
                self._tau = Thresholds.load(path, model_id=engine.model_identity, reading=self.reading())
                return self._tau
            shipped = Path(__file__).resolve().parent.parent / "embedded" / "thresholds.json"
            self._tau = Thresholds()
            if engine.adapter.family == "embedded" and shipped.exists():
                try:
                    self._tau = Thresholds.load(shipped, model_id=engine.model_identity, reading=self.reading())
                except CarnatorError as e:  # the shipped file does not fit this configuration: the paper's values
                    log.warning("%s; using the paper's thresholds", e)
        return self._tau

    # ---- the stages -------------------------------------------------------------------------------
    def recall(self, ctx, nouns: list[str]):
        """Top-K by recall embedding within the request's key and tenant, then the noun filter."""
        hits = ctx.recall(self.cfg.top_k)
        out = []
        for meta, score in hits:
            diff = noun_diff(nouns, meta.extra.get("nouns", []))
            if diff is not None and "signature" in meta.extra:
                out.append((meta, score, diff))
        return out

    def probe(self, ctx, nouns: list[str]):
        """Run the first steps densely, recording evidence at the last probe step."""
        ad, req = ctx.adapter, ctx.request
        ctrl = ad.attention()
        positions = {n: ad.word_token_positions(req.prompt, n, self.cfg.modifiers) for n in nouns}
        ctrl.record_positions = sorted({p for ps in positions.values() for p in ps})
        ctrl.record_step = self.cfg.probe_steps - 1
        ctrl.record_layer = self.cfg.probe_layer if self.cfg.probe_layer is not None else ad.num_layers() // 2
        ctx.run_steps(self.cfg.probe_steps)
        ctrl.record_step = None
        return positions, ctrl.evidence

    def signature(self, ctx, positions: dict[str, list[int]], ev) -> tuple[EarlySignature, dict[str, np.ndarray]]:
        ad, req, st = ctx.adapter, ctx.request, ctx.state
        grid = ad.token_grid(req)
        regions = {}
        for noun, pos in positions.items():
            if not pos or ev is None or ev.cross is None:
                regions[noun] = np.zeros(grid, dtype=bool)
                continue
            cols = [ev.positions.index(p) for p in pos]
            C = ev.cross[:, :, cols].float().mean(dim=(0, 2)).cpu().numpy()
            seeds = select_seeds(C, grid, self.cfg.region)
            reg = evidence_region(C, ev.self_attention_columns, seeds, grid, self.cfg.region)
            regions[noun] = reg.mask
        x0 = ad.predicted_x0(st.last_input, st.last_prediction, self.cfg.probe_steps - 1)
        tail = ad.decode_tail(x0, req)
        return early_signature(regions, tail), regions

    def decide(self, ctx, sig: EarlySignature, candidates):
        tau = self.thresholds(ctx.engine)
        for meta, score, diff in candidates[: self.cfg.tested]:
            try:
                sig_j = EarlySignature.from_dict(meta.extra["signature"])
            except (ValueError, KeyError, TypeError):
                continue
            d = discrepancies(sig, sig_j, diff, self.cfg.compat, similarity=score)
            if compatible(d, tau):
                return meta, diff, d
        return None

    # ---- plan ---------------------------------------------------------------------------------------
    def plan(self, ctx) -> Plan:
        cfg, ad, req, tm = self.cfg, ctx.adapter, ctx.request, ctx.timings
        if not ad.supports_attention:
            if not getattr(self, "_warned", False):
                log.warning("carnator's attention processors are not yet available for %s: generating densely", ad.family)
                self._warned = True
            return Plan(hit=False, notes={"fallback": "dense"})
        if ctx.state.num_steps <= cfg.probe_steps:  # no step left after the probe: nothing to read or to reuse
            return Plan(hit=False, notes={"fallback": "dense", "reason": f"{ctx.state.num_steps} steps <= the {cfg.probe_steps}-step probe"})
        ctrl = ad.attention()
        sparse = cfg.sparse.for_tokens(int(np.prod(ad.token_grid(req))))
        ctrl.sparse = sparse if sparse.applies(ctx.state.latents.device) else None
        nouns = extract_nouns(req.prompt)

        t0 = time.perf_counter()
        candidates = self.recall(ctx, nouns)
        tm["recall"] = time.perf_counter() - t0
        # Read the first candidate's entry beside the probe, unless its text distance alone already fails the test.
        prefetched = None
        if candidates and cfg.prefetch and 1.0 - candidates[0][1] <= self.thresholds(ctx.engine).text:
            prefetched = self._prefetch(ctx, candidates[0][0].id)

        t0 = time.perf_counter()
        positions, ev = self.probe(ctx, nouns)
        tm["probe"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        sig, regions = self.signature(ctx, positions, ev)
        ctrl.evidence = None
        tm["signature"] = time.perf_counter() - t0

        extra = {"nouns": nouns, "signature": sig.to_dict()}
        ev_tensors = {EVIDENCE_PREFIX + n: torch.from_numpy(m.astype(np.uint8)) for n, m in regions.items()}
        t0 = time.perf_counter()
        won = self.decide(ctx, sig, candidates) if candidates else None
        tm["decision"] = time.perf_counter() - t0
        # The request's own signature goes into its stats too: why it hit or missed can be read, and calibration
        # rows keep it, so that another discrepancy definition can be evaluated without generating again.
        notes = {"candidates": len(candidates), "signature": extra["signature"]}
        miss = Plan(hit=False, entry_extra=extra, entry_tensors=ev_tensors, notes=dict(notes))
        if won is None:
            return miss

        t0 = time.perf_counter()
        plan = self._reuse_plan(ctx, won, regions, prefetched)
        tm["plan"] = time.perf_counter() - t0
        if plan is None:
            return miss
        plan.entry_extra, plan.entry_tensors = extra, ev_tensors
        plan.notes.update(notes)
        return plan

    def _prefetch(self, ctx, entry_id: str) -> tuple[str, Future]:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carnator-prefetch")
        return entry_id, self._loader.submit(ctx.bank.load, entry_id)

    def _reuse_plan(self, ctx, won, regions, prefetched: tuple[str, Future] | None = None) -> Plan | None:
        cfg, ad, req, st = self.cfg, ctx.adapter, ctx.request, ctx.state
        meta, diff, d = won
        r = self.resume_at()
        n = st.num_steps
        if r >= n:
            return None
        if prefetched is not None and prefetched[0] == meta.id:
            tensors = prefetched[1].result()  # the bank's own errors surface here as they would from load()
        else:
            tensors = ctx.bank.load(meta.id)
        grid = ad.token_grid(req)
        need = [f"traj.{i}" for i in range(r - 1, n)]
        if tensors is None or any(k not in tensors for k in need):
            log.info("entry %s lacks the trajectory for resume step %d: miss", meta.id, r)
            return None
        traj = {i: tensors[f"traj.{i}"] for i in range(r - 1, n)}
        if tuple(traj[r - 1].shape) != tuple(st.latents.shape):
            return None
        # Target region: the query's region of the substituted noun and the source's region of its
        # noun (so the old object is recomputed, not kept as a ghost); with no substitution, every noun's.
        src_regions = {k[len(EVIDENCE_PREFIX):]: v.bool().numpy() for k, v in tensors.items() if k.startswith(EVIDENCE_PREFIX)}
        if diff.substituted is not None:
            oq, oj = diff.substituted
            ev = [regions.get(oq), src_regions.get(oj)]
        else:
            ev = list(regions.values()) + list(src_regions.values())
        ev = [m for m in ev if m is not None and m.shape == tuple(grid)]
        if not ev:
            return None
        scope = reuse_scope(ev, cfg.scope)
        W = ad.latent_weight(scope.weight, st.latents)
        dev = st.latents.device

        def after_step(i: int, state) -> torch.Tensor:
            z_c = traj[i].to(dev, state.latents.dtype)
            return W * state.latents + (1 - W) * z_c

        ctrl = ad.attention()
        ctrl.window = WindowPlan.over(cfg.window, ad.num_layers(), scope.active, scope.context)
        density = None
        if ctrl.sparse is not None:  # masks apply here (SparseConfig.apply)
            try:
                masks = BlockMaskSet.from_tensors(tensors, MASK_PREFIX)
                if masks.q_len == int(np.prod(grid)):
                    ctrl.use_masks(masks, dev)
                    density = masks.density
            except (KeyError, ValueError):
                ctrl.use_masks(None)
        return Plan(
            hit=True, source_id=meta.id, resume_step=r, init_latents=traj[r - 1], hooks=StepHooks(after_step=after_step),
            active_fraction=float(scope.active.mean()), mask_density=density,
            notes={"discrepancies": {k: (None if v is None else float(v)) for k, v in vars(d).items()}},
        )

    def resume_at(self) -> int:
        """The step a reuse resumes at: the resume step, never inside the probe."""
        return max(self.cfg.resume_step, self.cfg.probe_steps)

    def stored_steps(self, num_steps: int) -> set[int]:
        # A reuse resumes at r and blends with the source's latents after every later step: traj.{r-1} .. traj.{n-1}.
        return set(range(self.resume_at() - 1, num_steps))

    def entry_tensors(self, ctx) -> dict[str, torch.Tensor]:
        if not ctx.adapter.supports_attention:
            return {}
        ctrl = ctx.adapter.attention()
        return ctrl.captured.to_tensors(MASK_PREFIX) if ctrl.captured is not None else {}
