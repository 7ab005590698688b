#!/usr/bin/env python3
"""Build a probe-distillation pool: the model's own trajectories, with where each object ends up.

    python lab/scripts/probe_pool.py --weights .ckpt/run8b -n 4096 --out /tmp/probe_pool.pt    # on the lent H200

Why: the method reads, at the last of the first 4 sampling steps (sigma 0.97 at flow shift 3), where
each noun's object will be. The grounding loss of ``carnator_lab.train (`carnator-lab train`)`` teaches the cross-attention
where the object is in the *rendered* clip that was noised; at sigma 0.97 that clip is 3 % of the
input, so the attention can only spread over the places the object might be (lab/notebook/PROBE.md: IoU 0.29
against the final clip). But sampling is deterministic: the object lands where the ODE from this
noise puts it. This script samples N train-split captions with the model (the sampler and CFG of
``sample_batch``), keeps each trajectory's input at the probe step and its final latent, and reads the
final clip with the world judge (per caption object: its mask in every frame). ``carnator_lab.train (`carnator-lab train`)
--probe-pool`` then trains the probe step's cross-attention to point at the object's final place
(``--probe-ground``) and, optionally, the probe step's x0 prediction towards the final clip
(``--probe-x0``, a reflow of the first steps, Liu et al. 2023).

Writes one torch file: x (N, C, F, H, W) bf16 probe-step inputs, t (the probe step's timestep), final
(N, C, F, H, W) bf16 final latents, ids (N, L) caption word ids, roles (N, L) int8 word -> object 0/1 or
2 (place) or -1, cover (N, 3, tokens) fp16 per token the share of its pixels covered by each object
(matched by the judge; zeros where unmatched) and the background.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import torch

from carnator.embedded import load_pipeline
from carnator.embedded.sample import denoise_batch
from carnator_lab.world.captions import caption
from carnator.embedded.world.judge import judge
from carnator_lab.world.render import to_uint8
from carnator_lab.world.scene import sample_scenes
from carnator_lab.train import caption_roles, token_cover


def _masks(args):
    frames, scene = args
    rep = judge(frames, scene)
    out = np.zeros((2, *frames.shape[:3]), dtype=bool)        # (2, T, H, W)
    for k, m in enumerate(rep.matches[:2]):
        if m is not None:
            out[k] = rep.objects[m].masks
    return np.packbits(out, axis=-1), rep.fidelity


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="a carnator_lab.train (`carnator-lab train`) --out directory (its EMA weights sample)")
    ap.add_argument("-n", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--probe-steps", type=int, default=4, help="the probe's length; its last step is kept")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    w = Path(args.weights)
    pipe = load_pipeline(dev, w / "weights.safetensors", w / "weights.json")
    cfg = pipe.cfg
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    scenes = sample_scenes(args.n, rng, split="train")
    caps = [caption(sc, rng, split="train") for sc in scenes]
    t0 = time.time()
    xs, finals, frames = [], [], []
    for a in range(0, args.n, args.batch):
        batch = caps[a:a + args.batch]
        noise = torch.randn((len(batch), cfg.latent_channels, cfg.frames, cfg.size // cfg.codec_factor, cfg.size // cfg.codec_factor), generator=gen, device=dev)
        lat, (xp, tp) = denoise_batch(pipe, batch, noise, keep_step=args.probe_steps - 1)
        xs.append(xp.bfloat16())
        finals.append(lat.bfloat16())
        frames.append(to_uint8(pipe.vae.decode(lat).clamp(0, 1)))
        print(f"sampled {min(a + args.batch, args.n)}/{args.n} ({time.time() - t0:.0f}s)", flush=True)
    frames = np.concatenate(frames)
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        read = pool.map(_masks, list(zip(frames, scenes)), chunksize=16)
    fid = float(np.mean([r[1] for r in read]))
    T, H, W = frames.shape[1:4]
    objs = torch.from_numpy(np.stack([np.unpackbits(r[0], axis=-1, count=W) for r in read])).to(dev).float()  # (N, 2, T, H, W)
    matched = (objs.flatten(2).amax(-1) > 0).float()
    cover = token_cover(objs, cfg).flatten(2).half()
    print(f"judged {args.n} clips in {time.time() - t0:.0f}s: fidelity {fid:.3f}, objects matched {matched.sum().item():.0f}", flush=True)
    ids, _ = pipe.tokenizer(caps)
    roles = caption_roles(caps, cfg.max_words)
    torch.save({"x": torch.cat(xs).cpu(), "t": tp.float().cpu(), "final": torch.cat(finals).cpu(), "ids": ids.cpu(), "roles": roles,
                "cover": cover.cpu(), "fidelity": fid, "weights": str(w), "probe_steps": args.probe_steps}, args.out)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
