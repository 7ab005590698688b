"""The adapter protocol: all model knowledge lives behind :class:`BackboneAdapter`.

An adapter wraps a diffusers pipeline object and exposes the pieces the one denoising loop in
:mod:`carnator.denoise` needs. It reuses the pipeline's own helpers (``encode_prompt``,
``prepare_latents``, the scheduler, the VAE and video processor), so that a dense run through the
loop equals ``pipe(...)`` exactly.

Adding a family: subclass :class:`BackboneAdapter`, set ``pipeline_classes`` and register the class with
:func:`carnator.backbones.register_adapter` (the built-in families are listed in :mod:`.registry`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request


@dataclass(frozen=True)
class GenerationDefaults:
    """Settings used when a request leaves them out (the pipeline's own ``__call__`` defaults)."""

    num_inference_steps: int
    num_frames: int
    height: int
    width: int
    guidance_scale: float
    negative_prompt: str | None = None


@dataclass
class Conditioning:
    """Encoded prompt for one request; ``data`` is opaque to everything but the adapter that made it."""

    data: dict[str, Any]
    do_cfg: bool


#: Config keys that record how a component was loaded rather than what it is; a model moved to
#: another directory (or loaded from disk instead of built in memory) keeps its identity and its cache.
_NOT_IDENTITY = frozenset({"_name_or_path", "_use_default_values", "_commit_hash"})

class BackboneAdapter(ABC):
    """One model family over a diffusers pipeline.

    The denoising loop calls, in order: :meth:`resolve` (fill and check a request), :meth:`encode`,
    :meth:`prepare_latents`, :meth:`new_scheduler` and :meth:`timesteps`, then per step :meth:`predict` and
    :meth:`step`, and finally :meth:`decode`. An adapter holds no request state: everything that changes during a
    request (the scheduler, the attention plan and record) belongs to the request, so requests may run side by side. Latents passed between these are in the pipeline's own layout (the
    layout its scheduler steps on).
    """

    family: ClassVar[str] = "base"
    pipeline_classes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, pipe):
        self.pipe = pipe
        self._intra = None
        self._cuda_graphs = False

    @property
    def vae_lock(self) -> threading.Lock:
        """Held around every VAE decode: diffusers' video VAEs keep per-call state on the module (Wan's causal
        feature cache), so two requests must not decode on one VAE at once. One lock per pipeline."""
        return self.pipe.__dict__.setdefault("_carnator_vae_lock", threading.Lock())

    #: whether :meth:`predict` can replay idle forwards as CUDA graphs (:meth:`use_cuda_graphs`)
    supports_cuda_graphs: ClassVar[bool] = False

    def use_cuda_graphs(self, on: bool) -> None:
        """Replay idle forwards (no recording, masks or window at that step; no intra-request cache) as CUDA
        graphs on a CUDA device. Families that cannot raise :class:`InvalidRequestError` when asked to."""
        if on and not self.supports_cuda_graphs:
            raise InvalidRequestError(f"CUDA graphs are not available for {self.family} (only for the embedded model)")
        self._cuda_graphs = bool(on)

    # ---- attention (probe evidence, sparse connectivity, active-token window) ------------------
    supports_attention: ClassVar[bool] = False

    def ensure_attention(self) -> None:
        """Install carnator's attention processors on the transformer (once; they hold no request state and compute
        the unmodified attention outside a step's :func:`~carnator.attention.state.attention_step`). Families
        without processors raise NotImplementedError."""
        if not self.supports_attention:
            raise NotImplementedError(f"carnator's attention processors are not available for {self.family} yet")
        if not getattr(self.transformer, "_carnator_attention", False):
            if self._intra is not None:
                # carnator's block forwards go *under* diffusers' cache hooks (a skipped block must skip them too);
                # the hooks are put back on the next forward.
                self._intra.remove()
            self.install_attention()

    def install_attention(self) -> None:
        raise NotImplementedError

    def _branches(self, branches: tuple[int, ...], step: int) -> None:
        """Announce the CFG branch of each batch row of the next forward (0 = cond, 1 = uncond)."""
        from ..attention.state import set_branches

        set_branches(branches)

    # ---- diffusers' intra-request caches (carnator.backbones.intra_cache) ----------------------------------
    #: per kind, the diffusers config fields that fit this family (which modules to hook, output layout)
    intra_cache_options: ClassVar[dict[str, dict[str, Any]]] = {}
    #: per kind, why it cannot run on this family
    intra_cache_unsupported: ClassVar[dict[str, str]] = {}
    #: whether :meth:`predict` puts every CFG branch in one batched forward when the cache needs it
    batches_cfg: ClassVar[bool] = True

    @property
    def intra_cache(self):
        """The :class:`~carnator.backbones.intra_cache.IntraCache` applied to this transformer, or None."""
        return self._intra

    def use_intra_cache(self, spec):
        """Apply ``spec`` (see :class:`~carnator.backbones.intra_cache.IntraCacheSpec`; None removes any) to the transformer.

        Raises :class:`~carnator.backbones.intra_cache.IntraCacheError` (a CarnatorError) naming the kinds that work
        when this family cannot run it. Returns the applied cache (hooks go on at the next forward)."""
        from .intra_cache import IntraCache, IntraCacheSpec

        spec = IntraCacheSpec.parse(spec)
        tr = self.transformer
        # The hooks live on the transformer, which several adapters (engines) may share: whoever applied them owns them.
        cur = tr.__dict__.get("_carnator_intra_cache")
        if cur is not None and cur.adapter is self and cur.spec == spec:
            return cur
        new = IntraCache(self, spec) if spec is not None else None  # validates before touching the current one
        if cur is not None:
            cur.remove()
            cur.adapter._intra = None
        tr.__dict__["_carnator_intra_cache"] = new
        self._intra = new
        return new

    def _one_forward_cfg(self) -> bool:
        """Whether this forward must put every CFG branch in one batch (the cache keeps one state for all calls)."""
        return self._intra is not None and self._intra.kind.one_forward_cfg

    def _uncond_first(self) -> bool:
        """Whether a batched CFG forward must put the uncond rows first (FasterCache)."""
        return self._intra is not None and self._intra.kind.uncond_first

    @contextmanager
    def branch_context(self, name: str, step: int, t: torch.Tensor, req: Request, do_cfg: bool) -> Iterator[None]:
        """Wrap one transformer forward of CFG branch(es) ``name`` ("cond", "uncond", or "cond_uncond" for a
        batched forward): the intra-request cache's per-request state handling, then diffusers'
        ``cache_context(name)`` (one hook state per branch) where the transformer is a CacheMixin."""
        from diffusers.models.cache_utils import CacheMixin

        tr = self.transformer
        if self._intra is not None:
            from ..attention.state import current

            plan = current().plan
            recording = plan.record is not None
            w = plan.window
            window = None if w is None else (id(w), w.layers.start, w.layers.stop, int(w.active.numel()), int(w.context.numel()))
            self._intra.before_forward(name, step, t, req, do_cfg, recording, window)
        if isinstance(tr, CacheMixin):
            with tr.cache_context(name):
                yield
        else:
            yield

    def num_layers(self) -> int:
        return len(self.transformer.blocks)

    def predicted_x0(self, scheduler, latents: torch.Tensor, noise_pred: torch.Tensor, step: int) -> torch.Tensor:
        """The clean-latent estimate at ``step`` under the request's ``scheduler`` (flow matching: x0 = x_t - sigma_t * v)."""
        sigma = scheduler.sigmas[step].to(latents.device, torch.float32)
        return latents.float() - sigma * noise_pred.float()

    def latent_weight(self, weight: np.ndarray, latents: torch.Tensor) -> torch.Tensor:
        """A token-grid array ``(T, H, W)`` (a blend weight) as a float32 tensor on ``latents``' device that
        broadcasts against ``latents``, each token's value covering its latent patch. This default is for
        latents laid out (B, C, T, H, W); families with another layout override it."""
        from ..reuse import upsample_tokens

        t, h, w = (int(a // b) for a, b in zip(latents.shape[2:], weight.shape))
        patch = (t, h, w)
        return torch.from_numpy(upsample_tokens(weight, patch).astype(np.float32))[None, None].to(latents.device)

    def decode_tail(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        """Last frame (H, W, 3) float in [0, 1] of a decode of ``latents``."""
        return self.decode(latents, req)[-1]

    # ---- identity and settings -------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return self.pipe._execution_device

    def model_identity(self) -> str:
        """A stable id of the model: pipeline class, component configs and a weight fingerprint.

        Two pipelines with the same id produce the same trajectory for the same request, so cache
        entries are never shared across ids.
        """
        h = hashlib.sha256()
        h.update(type(self.pipe).__name__.encode())
        for name in ("transformer", "vae", "text_encoder", "scheduler"):
            comp = getattr(self.pipe, name, None)
            cfg = getattr(comp, "config", None)
            if cfg is not None:  # diffusers configs are dicts; transformers configs (text encoders) have to_dict()
                cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
                # Loading bookkeeping, not the model: where it was loaded from, which values were defaulted.
                cfg = {k: v for k, v in cfg.items() if k not in _NOT_IDENTITY}
                h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        # Fingerprint a few weights so two random inits of one config never collide.
        with torch.no_grad():
            for i, p in enumerate(self.transformer.parameters()):
                if i % 7 == 0:
                    flat = p.detach().reshape(-1)[:64].float().cpu().numpy()
                    h.update(np.ascontiguousarray(flat).tobytes())
        return f"{self.family}-{h.hexdigest()[:16]}"

    def scheduler_name(self) -> str:
        return type(self.pipe.scheduler).__name__

    @abstractmethod
    def defaults(self) -> GenerationDefaults: ...

    def limits(self):
        """What this model accepts (:class:`~carnator.request.RequestLimits`), enforced by :meth:`resolve`: the
        shared bounds, and the text encoder's reading, ``max_sequence_length`` tokens of the cleaned prompt with its
        special tokens (the T5 families; others override)."""
        from ..request import RequestLimits

        n = getattr(self, "max_sequence_length", None)
        tok = getattr(self.pipe, "tokenizer", None)
        if n is None or tok is None:
            return RequestLimits()
        return RequestLimits(max_prompt_tokens=int(n), count_tokens=lambda text: len(tok(self.clean_prompt(text), add_special_tokens=True)["input_ids"]))

    def resolve(
        self,
        prompt: str,
        *,
        seed: int,
        negative_prompt: str | None = None,
        num_inference_steps: int | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        guidance_scale: float | None = None,
        tenant: str = "default",
    ) -> Request:
        """Fill unset settings from :meth:`defaults` and check everything against :meth:`limits` and
        :meth:`check_geometry` (:func:`~carnator.request.resolve_request`); raises InvalidRequestError."""
        from ..request import resolve_request

        req = resolve_request(
            self.defaults(), self.limits(), prompt, seed=seed, negative_prompt=negative_prompt,
            num_inference_steps=num_inference_steps, num_frames=num_frames, height=height, width=width,
            guidance_scale=guidance_scale, tenant=tenant,
        )
        self.check_geometry(req)
        return req

    @abstractmethod
    def check_geometry(self, req: Request) -> None:
        """Raise InvalidRequestError if the model cannot take this frame count or size."""

    # ---- the pieces of the loop -----------------------------------------------------------
    def make_generator(self, req: Request) -> torch.Generator:
        """The request's random generator (on the CPU, so a seed gives the same noise on any device)."""
        return torch.Generator(device="cpu").manual_seed(req.seed)

    @abstractmethod
    def encode(self, req: Request) -> Conditioning: ...

    @abstractmethod
    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor: ...

    def new_scheduler(self):
        """A scheduler of its own for one request, configured as the pipeline's: multistep solvers keep history
        between steps, so requests that share one scheduler object cannot run side by side."""
        s = self.pipe.scheduler
        return type(s).from_config(s.config)

    @abstractmethod
    def timesteps(self, scheduler, req: Request) -> torch.Tensor:
        """Set the request's ``scheduler`` (from :meth:`new_scheduler`) for this request; its timesteps (one per step)."""

    @abstractmethod
    def predict(self, latents: torch.Tensor, t: torch.Tensor, step: int, cond: Conditioning, req: Request) -> torch.Tensor:
        """One guided prediction (every CFG branch) for the scheduler."""

    def step(self, scheduler, noise_pred: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One step of the request's ``scheduler``; returns the post-scheduler latent."""
        return scheduler.step(noise_pred, t, latents, return_dict=False)[0]

    def seek(self, scheduler, step: int) -> None:
        """Position the scheduler at ``step`` (after :meth:`timesteps`) with an empty multistep history.

        Used to resume from a cached latent: the next :meth:`step` call advances from ``step``, and
        multistep solvers (UniPC, DPM-Solver) restart at first order, as they do at step 0.
        """
        if self._intra is not None:
            self._intra.begin()  # another trajectory from here: the intra-request cache starts over
        s = scheduler
        if hasattr(s, "_step_index"):
            s._step_index = int(step)
        if hasattr(s, "model_outputs"):
            s.model_outputs = [None] * len(s.model_outputs)
        if hasattr(s, "timestep_list"):
            s.timestep_list = [None] * len(s.timestep_list)
        if hasattr(s, "lower_order_nums"):
            s.lower_order_nums = 0
        if hasattr(s, "last_sample"):
            s.last_sample = None

    @abstractmethod
    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        """VAE decode to a float32 video (T, H, W, 3) in [0, 1], as ``pipe(..., output_type="np").frames[0]``."""

    # ---- geometry and text ----------------------------------------------------------------
    @abstractmethod
    def token_grid(self, req: Request) -> tuple[int, int, int]:
        """(T, H, W) of the transformer's visual tokens after patching."""

    @abstractmethod
    def prompt_token_ids(self, prompt: str) -> list[int]:
        """Token ids of the prompt exactly as the transformer sees them (cond branch, unpadded)."""

    def content_reader(self):
        """What a prompt asks for (``text -> list[str]``, :mod:`carnator.signature.content`): content words minus stop,
        style and framing words for real models."""
        from ..signature.content import heuristic_content

        return heuristic_content

    def noun_extractor(self):
        """The nouns of a prompt for this model (``text -> list[str]``): spaCy or the heuristic of
        :func:`~carnator.signature.nouns.extract_nouns` for real models."""
        from ..signature.nouns import extract_nouns

        return extract_nouns

    def word_token_positions(self, prompt: str, word: str, modifiers: int = 0) -> list[int]:
        """Positions (in the transformer's text sequence) of the tokens that spell ``word`` in ``prompt``, with up to
        ``modifiers`` words modifying each occurrence (:func:`~carnator.signature.nouns.noun_phrase_spans`).

        Found by tokenizing the prompt with offsets and keeping the tokens whose character span
        overlaps an occurrence (case-insensitive, whole word).
        """
        from ..signature.nouns import noun_phrase_spans

        tok = self.pipe.tokenizer
        text = self.clean_prompt(prompt)
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=True)
        spans = noun_phrase_spans(text, word, modifiers)
        out = []
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if b > a and any(a < e and b > s for s, e in spans):
                out.append(i + self.text_offset())
        return out

    def clean_prompt(self, prompt: str) -> str:
        """The prompt text as the pipeline feeds it to its tokenizer."""
        return prompt

    def text_offset(self) -> int:
        """Index of the first text token within the transformer's text sequence (0 for most families)."""
        return 0
