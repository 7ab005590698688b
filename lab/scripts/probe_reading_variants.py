"""Ways to read the probe's tail frame at the default layer and RegionConfig: pixel-resolution maps and colour reads.

    python lab/scripts/probe_reading_variants.py [-n 120] [--gen 48] [--modifiers 1] [--out res.json]

Same scenes, seeds, ground truth (the model's own 50-step clips, read with the judge) and probe as
scripts/measure_probe.py, at the probe layer (the middle one) and the shipped RegionConfig. Per object, tail-frame
masks:

* near: the token region nearest-upsampled (what the signature and measure_probe.py use);
* bilLO-HI: the fused map F of the tail frame bilinearly upsampled to pixels, hysteresis (LO, HI) at pixel resolution;
* relT: the upsampled F over its own maximum >= T, inside the token region dilated by 4 px;

and colour reads inside each: mean (the paper's mean CIELAB), weighted (by the upsampled F), distinctQ (the mean of
the share Q of pixels farthest in CIEDE2000 from the frame's median colour). Prints, per mask, the mean IoU against
the final clip's object mask and the share of objects within CIEDE2000 10 of the final clip's colour (final) and of
the caption's named colour (named).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage
from skimage.filters import apply_hysteresis_threshold
from measure_probe import DE_OK, iou, model_ground_truth, probe_all_layers
from carnator.backbones.embedded import EmbeddedAdapter
from carnator.embedded import load_pipeline
from carnator.signature import (
    RegionConfig,
    ciede2000,
    evidence_region,
    mean_lab,
    select_seeds,
    srgb_to_lab,
    upsample_mask,
)
from carnator_lab.world import caption, sample_scenes
from carnator_lab.world.captions import nouns as caption_nouns
from carnator_lab.world.scene import COLORS

ap = argparse.ArgumentParser(description="probe reading variants")
ap.add_argument("-n", type=int, default=120)
ap.add_argument("--gen", type=int, default=48)
ap.add_argument("--device", default="cpu")
ap.add_argument("--modifiers", type=int, default=1)
ap.add_argument("--out", default="probe-reading-variants.json")
args = ap.parse_args()
if args.device == "cpu":
    torch.set_num_threads(1)
pipe = load_pipeline(args.device)
ad = EmbeddedAdapter(pipe)
L = ad.num_layers()
layer = L // 2
rng = np.random.default_rng(0)
scenes = sample_scenes(args.n, rng, split="heldout")
caps = [caption(s, rng, split="heldout") for s in scenes]
G = min(args.gen, args.n)
t0 = time.time()
gt = {i: g["objs"] for i, g in model_ground_truth(pipe, scenes, caps, G, batch=16)[0].items()}
cfg = RegionConfig()


def bil(f, hw=(64, 64)):
    return F.interpolate(
        torch.tensor(f, dtype=torch.float32)[None, None], size=hw, mode="bilinear", align_corners=False
    )[0, 0].numpy()


R = {}


def add(k, v):
    R.setdefault(k, []).append(v)


for i in range(args.n):
    words = caption_nouns(caps[i])
    store, positions, tail = probe_all_layers(ad, caps[i], i, words, 4, args.modifiers)
    tail = tail.astype(np.float64)
    ev = store[layer]
    lab_img = srgb_to_lab(tail)
    med = np.median(lab_img.reshape(-1, 3), axis=0)
    obj_words = words[:-1]
    for k, w in enumerate(obj_words):
        if obj_words.count(w) != 1 or not positions[w]:
            continue
        cols = [ev.positions.index(p) for p in positions[w]]
        C = ev.cross[:, :, cols].float().mean(dim=(0, 2)).cpu().numpy()
        seeds = select_seeds(C, ad.token_grid(ad.resolve(caps[i], seed=0)), cfg)
        reg = evidence_region(
            C,
            ev.self_attention_columns(seeds.columns),
            seeds,
            tuple(reg_shape := ad.token_grid(ad.resolve(caps[i], seed=0))),
            cfg,
        )
        Ft = reg.fused[-1]
        near = upsample_mask(reg.mask[-1], (64, 64))
        B = bil(Ft)
        masks = {"near": near}
        for lo, hi in ((0.15, 0.3), (0.3, 0.5), (0.4, 0.6), (0.5, 0.7)):
            masks[f"bil{lo}-{hi}"] = apply_hysteresis_threshold(B, lo, hi)
        # bilinear over the region's own max (relative threshold)
        Bn = B / max(B.max(), 1e-9)
        for t in (0.4, 0.5, 0.6):
            masks[f"rel{t}"] = (Bn >= t) & ndimage.binary_dilation(near, iterations=4)
        named = srgb_to_lab(np.array(COLORS[scenes[i].objects[k].color], float) / 255)

        # colour reads
        def reads(m):
            out = {}
            out["mean"] = mean_lab(tail, m) if m.any() else None
            if m.any():
                px = lab_img[m]
                d = np.asarray(ciede2000(px, med[None].repeat(len(px), 0)))
                for q in (0.25, 0.5):
                    n = max(1, int(np.ceil(q * len(px))))
                    sel = np.argsort(-d)[:n]
                    out[f"distinct{q}"] = px[sel].mean(0)
                wts = B[m]
                out["weighted"] = (px * wts[:, None]).sum(0) / max(wts.sum(), 1e-9)
            else:
                for kk in ("distinct0.25", "distinct0.5", "weighted"):
                    out[kk] = None
            return out

        g = gt.get(i, {})
        for mk, m in masks.items():
            rd = reads(m)
            for ck, lab in rd.items():
                add(f"{mk}|{ck}|named", np.inf if lab is None else float(ciede2000(lab, named)))
                if k in g:
                    add(f"{mk}|{ck}|final", np.inf if lab is None else float(ciede2000(lab, g[k][1])))
            if k in g:
                add(f"{mk}|iou", iou(m, g[k][0]))
    if (i + 1) % 20 == 0:
        print("probed", i + 1, time.time() - t0, flush=True)
S = {}
for k, v in R.items():
    v = np.array(v)
    S[k] = dict(n=len(v), val=float(np.mean(v)) if k.endswith("iou") else float(np.mean(v <= DE_OK)))
json.dump(S, open(args.out, "w"), indent=1)
for k in sorted(S):
    print(k, S[k])
