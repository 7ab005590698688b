"""Check and time carnator's block-sparse attention on a CUDA GPU (written for an H200).

Run from the repository root (needs only torch and triton):

    PYTHONPATH=src:lab/src python lab/scripts/check_attention_cuda.py            # Wan2.1-1.3B shape
    PYTHONPATH=src:lab/src python lab/scripts/check_attention_cuda.py --tokens 8192 --quick

1. ``check_flex_against_sdpa('cuda')``: compiled flex vs masked SDPA on small random cases
   (bf16 and fp32, full / partial BlockMasks, fully masked query blocks, dense mask).
2. Full-shape correctness: flex vs float32 masked SDPA at B=1, 12 heads, 32,760 tokens, D=128, bf16.
3. Timings (``triton.testing.do_bench``, median ms): dense SDPA (cuDNN, FlashAttention, default),
   compiled flex at random block densities 0.1..0.5 and dense, flex over top-p masks built from
   random block masses, the BlockMask build, the mass estimate, and the chunked SDPA fallback.
Exits non-zero if a correctness check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import carnator  # noqa: F401
except ImportError:
    # carnator's own dependencies (diffusers, ...) are absent here: load carnator.attention alone
    if importlib.util.find_spec("carnator") is None:
        raise
    _pkg = types.ModuleType("carnator")
    _pkg.__path__ = [str(Path(importlib.util.find_spec("carnator").origin).parent)]
    sys.modules["carnator"] = _pkg

from carnator.attention import (
    check_flex_against_sdpa,
    estimate_block_mass,
    flex_block_mask,
    kernels,
    masked_attention,
    num_blocks,
    topp_block_mask,
)


def bench(fn, rep: int = 200) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def random_block_mask(h: int, nb: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Bernoulli block table with every query block keeping at least its diagonal block."""
    m = torch.rand(1, h, nb, nb, generator=gen) < density
    m |= torch.eye(nb, dtype=torch.bool)
    return m.cuda()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="fewer densities, shorter timings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = True

    # 1. small random cases
    t0 = time.perf_counter()
    try:
        rows = check_flex_against_sdpa("cuda")
        print(f"[1] check_flex_against_sdpa: OK ({time.perf_counter() - t0:.1f} s incl. compile)")
    except AssertionError as e:
        print(f"[1] check_flex_against_sdpa: FAILED: {e}")
        rows, ok = [], False
    for r in rows:
        print("    " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))

    h, n, d, blk = args.heads, args.tokens, args.dim, args.block
    nb = num_blocks(n, blk)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))

    with torch.inference_mode():
        # 2. full-shape correctness
        bm = random_block_mask(h, nb, 0.25, gen)
        bm[:, :, 1] = False  # one query block with no key
        ref = masked_attention(q.float(), k.float(), v.float(), bm, blk, backend="sdpa", chunk=2048)
        for full in (True, False):
            out = kernels._flex_attention(q, k, v, bm, blk, None, full_blocks=full).float()
            err = float((out - ref).abs().max())
            zero = float(out[:, :, blk : 2 * blk].abs().max())
            good = err < 3e-2 and zero == 0.0
            ok &= good
            print(
                f"[2] full shape (1, {h}, {n}, {d}) bf16, density {bm.float().mean():.3f}, "
                f"{'full' if full else 'partial'} blocks: max|flex - sdpa| = {err:.3g}, "
                f"keyless rows max {zero:.3g} -> {'OK' if good else 'FAILED'}"
            )
        del ref

        # 3. timings
        rep = 50 if args.quick else 200
        table: list[tuple[str, float, float]] = []
        for name, backends in (
            ("sdpa dense cuDNN", [SDPBackend.CUDNN_ATTENTION]),
            ("sdpa dense flash", [SDPBackend.FLASH_ATTENTION]),
            ("sdpa dense default", None),
        ):
            def fn():
                return F.scaled_dot_product_attention(q, k, v)

            try:
                if backends is None:
                    table.append((name, 1.0, bench(fn, rep)))
                else:
                    with sdpa_kernel(backends):
                        fn()
                        table.append((name, 1.0, bench(fn, rep)))
            except RuntimeError as e:
                print(f"    {name}: unavailable ({str(e).splitlines()[0][:80]})")

        flex = kernels.compiled_flex_attention()
        densities = (0.1, 0.3, 0.5) if args.quick else (0.1, 0.2, 0.3, 0.4, 0.5)
        for density in (*densities, 1.0):
            bm = random_block_mask(h, nb, density, gen)
            mask = flex_block_mask(bm, blk, n, n)
            table.append(
                (
                    f"flex random {density:.1f}",
                    float(bm.float().mean()),
                    bench(lambda mask=mask: flex(q, k, v, block_mask=mask), rep),
                )
            )
        bm = random_block_mask(h, nb, 0.3, gen)
        table.append(
            (
                "masked_attention (build+flex) 0.3",
                float(bm.float().mean()),
                bench(lambda: masked_attention(q, k, v, bm, blk), rep),
            )
        )
        for p in (0.5, 0.7, 0.9):
            mass = torch.softmax(2.5 * torch.randn(1, h, nb, nb, generator=gen), dim=-1).cuda()
            bm = topp_block_mask(mass, p)
            mask = flex_block_mask(bm, blk, n, n)
            table.append(
                (
                    f"flex top-p p={p}",
                    float(bm.float().mean()),
                    bench(lambda mask=mask: flex(q, k, v, block_mask=mask), rep),
                )
            )
        from torch._dynamo.utils import counters

        dynamo = counters.get("stats", {})
        base = next((t for nm, _, t in table if nm == "sdpa dense cuDNN"), table[0][2])
        print(f"[3] timings, (1, {h}, {n}, {d}) bf16, block {blk}, median ms (x = speedup vs cuDNN dense):")
        print(f"    {'case':36s} {'density':>8s} {'ms':>8s} {'x':>6s}")
        for nm, dens, ms in table:
            print(f"    {nm:36s} {dens:8.3f} {ms:8.3f} {base / ms:6.2f}")
        bm = random_block_mask(h, nb, 0.3, gen)
        print(
            f"    flex_block_mask build: {bench(lambda: flex_block_mask(bm, blk, n, n), rep):.3f} ms; "
            f"estimate_block_mass: {bench(lambda: estimate_block_mass(q, k, blk), rep):.3f} ms; "
            f"topp_block_mask: {bench(lambda: topp_block_mask(mass, 0.9), rep):.3f} ms"
        )
        t0 = time.perf_counter()
        masked_attention(q, k, v, bm, blk, backend="sdpa", chunk=4096)
        torch.cuda.synchronize()
        print(f"    chunked masked SDPA fallback (one call, chunk 4096): {1e3 * (time.perf_counter() - t0):.1f} ms")
        print(f"    dynamo stats: {dict(dynamo)}")
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
