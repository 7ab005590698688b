"""The one denoising loop. It executes; it never decides.

A :class:`DenoiseState` holds one request's progress (latent, next step, captured trajectory).
:func:`run_steps` advances it through a range of steps. A dense generation is one call over all
steps; a probe is a call over the first few steps; a reuse resumes a state built from a cached
latent. Everything a policy wants done differently at a step arrives as a :class:`StepHooks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .backbones.base import BackboneAdapter, Conditioning
from .request import Request


@dataclass
class DenoiseState:
    """One request's progress through the schedule."""

    latents: torch.Tensor
    timesteps: torch.Tensor
    generator: torch.Generator
    next_step: int = 0
    trajectory: dict[int, torch.Tensor] = field(default_factory=dict)  # step -> post-scheduler latent (CPU, float32)
    dit_forwards: int = 0
    dit_seconds: float = 0.0
    #: input latent and guided prediction of the last step run (a probe reads its x0 estimate)
    last_input: torch.Tensor | None = None
    last_prediction: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


@dataclass
class StepHooks:
    """Optional per-step behaviour a plan asks of the loop.

    ``before_predict(step, state)`` runs before the transformer (e.g. to set attention plans);
    ``after_step(step, state)`` runs on the post-scheduler latent and may replace it (region blend).
    """

    before_predict: Callable[[int, DenoiseState], None] | None = None
    after_step: Callable[[int, DenoiseState], torch.Tensor | None] | None = None


def capture_set(spec: str | Iterable[int] | None, num_steps: int) -> set[int]:
    """Which post-scheduler latents to keep: "all", "none"/None, or an iterable of step indices."""
    if spec is None or spec == "none":
        return set()
    if spec == "all":
        return set(range(num_steps))
    return {int(s) for s in spec if 0 <= int(s) < num_steps}


def start(adapter: BackboneAdapter, req: Request) -> DenoiseState:
    """Fresh state: the seed's initial noise and the scheduler reset for this request."""
    gen = adapter.make_generator(req)
    ts = adapter.timesteps(req)
    lat = adapter.prepare_latents(req, gen)
    return DenoiseState(latents=lat, timesteps=ts, generator=gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(
    adapter: BackboneAdapter,
    state: DenoiseState,
    cond: Conditioning,
    req: Request,
    stop: int | None = None,
    *,
    capture: set[int] | None = None,
    hooks: StepHooks | None = None,
    progress: Callable[[int], None] | None = None,
) -> DenoiseState:
    """Run steps ``state.next_step`` .. ``stop - 1`` (all remaining if ``stop`` is None)."""
    stop = state.num_steps if stop is None else min(stop, state.num_steps)
    capture = capture or set()
    for i in range(state.next_step, stop):
        t = state.timesteps[i]
        if hooks and hooks.before_predict:
            hooks.before_predict(i, state)
        _sync(state.latents.device)
        t0 = time.perf_counter()
        noise_pred = adapter.predict(state.latents, t, i, cond, req)
        _sync(state.latents.device)
        state.dit_seconds += time.perf_counter() - t0
        state.dit_forwards += 2 if cond.do_cfg else 1
        state.last_input, state.last_prediction = state.latents, noise_pred
        state.latents = adapter.step(noise_pred, t, state.latents, state.generator)
        if hooks and hooks.after_step:
            new = hooks.after_step(i, state)
            if new is not None:
                state.latents = new
        if i in capture:
            state.trajectory[i] = state.latents.detach().to("cpu", torch.float32).clone()
        state.next_step = i + 1
        if progress:
            progress(i)
    return state
