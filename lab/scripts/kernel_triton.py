#!/usr/bin/env python3
"""Time the Triton block-sparse kernel against compiled flex and d x cuDNN SDPA at one attention shape (CUDA).

    python lab/scripts/kernel_triton.py --heads 12 -n 32760 --out kernel.json      # Wan2.1-1.3B, 480p

Every launch config of the grid (BLOCK_N x num_warps x num_stages x warp_specialize) is checked against the
masked SDPA reference, then timed at each block density; flex runs with the best tile options of session 3.
"""

import argparse
import itertools
import json

import torch
import triton

from carnator_lab.scale import kernel_bench

FLEX_BEST = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "USE_TMA": True}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("-n", type=int, default=32760)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--densities", default="0.1,0.2,0.3,0.5")
    ap.add_argument("--grid", default="64,128:4,8:2,3,4:0,1", help="BLOCK_N:num_warps:num_stages:warp_specialize lists")
    ap.add_argument("--skip-flex", action="store_true", help="time flex with its default options only once (faster)")
    ap.add_argument("--out", default="kernel.json")
    args = ap.parse_args()
    axes = [[int(x) for x in part.split(",")] for part in args.grid.split(":")]
    configs = [{"BLOCK_N": bn, "num_warps": w, "num_stages": s, "warp_specialize": bool(ws)} for bn, w, s, ws in itertools.product(*axes)]
    rep = kernel_bench(args.heads, args.n, args.head_dim, tuple(float(x) for x in args.densities.split(",")),
                       option_sets=[None] if args.skip_flex else [FLEX_BEST], triton_configs=configs)
    rep["torch"], rep["triton_version"], rep["device"] = torch.__version__, triton.__version__, torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"{rep['device']} torch {rep['torch']} triton {rep['triton_version']}; cuDNN dense {rep['sdpa_cudnn_ms']:.2f} ms, "
          f"flex dense {rep['flex_dense_ms']:.2f} ms, flex/limit " + " ".join(f"{r['density']:.2f}:{r['ratio_to_limit']:.2f}x" for r in rep["rows"]))
    for t in sorted(rep["triton"], key=lambda t: t.get("dense_ms", 1e9)):
        if "error" in t:
            print(t["config"], t["error"][:160])
            continue
        print(t["config"], f"err {t['max_err_small']:.1e}/{t['max_err_vs_sdpa']:.1e} dense {t['dense_ms']:.2f} ms; /limit "
              + " ".join(f"{r['density']:.2f}:{r['ratio_to_limit']:.2f}x" for r in t["rows"]))


if __name__ == "__main__":
    main()
