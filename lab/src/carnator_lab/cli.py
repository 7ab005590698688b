"""``carnator-lab``: the lab's command line (shapes-world benchmark and calibration, bench-scale, training).

    carnator-lab bench --warm W --test S [--seed K] [library bench options]      the embedded world's protocol
    carnator-lab calibrate --pairs N [--pairs-from stream|edits] [--warm W] [library calibrate options]
    carnator-lab bench-scale [MODEL] [...]                                         real-size speed on a CUDA GPU
    carnator-lab train [...]                                                       train the embedded model
    carnator-lab export-lexicon                                                    rewrite the embedded model's lexicon.json

``bench`` and ``calibrate`` draw the shapes world's workload (a trace, or calibration pairs), then run the library's
``carnator bench`` / ``carnator calibrate`` on it with the shapes judge; every other option is theirs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from carnator.cli import main as carnator_main
from carnator.errors import CarnatorError

from carnator.embedded.judge import DEFAULT_DELTAS


def _quality(args) -> list[str]:
    return ["--judge", "shapes", "--quality", f"fidelity={args.delta_fidelity}", "--quality", f"artifact={args.delta_artifact}"]


def _add_rule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--delta-fidelity", type=float, default=DEFAULT_DELTAS["fidelity"],
                   help="a reuse is acceptable iff its judge fidelity >= dense's - this (default %(default)s) ...")
    p.add_argument("--delta-artifact", type=float, default=DEFAULT_DELTAS["artifact"],
                   help="... and its artifact score <= dense's + this (default %(default)s)")


def cmd_bench(args, rest: list[str]) -> int:
    from .traces import world_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "trace.json"
    if not args.report_only:
        world_trace(args.warm, args.test, seed=args.seed).save(trace_path)
    return carnator_main(["bench", "--trace", str(trace_path), "--out", str(out), *_quality(args), *rest]
                         + (["--report-only"] if args.report_only else []))


def cmd_calibrate(args, rest: list[str]) -> int:
    out = Path(args.out)
    if args.select_only:
        return carnator_main(["calibrate", "--select-only", "--out", str(out), *_quality(args), *rest])
    from carnator.recall.embedder import default_embedder

    from .pairs import make_pairs, stream_pairs

    out.mkdir(parents=True, exist_ok=True)
    pairs_path = out / "pairs-input.jsonl"
    if args.pairs_from == "edits":
        pairs, drawn = make_pairs(args.pairs), {"pairs_from": "edits"}
    else:
        pairs = stream_pairs(args.pairs, default_embedder(), warm=args.warm, top_k=args.top_k)
        drawn = {"pairs_from": "stream", "warm": args.warm, "top_k": args.top_k}
    pairs_path.write_text("".join(json.dumps(dict(zip(("kind", "source", "source_seed", "target", "target_seed"), p))) + "\n"
                                  for p in pairs))
    pairs_path.with_suffix(".meta.json").write_text(json.dumps(drawn))
    return carnator_main(["calibrate", "--pairs-file", str(pairs_path), "--pairs", str(args.pairs), "--out", str(out),
                          *_quality(args), *rest])


def cmd_bench_scale(args, rest: list[str]) -> int:
    import torch

    from .scale import SPECS, ScaleConfig, run_scale, to_markdown

    if args.model not in SPECS:
        raise CarnatorError(f"unknown size {args.model!r}; available: {', '.join(SPECS)}")
    if args.frames is not None:  # checked before a GPU is touched: a real size takes minutes to build
        try:
            SPECS[args.model].check_frames(args.frames)
        except ValueError as e:
            raise CarnatorError(f"--frames: {e}") from None
    if args.resume_step is None:
        from carnator.policies.carnator import DEFAULT_RESUME_STEP

        args.resume_step = DEFAULT_RESUME_STEP
    if args.steps < 1 or not 0 < args.resume_step < args.steps:
        raise CarnatorError(f"--resume-step must lie in [1, --steps) for a hit to resume, got {args.resume_step} of {args.steps} steps")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CarnatorError("bench-scale measures speed on a CUDA GPU and none is available here "
                            "(--device cpu runs the tiny-wan and tiny-ltx smoke tests)")
    try:
        dens = tuple(float(x) for x in args.densities.split(","))
    except ValueError:
        raise CarnatorError(f"--densities must be comma-separated numbers, got {args.densities!r}") from None
    if not all(0 < d <= 1 for d in dens):
        raise CarnatorError("--densities must lie in (0, 1]")
    if not 0 < args.active_fraction <= 1:
        raise CarnatorError("--active-fraction must lie in (0, 1]")
    from .scale import BASELINES

    try:
        frame_steps = tuple(int(x) for x in args.frame_steps.split(",") if x.strip())
    except ValueError:
        raise CarnatorError(f"--frame-steps must be comma-separated steps, got {args.frame_steps!r}") from None
    if not all(0 < f < args.steps for f in frame_steps):
        raise CarnatorError(f"--frame-steps must lie in [1, --steps), got {args.frame_steps!r} of {args.steps} steps")

    baselines = tuple(b for b in args.baselines.split(",") if b) if args.baselines != "none" else ()
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise CarnatorError(f"--baselines: unknown {', '.join(unknown)}; choose from {', '.join(BASELINES)} (or none)")
    if not 0 < args.nirvana_resume_step < 50:
        raise CarnatorError(f"--nirvana-resume-step is a step of 50 in [1, 50), got {args.nirvana_resume_step}")
    flex_options = _flex_options_arg("--flex-options", args.flex_options, many=False)
    kernel_sweep = _flex_options_arg("--kernel-sweep", args.kernel_sweep, many=True) or []
    cfg = ScaleConfig(model=args.model, frames=args.frames, steps=args.steps, densities=dens, active_fraction=args.active_fraction,
                      resume_step=args.resume_step, mask_stride=args.mask_stride, kernels=not args.no_kernels, device=args.device,
                      intra_cache=args.intra_cache, flex_options=flex_options, kernel_sweep=kernel_sweep, sparse_kernel=args.sparse_kernel,
                      baselines=baselines, nirvana_resume_step=args.nirvana_resume_step, frame_steps=frame_steps)
    rep = run_scale(cfg, Path(args.out))
    print(to_markdown(rep))
    return 0


def _flex_options_arg(flag: str, text: str | None, *, many: bool):
    """``--flex-options`` (a JSON object) or ``--kernel-sweep`` (a JSON list of objects), checked like the kernels will."""
    import json

    from carnator.attention.kernels import check_flex_kernel_options

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CarnatorError(f"{flag} must be JSON ({e.msg} at character {e.pos}), got {text!r}") from None
    sets = value if many else [value]
    if many and not isinstance(value, list):
        raise CarnatorError(f"{flag} must be a JSON list of objects, e.g. '[{{\"USE_TMA\": true}}]'")
    for opts in sets:
        try:
            check_flex_kernel_options(opts)
        except ValueError as e:
            raise CarnatorError(f"{flag}: {e}") from None
    return value




def cmd_train(args, rest: list[str]) -> int:
    from . import train

    sys.argv = ["carnator-lab train", *rest]
    return train.main()


def cmd_export_lexicon(args, rest: list[str]) -> int:
    from .lexicon import LEXICON_PATH, write_lexicon

    write_lexicon(LEXICON_PATH)
    print(f"wrote {LEXICON_PATH}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="carnator-lab", description="The Carnator lab: the shapes world's benchmark and calibration, "
                                 "real-size speed, training the embedded model.")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="the embedded world's benchmark protocol (a world trace through `carnator bench`)")
    b.add_argument("--warm", type=int, default=12, help="warm-cache requests W (paper: 1000)")
    b.add_argument("--test", type=int, default=12, help="test requests S (paper: 300)")
    b.add_argument("--seed", type=int, default=0, help="the trace's seed")
    b.add_argument("--out", default="carnator-bench")
    b.add_argument("--report-only", action="store_true", help="only rewrite report.html of the finished run in --out")
    _add_rule_args(b)
    b.set_defaults(func=cmd_bench)
    k = sub.add_parser("calibrate", help="calibrate on shapes-world pairs (through `carnator calibrate`)")
    k.add_argument("--pairs", type=int, default=100, help="request-cache pairs (paper: 30 selection + 70 certification)")
    k.add_argument("--pairs-from", choices=["stream", "edits"], default="stream",
                   help="stream: each request of a bench-mix stream paired with the cached request recall hands the compatibility "
                        "test first, as deployed; edits: each pair an edit of one scene (default %(default)s)")
    k.add_argument("--warm", type=int, default=100, help="warm requests the stream recalls from (--pairs-from stream)")
    k.add_argument("--top-k", type=int, default=10, help="recalled candidates (the carnator policy's top_k)")
    k.add_argument("--out", default="carnator-calibration")
    k.add_argument("--select-only", action="store_true", help="select and certify from the pairs already in --out")
    _add_rule_args(k)
    k.set_defaults(func=cmd_calibrate)
    z = sub.add_parser("bench-scale", help="real-size speed on a CUDA GPU: dense vs replayed carnator hits, and kernels")
    from .scale import SPECS

    def spec_names() -> str:
        return "one of: " + ", ".join(SPECS) + " (tiny-*: CPU-sized smoke tests of the same path)"

    z.add_argument("model", nargs="?", default="wan2.1-1.3b", help=spec_names())
    z.add_argument("--frames", type=int, default=None, help="fewer frames than the model's default (state it when reporting)")
    z.add_argument("--steps", type=int, default=50)
    z.add_argument("--densities", default="0.1,0.2,0.3,0.5", help="block-mask densities of the replayed hits")
    z.add_argument("--active-fraction", type=float, default=0.3, help="Active share of tokens in the replayed plan")
    z.add_argument("--resume-step", type=int, default=None, help="the replayed plan's resume step (default: 30, carnator's without a thresholds file that names one)")
    z.add_argument("--frame-steps", default="", metavar="STEPS",
                   help="comma-separated resume steps of replayed frame-tier hits (no probe, every token recomputed, masks at the first density)")
    z.add_argument("--mask-stride", type=int, default=5, help="masks recorded every N steps")
    z.add_argument("--no-kernels", action="store_true", help="skip the kernel microbenchmark")
    z.add_argument("--baselines", default="nirvana,chorus,chorus2",
                   help="cross-request baselines also timed as replayed hits (comma-separated, or none)")
    z.add_argument("--nirvana-resume-step", type=int, default=25,
                   help="the step (of 50) NIRVANA's replayed hit resumes at (25: its table's best case)")
    z.add_argument("--intra-cache", default=None, metavar="SPEC",
                   help="also time a diffusers intra-request cache alone and composed with a hit (e.g. taylorseer; "
                        "residual-driven kinds skip arbitrarily with random weights)")
    z.add_argument("--flex-options", default=None, metavar="JSON",
                   help='FlexAttention kernel_options for every flex call, e.g. \'{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}\'')
    z.add_argument("--kernel-sweep", default=None, metavar="JSON",
                   help='more kernel_options sets timed in the kernel microbenchmark, a JSON list, e.g. \'[{"USE_TMA": true}]\'')
    z.add_argument("--sparse-kernel", choices=["auto", "flex"], default="auto",
                   help="the CUDA block-sparse kernel: auto (the Triton kernel where it serves) or flex")
    z.add_argument("--device", default="cuda")
    z.add_argument("--out", default="carnator-bench-scale")
    z.set_defaults(func=cmd_bench_scale)
    t = sub.add_parser("train", help="train the embedded model (options: carnator-lab train -- --help)", add_help=False)
    t.set_defaults(func=cmd_train)
    x = sub.add_parser("export-lexicon", help="rewrite the embedded model's lexicon.json from the shapes world")
    x.set_defaults(func=cmd_export_lexicon)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:  # argparse's status (help: 0, a usage error: 2) is returned, not raised
        args, rest = ap.parse_known_args(argv)
        if rest and args.command in ("bench-scale", "export-lexicon"):
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return args.func(args, rest)
    except CarnatorError as e:
        print(f"carnator-lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
