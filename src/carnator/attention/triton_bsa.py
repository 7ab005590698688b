"""A block-sparse flash-attention forward kernel in Triton (a kernel nearer the limit than flex).

:func:`block_sparse_attention` computes exactly what :func:`~carnator.attention.kernels.masked_attention`
computes - the queries of query block ``i`` attend only to the keys of the key blocks ``j`` with
``table[..., i, j]``, rows with no allowed key output zeros - but loops, per query block, over the list of
its kept key blocks only (as flex does), with the online softmax of FlashAttention-2 in base 2 and the
scale folded into one multiply. The key-block lists come from :func:`kv_lists` (kept indices first, in
ascending order, so consecutive query blocks stream the same keys through L2).

It needs Triton (the CUDA build of torch ships it) and runs on CUDA; with ``TRITON_INTERPRET=1`` it runs on the
CPU through Triton's interpreter (slow; how the tests check it). Forward only: nothing here trains.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with torch's CUDA builds; the CPU build lacks it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

__all__ = ["available", "block_sparse_attention", "kv_lists", "DEFAULT_CONFIG"]

#: launch settings (BLOCK_N is the key tile inside a mask block; it must divide the mask block)
DEFAULT_CONFIG = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "warp_specialize": False}


def available() -> bool:
    return triton is not None


def kv_lists(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key-block lists of a bool block table ``(B, H, nq, nk)``: ``counts (B, H, nq)`` int32 and
    ``indices (B, H, nq, nk)`` int32 holding each row's kept key blocks first, ascending."""
    if table.dtype != torch.bool or table.dim() != 4:
        raise ValueError("table must be a bool (B, H, nq, nk) tensor")
    counts = table.sum(-1, dtype=torch.int32)
    # a stable sort of "not kept" puts the kept blocks first, each group in ascending block order
    indices = torch.sort((~table).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return counts.contiguous(), indices.contiguous()


if triton is not None:

    @triton.jit
    def _load_rows(ptr, b, h, start, s_b, s_h, s_n, N, ROWS: tl.constexpr, DIM: tl.constexpr, MASKED: tl.constexpr):
        """Rows start .. start + ROWS of head (b, h), bounds-checked only where ``MASKED``."""
        offs = start + tl.arange(0, ROWS)
        ptrs = ptr + b * s_b + h * s_h + offs[:, None] * s_n + tl.arange(0, DIM)[None, :]
        if MASKED:
            return tl.load(ptrs, mask=offs[:, None] < N, other=0.0)
        return tl.load(ptrs)

    @triton.jit
    def _attend(q, K, V, b, h, start_n, m_i, l_i, acc, qk_scale, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, N_K,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """One key tile of the online softmax (base 2, qk_scale = scale * log2(e)); ``MASKED``: keys past N_K
        (the last block's padding) get -inf."""
        k = _load_rows(K, b, h, start_n, s_kb, s_kh, s_kn, N_K, BLOCK_N, HEAD_DIM, MASKED)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = qk + tl.where(start_n + tl.arange(0, BLOCK_N) < N_K, 0.0, float("-inf"))[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(V, b, h, start_n, s_vb, s_vh, s_vn, N_K, BLOCK_N, HEAD_DIM_V, MASKED)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return m_new, l_i, acc

    @triton.jit
    def _bsa_fwd(
        Q, K, V, Out, COUNTS, INDICES,
        qk_scale,
        s_qb, s_qh, s_qn,
        s_kb, s_kh, s_kn,
        s_vb, s_vh, s_vn,
        s_ob, s_oh, s_on,
        s_cb, s_ch,
        s_ib, s_ih, s_iq,
        H, N_Q, N_K,
        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, MASK_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)  # query block (BLOCK_M = MASK_BLOCK rows)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        q = _load_rows(Q, b, h, pid_m * MASK_BLOCK, s_qb, s_qh, s_qn, N_Q, MASK_BLOCK, HEAD_DIM, True)
        m_i = tl.full([MASK_BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([MASK_BLOCK], dtype=tl.float32)
        acc = tl.zeros([MASK_BLOCK, HEAD_DIM_V], dtype=tl.float32)
        n_kept = tl.load(COUNTS + b * s_cb + h * s_ch + pid_m)
        idx_base = INDICES + b * s_ib + h * s_ih + pid_m * s_iq
        SUB: tl.constexpr = MASK_BLOCK // BLOCK_N
        # The kept blocks are ascending, so a partial last key block can only be the last in the list: every
        # other block runs without bounds checks, that one (if kept) after them with them.
        last = tl.load(idx_base + n_kept - 1, mask=n_kept > 0, other=0)
        tail = ((N_K % MASK_BLOCK) != 0) & (n_kept > 0) & (last == (N_K - 1) // MASK_BLOCK)
        n_main = n_kept - tail.to(tl.int32)
        for j in tl.range(0, n_main * SUB, warp_specialize=WARP_SPECIALIZE):
            start_n = tl.load(idx_base + j // SUB) * MASK_BLOCK + (j % SUB) * BLOCK_N
            m_i, l_i, acc = _attend(q, K, V, b, h, start_n, m_i, l_i, acc, qk_scale, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, N_K,
                                    HEAD_DIM, HEAD_DIM_V, BLOCK_N, False)
        for j in range(n_main * SUB, n_kept * SUB):
            start_n = last * MASK_BLOCK + (j % SUB) * BLOCK_N
            m_i, l_i, acc = _attend(q, K, V, b, h, start_n, m_i, l_i, acc, qk_scale, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, N_K,
                                    HEAD_DIM, HEAD_DIM_V, BLOCK_N, True)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no kept key: zeros
        offs_m = pid_m * MASK_BLOCK + tl.arange(0, MASK_BLOCK)
        tl.store(Out + b * s_ob + h * s_oh + offs_m[:, None] * s_on + tl.arange(0, HEAD_DIM_V)[None, :], acc.to(Out.dtype.element_ty),
                 mask=offs_m[:, None] < N_Q)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lists: tuple[torch.Tensor, torch.Tensor],
    block: int = 128,
    scale: float | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention of ``q (B, H, Nq, D)`` over ``k, v (B, H, Nk, D|Dv)`` where query block ``i`` attends only to
    the key blocks listed for it in ``lists = kv_lists(table)`` (blocks of ``block`` tokens, queries and keys).

    ``config``: ``BLOCK_N`` (key tile, divides ``block``), ``num_warps``, ``num_stages``, ``warp_specialize``
    (Triton's automatic warp specialization of the key loop, Triton >= 3.4) (default
    :data:`DEFAULT_CONFIG`: the fastest of a 24-setting grid at both Wan shapes on an H200)."""
    if triton is None:
        raise RuntimeError("block_sparse_attention needs Triton (part of torch's CUDA builds)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, N, D)")
    b, h, nq_tok, d = q.shape
    nk_tok, dv = k.shape[2], v.shape[-1]
    counts, indices = lists
    nqb = -(-nq_tok // block)
    if tuple(counts.shape) != (b, h, nqb) or indices.shape[:3] != counts.shape or indices.shape[3] < -(-nk_tok // block):
        raise ValueError(f"key-block lists {tuple(counts.shape)} / {tuple(indices.shape)} do not fit q {tuple(q.shape)}, k {tuple(k.shape)} at block {block}")
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block)  # a key tile never spans two mask blocks
    if block % cfg["BLOCK_N"] or block < 16 or block & (block - 1) or d & (d - 1) or dv & (dv - 1):
        raise ValueError("block, BLOCK_N and the head dims must be powers of two, with BLOCK_N dividing block")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.empty(b, h, nq_tok, dv, dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _bsa_fwd[(nqb, b * h)](
        q, k, v, o, counts, indices,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        counts.stride(0), counts.stride(1),
        indices.stride(0), indices.stride(1), indices.stride(2),
        h, nq_tok, nk_tok,
        HEAD_DIM=d, HEAD_DIM_V=dv, MASK_BLOCK=block, BLOCK_N=cfg["BLOCK_N"], WARP_SPECIALIZE=cfg["warp_specialize"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o
