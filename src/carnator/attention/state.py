"""Per-request attention state: what carnator's attention processors apply and record at one denoising step.

The processors are installed once per transformer and hold no request state. Before every transformer forward the
denoising loop enters :func:`attention_step` with that step's :class:`AttentionPlan` (plain data: what to record,
capture and apply) and the request's :class:`AttentionSession`; the processors reach both through
:func:`current` (a context variable, so two requests in two threads never see each other's state) and write what
they record into the session's :class:`AttentionRecord`. Outside :func:`attention_step` the processors compute the
unmodified attention. Nothing here knows a model family.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch

from .blockmask import BlockMaskSet, estimate_block_mass, exact_block_mass, topp_block_mask
from .kernels import BlockTable, block_sparse_kernel


@dataclass
class SparseConfig:
    """Sparse-connectivity capture (PAPER step 9; block size and mass fraction are not given).

    block: tokens per block (queries and keys). 128 is the FlexAttention tile on CUDA; the
        embedded model (512 tokens) uses 32 so a mask has 16 x 16 blocks.
    p: fraction of each query block's attention mass its kept key blocks must cover.
    steps: which denoising steps are captured ("all", or a list); layers: which layers (None = all).
    stride: capture only every ``stride``-th step (step % stride == 0); a reuse at a step without its
        own mask uses the latest earlier recorded step's. 1 records every step; larger strides make
        entries smaller (Wan2.1-1.3B, 480p: 8 KiB per head mask, 720 head masks per step) and captures
        cheaper. Default 5: with the exact mass on the embedded model, a miss that captures costs 3.2 s
        on the 2-core CPU at stride 5 against 4.0 s at stride 1 (3.2 s with the estimate at stride 1).
    mass: how the block mass is measured: "estimate" from mean-pooled Q and K blocks
        (:func:`estimate_block_mass`, (N / block)^2 per head instead of a dense pass), "exact"
        (:func:`exact_block_mass`, one extra dense attention pass per captured forward), or "auto":
        exact up to ``exact_max_tokens`` tokens, the estimate above. Measured on the embedded model
        (docs/METHOD.md): at p 0.9 the estimate's masks (density 0.46) cost forced reuses 0.10
        of judge fidelity against reuses without masks, the exact mass's (density 0.49) nothing.
    exact_max_tokens: the "auto" limit (the embedded model has 512 tokens; Wan2.1-1.3B at 480p 32,760).
    apply: where masks are captured and applied: "auto" only where a block-sparse kernel makes them save
        time (:func:`~carnator.attention.kernels.block_sparse_kernel`: CUDA with blocks of a multiple of
        128 tokens, so not the embedded model's 32-token blocks, nor any CPU run); "always" everywhere (the
        CPU then computes a masked *dense* attention: the quality of a mask, no saving); "never" nowhere.
        Measured on the embedded model (docs/METHOD.md): on the 2-core CPU masks made a hit's
        DiT slower, not faster, and a capturing miss slower than dense.
    """

    block: int = 128
    p: float = 0.9
    steps: str | list[int] = "all"
    layers: list[int] | None = None
    stride: int = 5
    mass: str = "auto"
    exact_max_tokens: int = 4096
    apply: str = "auto"

    def __post_init__(self) -> None:
        if not (0.0 < self.p <= 1.0):
            raise ValueError(f"SparseConfig.p must be in (0, 1], got {self.p}")
        if self.block <= 0 or self.stride <= 0:
            raise ValueError("SparseConfig.block and stride must be positive")
        if self.mass not in ("estimate", "exact", "auto"):
            raise ValueError(f"SparseConfig.mass must be 'estimate', 'exact' or 'auto', got {self.mass!r}")
        if self.apply not in ("auto", "always", "never"):
            raise ValueError(f"SparseConfig.apply must be 'auto', 'always' or 'never', got {self.apply!r}")

    def for_tokens(self, n_tokens: int) -> "SparseConfig":
        """This config for a sequence of ``n_tokens``: small sequences (the embedded model's 512) get blocks of
        ``n_tokens // 16`` (at least 8) so that a mask still has 16 x 16 blocks."""
        if self.block * 8 <= n_tokens:
            return self
        return replace(self, block=max(8, n_tokens // 16))

    def applies(self, device: torch.device | str) -> bool:
        """Whether masks are captured and applied for a request on ``device`` (at this config's block size)."""
        if self.apply == "auto":
            return block_sparse_kernel(device, self.block)
        return self.apply == "always"


@dataclass
class EvidenceRecord:
    """Attention evidence from one probe forward at the probe layer (cond branch only).

    cross: (heads, N, n_positions) cross-attention probabilities of visual tokens to the recorded
        text positions; q, k: (heads, N, d) self-attention queries/keys (after norm and RoPE);
        lse: (heads, N) log-sum-exp of each self-attention row, so any column is exp(q.k*s - lse).
    """

    positions: list[int]
    cross: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    scale: float = 1.0

    def self_attention_columns(self, cols: Iterable[int]) -> torch.Tensor:
        """A_h[i, u] for u in ``cols``: (heads, N, len(cols)), float32, without building N x N."""
        if self.q is None or self.k is None or self.lse is None:
            raise ValueError("this record holds no self-attention (its layer was recorded without it)")
        idx = torch.as_tensor(list(cols), dtype=torch.long, device=self.k.device)
        logits = torch.einsum("hnd,hmd->hnm", self.q.float(), self.k[:, idx].float()) * self.scale
        return torch.exp(logits - self.lse[..., None])


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """Region-guided recomputation in a window of middle layers: only ``active`` token indices are
    recomputed there, attending to ``context`` token indices (both sorted 1-D LongTensors)."""

    layers: range
    active: torch.Tensor
    context: torch.Tensor

    @classmethod
    def over(cls, window: tuple[float, float], num_layers: int, active, context) -> "WindowPlan | None":
        """The plan for the layer fraction ``window`` of ``num_layers`` and the bool token masks ``active`` and
        ``context`` (any shape, raster order), or None where it would restrict nothing: no layer in the window,
        no Active token, or every token Active (the gather/scatter would then copy every token for nothing,
        and the layers run in full instead, block-sparse where masks apply)."""
        import numpy as np

        lo, hi = round(window[0] * num_layers), round(window[1] * num_layers)
        a = np.asarray(active, dtype=bool).reshape(-1)
        if hi <= lo or not a.any() or a.all():
            return None
        c = np.asarray(context, dtype=bool).reshape(-1)
        return cls(range(lo, hi), torch.from_numpy(np.flatnonzero(a)), torch.from_numpy(np.flatnonzero(c)))


@dataclass(frozen=True)
class Amplification:
    """Token-Guided Attention Amplification (the ``chorus`` baseline): in the cond branch's
    cross-attention, the weights of the text tokens at ``positions`` are multiplied by ``scale`` and
    each row renormalised, i.e. ``log(scale)`` is added to those logits."""

    positions: tuple[int, ...]
    scale: float

    @property
    def active(self) -> bool:
        """Whether it changes anything (a scale of 1 is the plain attention, bit for bit)."""
        return self.scale != 1.0 and bool(self.positions)


@dataclass(frozen=True)
class RecordSpec:
    """Probe evidence to record at one forward: the cond branch's cross-attention of every visual token to the
    text ``positions`` at ``layer`` (None: at every layer, for measurements) and, with ``self_attention``, that
    layer's self-attention Q, K and row log-sum-exps (an :class:`EvidenceRecord` per layer)."""

    layer: int | None
    positions: tuple[int, ...]
    self_attention: bool = True


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """What the processors do at one denoising step; built by the denoising loop from the request's plan.

    ``record``: evidence to record; ``capture``: record this step's top-p block masks (every layer
    ``capture.layers`` allows); ``masks``: apply these block masks (the mask of the latest recorded step at or
    before this one); ``window``: recompute only Active tokens in these layers; ``amplify``: TGAA.
    """

    record: RecordSpec | None = None
    capture: SparseConfig | None = None
    masks: BlockMaskSet | None = None
    window: WindowPlan | None = None
    amplify: Amplification | None = None

    @property
    def idle(self) -> bool:
        """Whether the processors compute nothing but the plain attention at every layer (an adapter may then replay
        the forward as a CUDA graph: no processor code runs in a replay)."""
        return (self.record is None and self.capture is None and self.masks is None and self.window is None
                and (self.amplify is None or not self.amplify.active))


IDLE = AttentionPlan()


@dataclass
class AttentionRecord:
    """What the processors recorded for one request: the evidence of each recording forward, by (step, layer), and
    the block masks captured so far."""

    evidence: dict[tuple[int, int], EvidenceRecord] = field(default_factory=dict)
    captured: BlockMaskSet | None = None


class AttentionSession:
    """One request's attention state across its steps: its :class:`AttentionRecord` and the device copies of the
    block masks it applies (kept while consecutive steps use masks recorded at the same step)."""

    def __init__(self) -> None:
        self.record = AttentionRecord()
        self._masks: BlockMaskSet | None = None
        self._device_masks: dict | None = None
        self._tables: dict = {}
        self._tables_step: int | None = None

    def cached_mask(self, masks: BlockMaskSet, step: int, branches: tuple[int, ...], layer: int, device) -> BlockTable | None:
        """The block mask of ``masks`` for this forward, a (B, H, nq, nk) :class:`BlockTable`, or None to run dense.

        A recorded mask serves the steps up to the next recorded one: each table (and the FlexAttention ``BlockMask``
        built from it on first use) is kept while the forwards use masks recorded at the same step, i.e. built once
        per (recorded step, branches, layer) instead of once per call. Kept on the device: one recorded step's
        tables, for Wan2.1-1.3B at 480p 13.4 MB per (layer, branch) with the BlockMask (0.8 GB for 30 layers x 2
        branches).
        """
        found = [masks.nearest(step, br, layer) for br in branches]
        keys = tuple(k for k in found if k is not None)
        if len(keys) < len(found):
            return None
        if masks is not self._masks:
            self._masks, self._device_masks, self._tables, self._tables_step = masks, None, {}, None
        table = self._tables.get(keys)
        if table is None:
            if self._device_masks is None:
                self._device_masks = masks.to_device(device)
            if keys[0][0] != self._tables_step:  # a later recorded step: the earlier one's tables are done
                self._tables, self._tables_step = {}, keys[0][0]
            table = self._tables[keys] = BlockTable(torch.stack([masks.unpack(self._device_masks[k]) for k in keys]))
        return table

    def preload(self, masks: BlockMaskSet, device) -> None:
        """Copy ``masks`` (packed) to ``device`` now rather than at the first forward that applies them."""
        self._masks, self._device_masks, self._tables, self._tables_step = masks, masks.to_device(device), {}, None


class StepAttention:
    """What one transformer forward's processors see: the step's plan, the request's session, the step index and
    the CFG branch of each batch row (set by the adapter before the forward: 0 = cond, 1 = uncond)."""

    lse_chunk = 1024

    def __init__(self, plan: AttentionPlan, session: AttentionSession, step: int, branches: tuple[int, ...] = (0,)):
        self.plan = plan
        self.session = session
        self.step = step
        self.branches = branches
        self._layer: int | None = None  # the layer of the last recording() that said yes

    # ---- what the processors ask ------------------------------------------------------------------------
    @property
    def window(self) -> WindowPlan | None:
        return self.plan.window

    @property
    def masks(self) -> BlockMaskSet | None:
        return self.plan.masks

    @property
    def record_positions(self) -> list[int]:
        r = self.plan.record
        return [] if r is None else list(r.positions)

    @property
    def evidence(self) -> EvidenceRecord | None:
        """The record of the layer now recording (the processors call :meth:`recording` first)."""
        return None if self._layer is None else self.session.record.evidence.get((self.step, self._layer))

    @evidence.setter
    def evidence(self, value: EvidenceRecord) -> None:
        assert self._layer is not None, "recording() names the layer first"
        self.session.record.evidence[(self.step, self._layer)] = value

    def fit_rows(self, batch: int) -> None:
        """Match ``branches`` to a forward that carries fewer rows than announced: an intra-request FasterCache
        computes only the cond half (the last rows) of a batched (uncond, cond) forward."""
        if batch < len(self.branches):
            self.branches = self.branches[len(self.branches) - batch:]

    def recording(self, layer: int, self_attention: bool = False) -> bool:
        r = self.plan.record
        yes = r is not None and (r.layer is None or layer == r.layer) and 0 in self.branches and (r.self_attention or not self_attention)
        if yes:
            self._layer = layer
        return yes

    def capturing(self, layer: int) -> bool:
        s = self.plan.capture
        return s is not None and (s.layers is None or layer in s.layers)

    def capture(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Record the top-p block mask of every batch row; q, k: (B, H, N, d)."""
        s = self.plan.capture
        assert s is not None, "capturing() said yes"
        exact = s.mass == "exact" or (s.mass == "auto" and max(q.shape[2], k.shape[2]) <= s.exact_max_tokens)
        mass = (exact_block_mass if exact else estimate_block_mass)(q, k, s.block)
        mask = topp_block_mask(mass, s.p)
        rec = self.session.record
        if rec.captured is None:
            rec.captured = BlockMaskSet.empty(num_heads=q.shape[1], q_len=q.shape[2], kv_len=k.shape[2], block=s.block)
        for b, br in enumerate(self.branches):
            rec.captured.add(self.step, br, layer, mask[b])

    def cached_mask(self, layer: int, device) -> BlockTable | None:
        m = self.plan.masks
        return None if m is None else self.session.cached_mask(m, self.step, self.branches, layer, device)

    def cross_bias(self, kv_len: int, device, dtype) -> torch.Tensor | None:
        """Additive cross-attention logit bias (B, 1, 1, kv_len) of this forward (TGAA), or None.

        None unless an amplification with a scale other than 1 applies to a cond row, so unamplified attention runs
        the plain kernel, bit for bit."""
        a = self.plan.amplify
        if a is None or not a.active or 0 not in self.branches:
            return None
        pos = [p for p in a.positions if 0 <= p < kv_len]
        if not pos:
            return None
        bias = torch.zeros(len(self.branches), 1, 1, kv_len, dtype=dtype, device=device)
        bias[self.branches.index(0), 0, 0, pos] = math.log(a.scale)
        return bias

    def in_window(self, layer: int) -> bool:
        w = self.plan.window
        return w is not None and layer in w.layers


#: what the processors do outside any :func:`attention_step`: the plain attention
_PLAIN = StepAttention(IDLE, AttentionSession(), 0)
_CURRENT: ContextVar[StepAttention | None] = ContextVar("carnator_attention", default=None)


def current() -> StepAttention:
    """The attention state of the forward running in this thread (context); a plain, idle one outside any step."""
    s = _CURRENT.get()
    return _PLAIN if s is None else s


def active() -> StepAttention | None:
    """The attention state of the forward running now, or None outside :func:`attention_step`."""
    return _CURRENT.get()


@contextmanager
def attention_step(plan: AttentionPlan | None, session: AttentionSession, step: int) -> Iterator[StepAttention]:
    """Run the transformer forwards of one denoising step under ``plan``, recording into ``session``."""
    state = StepAttention(plan or IDLE, session, step)
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)


def set_branches(branches: tuple[int, ...]) -> None:
    """Announce the CFG branch of each batch row of the next forward (adapters call it; no-op outside a step)."""
    s = _CURRENT.get()
    if s is not None:
        s.branches = branches


