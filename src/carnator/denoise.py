"""The one denoising loop. It executes; it never decides.

A :class:`DenoiseState` holds one request's progress: its latent, its own scheduler (multistep solvers keep history
between steps, so no two requests share one), the captured trajectory and its :class:`AttentionSession`.
:func:`run_steps` advances it through a range of steps; before each transformer forward it enters
:func:`~carnator.attention.state.attention_step` with the step's :class:`~carnator.attention.state.AttentionPlan`.

What a step does differently comes from a :class:`Program`: :meth:`Program.probe` for the dense probe (record the
evidence at its last step), :meth:`Program.bind` for a :class:`~carnator.plan.ReusePlan` bound to the source tensors
it reads (start latent, blend latents, regions, block masks). Nothing here is a closure a policy wrote: a plan is data,
and this module is the only code that turns it into steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .attention.state import IDLE, AttentionPlan, AttentionSession, RecordSpec, SparseConfig, WindowPlan, attention_step
from .backbones.base import BackboneAdapter, Conditioning
from .errors import Cancelled
from .plan import Phase, RegionSpec, ReusePlan
from .request import Request

if TYPE_CHECKING:
    from .attention.blockmask import BlockMaskSet

log = logging.getLogger("carnator")

__all__ = ["DenoiseState", "Program", "capture_set", "run_steps", "start"]


@dataclass
class DenoiseState:
    """One request's progress through the schedule."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    generator: torch.Generator
    scheduler: Any  # a diffusers scheduler (untyped)
    next_step: int = 0
    trajectory: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> post-scheduler latent (CPU, float32)
    dit_forwards: int = 0
    dit_seconds: float = 0.0
    #: input latent and guided prediction of the last step run (a probe reads its x0 estimate)
    last_input: torch.Tensor | None = None
    last_prediction: torch.Tensor | None = None
    attention: AttentionSession = field(default_factory=AttentionSession)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def capture_set(spec: str | Iterable[int] | None, num_steps: int) -> set[int]:
    """Which post-scheduler latents to keep: "all", "none"/None, or an iterable of step indices."""
    if spec is None or spec == "none":
        return set()
    if spec == "all":
        return set(range(num_steps))
    return {int(s) for s in spec if 0 <= int(s) < num_steps}


def start(adapter: BackboneAdapter, req: Request) -> DenoiseState:
    """Fresh state: the seed's initial noise and a scheduler of the request's own."""
    gen = adapter.make_generator(req)
    sched = adapter.new_scheduler()
    ts = adapter.timesteps(sched, req)
    lat = adapter.prepare_latents(req, gen)
    return DenoiseState(latents=lat, timesteps=ts, generator=gen, scheduler=sched)


def resume(adapter: BackboneAdapter, state: DenoiseState, latent: torch.Tensor, step: int) -> None:
    """Continue ``state`` from ``latent`` (a cached post-scheduler latent after step ``step - 1``) at ``step``."""
    state.latents = latent.to(state.latents.device, state.latents.dtype)
    state.next_step = int(step)
    adapter.seek(state.scheduler, state.next_step)


def own_sample_latent(adapter: BackboneAdapter, state: DenoiseState, req: Request, latent: torch.Tensor,
                      clean: torch.Tensor, step: int, mix: float) -> torch.Tensor:
    """The start latent of a hit that keeps the request's own sample, for flow-matching schedulers.

    ``latent`` is the source's latent entering ``step`` (at noise level ``s = sigmas[step]``) and ``clean`` its final
    latent ``x0``. The source's latent is ``(1 - s) x0 + s e_src``, so ``e_src`` follows; the result is
    ``(1 - s) x0 + s (mix e_req + sqrt(1 - mix^2) e_src)`` with ``e_req`` the request's own seed noise: ``mix`` 0
    gives the source's latent back, 1 the exact state of a flow-matching trajectory through ``x0`` with the request's
    noise."""
    sigma = float(state.scheduler.sigmas[step])
    dev = state.latents.device
    z, x0 = latent.to(dev, torch.float32), clean.to(dev, torch.float32)
    e_src = (z - (1.0 - sigma) * x0) / max(sigma, 1e-6)
    e_req = adapter.prepare_latents(req, adapter.make_generator(req)).to(dev, torch.float32)
    mix = float(mix)
    e = mix * e_req + float(np.sqrt(max(0.0, 1.0 - mix * mix))) * e_src
    return ((1.0 - sigma) * x0 + sigma * e).to(state.latents.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Program:
    """What applies at each step of one request: attention plans (record, capture, masks, window, amplification) and
    the latent blend. Built by :meth:`probe` or :meth:`bind`; stateless between requests."""

    def __init__(self, *, capture: SparseConfig | None = None, record_step: int | None = None, record: RecordSpec | None = None,
                 phases: tuple[Phase, ...] = (), masks: BlockMaskSet | None = None, blend_latents: Mapping[int, torch.Tensor] | None = None,
                 region: "_Region | None" = None):
        self.capture = capture
        self.record_step, self.record = record_step, record
        self.phases = tuple(sorted(phases, key=lambda p: p.start))
        self.masks = masks
        self.blend_latents = dict(blend_latents or {})
        self.region = region

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def probe(cls, steps: int, record: RecordSpec, capture: SparseConfig | None) -> Program:
        """The dense probe: record ``record`` at the last of ``steps``; capture block masks as the request does."""
        return cls(capture=capture, record_step=steps - 1, record=record)

    @classmethod
    def bind(cls, plan: ReusePlan, adapter: BackboneAdapter, req: Request, state: DenoiseState,
             tensors: Mapping[str, torch.Tensor]) -> Program | None:
        """``plan`` bound to the source tensors it reads (``tensors``: by name, from the store), or None when the
        source cannot serve it (a latent missing or of another shape, no region at all, masks that a plan requires
        missing): the request then misses."""
        record_step = record = None
        if plan.record is not None:
            record_step, layer, positions = plan.record
            record = RecordSpec(layer, tuple(positions), self_attention=False)
        if not plan.hit:
            return cls(capture=plan.capture, record_step=record_step, record=record)
        if plan.init_latent is not None:
            z = tensors.get(plan.init_latent)
            if z is None or tuple(z.shape) != tuple(state.latents.shape):
                log.info("entry %s lacks %s (or holds another shape): miss", plan.source_id, plan.init_latent)
                return None
        blend = {}
        for i in plan.blend_steps():
            z = tensors.get(f"traj.{i}")
            if z is None:
                log.info("entry %s lacks the trajectory for step %d: miss", plan.source_id, i)
                return None
            blend[i] = z
        masks = None
        if plan.mask_prefix is not None:
            masks = _masks(tensors, plan.mask_prefix, int(np.prod(adapter.token_grid(req))))
            if masks is None and plan.require_masks:
                return None
            if masks is not None:
                state.attention.preload(masks, state.latents.device)
        region = None
        if plan.region is not None:
            region = _Region(plan.region, adapter, req, tensors, plan.window_layers, (record_step, None if record is None else record.layer))
            if region.unusable:
                return None
        return cls(capture=plan.capture, record_step=record_step, record=record, phases=plan.phases, masks=masks,
                   blend_latents=blend, region=region)

    # ---- what the loop asks -------------------------------------------------------------------------------
    def phase(self, step: int) -> Phase | None:
        for p in self.phases:
            if p.start <= step < p.stop:
                return p
        return None

    def attention(self, step: int) -> AttentionPlan:
        """The attention plan of ``step``."""
        c = self.capture
        capture = c if c is not None and step % c.stride == 0 and (c.steps == "all" or step in c.steps) else None
        record = self.record if step == self.record_step else None
        p = self.phase(step)
        masks = window = amplify = None
        if p is not None:
            masks = self.masks if p.masks else None
            window = self.region.window if (p.window and self.region is not None and self.region.ready) else None
            amplify = p.amplify if p.amplify is not None and p.amplify.active else None
        if record is None and capture is None and masks is None and window is None and amplify is None:
            return IDLE
        return AttentionPlan(record=record, capture=capture, masks=masks, window=window, amplify=amplify)

    def after_step(self, step: int, state: DenoiseState) -> torch.Tensor | None:
        """The latent after ``step``'s scheduler step: blended with the source's where the plan says, else None."""
        p = self.phase(step)
        if p is None or not p.blend:
            return None
        r = self.region
        assert r is not None and self.blend_latents is not None, "a blend phase comes with its region and latents"
        if not r.ready:
            r.resolve_recorded(state)
        W = r.latent_weight(state.latents)
        z_c = self.blend_latents[step].to(state.latents.device, state.latents.dtype)
        return W * state.latents + (1 - W) * z_c

    # ---- what the run reports -----------------------------------------------------------------------------
    @property
    def active_fraction(self) -> float | None:
        return None if self.region is None or not self.region.ready else self.region.active_fraction

    @property
    def mask_density(self) -> float | None:
        return None if self.masks is None else self.masks.density

    @property
    def localized(self) -> bool | None:
        return None if self.region is None else self.region.localized


def _masks(tensors: Mapping[str, torch.Tensor], prefix: str, n_tokens: int) -> BlockMaskSet | None:
    from .attention.blockmask import BlockMaskSet

    try:
        masks = BlockMaskSet.from_tensors(tensors, prefix)
    except (KeyError, ValueError):
        return None
    return masks if masks.q_len == n_tokens else None


class _Region:
    """A plan's :class:`RegionSpec` made concrete: the union of its masks, the reuse scope (Active, Context, blend
    weight W) and the window plan; resolved at once, or after the record step for recorded regions."""

    def __init__(self, spec: RegionSpec, adapter: BackboneAdapter, req: Request, tensors: Mapping[str, torch.Tensor],
                 window_layers: tuple[float, float] | None, record_at: tuple[int | None, int | None]):
        self.spec, self.adapter = spec, adapter
        self.grid: tuple[int, int, int] = adapter.token_grid(req)
        self.window_layers = window_layers
        self.record_at = record_at  # (step, layer) of the record recorded regions read
        self.tensors = tensors
        self.masks = [m for m in spec.masks if m is not None and tuple(m.shape) == self.grid]
        for name in spec.source_masks:
            t = tensors.get(name)
            if t is not None and tuple(t.shape) == self.grid:
                self.masks.append(t.bool().numpy())
        self.ready = False
        self.unusable = False
        self.localized: bool | None = None
        self.window: WindowPlan | None = None
        self._W: torch.Tensor | None = None
        if spec.recorded is None:
            self._finish()

    def resolve_recorded(self, state: DenoiseState) -> None:
        """Read the recorded regions (the record at ``record_at``) and the source's stored responses."""
        from .reuse import cross_attention_region

        rec = self.spec.recorded
        assert rec is not None, "only a region of recorded masks resolves them"
        step, layer = self.record_at
        ev = None if step is None or layer is None else state.attention.record.evidence.get((step, layer))
        n = int(np.prod(self.grid))
        if ev is not None and ev.cross is not None:
            for positions in rec.positions:
                cols = [ev.positions.index(p) for p in positions if p in ev.positions]
                if cols:
                    resp = ev.cross[:, :, cols].float().mean(dim=(0, 2))
                    self.masks.append(cross_attention_region(resp, self.grid, rec.high, rec.low, rec.connectivity))
        for name in rec.source_responses:
            resp = self.tensors.get(name)
            if resp is not None and resp.numel() == n:
                self.masks.append(cross_attention_region(resp, self.grid, rec.high, rec.low, rec.connectivity))
        self._finish()

    def _finish(self) -> None:
        from .attention.state import WindowPlan
        from .reuse import reuse_scope

        self.localized = any(m.any() for m in self.masks)
        if not self.localized and self.spec.everywhere_if_empty:
            masks = [np.ones(self.grid, dtype=bool)]
        elif not self.masks:
            self.unusable = True
            return
        else:
            masks = self.masks
        scope = reuse_scope(masks, self.spec.scope)
        self.scope = scope
        self.active_fraction = float(scope.active.mean())
        if self.window_layers is not None:
            self.window = WindowPlan.over(self.window_layers, self.adapter.num_layers(), scope.active, scope.context)
        self.ready = True

    def latent_weight(self, latents: torch.Tensor) -> torch.Tensor:
        if self._W is None:
            self._W = self.adapter.latent_weight(self.scope.weight, latents)
        return self._W


def run_steps(
    adapter: BackboneAdapter,
    state: DenoiseState,
    cond: Conditioning,
    req: Request,
    stop: int | None = None,
    *,
    program: Program | None = None,
    capture: set[int] | None = None,
    progress: Callable[[int], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> DenoiseState:
    """Run steps ``state.next_step`` .. ``stop - 1`` (all remaining if ``stop`` is None) under ``program``.

    ``capture``: the steps whose post-scheduler latent is kept in ``state.trajectory``. ``cancel``: asked before every
    step; when it returns True the loop stops with :class:`~carnator.errors.Cancelled` (the state is then partial).
    """
    stop = state.num_steps if stop is None else min(stop, state.num_steps)
    capture = capture or set()
    for i in range(state.next_step, stop):
        if cancel is not None and cancel():
            raise Cancelled(f"cancelled before step {i} of {state.num_steps}")
        t = state.timesteps[i]
        plan = program.attention(i) if program is not None else IDLE
        _sync(state.latents.device)
        t0 = time.perf_counter()
        with attention_step(plan, state.attention, i):
            noise_pred = adapter.predict(state.latents, t, i, cond, req)
        _sync(state.latents.device)
        state.dit_seconds += time.perf_counter() - t0
        state.dit_forwards += 2 if cond.do_cfg else 1
        state.last_input, state.last_prediction = state.latents, noise_pred
        state.latents = adapter.step(state.scheduler, noise_pred, t, state.latents, state.generator)
        if program is not None:
            new = program.after_step(i, state)
            if new is not None:
                state.latents = new
        if i in capture:
            state.trajectory[i] = state.latents.detach().to("cpu", torch.float32).clone()
        state.next_step = i + 1
        if progress:
            progress(i)
    return state
