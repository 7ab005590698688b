"""Block-mask math for historical sparse-connectivity reuse (PAPER.md step 9).

Tokens are cut into consecutive blocks of ``block`` tokens (the last block may be shorter). A
*block mask* is a bool tensor ``(B, H, nq, nk)``: entry ``[b, h, i, j]`` says that the queries of
query block ``i`` may attend to the keys of key block ``j``.

*Block mass* ``M[b, h, i, j]`` is the attention mass query block ``i`` puts on key block ``j``: the
mean over the queries of block ``i`` of the sum of their softmax probabilities over the keys of
block ``j``. Each row of ``M`` sums to 1.

Recording (while a request is generated)::

    mass = estimate_block_mass(q, k, block)      # or exact_block_mass(q, k, block)
    mask = topp_block_mask(mass, p)              # (B, H, nq, nk) bool
    masks.add(step, branch, layer, mask[b])      # BlockMaskSet, one entry per CFG branch b

Reuse: ``masks.get(step, branch, layer)`` and :func:`carnator.attention.masked_attention`.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "BlockMaskSet",
    "block_token_index",
    "estimate_block_mass",
    "exact_block_mass",
    "num_blocks",
    "pack_bits",
    "restrict",
    "token_blocks",
    "topp_block_mask",
    "unpack_bits",
]


_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def num_blocks(n: int, block: int) -> int:
    """Number of blocks of ``block`` tokens covering ``n`` tokens (the last one may be partial)."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    return -(-int(n) // int(block))


def _block_lengths(n: int, block: int, device: torch.device) -> torch.Tensor:
    """Token count of each block, float32 ``(num_blocks(n, block),)``."""
    starts = torch.arange(0, n, block, device=device)
    return (torch.clamp(n - starts, max=block)).to(torch.float32)


def _pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of ``x (B, H, N, D)`` over each token block -> ``(B, H, nblocks, D)`` (float32)."""
    b, h, n, d = x.shape
    nb = num_blocks(n, block)
    pad = nb * block - n
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    sums = xf.view(b, h, nb, block, d).sum(dim=3)
    return sums / _block_lengths(n, block, x.device)[:, None]


def estimate_block_mass(q: torch.Tensor, k: torch.Tensor, block: int, *, scale: float | None = None) -> torch.Tensor:
    """Cheap *estimate* of the block mass ``(B, H, nq, nk)`` from mean-pooled Q and K blocks.

    ``score[i, j] = scale * mean(Q_i) . mean(K_j) + log(len(K_j))`` and the estimate is the softmax
    of ``score`` over key blocks. The log-length term weighs a key block by its token count (it
    matters only for the last, partial block). This is exact only when all tokens of a block are
    equal; in general it smooths out peaks inside blocks, so it ranks strong blocks well but is
    not the true mass (see :func:`exact_block_mass`). Cost: ``O(nq * nk * D)``.

    ``q (B, H, Nq, D)``, ``k (B, H, Nk, D)``; ``scale`` defaults to ``1 / sqrt(D)``. Float32 result.
    """
    _check_qk(q, k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pq = _pool_blocks(q, block)
    pk = _pool_blocks(k, block)
    scores = torch.matmul(pq, pk.transpose(-1, -2)) * scale
    scores = scores + torch.log(_block_lengths(k.shape[2], block, k.device))
    return torch.softmax(scores, dim=-1)


def exact_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    block: int,
    chunk: int = 1024,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """True block mass ``(B, H, nq, nk)`` (float32), computed ``chunk`` queries at a time.

    Peak extra memory is about ``B * H * chunk * Nk`` floats (one chunk of attention
    probabilities); the full ``Nq x Nk`` matrix is never materialized. Cost: one dense attention
    pass. Probabilities are computed in float32 (float64 if the inputs are float64).
    """
    _check_qk(q, k)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    b, h, nq_tok, _ = q.shape
    nk_tok = k.shape[2]
    nq, nk = num_blocks(nq_tok, block), num_blocks(nk_tok, block)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    kf = k.to(dtype)
    key_pad = nk * block - nk_tok
    mass = torch.zeros(b, h, nq, nk, dtype=dtype, device=q.device)
    for start in range(0, nq_tok, chunk):
        stop = min(start + chunk, nq_tok)
        probs = torch.softmax(torch.matmul(q[:, :, start:stop].to(dtype), kf.transpose(-1, -2)) * scale, dim=-1)
        if key_pad:
            probs = torch.nn.functional.pad(probs, (0, key_pad))
        per_key_block = probs.view(b, h, stop - start, nk, block).sum(dim=-1)  # (B, H, c, nk)
        q_block_of_row = torch.arange(start, stop, device=q.device) // block
        mass.index_add_(2, q_block_of_row, per_key_block)
    mass /= _block_lengths(nq_tok, block, q.device).to(dtype)[:, None]
    return mass.float()


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, N, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on B, H or D")


def topp_block_mask(mass: torch.Tensor, p: float) -> torch.Tensor:
    """Per query block, the fewest key blocks whose mass reaches a fraction ``p`` of the row's mass.

    Rows are sorted by mass, descending (ties: the lower key-block index first, so the result is
    deterministic); blocks are kept through the first one at which the running sum reaches
    ``p * row_sum`` (with a relative tolerance of 1e-6 for rounding). At least one block is always
    kept. ``p >= 1`` keeps every block. ``mass (..., nk)`` -> bool of the same shape.
    """
    if not p > 0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    if p >= 1:
        return torch.ones_like(mass, dtype=torch.bool)
    m = mass.to(torch.float64)
    sorted_m, order = torch.sort(m, dim=-1, descending=True, stable=True)
    total = sorted_m.sum(dim=-1, keepdim=True)
    before = torch.cumsum(sorted_m, dim=-1) - sorted_m  # mass of the blocks ranked above
    keep_sorted = before < (p - 1e-6) * total
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def _pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """Pack ``rows (R, n)`` bool -> ``(R, ceil(n / 8))`` uint8, bit ``i`` of byte ``j`` = element ``8j + i``."""
    r, n = rows.shape
    nbytes = -(-n // 8)
    x = torch.zeros(r, nbytes * 8, dtype=torch.uint8, device=rows.device)
    x[:, :n] = rows.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=rows.device)
    return (x.view(r, nbytes, 8) * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack_rows`: ``(R, nbytes)`` uint8 -> ``(R, n)`` bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n].bool()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor of any shape, flattened in C order, 8 elements per byte -> 1-D uint8.

    Bit ``i`` (least significant first) of byte ``j`` holds element ``8j + i``; the last byte is
    zero-padded. Exact inverse: :func:`unpack_bits` with the original shape.
    """
    return _pack_rows(mask.reshape(1, -1).bool())[0]


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bool tensor of ``shape`` on ``packed``'s device."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != -(-n // 8):
        raise ValueError(f"packed must be 1-D uint8 of {-(-n // 8)} bytes for shape {shape}")
    return _unpack_rows(packed.reshape(1, -1), n)[0].reshape(shape)


def token_blocks(token_mask: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks holding at least one selected token: ``token_mask (..., N)`` -> bool ``(..., nblocks)``."""
    n = token_mask.shape[-1]
    nb = num_blocks(n, block)
    x = torch.nn.functional.pad(token_mask.bool().to(torch.uint8), (0, nb * block - n))
    return x.view(*token_mask.shape[:-1], nb, block).amax(dim=-1).bool()


def block_token_index(blocks_keep: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Token indices (int64, ascending) of the kept blocks ``blocks_keep (nblocks,)`` of ``n`` tokens.

    Gathering these tokens keeps block alignment: the kept blocks become consecutive blocks of
    the gathered sequence (a kept partial last block stays last), so a mask from
    ``restrict(..., compact=True)`` applies to the gathered tokens unchanged.
    """
    keep = _as_keep(blocks_keep, num_blocks(n, block), "blocks_keep")
    if keep is None:
        return torch.arange(n)
    tok = torch.arange(n, device=keep.device)
    return tok[keep[tok // block]]


def _as_keep(sel: torch.Tensor | None, n: int, name: str) -> torch.Tensor | None:
    """``sel`` as a bool vector of length ``n`` (from bool or integer indices), or None for all."""
    if sel is None:
        return None
    sel = torch.as_tensor(sel)
    if sel.dtype == torch.bool:
        if sel.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(sel.shape)}")
        return sel
    keep = torch.zeros(n, dtype=torch.bool, device=sel.device)
    keep[sel.long()] = True
    return keep


def restrict(
    mask: torch.Tensor,
    query_blocks_keep: torch.Tensor | None = None,
    key_blocks_keep: torch.Tensor | None = None,
    *,
    compact: bool = False,
) -> torch.Tensor:
    """Restrict a block mask ``(..., nq, nk)`` to kept query blocks (Active) and key blocks (Context).

    The keep arguments are bool vectors ``(nq,)`` / ``(nk,)`` or integer block indices; None keeps
    all. Use :func:`token_blocks` to turn token-level Active / Context masks into block vectors.

    - ``compact=False`` (same shape): rows of dropped query blocks and columns of dropped key
      blocks become False. Dropped rows then attend to nothing (``masked_attention`` outputs
      zeros there; the caller keeps the cached computation for those tokens). Shapes stay fixed,
      so compiled flex never recompiles and still skips the dropped blocks: prefer it on CUDA.
    - ``compact=True``: the sub-matrix of kept rows and columns, ``(..., nq', nk')``, matching
      tokens gathered with :func:`block_token_index` (less work on the SDPA path; on CUDA every
      new token count compiles flex once more).

    A kept query block whose allowed key blocks all lie outside the kept key blocks would have no
    key left; it instead attends to all kept key blocks (its whole Context), never to nothing.
    """
    nq, nk = mask.shape[-2:]
    qk = _as_keep(query_blocks_keep, nq, "query_blocks_keep")
    kk = _as_keep(key_blocks_keep, nk, "key_blocks_keep")
    out = mask.bool()
    if kk is not None:
        kk = kk.to(mask.device)
        out = out & kk
        empty = ~out.any(dim=-1, keepdim=True)
        out = torch.where(empty, kk.expand_as(out), out)
    if qk is not None:
        qk = qk.to(mask.device)
        out = out & qk[:, None]
    if compact:
        if qk is not None:
            out = out[..., qk, :]
        if kk is not None:
            out = out[..., kk]
    return out


MaskKey = tuple[int, int, int]  # (step, branch, layer)


@dataclass
class BlockMaskSet:
    """The block masks of one request: one ``(H, nq, nk)`` mask per (step, branch, layer).

    Each head's mask is stored bit-packed (:func:`pack_bits`, ``ceil(nq * nk / 8)`` bytes). With
    ``dedup=True`` (the default) identical head masks are stored once: masks of consecutive steps
    are often identical, and ``index`` maps each (key, head) to its row in ``packed``.

    Size, for scale: Wan2.1-1.3B at 480p/81 frames (32,760 tokens, block 128 -> 256 x 256 blocks)
    is 8 KiB per head mask; 50 steps x 2 branches x 30 layers x 12 heads is 288 MiB before dedup.
    Record a subset of steps or layers, or rely on dedup, to keep cache entries small.

    Build with :meth:`empty` and :meth:`add`; read with :meth:`get`; store with :meth:`to_tensors`
    (a flat dict of tensors for safetensors, self-describing) and :meth:`from_tensors`;
    :meth:`meta` is a small JSON-able summary.
    """

    num_heads: int
    nq: int
    nk: int
    block: int
    q_len: int
    kv_len: int
    dedup: bool = True
    _rows: list[torch.Tensor] = field(default_factory=list, repr=False)  # packed uint8 (nbytes,)
    _row_of_digest: dict[bytes, int] = field(default_factory=dict, repr=False)
    _index: dict[MaskKey, list[int]] = field(default_factory=dict, repr=False)
    _ones: dict[MaskKey, int] = field(default_factory=dict, repr=False)  # set bits per key
    _steps_of: dict[tuple[int, int], list[int]] | None = field(default=None, repr=False)  # (branch, layer) -> steps
    _pending: list[tuple[MaskKey, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)  # added, not yet on the host

    FORMAT = 1

    @classmethod
    def empty(cls, num_heads: int, q_len: int, kv_len: int, block: int, *, dedup: bool = True) -> BlockMaskSet:
        """An empty set for masks of ``num_heads`` heads over ``q_len`` x ``kv_len`` tokens."""
        return cls(num_heads, num_blocks(q_len, block), num_blocks(kv_len, block), block, q_len, kv_len, dedup)

    @property
    def mask_shape(self) -> tuple[int, int, int]:
        """Shape of one entry: ``(num_heads, nq, nk)``."""
        return (self.num_heads, self.nq, self.nk)

    def add(self, step: int, branch: int, layer: int, mask: torch.Tensor) -> None:
        """Store ``mask (H, nq, nk)`` bool for (step, branch, layer), replacing any earlier one.

        Packs on the mask's device and does not wait for it: the packed rows reach the host (and are
        deduplicated) together at the first read, one transfer per request instead of one per (step, branch,
        layer), each of which would wait for the GPU."""
        if tuple(mask.shape) != self.mask_shape:
            raise ValueError(f"mask must have shape {self.mask_shape}, got {tuple(mask.shape)}")
        key = (int(step), int(branch), int(layer))
        m = mask.detach().bool()
        self._pending.append((key, _pack_rows(m.reshape(self.num_heads, -1)), m.sum()))
        self._steps_of = None

    def _settle(self) -> None:
        """Bring the masks :meth:`add` left on their device to the host, deduplicating their head rows."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        packed_all = torch.stack([p for _, p, _ in pending]).cpu()
        ones_all = torch.stack([n for _, _, n in pending]).cpu().tolist()
        for (key, _, _), packed, ones in zip(pending, packed_all, ones_all):
            rows = []
            for head in packed:
                if self.dedup:
                    digest = hashlib.blake2b(head.numpy().tobytes(), digest_size=16).digest()
                    row = self._row_of_digest.get(digest)
                    if row is None:
                        row = self._row_of_digest[digest] = len(self._rows)
                        self._rows.append(head.clone())
                else:
                    row = len(self._rows)
                    self._rows.append(head.clone())
                rows.append(row)
            self._index[key] = rows
            self._ones[key] = int(ones)

    def get(self, step: int, branch: int, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The ``(H, nq, nk)`` bool mask of (step, branch, layer); KeyError if it was not recorded."""
        self._settle()
        rows = self._index[(int(step), int(branch), int(layer))]
        packed = torch.stack([self._rows[r] for r in rows])
        if device is not None:
            packed = packed.to(device)
        return _unpack_rows(packed, self.nq * self.nk).view(self.mask_shape)

    def nearest(self, step: int, branch: int, layer: int) -> MaskKey | None:
        """The recorded key of (``branch``, ``layer``) with the latest step <= ``step``, or None.

        Masks recorded every few steps (``SparseConfig.stride``) serve the steps in between.
        """
        self._settle()
        if self._steps_of is None:
            by: dict[tuple[int, int], list[int]] = {}
            for s, b, ly in self._index:
                by.setdefault((b, ly), []).append(s)
            self._steps_of = {k: sorted(v) for k, v in by.items()}
        steps = self._steps_of.get((int(branch), int(layer)))
        if not steps:
            return None
        i = bisect.bisect_right(steps, int(step)) - 1
        return (steps[i], int(branch), int(layer)) if i >= 0 else None

    def to_device(self, device: torch.device | str) -> dict[MaskKey, torch.Tensor]:
        """Every mask's packed head rows on ``device`` in one copy: ``{key: (H, nbytes) uint8}``.

        Unpack one with :meth:`unpack` where it is used (cheap on the device; keeps device memory at
        the packed size, 1/8 of the bool masks).
        """
        self._settle()
        if not self._rows:
            return {}
        rows = torch.stack(self._rows).to(device)
        return {key: rows[torch.as_tensor(idx, device=rows.device)] for key, idx in self._index.items()}

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``(H, nbytes)`` packed rows (from :meth:`to_device`) -> ``(H, nq, nk)`` bool, on their device."""
        return _unpack_rows(packed, self.nq * self.nk).view(self.mask_shape)

    def __contains__(self, key: object) -> bool:
        self._settle()
        return key in self._index

    def __len__(self) -> int:
        self._settle()
        return len(self._index)

    def keys(self) -> Iterator[MaskKey]:
        """The recorded (step, branch, layer) keys, sorted."""
        self._settle()
        return iter(sorted(self._index))

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (packed rows + index + keys), as :meth:`to_tensors` gives them."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    @property
    def density(self) -> float:
        """Fraction of allowed (query block, key block) pairs over all recorded masks (0 if empty)."""
        self._settle()
        total = len(self._index) * self.num_heads * self.nq * self.nk
        return sum(self._ones.values()) / total if total else 0.0

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Flat dict for safetensors: ``{prefix}packed`` uint8 (U, bytes), ``{prefix}index`` int32
        (K, H), ``{prefix}keys`` int32 (K, 3) sorted (step, branch, layer), ``{prefix}geometry``
        int64 [format, H, q_len, kv_len, block, dedup]."""
        self._settle()
        keys = sorted(self._index)
        nbytes = -(-self.nq * self.nk // 8)
        packed = torch.stack(self._rows) if self._rows else torch.zeros(0, nbytes, dtype=torch.uint8)
        index = torch.tensor([self._index[k] for k in keys], dtype=torch.int32).reshape(len(keys), self.num_heads)
        geometry = [self.FORMAT, self.num_heads, self.q_len, self.kv_len, self.block, int(self.dedup)]
        return {
            f"{prefix}packed": packed,
            f"{prefix}index": index,
            f"{prefix}keys": torch.tensor(keys, dtype=torch.int32).reshape(len(keys), 3),
            f"{prefix}geometry": torch.tensor(geometry, dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> BlockMaskSet:
        """Inverse of :meth:`to_tensors` (needs only the tensors)."""
        fmt, heads, q_len, kv_len, block, dedup = (int(x) for x in tensors[f"{prefix}geometry"].tolist())
        if fmt != cls.FORMAT:
            raise ValueError(f"unknown BlockMaskSet format {fmt}")
        out = cls.empty(heads, q_len, kv_len, block, dedup=bool(dedup))
        packed = tensors[f"{prefix}packed"].to("cpu", torch.uint8)
        out._rows = list(packed.unbind(0))
        if out.dedup:
            out._row_of_digest = {
                hashlib.blake2b(r.numpy().tobytes(), digest_size=16).digest(): i for i, r in enumerate(out._rows)
            }
        # set bits per row by a byte popcount table (padding bits past nq * nk are zero)
        ones_per_row = _POPCOUNT[packed.long()].sum(dim=-1).tolist() if len(packed) else []
        keys = tensors[f"{prefix}keys"].tolist()
        for key, rows in zip(keys, tensors[f"{prefix}index"].tolist()):
            out._index[tuple(key)] = rows
            out._ones[tuple(key)] = int(sum(ones_per_row[r] for r in rows))
        out._steps_of = None
        return out

    def meta(self) -> dict[str, object]:
        """Small JSON-able summary (geometry, counts, density, bytes) for an entry's metadata."""
        self._settle()
        return {
            "format": self.FORMAT,
            "num_heads": self.num_heads,
            "q_len": self.q_len,
            "kv_len": self.kv_len,
            "block": self.block,
            "nq": self.nq,
            "nk": self.nk,
            "dedup": self.dedup,
            "masks": len(self._index),
            "unique_head_masks": len(self._rows),
            "density": self.density,
            "nbytes": self.nbytes,
        }
