"""Block-mask math and block-sparse attention for historical sparse-connectivity reuse.

Recording a request (per denoising step, CFG branch, layer; all heads at once)::

    from carnator.attention import BlockMaskSet, estimate_block_mass, topp_block_mask
    masks = BlockMaskSet.empty(num_heads=H, q_len=N, kv_len=N, block=128)
    mask = topp_block_mask(estimate_block_mass(q, k, 128), p=0.9)       # (B, H, nq, nk) bool
    masks.add(step, branch, layer, mask[b])                               # one CFG branch b
    tensors = masks.to_tensors("attn.")                                   # for the cache bank

Reusing it::

    masks = BlockMaskSet.from_tensors(tensors, "attn.")
    bm = masks.get(step, branch, layer, device=q.device)                  # (H, nq, nk)
    out = masked_attention(q, k, v, bm, block=masks.block)                # Triton (or flex) on CUDA, SDPA else

Middle-layer window (Active queries, Context keys): ``restrict(bm, token_blocks(active, block),
token_blocks(context, block))``; rows of dropped query blocks output zeros (keep the cached
computation there), or gather whole blocks with ``block_token_index`` and ``compact=True``.
"""

from .blockmask import (
    BlockMaskSet,
    block_token_index,
    estimate_block_mass,
    exact_block_mass,
    num_blocks,
    pack_bits,
    restrict,
    token_blocks,
    topp_block_mask,
    unpack_bits,
)
from .kernels import (
    FLEX_BLOCK,
    BlockTable,
    check_flex_against_sdpa,
    flex_block_mask,
    gather_tokens,
    masked_attention,
    scatter_tokens,
)

__all__ = [
    "FLEX_BLOCK",
    "BlockMaskSet",
    "BlockTable",
    "block_token_index",
    "check_flex_against_sdpa",
    "estimate_block_mass",
    "exact_block_mass",
    "flex_block_mask",
    "gather_tokens",
    "masked_attention",
    "num_blocks",
    "pack_bits",
    "restrict",
    "scatter_tokens",
    "token_blocks",
    "topp_block_mask",
    "unpack_bits",
]
