"""``carnator`` command line: generate, cache, and (with later stages) demo, calibrate, bench.

User mistakes print one line ``carnator: error: ...`` and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .errors import CarnatorError


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help='"embedded" (default) or a local diffusers pipeline directory')
    p.add_argument("--cache-dir", default=None, help="cache directory (default: $CARNATOR_CACHE_DIR or ~/.cache/carnator)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _engine(args):
    from .engine import Carnator

    return Carnator.from_pretrained(args.model, cache_dir=args.cache_dir, device=args.device)


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from .video import write_video

    out = Path(args.out)
    if out.suffix.lower() not in (".mp4", ".gif"):
        raise CarnatorError(f"--out must end in .mp4 or .gif, got {out.name!r}")
    eng = _engine(args)
    bar = tqdm(total=None, desc="denoising", unit="step", disable=args.quiet, leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    res = eng.generate(
        args.prompt, seed=args.seed, policy=args.policy, negative_prompt=args.negative_prompt,
        num_inference_steps=args.steps, num_frames=args.frames, height=args.height, width=args.width,
        guidance_scale=args.guidance, tenant=args.tenant, store=not args.no_store, progress=progress,
    )
    bar.close()
    write_video(res.frames, out, fps=args.fps)
    s = res.stats
    summary = {
        "out": str(out), "frames": list(res.frames.shape), "hit": s.hit, "exact_hit": s.exact_hit,
        "source_id": s.source_id, "resume_step": s.resume_step, "entry_id": s.entry_id,
        "seconds": {k: round(v, 4) for k, v in s.timings.items()},
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def _bank(args):
    from .cache import CacheBank, default_cache_dir

    return CacheBank(Path(args.cache_dir) if args.cache_dir else default_cache_dir())


def cmd_cache(args) -> int:
    bank = _bank(args)
    if args.action == "ls":
        rows = bank.entries(tenant=args.tenant)
        for e in rows:
            print(f"{e.id}  {e.tenant:<10} {e.nbytes:>10d} B  uses={e.use_count:<3d} seed={e.seed:<6d} {e.prompt[:60]!r}")
        print(f"{len(rows)} entries")
    elif args.action == "stats":
        print(json.dumps(bank.stats(), indent=1, default=str))
    elif args.action == "verify":
        report = bank.verify()
        print(json.dumps(report if isinstance(report, dict) else getattr(report, "__dict__", str(report)), indent=1, default=str))
    elif args.action == "clear":
        n = bank.clear(tenant=args.tenant)
        print(f"cleared {n} entries" if isinstance(n, int) else "cleared")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="carnator", description="Fast text-to-video generation by cross-request reuse.")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one video")
    g.add_argument("prompt")
    _add_gen_args(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--policy", default="dense")
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    g.add_argument("--frames", type=int, default=None)
    g.add_argument("--height", type=int, default=None)
    g.add_argument("--width", type=int, default=None)
    g.add_argument("--guidance", type=float, default=None)
    g.add_argument("--tenant", default="default")
    g.add_argument("--out", default="out.mp4", help="output video (.mp4 or .gif)")
    g.add_argument("--fps", type=int, default=8)
    g.add_argument("--no-store", action="store_true", help="do not add the result to the cache")
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("cache", help="inspect or manage the cache")
    c.add_argument("action", choices=["ls", "stats", "verify", "clear"])
    c.add_argument("--cache-dir", default=None)
    c.add_argument("--tenant", default=None)
    c.set_defaults(func=cmd_cache)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="carnator: %(levelname)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except CarnatorError as e:
        print(f"carnator: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("carnator: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
