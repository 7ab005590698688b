"""Block-sparse attention kernels and token gather / scatter helpers.

:func:`masked_attention` is exact attention where the queries of query block ``i`` attend only
to the keys of the key blocks ``j`` with ``block_mask[..., i, j]``. Three paths, same result:

- ``"sdpa"`` (CPU, and any device): expand the block mask to an element mask, ``chunk`` query
  rows at a time, and call :func:`torch.nn.functional.scaled_dot_product_attention`. Memory is
  bounded by the chunk; compute is dense (no speedup), so use it for correctness and small sizes.
- ``"triton"`` (chosen automatically on CUDA at blocks of a multiple of 128, unless extra keys are
  attended or :func:`set_block_sparse_kernel` says ``"flex"``): the block-sparse flash-attention kernel of
  :mod:`carnator.attention.triton_bsa`, over key-block lists built once per :class:`BlockTable`.
  It is the faster of the two at the densities Carnator's plans use (docs/BENCHMARKS.md).
- ``"flex"`` (on CUDA where Triton's kernel does not serve): FlexAttention, compiled once per process
  with ``torch.compile``, over a ``BlockMask`` built directly from the block table
  (:func:`flex_block_mask`). Skipped blocks cost nothing; it pays below ~60 % block density on an
  H200 (DESIGN.md field notes). On CUDA the block size must be a multiple of 128 (flex's kernel
  tiles); other block sizes fall back to ``"sdpa"``. On CPU, ``backend="flex"`` runs flex
  *eagerly* (slow, for tests; compiled flex fails on the CPU build).

Query rows with no allowed key (an all-False row of the block mask) output zeros on both paths.

:func:`set_flex_kernel_options` passes FlexAttention ``kernel_options`` (tile sizes, warps,
stages, ``USE_TMA`` on Hopper, ...) to every compiled flex call of this process; ``None`` (the
default) leaves flex's own heuristics. ``carnator bench-scale --flex-options/--kernel-sweep`` times them.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from .blockmask import num_blocks

__all__ = [
    "FLEX_BLOCK",
    "BlockTable",
    "block_sparse_kernel",
    "set_block_sparse_kernel",
    "check_flex_against_sdpa",
    "flex_block_mask",
    "gather_tokens",
    "check_flex_kernel_options",
    "masked_attention",
    "scatter_tokens",
    "set_flex_kernel_options",
]

FLEX_BLOCK = 128
"""Default block size, and the granularity flex needs on CUDA (block % 128 == 0)."""


def block_sparse_kernel(device: torch.device | str, block: int) -> bool:
    """Whether :func:`masked_attention` runs a kernel that skips masked blocks (so a mask saves time) for
    queries on ``device`` with blocks of ``block`` tokens: the Triton kernel (or compiled flex) on CUDA at a
    multiple of 128. Elsewhere it runs the dense ``"sdpa"`` path, whose element mask costs time instead of saving it."""
    return torch.device(device).type == "cuda" and block % FLEX_BLOCK == 0


_ELEMENTS_PER_CHUNK = 1 << 25  # bool mask elements (and attention scores) per SDPA chunk
_KEPT_ELEMENTS = 1 << 22  # largest element mask a BlockTable keeps for the SDPA path (16 MB in float32)
_compiled_flex: Any = None
_flex_options: dict[str, Any] | None = None
_sparse_kernel = "auto"


def set_block_sparse_kernel(name: str) -> str:
    """Which CUDA block-sparse kernel :func:`masked_attention` runs for this process: "auto" (Triton's where it
    serves, else flex) or "flex" (always flex); returns the previous setting."""
    global _sparse_kernel
    if name not in ("auto", "flex"):
        raise ValueError(f"unknown block-sparse kernel {name!r}: 'auto' or 'flex'")
    old, _sparse_kernel = _sparse_kernel, name
    return old


def check_flex_kernel_options(options: Any) -> None:
    """Raise ``ValueError`` unless ``options`` is ``None`` or a dict of ``FlexKernelOptions`` keys.

    Keys are those of ``torch.nn.attention.flex_attention.FlexKernelOptions`` (e.g. ``BLOCK_M``,
    ``BLOCK_N``, ``num_warps``, ``num_stages``, ``USE_TMA``): an unknown key fails here rather than
    as a compile error later.
    """
    if options is None:
        return
    from torch.nn.attention.flex_attention import FlexKernelOptions

    if not isinstance(options, dict):
        raise ValueError(f"flex kernel options must be a dict, got {type(options).__name__}")
    known = FlexKernelOptions.__annotations__
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown FlexAttention kernel option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def set_flex_kernel_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """Use ``options`` as FlexAttention ``kernel_options`` for this process's flex calls; returns the previous ones.

    Checked by :func:`check_flex_kernel_options`. The mask's block size must be a multiple of
    ``BLOCK_M`` and ``BLOCK_N``. Each distinct set compiles the kernel once more.
    """
    global _flex_options
    check_flex_kernel_options(options)
    previous, _flex_options = _flex_options, (dict(options) or None) if options is not None else None
    return previous


def _flex_kwargs(kernel_options: dict[str, Any] | None) -> dict[str, Any]:
    opts = _flex_options if kernel_options is None else kernel_options
    return {"kernel_options": dict(opts)} if opts else {}


def gather_tokens(x: torch.Tensor, idx: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """The tokens ``idx`` (int64) of ``x`` along the token dimension ``dim`` (``index_select``).

    The default ``dim=-2`` fits both hidden states ``(B, N, C)`` and per-head ``(B, H, N, D)``.
    """
    return x.index_select(dim, idx.to(x.device))


def scatter_tokens(x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Copy of ``x`` with the tokens ``idx`` along ``dim`` replaced by ``values`` (``index_copy``).

    Inverse of :func:`gather_tokens`: ``scatter_tokens(x, idx, gather_tokens(x, idx)) == x``.
    """
    return x.index_copy(dim, idx.to(x.device), values.to(x.dtype))


def _broadcast_mask(block_mask: torch.Tensor, b: int, h: int, nq: int, nk: int) -> torch.Tensor:
    """``(nq, nk)``, ``(H, nq, nk)`` or ``(B|1, H|1, nq, nk)`` -> bool view ``(B, H, nq, nk)``."""
    m = block_mask.bool()
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.shape[-2:] != (nq, nk):
        raise ValueError(f"block_mask has {tuple(m.shape[-2:])} blocks, expected ({nq}, {nk})")
    return m.expand(b, h, nq, nk)


class BlockTable:
    """A bool block table ``(B, H, nq, nk)`` that keeps the FlexAttention ``BlockMask`` built from it.

    Pass it to :func:`masked_attention` instead of the bare tensor when the same mask serves several
    calls: a recorded mask serves every layer call of the steps up to the next recorded one
    (``SparseConfig.stride``), and building a ``BlockMask`` (a sort of every query block's key
    blocks) costs milliseconds per call at Wan's token counts.
    """

    def __init__(self, table: torch.Tensor):
        self.table = table.bool()
        self._flex: dict[tuple[int, int, int], Any] = {}
        self._lists: tuple[torch.Tensor, torch.Tensor] | None = None
        self._elements: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    def flex(self, block: int, q_len: int, kv_len: int):
        """The ``BlockMask`` of :func:`flex_block_mask` for this table, built on the first call."""
        key = (block, q_len, kv_len)
        if key not in self._flex:
            self._flex[key] = flex_block_mask(self.table, block, q_len, kv_len)
        return self._flex[key]

    def lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton kernel's key-block lists (:func:`~carnator.attention.triton_bsa.kv_lists`), built on the first call."""
        if self._lists is None:
            from .triton_bsa import kv_lists

            self._lists = kv_lists(self.table)
        return self._lists

    def elements(self, key: tuple, build):
        """The masked-SDPA path's element mask for ``key`` (``build()`` on the first call), as an additive float
        mask: kept only where one call covers every query row with at most ``_KEPT_ELEMENTS`` mask elements
        (small token counts, e.g. the embedded model's 2 x 4 x 512 x 512, 8 MB in float32)."""
        if key not in self._elements:
            self._elements[key] = build()
        return self._elements[key]


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor | BlockTable,
    block: int = FLEX_BLOCK,
    scale: float | None = None,
    *,
    backend: Literal["auto", "sdpa", "flex", "triton"] = "auto",
    chunk: int | None = None,
    extra_k: torch.Tensor | None = None,
    extra_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q (B, H, Nq, D)`` over ``k, v (B, H, Nk, D|Dv)`` limited to allowed blocks.

    ``block_mask`` is bool ``(B, H, nq, nk)`` (or broadcastable: ``(H, nq, nk)``, ``(nq, nk)``,
    size-1 B / H) with ``nq = ceil(Nq / block)``, ``nk = ceil(Nk / block)``, or a :class:`BlockTable`
    (the flex path then reuses the table's ``BlockMask`` when its B and H are the call's). ``scale`` defaults to
    ``1 / sqrt(D)``. Rows with no allowed key output zeros. ``backend="auto"``: on CUDA with
    ``block % 128 == 0`` the Triton kernel (flex where extra keys are attended, Triton is missing, a head dim
    is not a power of two, or :func:`set_block_sparse_kernel` chose flex), else chunked SDPA (``chunk`` query
    rows at a time; default: about 32 M mask elements per chunk).

    ``extra_k, extra_v (B, H, L, D|Dv)``: keys every query attends besides the masked ones (the text
    tokens of a joint text-video attention); the softmax runs over the allowed keys and all of these.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, N, D)")
    b, h, nq_tok, _ = q.shape
    nk_tok = k.shape[2]
    prepared = block_mask if isinstance(block_mask, BlockTable) else None
    table: torch.Tensor = block_mask.table if isinstance(block_mask, BlockTable) else block_mask
    bm = _broadcast_mask(table.to(q.device), b, h, num_blocks(nq_tok, block), num_blocks(nk_tok, block))
    if backend == "auto":
        backend = "sdpa"
        if block_sparse_kernel(q.device, block):
            backend = "triton" if extra_k is None and _triton_serves(q, v) else "flex"
    if backend not in ("flex", "sdpa", "triton"):
        raise ValueError(f"unknown backend {backend!r}")
    # The table's kept masks serve only a call of its own batch, heads and device (else bm was broadcast or moved).
    keep = prepared if prepared is not None and tuple(table.shape) == tuple(bm.shape) and table.device == q.device else None
    flex_mask = keep.flex(block, nq_tok, nk_tok) if backend == "flex" and keep is not None else None
    if extra_k is not None:
        if backend == "triton":
            raise ValueError("the Triton kernel attends no extra keys; use flex or sdpa")
        return _with_extra_keys(q, k, v, bm, block, scale, chunk, backend, extra_k, extra_v, flex_mask, keep)
    if backend == "triton":
        from .triton_bsa import block_sparse_attention, kv_lists

        return block_sparse_attention(q, k, v, keep.lists() if keep is not None else kv_lists(bm), block, scale)
    if backend == "flex":
        return _flex_attention(q, k, v, bm, block, scale, mask=flex_mask)
    return _sdpa_masked(q, k, v, bm, block, scale, chunk, prepared=keep)


def _triton_serves(q: torch.Tensor, v: torch.Tensor) -> bool:
    if _sparse_kernel == "flex":
        return False
    from .triton_bsa import available

    pow2 = all(n >= 16 and n & (n - 1) == 0 for n in (q.shape[-1], v.shape[-1]))
    return available() and pow2 and q.dtype in (torch.float16, torch.bfloat16)


def _sdpa_masked(q, k, v, bm, block, scale, chunk, n_extra: int = 0, prepared: BlockTable | None = None) -> torch.Tensor:
    # With n_extra > 0, the last n_extra keys of k, v are attended by every query. ``prepared``: the BlockTable
    # that bm came from; it keeps the (additive) element mask when one chunk covers every query row.
    b, h, nq_tok, _ = q.shape
    nk_tok = k.shape[2] - n_extra
    if chunk is None:
        chunk = max(1, _ELEMENTS_PER_CHUNK // max(1, b * h * (nk_tok + n_extra)))
    kept = prepared is not None and chunk >= nq_tok and b * h * nq_tok * (nk_tok + n_extra) <= _KEPT_ELEMENTS
    out = q.new_empty(b, h, nq_tok, v.shape[-1])
    for start in range(0, nq_tok, chunk):
        stop = min(start + chunk, nq_tok)
        if kept and prepared is not None:  # SDPA on the CPU runs ~20 % faster with a float mask than with a bool one
            mask, has, keyless = prepared.elements((block, nq_tok, nk_tok, n_extra, q.dtype),
                                                   lambda: _additive(*_element_mask(bm, block, 0, nq_tok, nk_tok, n_extra), q))
        else:
            mask, has, keyless = _element_mask(bm, block, start, stop, nk_tok, n_extra)
        o = F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=mask, scale=scale)
        out[:, :, start:stop] = o.masked_fill(~has, 0) if keyless else o
    return out


def _element_mask(bm: torch.Tensor, block: int, start: int, stop: int, nk_tok: int,
                  n_extra: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(mask, has, keyless)`` of query rows start..stop: the bool element mask (the block rows repeated block
    times - repeat_interleave is ~40x faster on the CPU than gathering with a token -> block index - cut to the
    rows and to Nk, then ``n_extra`` always-allowed keys), whether each row has a key, and whether any has none."""
    b0, b1 = start // block, (stop - 1) // block + 1
    rows, cut = bm[:, :, b0:b1], slice(start - b0 * block, stop - b0 * block)
    mask = rows.repeat_interleave(block, dim=-2)[:, :, cut].repeat_interleave(block, dim=-1)[..., :nk_tok]
    has = (rows.any(dim=-1) | (n_extra > 0)).repeat_interleave(block, dim=-1)[:, :, cut, None]
    keyless = not bool(has.all())
    if keyless:
        mask = mask | ~has  # keyless rows: any finite values, zeroed by the caller
    if n_extra:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], n_extra)], dim=-1)
    return mask, has, keyless


def _additive(mask: torch.Tensor, has: torch.Tensor, keyless: bool, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The bool element mask as an additive one of q's dtype and device (0 allowed, -inf not)."""
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf")), has, keyless


def _with_extra_keys(q, k, v, bm, block, scale, chunk, backend, extra_k, extra_v, flex_mask=None, prepared=None) -> torch.Tensor:
    """Masked attention over k, v plus dense attention over extra_k, extra_v, in one softmax."""
    if backend == "sdpa":
        return _sdpa_masked(q, torch.cat([k, extra_k], dim=2), torch.cat([v, extra_v], dim=2), bm, block, scale, chunk,
                            extra_k.shape[2], prepared=prepared)
    # flex: the two parts separately, merged by their row log-sum-exps (a keyless masked row has lse -inf)
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    flex = compiled_flex_attention() if q.is_cuda else flex_attention
    mask = flex_mask if flex_mask is not None else flex_block_mask(bm, block, q.shape[2], k.shape[2])
    kw = _flex_kwargs(None) if q.is_cuda else {}
    o_m, aux_m = flex(q, k, v, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True), **kw)
    o_e, aux_e = flex(q, extra_k, extra_v, scale=scale, return_aux=AuxRequest(lse=True), **kw)
    lse_m, lse_e = aux_m.lse, aux_e.lse
    lse = torch.logaddexp(lse_m.float(), lse_e.float())
    w_m, w_e = torch.exp(lse_m.float() - lse)[..., None], torch.exp(lse_e.float() - lse)[..., None]
    return (o_m.float().nan_to_num(0.0) * w_m + o_e.float() * w_e).to(q.dtype)


def flex_block_mask(block_mask: torch.Tensor, block: int, q_len: int, kv_len: int, *, full_blocks: bool = True):
    """A FlexAttention ``BlockMask`` from a bool block table ``(B, H, nq, nk)``.

    Built with ``BlockMask.from_kv_blocks`` (kv indices: the allowed key blocks of each query
    block, ascending). The ``mask_mod`` reads the same table, so eager flex (which ignores the
    block table and evaluates only ``mask_mod``) gives the same answer as the compiled kernel.
    ``full_blocks=True`` lists every allowed block as *full* (the kernel then skips ``mask_mod``
    inside it, which is exact: within an allowed block every in-range element is allowed; flex
    masks positions past ``q_len`` / ``kv_len`` itself); ``False`` lists them as partial blocks
    that evaluate ``mask_mod`` elementwise (slower, for cross-checking).
    """
    from torch.nn.attention.flex_attention import BlockMask

    table = block_mask.bool().contiguous()
    counts = table.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return table[b, h, q_idx // block, kv_idx // block]

    kw: dict[str, Any] = {"BLOCK_SIZE": block, "mask_mod": mask_mod, "seq_lengths": (q_len, kv_len)}
    if full_blocks:
        return BlockMask.from_kv_blocks(torch.zeros_like(counts), indices, counts, indices, **kw)
    return BlockMask.from_kv_blocks(counts, indices, **kw)


def compiled_flex_attention():
    """``torch.compile(flex_attention)``, created once per process.

    Compiled with static shapes (``dynamic=False``): new BlockMasks of the same shape reuse the
    kernel; each new (shape, dtype, full/partial-block layout) compiles once more, and past
    dynamo's recompile limit (8 by default; ``torch._dynamo.config.recompile_limit``) flex falls
    back to eager, which materializes the scores. A serving process sees few shapes; on CUDA
    prefer the same-shape ``restrict(..., compact=False)`` (skipped blocks cost flex nothing)
    over gathering a different number of tokens at every step.
    """
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _flex_attention(q, k, v, bm, block, scale, *, full_blocks: bool = True, kernel_options: dict[str, Any] | None = None,
                    mask=None) -> torch.Tensor:
    """Compiled flex on CUDA with ``kernel_options`` (default: :func:`set_flex_kernel_options`'s); ``mask``: a
    ``BlockMask`` already built from ``bm`` (full blocks)."""
    if mask is None:
        mask = flex_block_mask(bm, block, q.shape[2], k.shape[2], full_blocks=full_blocks)
    if not q.is_cuda:  # eager: evaluates mask_mod densely, ignores kernel options; for tests only
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, scale=scale)
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale, **_flex_kwargs(kernel_options))


def _random_block_mask(b, h, nq, nk, density, generator, device) -> torch.Tensor:
    """Bernoulli(density) block table with one fully masked query block per (b, h) row set."""
    m = torch.rand(b, h, nq, nk, generator=generator) < density
    m[:, :, 0] = False  # a query block with no key: must output zeros
    return m.to(device)


def check_flex_against_sdpa(
    device: str = "cuda",
    *,
    shape: tuple[int, int, int, int] = (2, 4, 1000, 64),
    block: int = FLEX_BLOCK,
    densities: tuple[float, ...] = (0.1, 0.3, 0.6, 1.0),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    atol: float | None = None,
) -> list[dict[str, Any]]:
    """Compare flex (compiled on CUDA) with masked SDPA on random inputs; raise on a mismatch.

    ``shape = (B, H, N, D)``; ``N`` is deliberately not a multiple of ``block`` (partial last
    block). Each case checks full-block and partial-block BlockMasks, a query block with no key
    (zeros expected), and a dense all-True mask against plain SDPA. The reference is masked SDPA in
    float32 on the same (rounded) inputs. Returns one dict per case with the max abs errors.
    """
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = shape
    nb = num_blocks(n, block)
    results = []
    for dtype in dtypes:
        tol = atol if atol is not None else (3e-2 if dtype in (torch.bfloat16, torch.float16) else 2e-3)
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(device, dtype) for _ in range(3))
        for density in densities:
            bm = _random_block_mask(b, h, nb, nb, density, gen, device)
            if density >= 1.0:
                bm[:] = True
            ref = _sdpa_masked(q.float(), k.float(), v.float(), bm, block, None, None)
            row: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "density": float(bm.float().mean())}
            for full in (True, False):
                out = _flex_attention(q, k, v, bm, block, None, full_blocks=full).float()
                name = "full" if full else "partial"
                row[f"err_{name}"] = float((out - ref).abs().max())
                if density < 1.0:  # query block 0 has no key
                    row[f"zero_rows_{name}"] = float(out[:, :, :block].abs().max())
            if density >= 1.0:
                row["err_dense_sdpa"] = float((F.scaled_dot_product_attention(q, k, v).float() - ref).abs().max())
            results.append(row)
            bad = [key for key, val in row.items() if key.startswith(("err", "zero")) and not val <= tol]
            if bad:
                raise AssertionError(f"flex vs masked SDPA mismatch on {device}: {row} (tol {tol})")
    return results
