#!/usr/bin/env python3
"""The calibration quality rule's noise floor: how often a plain dense sample with another seed is "unacceptable".

    python lab/scripts/rule_noise.py [-n 48] [--seed 777]

For n train-split captions (as `carnator calibrate` draws them) the embedded model generates two dense
clips, seeds i and 1000 + i, and the world judge scores both. The shapes rule (`carnator.embedded.judge.shapes_rule`)
(fidelity >= dense - delta_fidelity and artifact <= dense + delta_artifact) is applied to the second clip
against the first, for the default deltas and a few wider ones. A reuse cannot be labelled more reliably
than this: an unsafe rate (or bound) below the floor printed here measures seed noise, not reuse.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from carnator.embedded.judge import shapes_rule
from carnator.embedded import load_pipeline
from carnator.embedded.sample import sample_batch
from carnator_lab.world.captions import caption
from carnator.embedded.world.judge import judge
from carnator_lab.world.render import to_uint8
from carnator_lab.world.scene import sample_scenes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    pipe = load_pipeline("cpu")
    rng = np.random.default_rng(args.seed)
    scenes = sample_scenes(args.n, rng, split="train")
    caps = [caption(s, rng, split="train") for s in scenes]
    t0 = time.time()
    clips = {}
    for off in (0, 1000):
        clips[off] = to_uint8(torch.cat([sample_batch(pipe, caps[i:i + args.batch], [off + j for j in range(i, min(i + args.batch, args.n))])
                                         for i in range(0, args.n, args.batch)]))
    a = [judge(f, c) for f, c in zip(clips[0], caps)]
    b = [judge(f, c) for f, c in zip(clips[1000], caps)]
    fa, fb = np.array([r.fidelity for r in a]), np.array([r.fidelity for r in b])
    aa, ab = np.array([r.artifact for r in a]), np.array([r.artifact for r in b])
    default = shapes_rule()
    print(f"{args.n} train captions, two seeds each, {time.time() - t0:.0f} s; fidelity {fa.mean():.3f} / {fb.mean():.3f}, "
          f"artifact {aa.mean():.3f} / {ab.mean():.3f}; mean |difference| fidelity {np.abs(fa - fb).mean():.3f}, artifact {np.abs(aa - ab).mean():.3f}")
    for rule in (default, shapes_rule(0.1, 0.05), shapes_rule(0.2, 0.05), shapes_rule(0.1, 1.0)):
        bad = ~rule.acceptable({"fidelity": fb, "artifact": ab}, {"fidelity": fa, "artifact": aa})
        fid_bad, art_bad = fb < fa - rule.deltas['fidelity'], ab > aa + rule.deltas['artifact']  # which half failed
        tag = " (calibrate's default)" if rule == default else ""
        print(f"rule delta_fidelity {rule.deltas['fidelity']}, delta_artifact {rule.deltas['artifact']}{tag}: a re-seeded dense clip is unacceptable in "
              f"{bad.mean():.0%} ({bad.sum()}/{args.n}; fidelity {fid_bad.mean():.0%}, artifact {art_bad.mean():.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
