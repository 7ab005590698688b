"""The Triton block-sparse kernel (carnator.attention.triton_bsa) against the masked SDPA reference, run on the CPU
through Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is imported: a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
# Triton's interpreter keeps scalars as 1-element arrays, which numpy 2's int() refuses before Triton 3.9 (3.5 fails)
pytestmark = pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9),
                                reason="the interpreter check needs Triton >= 3.9")

CHECK = r"""
import json, torch
from carnator.attention.kernels import BlockTable, masked_attention
from carnator.attention.triton_bsa import block_sparse_attention, kv_lists

g = torch.Generator().manual_seed(0)
errs, changed = [], []
# (B, H, Nq, Nk, D, Dv, block, BLOCK_N): partial last key and query blocks, Nq != Nk, Dv != D, sub-tiles
for b, h, nq, nk, d, dv, blk, bn in [(2, 3, 70, 83, 16, 16, 32, 16), (1, 2, 64, 64, 32, 32, 32, 32),
                                     (1, 1, 100, 50, 16, 32, 16, 16), (1, 2, 96, 96, 16, 16, 32, 16)]:
    q = torch.randn(b, nq, h, d, generator=g).transpose(1, 2)  # (B, H, N, D) views, as the processors pass them
    k = torch.randn(b, nk, h, d, generator=g).transpose(1, 2)
    v = torch.randn(b, nk, h, dv, generator=g).transpose(1, 2)
    t = torch.rand(b, h, -(-nq // blk), -(-nk // blk), generator=g) < 0.5
    t[:, :, 0] = False       # a query block with no key: zeros
    t[:, :, -1, -1] = True   # the partial last key block, kept
    ref = masked_attention(q, k, v, t, blk, backend="sdpa")
    out = block_sparse_attention(q, k, v, kv_lists(t), blk, config={"BLOCK_N": bn})
    errs.append(float((out - ref).abs().max()))
    errs.append(float((masked_attention(q, k, v, BlockTable(t), blk, backend="triton") - ref).abs().max()))
    full = masked_attention(q, k, v, torch.ones_like(t), blk, backend="sdpa")
    changed.append(float((out - full).abs().max()))
counts, idx = kv_lists(torch.tensor([[[[False, True, False, True], [True, True, True, True], [False] * 4]]]))
print(json.dumps({"errs": errs, "changed": changed, "counts": counts.tolist(), "idx": idx.tolist()}))
"""


def test_triton_kernel_equals_masked_sdpa_and_a_mask_changes_the_result():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert max(got["errs"]) < 1e-5
    assert min(got["changed"]) > 1e-2  # the masks matter: the same kernel without them differs
    # kept blocks first and ascending; the rest after them, also ascending
    assert got["counts"] == [[[2, 4, 0]]]
    assert got["idx"] == [[[[1, 3, 0, 2], [0, 1, 2, 3], [0, 1, 2, 3]]]]
