"""Validate the shapes-world judge on rendered ground truth.

    python lab/scripts/validate_judge.py [-n 2000] [--noise 0.03] [--seed 0] [--frames 16] [--size 64]

Renders N random scenes (train and held-out splits alike), reads each clip with
``carnator_lab.world.read`` and prints per-attribute accuracy against the scene (objects matched to
the ground-truth masks by IoU), the mean mask IoU, the share of clips with fidelity 1.0 against
a random caption, and the mean artifact score: clean, with Gaussian noise (a generator's grain)
and with a Gaussian blur (a VAE decode's softness).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy import ndimage

from carnator_lab.world import caption, judge, read, render, sample_scenes, to_uint8


def evaluate(scenes, videos, masks, captions):
    attrs = ("background", "shape", "color", "size", "motion")
    hits = {a: [] for a in attrs}
    clip_ok, ious, fid, art, extra = [], [], [], [], 0
    errors = []
    for i, sc in enumerate(scenes):
        rd = read(videos[i])
        ok = rd.background == sc.background
        hits["background"].append(ok)
        used = set()
        for j, o in enumerate(sc.objects):
            gt = masks[i, j]
            cand = [(np.logical_and(r.masks, gt).sum() / max(np.logical_or(r.masks, gt).sum(), 1), k)
                    for k, r in enumerate(rd.objects) if k not in used]
            iou, k = max(cand) if cand else (0.0, None)
            ious.append(iou)
            r = rd.objects[k] if k is not None and iou > 0.2 else None
            if r is not None:
                used.add(k)
            for a in ("shape", "color", "size", "motion"):
                h = r is not None and getattr(r, a) == getattr(o, a)
                hits[a].append(h)
                ok &= h
                if not h:
                    errors.append((a, getattr(o, a), getattr(r, a) if r else None, sc))
        extra += len(rd.objects) - len(used)
        clip_ok.append(ok)
        rep = judge(videos[i], captions[i], reading=rd)
        fid.append(rep.fidelity)
        art.append(rep.artifact)
    return dict(acc={a: float(np.mean(h)) for a, h in hits.items()}, clip=float(np.mean(clip_ok)),
                iou=float(np.mean(ious)), fid1=float(np.mean(np.array(fid) == 1.0)), fid=float(np.mean(fid)),
                artifact=float(np.mean(art)), extra=extra, errors=errors)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--noise", type=float, default=0.03)
    ap.add_argument("--blur", type=float, default=1.0, help="also test a Gaussian blur of this many px (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--show-errors", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)  # small CPU ops: threading only adds overhead (and hurts on shared machines)

    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    scenes = sample_scenes(args.n, rng, split=None)
    captions = [caption(s, rng, split=None) for s in scenes]
    t0 = time.time()
    clean, noisy, soft, masks = [], [], [], []
    for k in range(0, args.n, args.batch):
        v, m = render(scenes[k:k + args.batch], frames=args.frames, size=args.size, generator=gen)
        clean.append(to_uint8(v))
        noisy.append(to_uint8(v + args.noise * torch.randn(v.shape, generator=gen)))
        if args.blur:
            soft.append(to_uint8(torch.from_numpy(ndimage.gaussian_filter(v.numpy(), (0, 0, 0, args.blur, args.blur)))))
        masks.append(np.pad(m.numpy(), ((0, 0), (0, 2 - m.shape[1]), (0, 0), (0, 0), (0, 0))))
    clean, noisy, masks = np.concatenate(clean), np.concatenate(noisy), np.concatenate(masks)
    variants = [("clean", clean), (f"noise sigma={args.noise}", noisy)]
    if args.blur:
        variants.append((f"blur sigma={args.blur}px", np.concatenate(soft)))
    print(f"rendered {args.n} clips of {args.frames}x{args.size}x{args.size} in {time.time() - t0:.1f}s (CPU)")
    for name, vids in variants:
        t0 = time.time()
        r = evaluate(scenes, vids, masks, captions)
        dt = time.time() - t0
        accs = "  ".join(f"{a} {v * 100:.2f}%" for a, v in r["acc"].items())
        print(f"[{name}] {accs}\n    all attributes of a clip correct {r['clip'] * 100:.2f}%  mask IoU {r['iou']:.3f}  "
              f"spurious objects {r['extra']}  fidelity==1 {r['fid1'] * 100:.2f}% (mean {r['fid']:.4f})  "
              f"artifact mean {r['artifact']:.5f}  ({dt / args.n * 1000:.0f} ms/clip for read+judge)")
        for e in r["errors"][: args.show_errors]:
            print("    miss:", e)


if __name__ == "__main__":
    main()
