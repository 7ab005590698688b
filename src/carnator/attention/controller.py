"""What the attention processors of one request record and apply (model-agnostic bookkeeping).

Adapters install processors that consult one :class:`AttentionController`. The engine and
policies set its fields; the processors read them. Nothing here knows a model family.
"""

from __future__ import annotations

import math
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
        (docs/RESULTS.md, session 5): at p 0.9 the estimate's masks (density 0.46) cost forced reuses 0.10
        of judge fidelity against reuses without masks, the exact mass's (density 0.49) nothing.
    exact_max_tokens: the "auto" limit (the embedded model has 512 tokens; Wan2.1-1.3B at 480p 32,760).
    apply: where masks are captured and applied: "auto" only where a block-sparse kernel makes them save
        time (:func:`~carnator.attention.kernels.block_sparse_kernel`: CUDA with blocks of a multiple of
        128 tokens, so not the embedded model's 32-token blocks, nor any CPU run); "always" everywhere (the
        CPU then computes a masked *dense* attention: the quality of a mask, no saving); "never" nowhere.
        Measured on the embedded model (docs/RESULTS.md, session 6): on the 2-core CPU masks made a hit's
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

    def self_attention_columns(self, cols) -> torch.Tensor:
        """A_h[i, u] for u in ``cols``: (heads, N, len(cols)), float32, without building N x N."""
        idx = torch.as_tensor(list(cols), dtype=torch.long, device=self.k.device)
        logits = torch.einsum("hnd,hmd->hnm", self.q.float(), self.k[:, idx].float()) * self.scale
        return torch.exp(logits - self.lse[..., None])


@dataclass
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


@dataclass
class Amplification:
    """Token-Guided Attention Amplification (the ``chorus`` baseline): in the cond branch's
    cross-attention, the weights of the text tokens at ``positions`` are multiplied by ``scale`` and
    each row renormalised, i.e. ``log(scale)`` is added to those logits; at ``steps`` (None = all)."""

    positions: list[int]
    scale: float
    steps: range | None = None


@dataclass
class AttentionController:
    """Shared per-request state of the processors."""

    step: int = 0
    #: CFG branch of each batch row of the current forward (0 = cond, 1 = uncond)
    branches: tuple[int, ...] = (0,)
    # -- recording evidence (probe) --
    record_step: int | None = None
    record_layer: int | None = None
    record_positions: list[int] = field(default_factory=list)
    evidence: EvidenceRecord | None = None
    # -- capturing connectivity --
    sparse: SparseConfig | None = None
    captured: BlockMaskSet | None = None
    # -- applying a reuse plan --
    masks: BlockMaskSet | None = None
    window: WindowPlan | None = None
    amplify: Amplification | None = None
    lse_chunk: int = 1024
    _device_masks: dict | None = field(default=None, repr=False)
    #: block tables of the recorded step now in use, by their mask keys (see :meth:`cached_mask`)
    _tables: dict = field(default_factory=dict, repr=False)
    _tables_step: int | None = field(default=None, repr=False)

    def reset(self) -> None:
        self.step, self.branches = 0, (0,)
        self.record_step = self.record_layer = None
        self.record_positions = []
        self.evidence = None
        self.captured = None
        self.sparse = None
        self.masks = None
        self._device_masks = None
        self._tables = {}
        self.window = None
        self.amplify = None

    def use_masks(self, masks: BlockMaskSet | None, device=None) -> None:
        """Apply ``masks`` from now on; with ``device``, copy them (packed) there now, else on first use."""
        self.masks = masks
        self._device_masks = None if masks is None or device is None else masks.to_device(device)
        self._tables = {}

    def fit_rows(self, batch: int) -> None:
        """Match ``branches`` to a forward that carries fewer rows than announced: an intra-request FasterCache
        computes only the cond half (the last rows) of a batched (uncond, cond) forward."""
        if batch < len(self.branches):
            self.branches = self.branches[len(self.branches) - batch:]

    def idle_at(self, step: int) -> bool:
        """Whether the processors do nothing but plain attention at ``step``, at every layer: nothing recorded or
        captured, no masks, no window, no amplification. Such a forward is the unmodified transformer's, and
        an adapter may replay it as a CUDA graph (no processor code runs in a replay)."""
        if self.record_step == step or self.masks is not None or self.window is not None:
            return False
        s = self.sparse
        if s is not None and step % s.stride == 0 and (s.steps == "all" or step in s.steps):
            return False
        a = self.amplify
        return a is None or a.scale == 1.0 or (a.steps is not None and step not in a.steps)

    # ---- decisions the processors ask for ------------------------------------------------------
    def recording(self, layer: int) -> bool:
        return self.record_step is not None and self.step == self.record_step and layer == self.record_layer and 0 in self.branches

    def capturing(self, layer: int) -> bool:
        s = self.sparse
        if s is None:
            return False
        if s.layers is not None and layer not in s.layers:
            return False
        if self.step % s.stride:
            return False
        return s.steps == "all" or self.step in s.steps

    def capture(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Record the top-p block mask of every batch row; q, k: (B, H, N, d)."""
        s = self.sparse
        exact = s.mass == "exact" or (s.mass == "auto" and max(q.shape[2], k.shape[2]) <= s.exact_max_tokens)
        mass = (exact_block_mass if exact else estimate_block_mass)(q, k, s.block)
        mask = topp_block_mask(mass, s.p)
        if self.captured is None:
            self.captured = BlockMaskSet.empty(num_heads=q.shape[1], q_len=q.shape[2], kv_len=k.shape[2], block=s.block)
        for b, br in enumerate(self.branches):
            self.captured.add(self.step, br, layer, mask[b])

    def cached_mask(self, layer: int, device) -> BlockTable | None:
        """The reuse plan's block mask for this forward, a (B, H, nq, nk) :class:`BlockTable`, or None to run dense.

        A recorded mask serves the steps up to the next recorded one: each table (and the FlexAttention
        ``BlockMask`` built from it on first use) is kept while the forwards use masks recorded at the same
        step, i.e. built once per (recorded step, branches, layer) instead of once per call. Kept on the
        device: one recorded step's tables, for Wan2.1-1.3B at 480p 13.4 MB per (layer, branch) with the BlockMask (0.8 GB for 30 layers x 2 branches).
        """
        m = self.masks
        if m is None:
            return None
        keys = tuple(m.nearest(self.step, br, layer) for br in self.branches)
        if any(k is None for k in keys):
            return None
        table = self._tables.get(keys)
        if table is None:
            if self._device_masks is None:
                self._device_masks = m.to_device(device)
            if keys[0][0] != self._tables_step:  # a later recorded step: the earlier one's tables are done
                self._tables, self._tables_step = {}, keys[0][0]
            table = self._tables[keys] = BlockTable(torch.stack([m.unpack(self._device_masks[k]) for k in keys]))
        return table

    def cross_bias(self, kv_len: int, device, dtype) -> torch.Tensor | None:
        """Additive cross-attention logit bias (B, 1, 1, kv_len) of this forward (TGAA), or None.

        None unless an amplification with a scale other than 1 applies at this step to a cond row,
        so unamplified attention runs the plain kernel, bit for bit."""
        a = self.amplify
        if a is None or a.scale == 1.0 or 0 not in self.branches or (a.steps is not None and self.step not in a.steps):
            return None
        pos = [p for p in a.positions if 0 <= p < kv_len]
        if not pos:
            return None
        bias = torch.zeros(len(self.branches), 1, 1, kv_len, dtype=dtype, device=device)
        bias[self.branches.index(0), 0, 0, pos] = math.log(a.scale)
        return bias

    def in_window(self, layer: int) -> bool:
        return self.window is not None and layer in self.window.layers
