#!/usr/bin/env python3
"""Train the embedded shapes-world model (flow matching, as Wan) in one device call.

    python scripts/train_embedded.py --minutes 7 --out $OUT            # on the lent H200
    python scripts/train_embedded.py --minutes 7 --resume $PREV --out $OUT       # $PREV: an earlier --out

Resuming from an earlier --out directory continues its raw weights, EMA weights, AdamW moments
(opt.safetensors, bf16) and architecture; resuming from a weights file keeps only the weights.

Data are rendered on the GPU on the fly from the world's *train* split (held-out attribute
combinations and caption templates are never seen). Writes to --out: weights.safetensors (EMA,
fp16) + weights.json (config, checksum, training info), resume.safetensors (raw weights, fp16),
opt.safetensors (AdamW moments, bf16), loss.csv, and with --eval-n > 0 eval.json (held-out judge fidelity per sampling shift),
eval_frames.npy and eval_captions.json (first 24 clips of the best shift): 8 files, the
device tool's return limit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from carnator.embedded import EmbeddedConfig, EmbeddedPipeline, save_pipeline
from carnator_lab.world.captions import PLACE, caption, vocabulary, word_roles
from carnator_lab.world.render import render
from carnator_lab.world.scene import sample_scenes


class Pool:
    """Rendered clips (uint8, on the device) and tokenized captions, refreshed a chunk at a time.

    Rendering the world on the fly each step made the step render-bound (~120 ms at batch 256);
    a pool rendered once (and refreshed in chunks) leaves the step to the model.
    """

    def __init__(self, pipe, n: int, captions_per_clip: int, seed: int, dev, gen):
        self.pipe, self.n, self.k, self.dev, self.gen = pipe, n, captions_per_clip, dev, gen
        self.rng = np.random.default_rng(seed)
        cfg = pipe.cfg
        self.video = torch.empty((n, 3, cfg.frames, cfg.size, cfg.size), dtype=torch.uint8, device=dev)
        self.ids = torch.zeros((n, captions_per_clip, cfg.max_words), dtype=torch.long, device=dev)
        # Where the objects are (dilated by 2 px, so a shape drawn too big is caught too): the loss's
        # foreground weight. One bit per pixel and frame.
        self.fg = torch.zeros((n, cfg.frames, cfg.size, cfg.size), dtype=torch.bool, device=dev)
        # Grounding targets: per token, the share of its pixels covered by object 0, object 1 and the
        # place (background); per caption word, which of the three it describes (-1: a filler).
        pt, ph, pw = cfg.patch_size
        grid = (cfg.frames // pt, cfg.size // (ph * cfg.codec_factor), cfg.size // (pw * cfg.codec_factor))
        self.tok = torch.zeros((n, 3, *grid), dtype=torch.float16, device=dev)
        self.roles = torch.full((n, captions_per_clip, cfg.max_words), -1, dtype=torch.int8, device=dev)
        self.cursor = 0
        self.refresh(n)

    def refresh(self, count: int, chunk: int = 2048) -> None:
        cfg = self.pipe.cfg
        while count > 0:
            m = min(chunk, count, self.n - self.cursor)
            scenes = sample_scenes(m, self.rng, split="train")
            caps = [caption(s, self.rng, split="train") for s in scenes for _ in range(self.k)]
            ids, _ = self.pipe.tokenizer(caps)
            roles = caption_roles(caps, cfg.max_words)
            sl = slice(self.cursor, self.cursor + m)
            with torch.no_grad():
                r = render(scenes, cfg.frames, cfg.size, device=self.dev, generator=self.gen)
                self.video[sl] = (r.video * 255).round().to(torch.uint8)
                fg = r.masks.any(1).float()                                           # (m, T, H, W)
                self.fg[sl] = torch.nn.functional.max_pool2d(fg.flatten(0, 1)[:, None], 5, 1, 2).view_as(fg) > 0
                objs = torch.zeros((m, 2, *r.masks.shape[2:]), device=self.dev)
                objs[:, : r.masks.shape[1]] = r.masks.float()
                self.tok[sl] = token_cover(objs, cfg).half()
            self.ids[sl] = ids.view(m, self.k, -1).to(self.dev)
            self.roles[sl] = roles.view(m, self.k, -1).to(self.dev)
            self.cursor = (self.cursor + m) % self.n
            count -= m

    def batch(self, bsz: int, drop: float):
        idx = torch.randint(0, self.n, (bsz,), device=self.dev, generator=self.gen)
        video = self.video[idx].float() / 255
        which = torch.randint(0, self.k, (bsz,), device=self.dev, generator=self.gen)
        ids = self.ids[idx, which]
        keep = torch.rand(bsz, device=self.dev, generator=self.gen) >= drop   # caption dropout (for CFG)
        ids = ids * keep[:, None]
        roles = torch.where(keep[:, None], self.roles[idx, which].long(), -1)
        return video, ids, ids != 0, self.fg[idx], self.tok[idx].flatten(2).float(), roles


def caption_roles(caps: list[str], max_words: int) -> torch.Tensor:
    """(len(caps), max_words) int8: per word, the object (0, 1) or the place (2) it describes, -1 for fillers.
    Our captions have no unknown words, so word j is token j."""
    roles = torch.full((len(caps), max_words), -1, dtype=torch.int8)
    for i, c in enumerate(caps):
        r = [2 if x == PLACE else x for x in word_roles(c)][:max_words]
        roles[i, : len(r)] = torch.tensor(r, dtype=torch.int8)
    return roles


def token_cover(objs: torch.Tensor, cfg) -> torch.Tensor:
    """Grounding targets from per-pixel object masks (B, 2, T, H, W): per token, the share of its pixels covered
    by object 0, object 1 and the place (the rest), shape (B, 3, T', H', W')."""
    cover = torch.cat([objs, (1 - objs.sum(1, keepdim=True)).clamp_min(0)], 1)
    pt, ph, pw = cfg.patch_size
    return torch.nn.functional.avg_pool3d(cover, (pt, ph * cfg.codec_factor, pw * cfg.codec_factor))


class GroundedCrossAttention:
    """Wan's cross-attention computed with explicit probabilities (the text is short), which it keeps
    for the grounding loss: ``probs`` collects one (B, visual tokens, words) head-mean map per call."""

    def __init__(self, probs: list):
        self.probs = probs

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        p = torch.softmax((q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5, dim=-1)
        self.probs.append(p.mean(1))
        out = (p.to(v.dtype) @ v).transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def grounding_loss(maps: list[torch.Tensor], cover: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
    """TokenCompose's token loss (Wang et al., CVPR 2024) on each kept cross-attention map: for every
    word that describes an object (or the place), (1 - share of its attention mass on that object's
    tokens)^2, token shares weighted by pixel coverage. maps: (B, N, L); cover: (B, 3, N); roles: (B, L)."""
    valid = roles >= 0
    target = torch.gather(cover, 1, roles.clamp_min(0)[:, :, None].expand(-1, -1, cover.shape[2]))   # (B, L, N)
    valid = valid & (target.sum(-1) > 0)
    total = 0.0
    for a in maps:
        a = a.float().transpose(1, 2)                                            # (B, L, N)
        share = (a * target).sum(-1) / a.sum(-1).clamp_min(1e-6)
        total = total + (((1 - share) ** 2) * valid).sum() / valid.sum().clamp_min(1)
    return total / len(maps)


def shifted(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching timestep shift Wan and SD3 use: more of the samples at high noise."""
    return shift * s / (1 + (shift - 1) * s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--pool", type=int, default=131072, help="clips rendered and kept on the device")
    ap.add_argument("--refresh", type=int, default=256, help="clips re-rendered into the pool per step")
    ap.add_argument("--shift", type=float, default=3.0, help="shift of the logit-normal half of the training noise levels (Wan/SD3 style)")
    ap.add_argument("--sample-shifts", default="2,3", help="sampling flow shifts evaluated; the best is shipped")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--drop", type=float, default=0.1, help="caption dropout (for CFG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default=None, help="an earlier --out directory (weights, EMA, optimizer, architecture) or a weights file")
    ap.add_argument("--loss", choices=["velocity", "x0"], default="velocity",
                    help="x0-prediction's loss weighting: 'velocity' = ||x0_hat - x0||^2 / max(sigma, floor)^2 (the flow-velocity loss), "
                         "'x0' = ||x0_hat - x0||^2 (relatively more weight on high noise, where shape and motion are decided)")
    ap.add_argument("--fg-weight", type=float, default=1.0,
                    help="loss weight of object pixels (dilated 2 px) relative to background pixels; the loss is the weighted mean")
    ap.add_argument("--ground", type=float, default=0.0,
                    help="weight of the grounding loss: each object's (and the place's) words attend to its pixels' tokens")
    ap.add_argument("--ground-layers", default="2,3,4", help="blocks whose cross-attention the grounding loss supervises")
    ap.add_argument("--probe-pool", default=None, help="a scripts/probe_pool.py file: the model's own trajectories at the probe step")
    ap.add_argument("--probe-batch", type=int, default=128, help="probe-pool items added to every step's batch")
    ap.add_argument("--probe-ground", type=float, default=0.0,
                    help="weight of the grounding loss at the probe step against where the object ends up in the model's own clip")
    ap.add_argument("--probe-x0", type=float, default=0.0,
                    help="weight of an x0 loss at the probe step towards the model's own final clip (a reflow of the first steps)")
    ap.add_argument("--sigma-floor", type=float, default=0.05, help="floor of sigma in the velocity weighting")
    ap.add_argument("--decay", type=float, default=0.0, help="fraction of --minutes at the end over which lr decays linearly to 5 %%")
    ap.add_argument("--codec-factor", type=int, default=None, help="architecture (new runs; default: EmbeddedConfig's)")
    ap.add_argument("--patch", default=None, help="patch size t,h,w")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-n", type=int, default=320)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    from safetensors.torch import load_file, save_file

    resume_dir = Path(args.resume) if args.resume and Path(args.resume).is_dir() else None
    if resume_dir is not None:
        cfg = EmbeddedConfig.from_dict(json.loads((resume_dir / "weights.json").read_text())["config"])
    else:
        arch = {"codec_factor": args.codec_factor, "num_layers": args.layers, "num_heads": args.heads, "head_dim": args.head_dim, "ffn_dim": args.ffn,
                "patch_size": tuple(int(x) for x in args.patch.split(",")) if args.patch else None}
        cfg = EmbeddedConfig(vocab=vocabulary(), **{k: v for k, v in arch.items() if v is not None})
    pipe = EmbeddedPipeline(cfg).to(dev)
    params = list(pipe.transformer.parameters()) + list(pipe.text_encoder.parameters())

    def load_weights(path: Path) -> None:
        st = load_file(str(path))
        pipe.transformer.load_state_dict({k[12:]: v.float() for k, v in st.items() if k.startswith("transformer.")})
        pipe.text_encoder.load_state_dict({k[13:]: v.float() for k, v in st.items() if k.startswith("text_encoder.")})

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    if resume_dir is not None:
        load_weights(resume_dir / "weights.safetensors")          # the EMA weights first ...
        ema = [p.detach().clone() for p in params]
        load_weights(resume_dir / "resume.safetensors")           # ... then the raw ones
        if (resume_dir / "opt.safetensors").exists():
            mom = load_file(str(resume_dir / "opt.safetensors"))
            for i, p in enumerate(params):
                opt.state[p] = {"step": mom["step"].float().clone(), "exp_avg": mom[f"m.{i}"].float().to(dev), "exp_avg_sq": mom[f"v.{i}"].float().to(dev)}
            print(f"resumed AdamW at step {int(mom['step'])}", flush=True)
    else:
        if args.resume:
            load_weights(Path(args.resume))
        ema = [p.detach().clone() for p in params]
    n_params = sum(p.numel() for p in params)
    print(f"params {n_params / 1e6:.2f}M device {dev} patch {cfg.patch_size} codec {cfg.codec_factor} layers {cfg.num_layers} dim {cfg.num_heads}x{cfg.head_dim}", flush=True)
    maps: list[torch.Tensor] = []
    probe = None
    if args.probe_pool:
        probe = torch.load(args.probe_pool, map_location=dev)
        print(f"probe pool: {probe['x'].shape[0]} trajectories of {probe['weights']} (judge fidelity {probe['fidelity']:.3f}), t {probe['t'].item():.1f}", flush=True)
    if args.ground > 0 or args.probe_ground > 0:
        for i in (int(x) for x in args.ground_layers.split(",")):
            pipe.transformer.blocks[i].attn2.set_processor(GroundedCrossAttention(maps))
    fwd = pipe.transformer if args.no_compile or dev.type != "cuda" else torch.compile(pipe.transformer)

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    t0 = time.time()
    pool = Pool(pipe, args.pool, 2, args.seed, dev, gen)
    print(f"pool of {args.pool} clips rendered in {time.time() - t0:.0f}s", flush=True)
    t_start = time.time()
    log = open(out / "loss.csv", "w")  # noqa: SIM115 (closed after the loop)
    log.write("step,seconds,loss,lr,ground,probe_ground\n")
    step, ema_loss = 0, None
    while time.time() - t_start < args.minutes * 60 and step < args.max_steps:
        if step and args.refresh:
            pool.refresh(args.refresh)
        with torch.no_grad():
            video, ids, mask, fg, cover, roles = pool.batch(args.batch, args.drop)
            x0 = pipe.vae.encode(video)
            # Per-element loss weight: 1 on the background, --fg-weight on (dilated) object pixels. The
            # latent is a pixel rearrangement, so the pixel weight maps through the codec exactly.
            wpix = (1 + (args.fg_weight - 1) * fg.float())[:, None].expand(-1, 3, -1, -1, -1)
            wfg = (pipe.vae.encode(wpix) + 1) / 2
            noise = torch.randn(x0.shape, device=dev, generator=gen)
            # Noise levels: half uniform over the whole range (the low levels clean up the last steps), half
            # logit-normal shifted towards noise, where layout, shape and motion are decided.
            u = torch.rand(x0.shape[0], device=dev, generator=gen)
            ln = torch.sigmoid(torch.randn(x0.shape[0], device=dev, generator=gen))
            sigma = torch.where(torch.rand(x0.shape[0], device=dev, generator=gen) < 0.5, u, shifted(ln, args.shift))
            s = sigma.view(-1, 1, 1, 1, 1)
            xt = (1 - s) * x0 + s * noise
            target = noise - x0
            B = x0.shape[0]
            if probe is not None:   # the probe step of the model's own trajectories rides along in the same forward
                pidx = torch.randint(0, probe["x"].shape[0], (args.probe_batch,), device=dev, generator=gen)
                xt = torch.cat([xt, probe["x"][pidx].float()])
                sigma = torch.cat([sigma, (probe["t"] / 1000).expand(args.probe_batch)])
                ids = torch.cat([ids, probe["ids"][pidx]])
                mask = ids != 0
                p_cover, p_roles, p_final = probe["cover"][pidx].float(), probe["roles"][pidx].long(), probe["final"][pidx].float()
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if args.decay > 0:
            left = 1 - (time.time() - t_start) / (args.minutes * 60)
            lr *= max(0.05, min(1.0, left / args.decay))
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            emb = pipe.text_encoder(ids, mask)
            try:
                pred = fwd(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=emb, return_dict=False)[0]
            except Exception as e:  # a compiler failure must not cost the device call: go on eagerly
                if fwd is pipe.transformer:
                    raise
                print(f"torch.compile failed ({type(e).__name__}: {e}); training eagerly", flush=True)
                fwd = pipe.transformer
                maps.clear()
                pred = fwd(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=emb, return_dict=False)[0]
        if probe is not None:
            pred, p_pred = pred[:B], pred[B:]
            sigma = sigma[:B]
        if cfg.prediction == "x0":
            err = (pred.float() - x0) ** 2
            if args.loss == "velocity":  # ||(x0_hat - x0) / sigma||^2, sigma floored
                err = err / sigma.clamp_min(args.sigma_floor).view(-1, 1, 1, 1, 1) ** 2
        else:
            err = (pred.float() - target) ** 2
        loss = (err * wfg).sum() / wfg.sum()
        pgl = None
        if probe is not None:
            if args.probe_ground > 0:
                pgl = grounding_loss([m[B:] for m in maps], p_cover, p_roles)
                loss = loss + args.probe_ground * pgl
            if args.probe_x0 > 0:
                loss = loss + args.probe_x0 * ((p_pred.float() - p_final) ** 2).mean()
        if maps:
            gl = grounding_loss([m[:B] for m in maps], cover, roles)
            maps.clear()
            loss = loss + args.ground * gl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            d = min(args.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - d)
        step += 1
        if step % 50 == 0:
            lv = loss.item()
            ema_loss = lv if ema_loss is None else 0.9 * ema_loss + 0.1 * lv
            glv = gl.item() if args.ground > 0 else float("nan")
            pglv = pgl.item() if pgl is not None else float("nan")
            log.write(f"{step},{time.time() - t_start:.1f},{lv:.5f},{lr:.2e},{glv:.4f},{pglv:.4f}\n")
            if step % 500 == 0:
                el = time.time() - t_start
                print(f"step {step} {el:.0f}s ({el / step * 1000:.0f} ms/step) loss {ema_loss:.4f} ground {glv:.4f} probe ground {pglv:.4f}", flush=True)
    log.close()
    train_s = time.time() - t_start
    print(f"trained {step} steps in {train_s:.0f}s", flush=True)

    info = {"steps": step, "batch": args.batch, "loss": args.loss, "fg_weight": args.fg_weight, "ground": args.ground, "ground_layers": args.ground_layers,
            "probe_pool": probe and {"n": int(probe["x"].shape[0]), "weights": probe["weights"], "batch": args.probe_batch, "ground": args.probe_ground, "x0": args.probe_x0}, "train_shift": args.shift, "pool": args.pool, "lr": args.lr, "ema": args.ema, "seconds": round(train_s), "final_loss": ema_loss,
            "resumed_from": args.resume,
            "total_steps": step + (json.loads((resume_dir / "weights.json").read_text())["info"].get("total_steps", 0) if resume_dir else 0), "params": n_params, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    # (the device tool returns at most 8 files: resume.json is not kept, weights.json has the same info)
    save_pipeline(pipe, out / "resume.safetensors", out / "resume.json", info=info)
    (out / "resume.json").unlink()
    mom = {"step": torch.tensor(float(opt.state[params[0]]["step"]))}
    for i, p in enumerate(params):
        mom[f"m.{i}"] = opt.state[p]["exp_avg"].detach().to("cpu", torch.bfloat16).contiguous()
        mom[f"v.{i}"] = opt.state[p]["exp_avg_sq"].detach().to("cpu", torch.bfloat16).contiguous()
    save_file(mom, str(out / "opt.safetensors"))
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    digest = save_pipeline(pipe, out / "weights.safetensors", out / "weights.json", info=info)
    print(f"saved weights sha256 {digest}", flush=True)

    if args.eval_n > 0:
        best, results, best_frames = None, [], None
        for shift in [float(x) for x in args.sample_shifts.split(",")]:
            res, frames = evaluate(out, dev, args.eval_n, shift)
            print("EVAL", json.dumps(res), flush=True)
            results.append(res)
            if best is None or res["fidelity"] > best["fidelity"]:
                best, best_frames = res, frames
        (out / "eval.json").write_text(json.dumps(results, indent=1))
        np.save(out / "eval_frames.npy", best_frames)
        # Ship the sampling shift that judged best (it is part of the config stored with the weights).
        pipe.cfg.flow_shift = best["flow_shift"]
        from carnator.embedded.model import build_scheduler

        pipe.scheduler = build_scheduler(pipe.cfg)
        info["eval"] = best
        digest = save_pipeline(pipe, out / "weights.safetensors", out / "weights.json", info=info)
        print(f"shipped flow_shift {best['flow_shift']} weights sha256 {digest}", flush=True)
    return 0


def evaluate(out: Path, dev, n: int, flow_shift: float) -> tuple[dict, np.ndarray]:
    """Held-out judge fidelity of the EMA weights in ``out``, sampled with ``flow_shift``; and the first 24 clips."""
    import multiprocessing as mp
    import os

    from carnator.embedded import load_pipeline
    from carnator.embedded.model import build_scheduler
    from carnator.embedded.sample import sample_batch
    from carnator.embedded.world.judge import judge
    from carnator_lab.world.render import to_uint8

    ev = load_pipeline(dev, out / "weights.safetensors", out / "weights.json")
    ev.cfg.flow_shift = flow_shift
    ev.scheduler = build_scheduler(ev.cfg)
    rng = np.random.default_rng(12345)
    scenes = sample_scenes(n, rng, split="heldout")
    caps = [caption(s, rng, split="heldout") for s in scenes]
    t0 = time.time()
    vids = torch.cat([sample_batch(ev, caps[i:i + 160], list(range(i, min(i + 160, n)))) for i in range(0, n, 160)])
    gen_s = time.time() - t0
    frames = to_uint8(vids)
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        reps = pool.starmap(judge, list(zip(frames, caps)))
    acc: dict[str, list[bool]] = {}
    for r in reps:
        for k, v in r.checks.items():
            acc.setdefault(k.split(".")[-1], []).append(v)
    (out / "eval_captions.json").write_text(json.dumps(caps[:24]))
    res = {"n": n, "flow_shift": flow_shift, "fidelity": float(np.mean([r.fidelity for r in reps])),
           "artifact": float(np.mean([r.artifact for r in reps])), "gen_seconds": round(gen_s, 1),
           "per_attribute": {k: round(float(np.mean(v)), 3) for k, v in acc.items()}}
    return res, frames[:24]


if __name__ == "__main__":
    sys.exit(main())
