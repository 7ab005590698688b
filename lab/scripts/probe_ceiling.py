"""The best tail-frame IoU a token-resolution region can reach on the embedded model's grid (issue 3's probe bar).

    python lab/scripts/probe_ceiling.py [-n 400]

Renders N held-out scenes (``sample_scenes(N, default_rng(0), split="heldout")``, positions from
``torch.Generator().manual_seed(0)``) and scores, against each object's true tail-frame mask (>= 4 px), masks
built from the *true* per-token coverage of the 8 x 8 tail-frame token grid (8 x 8 px tokens):

* blocky: tokens with coverage >= t, nearest-upsampled to pixels (what the probe's token region is);
* oracle: the best IoU over the k most-covered tokens, k = 1..11;
* smooth: the coverage map bilinearly upsampled, divided by its maximum, thresholded at t (a soft map).

A perfect probe is bounded by these numbers; measure_probe.py's IoU is measured the same way (blocky).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from carnator_lab.world.render import render
from carnator_lab.world.scene import sample_scenes


def iou(a: np.ndarray, b: np.ndarray) -> float:
    u = (a | b).sum()
    return float((a & b).sum() / u) if u else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scenes = sample_scenes(args.n, np.random.default_rng(0), split="heldout")
    masks = render(scenes, generator=torch.Generator().manual_seed(0)).masks[:, :, -1].numpy()  # (B, n, H, W)
    H = masks.shape[-1]
    tok = H // 8
    blocky = {t: [] for t in (0.25, 0.5, 0.75)}
    smooth = {t: [] for t in (0.2, 0.3, 0.4, 0.5)}
    oracle, areas = [], []
    for px in masks.reshape(-1, H, H):
        if px.sum() < 4:
            continue
        areas.append(int(px.sum()))
        cov = px.reshape(8, tok, 8, tok).mean(axis=(1, 3))
        up = np.ones((tok, tok), bool)
        for t in blocky:
            blocky[t].append(iou(np.kron(cov >= t, up), px))
        order = np.argsort(-cov.ravel())
        best = 0.0
        for k in range(1, 12):
            m = np.zeros(64, bool)
            m[order[:k]] = True
            best = max(best, iou(np.kron(m.reshape(8, 8), up), px))
        oracle.append(best)
        s = F.interpolate(torch.tensor(cov, dtype=torch.float32)[None, None], size=(H, H), mode="bilinear", align_corners=False)[0, 0].numpy()
        s = s / s.max()
        for t in smooth:
            smooth[t].append(iou(s >= t, px))
    print(f"{len(oracle)} objects; tail-frame area median {np.median(areas):.0f} px (frame {H * H} px)")
    for t, v in blocky.items():
        print(f"blocky, coverage >= {t}: mean IoU {np.mean(v):.3f}")
    print(f"oracle token set: mean IoU {np.mean(oracle):.3f}")
    for t, v in smooth.items():
        print(f"smooth (bilinear) >= {t} of max: mean IoU {np.mean(v):.3f}")


if __name__ == "__main__":
    main()
