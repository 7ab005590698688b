"""Tests of carnator.attention: block mass, top-p masks, bit packing, mask sets, masked attention."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from carnator.attention import (
    BlockMaskSet,
    BlockTable,
    block_token_index,
    check_flex_against_sdpa,
    estimate_block_mass,
    exact_block_mass,
    flex_block_mask,
    gather_tokens,
    masked_attention,
    num_blocks,
    pack_bits,
    restrict,
    scatter_tokens,
    token_blocks,
    topp_block_mask,
    unpack_bits,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


def dense_block_mass(q, k, block):
    """Brute force: full float64 softmax, summed per key block, averaged per query block."""
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    nq, nk = num_blocks(q.shape[2], block), num_blocks(k.shape[2], block)
    out = torch.zeros(*q.shape[:2], nq, nk, dtype=torch.float64)
    for i in range(nq):
        for j in range(nk):
            out[..., i, j] = p[..., i * block : (i + 1) * block, j * block : (j + 1) * block].sum(-1).mean(-1)
    return out


def reference_attention(q, k, v, block_mask, block):
    """Dense float64 attention under the element mask expanded from ``block_mask``; keyless rows -> 0."""
    nq_tok, nk_tok = q.shape[2], k.shape[2]
    bm = block_mask.bool()
    while bm.dim() < 4:
        bm = bm.unsqueeze(0)
    qb = torch.arange(nq_tok) // block
    kb = torch.arange(nk_tok) // block
    elem = bm[:, :, qb][..., kb]
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~elem, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v.double()


# ---------------------------------------------------------------- block mass


def test_exact_block_mass_matches_brute_force_for_any_chunk():
    q, k = _randn(2, 3, 45, 8, seed=1), _randn(2, 3, 37, 8, seed=2)
    ref = dense_block_mass(q, k, 8)
    assert ref.shape == (2, 3, 6, 5)
    for chunk in (1, 7, 8, 45, 1000):
        got = exact_block_mass(q, k, 8, chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ref.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))


def test_estimate_is_exact_when_blocks_are_constant_including_partial_last_block():
    # every token of a block equal -> pooled scores are the true scores; the log(len) term weighs
    # the 5-token last key block correctly
    block = 8
    q = _randn(1, 2, 4, 6, seed=3).repeat_interleave(block, dim=2)[:, :, :29]
    k = _randn(1, 2, 4, 6, seed=4).repeat_interleave(block, dim=2)[:, :, :29]
    est = estimate_block_mass(q, k, block)
    torch.testing.assert_close(est.double(), dense_block_mass(q, k, block), rtol=0, atol=1e-6)


def test_estimate_ranks_planted_strong_block_first():
    b, h, n, d, block = 2, 4, 160, 16, 16
    nb = n // block
    q, k = 0.3 * _randn(b, h, n, d, seed=5), 0.3 * _randn(b, h, n, d, seed=6)
    g = _gen(7)
    target = torch.stack([torch.randperm(nb, generator=g) for _ in range(b * h)]).view(b, h, nb)
    for bi in range(b):
        for hi in range(h):
            for i in range(nb):
                u = torch.randn(d, generator=g, dtype=torch.float64)
                u = 4.0 * u / u.norm()
                q[bi, hi, i * block : (i + 1) * block] += u
                t = int(target[bi, hi, i])
                k[bi, hi, t * block : (t + 1) * block] += u
    exact = exact_block_mass(q, k, block, chunk=64)
    est = estimate_block_mass(q, k, block)
    assert torch.equal(exact.argmax(-1), target)
    assert torch.equal(est.argmax(-1), target)
    torch.testing.assert_close(est.sum(-1), torch.ones(b, h, nb))


def test_block_mass_rejects_bad_shapes():
    with pytest.raises(ValueError):
        estimate_block_mass(torch.zeros(1, 2, 8, 4), torch.zeros(1, 3, 8, 4), 4)
    with pytest.raises(ValueError):
        exact_block_mass(torch.zeros(2, 8, 4), torch.zeros(2, 8, 4), 4)


# ---------------------------------------------------------------- top-p


def test_topp_hand_computed():
    m = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert topp_block_mask(m, 0.8).tolist() == [True, True, False, False]
    assert topp_block_mask(m, 0.81).tolist() == [True, True, True, False]
    assert topp_block_mask(m, 0.5).tolist() == [True, False, False, False]
    assert topp_block_mask(m, 0.01).tolist() == [True, False, False, False]
    assert topp_block_mask(m, 1.0).tolist() == [True] * 4
    # order does not matter, only mass; rows need not be normalized
    perm = torch.tensor([0.05, 0.15, 0.5, 0.3])
    assert topp_block_mask(perm * 10, 0.8).tolist() == [False, False, True, True]
    # ties: the lower index first
    assert topp_block_mask(torch.full((4,), 0.25), 0.5).tolist() == [True, True, False, False]
    assert topp_block_mask(torch.tensor([0.2, 0.4, 0.4]), 0.3).tolist() == [False, True, False]
    with pytest.raises(ValueError):
        topp_block_mask(m, 0.0)


def test_topp_is_minimal_on_random_rows():
    mass = torch.softmax(2 * _randn(3, 4, 10, 12, seed=8, dtype=torch.float32), dim=-1)
    for p in (0.3, 0.7, 0.9, 0.99):
        keep = topp_block_mask(mass, p)
        assert keep.shape == mass.shape and keep.dtype == torch.bool
        kept = (mass * keep).sum(-1)
        assert bool((kept >= p - 1e-5).all())
        # dropping the weakest kept block falls below p (fewest blocks)
        weakest = torch.where(keep, mass, torch.inf).amin(-1)
        assert bool(((kept - weakest) < p).all())
        assert bool((keep.sum(-1) >= 1).all())


# ---------------------------------------------------------------- bit packing


@pytest.mark.parametrize("shape", [(1,), (7,), (9,), (3, 5, 7), (2, 3, 13, 11), (0,)])
def test_pack_round_trip(shape):
    m = torch.rand(shape, generator=_gen(9)) < 0.4
    packed = pack_bits(m)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(m.numel() / 8),)
    assert torch.equal(unpack_bits(packed, shape), m)


def test_pack_bit_order():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)).tolist() == [1, 1]
    assert pack_bits(torch.tensor([0, 1, 1], dtype=torch.bool)).tolist() == [6]
    assert pack_bits(torch.ones(8, dtype=torch.bool)).tolist() == [255]
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), (3, 7))


# ---------------------------------------------------------------- mask sets


def _random_masks(h, nq, nk, seed):
    return torch.rand(h, nq, nk, generator=_gen(seed)) < 0.3


def test_block_mask_set_round_trip_dedup_and_storage():
    s = BlockMaskSet.empty(num_heads=3, q_len=50, kv_len=37, block=8)
    assert (s.nq, s.nk, s.mask_shape) == (7, 5, (3, 7, 5))
    a, b = _random_masks(3, 7, 5, 10), _random_masks(3, 7, 5, 11)
    for step in range(4):  # identical consecutive steps
        s.add(step, 0, 0, a)
    s.add(0, 1, 0, b)
    s.add(0, 0, 1, torch.cat([a[:1], b[1:]]))  # heads shared with earlier masks
    assert len(s) == 6 and (2, 0, 0) in s and (9, 0, 0) not in s
    assert s.meta()["unique_head_masks"] == len({bytes(pack_bits(m).tolist()) for m in [*a, *b]})
    assert torch.equal(s.get(3, 0, 0), a) and torch.equal(s.get(0, 1, 0), b)
    expected_density = (4 * a.sum() + b.sum() + a[0].sum() + b[1:].sum()).item() / (6 * 3 * 7 * 5)
    assert s.density == pytest.approx(expected_density)
    with pytest.raises(KeyError):
        s.get(9, 0, 0)
    with pytest.raises(ValueError):
        s.add(0, 0, 0, a[:2])

    data = st_save(s.to_tensors("attn."))
    back = BlockMaskSet.from_tensors(st_load(data), "attn.")
    assert list(back.keys()) == list(s.keys())
    for key in list(s.keys()):
        assert torch.equal(back.get(*key), s.get(*key))
    assert back.density == pytest.approx(s.density) and back.nbytes == s.nbytes
    json.dumps(back.meta())
    # adding after a reload still deduplicates against stored rows
    back.add(7, 0, 0, a)
    assert back.meta()["unique_head_masks"] == s.meta()["unique_head_masks"]

    plain = BlockMaskSet.empty(3, 50, 37, 8, dedup=False)
    for step in range(4):
        plain.add(step, 0, 0, a)
    deduped = BlockMaskSet.empty(3, 50, 37, 8)
    for step in range(4):
        deduped.add(step, 0, 0, a)
    assert plain.meta()["unique_head_masks"] == 12 and deduped.meta()["unique_head_masks"] == 3
    # packed rows of 5 bytes + int32 index (4 keys x 3 heads) + int32 keys (4 x 3) + int64 geometry (6)
    assert plain.nbytes == 12 * 5 + 48 + 48 + 48 and deduped.nbytes == 3 * 5 + 48 + 48 + 48
    assert torch.equal(BlockMaskSet.from_tensors(plain.to_tensors()).get(2, 0, 0), a)


def test_masks_added_between_reads_keep_their_order_and_replacements():
    """add() packs without reading back; the rows reach the host at the next read, in the order added."""
    a, b, c = (_random_masks(2, 4, 4, k) for k in (1, 2, 3))
    s = BlockMaskSet.empty(2, 32, 32, 8)
    s.add(0, 0, 0, a)
    s.add(0, 0, 0, b)  # replaces a before any read
    s.add(5, 0, 0, c)
    assert s.nearest(4, 0, 0) == (0, 0, 0) and torch.equal(s.get(0, 0, 0), b)
    s.add(5, 0, 0, a)  # replaces c after a read
    assert torch.equal(s.get(5, 0, 0), a) and len(s) == 2
    assert s.density == pytest.approx((b.sum() + a.sum()).item() / (2 * 2 * 4 * 4))
    assert s.meta()["unique_head_masks"] == len({bytes(pack_bits(m).tolist()) for m in [*a, *b, *c]})


def test_empty_block_mask_set_round_trip():
    s = BlockMaskSet.empty(2, 16, 16, 8)
    back = BlockMaskSet.from_tensors(s.to_tensors())
    assert len(back) == 0 and back.density == 0.0


# ---------------------------------------------------------------- masked attention


def _random_block_mask(b, h, nq, nk, seed, density=0.4):
    m = torch.rand(b, h, nq, nk, generator=_gen(seed)) < density
    m[0, 0, 1] = False  # a query block with no key
    m[..., 0, 0] = True
    return m


@pytest.mark.parametrize("chunk", [None, 5, 64])
def test_masked_attention_equals_float64_reference(chunk):
    b, h, nq_tok, nk_tok, d, block = 2, 3, 45, 37, 8, 8  # partial last blocks on both sides
    q, k, v = _randn(b, h, nq_tok, d, seed=12), _randn(b, h, nk_tok, d, seed=13), _randn(b, h, nk_tok, 5, seed=14)
    bm = _random_block_mask(b, h, 6, 5, seed=15)
    ref = reference_attention(q, k, v, bm, block)
    out = masked_attention(q, k, v, bm, block, chunk=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out32 = masked_attention(q.float(), k.float(), v.float(), bm, block, chunk=chunk)
    torch.testing.assert_close(out32.double(), ref, rtol=0, atol=1e-5)
    # keyless query block -> zeros; the mask changes the result vs dense
    assert bool((out[0, 0, block : 2 * block] == 0).all())
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() > 0.1


def test_masked_attention_broadcast_masks_and_scale():
    q, k, v = _randn(2, 3, 20, 4, seed=16), _randn(2, 3, 20, 4, seed=17), _randn(2, 3, 20, 4, seed=18)
    m2 = torch.rand(5, 5, generator=_gen(19)) < 0.5
    m2[:, 0] = True
    m3 = torch.rand(3, 5, 5, generator=_gen(20)) < 0.5
    m3[..., 0] = True
    torch.testing.assert_close(
        masked_attention(q, k, v, m2, 4), reference_attention(q, k, v, m2.expand(2, 3, 5, 5), 4), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        masked_attention(q, k, v, m3, 4), reference_attention(q, k, v, m3, 4), rtol=0, atol=1e-12
    )
    full = torch.ones(5, 5, dtype=torch.bool)
    torch.testing.assert_close(
        masked_attention(q, k, v, full, 4, scale=0.3), F.scaled_dot_product_attention(q, k, v, scale=0.3)
    )
    with pytest.raises(ValueError):
        masked_attention(q, k, v, torch.ones(4, 5, dtype=torch.bool), 4)


def test_full_mask_equals_plain_sdpa():
    q, k, v = (_randn(1, 2, 33, 16, seed=s, dtype=torch.float32) for s in (21, 22, 23))
    out = masked_attention(q, k, v, torch.ones(1, 2, 5, 5, dtype=torch.bool), 8)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_all_false_mask_outputs_zeros():
    q, k, v = (_randn(1, 2, 10, 4, seed=s) for s in (24, 25, 26))
    out = masked_attention(q, k, v, torch.zeros(2, 2, dtype=torch.bool), 8)
    assert torch.equal(out, torch.zeros_like(out))


def test_flex_block_mask_table_and_eager_flex_match_sdpa():
    # BlockMask built from the table holds exactly the table (full and partial variants), and eager
    # flex with its mask_mod gives the masked-SDPA answer (compiled flex is checked on CUDA only).
    q, k, v = (_randn(2, 2, 45, 8, seed=s, dtype=torch.float32) for s in (27, 28, 29))
    bm = _random_block_mask(2, 2, 6, 6, seed=30)
    for full in (True, False):
        mask = flex_block_mask(bm, 8, 45, 45, full_blocks=full)
        assert torch.equal(mask.to_dense().bool(), bm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = masked_attention(q, k, v, bm, 8, backend="flex")
        rows = check_flex_against_sdpa(
            "cpu", shape=(1, 2, 40, 8), block=8, densities=(0.3, 1.0), dtypes=(torch.float32,)
        )
    torch.testing.assert_close(flex.double(), reference_attention(q, k, v, bm, 8), rtol=0, atol=1e-5)
    assert len(rows) == 2 and rows[0]["zero_rows_full"] == 0.0


def test_a_block_table_builds_its_flex_mask_once_and_answers_as_the_bare_tensor():
    q, k, v = (_randn(2, 2, 45, 8, seed=s, dtype=torch.float32) for s in (31, 32, 33))
    bm = _random_block_mask(2, 2, 6, 6, seed=34)
    table = BlockTable(bm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = masked_attention(q, k, v, bm, 8, backend="flex")
        first = masked_attention(q, k, v, table, 8, backend="flex")
        built = table.flex(8, 45, 45)
        second = masked_attention(q * 2, k, v, table, 8, backend="flex")
        sdpa = masked_attention(q, k, v, table, 8, backend="sdpa")
    assert torch.equal(first, ref)
    torch.testing.assert_close(sdpa, masked_attention(q, k, v, bm, 8, backend="sdpa"), rtol=1e-6, atol=1e-6)
    assert table.flex(8, 45, 45) is built and len(table._flex) == 1          # built once, reused
    assert torch.equal(built.to_dense().bool(), bm)
    assert not torch.equal(second, first)                                   # same mask, new queries
    # a table whose batch differs from the call's is broadcast and built afresh, not its cached mask misused
    one = BlockTable(bm[:1, :1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = masked_attention(q, k, v, one, 8, backend="flex")
    assert torch.equal(out, masked_attention(q, k, v, bm[:1, :1].expand(2, 2, 6, 6), 8, backend="flex")) and not one._flex


def test_a_block_table_keeps_the_sdpa_element_mask_and_answers_as_the_bare_tensor():
    """CPU path: the table keeps its additive element mask (built once), with keyless rows still zero."""
    q, k, v = (_randn(2, 3, 45, 8, seed=s, dtype=torch.float32) for s in (41, 42, 43))
    bm = _random_block_mask(2, 3, 6, 6, seed=44)
    bm[0, 1, 2] = False  # a query block with no key block: its rows output zeros
    table = BlockTable(bm)
    ref = masked_attention(q, k, v, bm, 8, backend="sdpa")
    first = masked_attention(q, k, v, table, 8, backend="sdpa")
    kept = dict(table._elements)
    second = masked_attention(q * 2, k, v, table, 8, backend="sdpa")
    assert len(kept) == 1 and all(table._elements[key][0] is m[0] for key, m in kept.items())  # built once, reused
    torch.testing.assert_close(first, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second, masked_attention(q * 2, k, v, bm, 8, backend="sdpa"), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(first[0, 1, 16:24]) == 0 and torch.count_nonzero(first[0, 0, 16:24]) > 0
    # with extra keys (joint text-video attention) the table keeps that call's mask too, apart from the plain one
    ek, ev = (_randn(2, 3, 5, 8, seed=s, dtype=torch.float32) for s in (45, 46))
    joint = masked_attention(q, k, v, table, 8, backend="sdpa", extra_k=ek, extra_v=ev)
    torch.testing.assert_close(joint, masked_attention(q, k, v, bm, 8, backend="sdpa", extra_k=ek, extra_v=ev), rtol=1e-6, atol=1e-6)
    assert len(table._elements) == 2 and torch.count_nonzero(joint[0, 1, 16:24]) > 0  # the extra keys serve keyless rows
    # one chunk per call only: a call split in chunks keeps nothing
    chunked = BlockTable(bm)
    torch.testing.assert_close(masked_attention(q, k, v, chunked, 8, backend="sdpa", chunk=16), ref, rtol=1e-6, atol=1e-6)
    assert not chunked._elements


# ---------------------------------------------------------------- restriction and token helpers


def test_restrict_semantics():
    m = torch.tensor(
        [
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    qk = torch.tensor([True, True, False])
    kk = torch.tensor([True, True, True, False])
    same = restrict(m, qk, kk)
    assert same.tolist() == [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
    # a kept row losing all its keys falls back to all kept keys
    assert restrict(m, None, torch.tensor([True, False, False, True]))[1].tolist() == [True, False, False, True]
    assert restrict(m, None, torch.tensor([1, 2])).tolist() == [[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0]]
    # integer indices == bool vectors; compact = the kept sub-matrix
    assert torch.equal(restrict(m, torch.tensor([0, 1]), torch.tensor([0, 1, 2])), same)
    assert restrict(m, qk, kk, compact=True).tolist() == [[1, 1, 0], [0, 1, 1]]
    assert torch.equal(restrict(m), m)
    # leading dims broadcast
    batched = m.expand(2, 3, 3, 4)
    assert torch.equal(restrict(batched, qk, kk, compact=True)[1, 2], restrict(m, qk, kk, compact=True))


def test_token_blocks_and_block_token_index():
    active = torch.zeros(21, dtype=torch.bool)
    active[[3, 20]] = True
    blocks = token_blocks(active, 8)
    assert blocks.tolist() == [True, False, True]
    assert block_token_index(blocks, 8, 21).tolist() == [*range(8), *range(16, 21)]
    assert block_token_index(torch.tensor([1]), 8, 21).tolist() == list(range(8, 16))


def test_compact_restriction_equals_same_shape_restriction():
    # Active queries / Context keys: gathering whole kept blocks and attending with the compact mask
    # gives the kept rows of the same-shape restricted attention; dropped query rows output zeros.
    block, n, h = 4, 22, 2
    q, k, v = (_randn(1, h, n, 6, seed=s) for s in (31, 32, 33))
    bm = _random_block_mask(1, h, 6, 6, seed=34, density=0.5)
    qkeep = torch.tensor([False, True, True, False, False, True])
    kkeep = torch.tensor([True, True, True, False, True, True])
    same = masked_attention(q, k, v, restrict(bm, qkeep, kkeep), block)
    qi, ki = block_token_index(qkeep, block, n), block_token_index(kkeep, block, n)
    compact = masked_attention(
        gather_tokens(q, qi),
        gather_tokens(k, ki),
        gather_tokens(v, ki),
        restrict(bm, qkeep, kkeep, compact=True),
        block,
    )
    torch.testing.assert_close(gather_tokens(same, qi), compact, rtol=0, atol=1e-12)
    dropped = block_token_index(~qkeep, block, n)
    assert bool((gather_tokens(same, dropped) == 0).all())


def test_gather_scatter_round_trip():
    x = _randn(2, 10, 3, seed=35)
    idx = torch.tensor([7, 1, 4])
    g = gather_tokens(x, idx)
    assert torch.equal(g, x[:, idx])
    assert torch.equal(scatter_tokens(x, idx, g), x)
    y = scatter_tokens(x, idx, torch.zeros_like(g))
    assert bool((y[:, idx] == 0).all()) and torch.equal(y[:, 0], x[:, 0])
    x4 = _randn(1, 2, 10, 3, seed=36)
    assert torch.equal(gather_tokens(x4, idx), x4[:, :, idx])


def test_nearest_mask_serves_the_steps_between_recorded_ones():
    from carnator.attention.state import AttentionSession, SparseConfig
    from carnator.denoise import Program

    g = torch.Generator().manual_seed(3)
    ms = BlockMaskSet.empty(num_heads=2, q_len=40, kv_len=40, block=8)
    m0, m5 = (torch.rand(2, 5, 5, generator=g) < 0.5 for _ in range(2))
    ms.add(0, 0, 1, m0)
    ms.add(5, 0, 1, m5)
    assert ms.nearest(3, 0, 1) == (0, 0, 1)
    assert ms.nearest(5, 0, 1) == (5, 0, 1)
    assert ms.nearest(49, 0, 1) == (5, 0, 1)
    assert ms.nearest(-1, 0, 1) is None      # before the first recorded step
    assert ms.nearest(3, 1, 1) is None       # other branch never recorded
    assert ms.nearest(3, 0, 0) is None       # other layer never recorded
    # the packed device copy unpacks to the same masks as get()
    dev = ms.to_device("cpu")
    assert torch.equal(ms.unpack(dev[(5, 0, 1)]), ms.get(5, 0, 1))
    # a request's session applies step 0's mask at steps 1..4 and step 5's from 5 on
    session = AttentionSession()
    session.preload(ms, "cpu")
    t4 = session.cached_mask(ms, 4, (0,), 1, "cpu")
    assert torch.equal(t4.table[0], m0)
    t7 = session.cached_mask(ms, 7, (0,), 1, "cpu")
    assert torch.equal(t7.table[0], m5)
    assert session.cached_mask(ms, 7, (0,), 0, "cpu") is None
    # one table per recorded step: steps 5..49 share step 5's (and the BlockMask built from it)
    assert session.cached_mask(ms, 9, (0,), 1, "cpu") is t7 and session._tables.keys() == {((5, 0, 1),)}
    # a capture stride of 2 records only even steps
    prog = Program(capture=SparseConfig(block=8, p=0.9, stride=2))
    assert [s for s in range(5) if prog.attention(s).capture is not None] == [0, 2, 4]
    with pytest.raises(ValueError):
        SparseConfig(p=0.0)


def test_capture_reads_the_configured_block_mass():
    """SparseConfig.mass picks the estimator: a key block that holds one strong key among weak ones wins under the
    exact mass but not under the pooled estimate (its mean key is pulled towards zero); hand-made Q, K."""
    from carnator.attention.state import AttentionPlan, AttentionSession, SparseConfig, StepAttention

    # 1 query block of 2 identical queries; 2 key blocks of 2 keys. Block 0: one key aligned with q (logit 8) and
    # one opposite (-8); block 1: two keys at logit 2. Exact mass: block 0 ~ e^8 / (e^8 + 2 e^2) ~ 0.995. Pooled:
    # mean key of block 0 is 0 (logit 0 + log 2), of block 1 logit 2 + log 2, so the estimate favours block 1.
    d = 4
    q = torch.zeros(1, 1, 2, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 4, d)
    k[0, 0, 0, 0], k[0, 0, 1, 0], k[0, 0, 2, 0], k[0, 0, 3, 0] = 16.0, -16.0, 4.0, 4.0   # logits x scale 1/2
    got = {}
    for mass in ("estimate", "exact"):
        session = AttentionSession()
        StepAttention(AttentionPlan(capture=SparseConfig(block=2, p=0.6, mass=mass)), session, 0).capture(0, q, k)
        got[mass] = session.record.captured.get(0, 0, 0)[0, 0].tolist()
    assert got == {"estimate": [False, True], "exact": [True, False]}
    with pytest.raises(ValueError, match="mass"):
        SparseConfig(mass="sampled")
