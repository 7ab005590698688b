"""``carnator`` command line: generate, cache, and (with later stages) demo, calibrate, bench.

User mistakes print one line ``carnator: error: ...`` and exit with status 2; never a traceback. The options that
are settings of the engine or the service are made from the fields of their config dataclasses
(:class:`~carnator.config.EngineConfig`, :class:`~carnator.config.EngineSpec`,
:class:`~carnator.service.config.ServeConfig`; :mod:`carnator.fieldargs`): flag, type, default and help live there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .config import EngineConfig, EngineSpec, parse_size
from .errors import CarnatorError
from .fieldargs import add_fields, field_values, float_in, int_in
from .service.config import ServeConfig

if TYPE_CHECKING:
    from .request import Params

#: the policies ``--policy`` offers (the registry's names, :func:`carnator.policies.policy_names`; a test keeps them
#: equal): listed here so that parsing a command line does not import the policies (torch, scipy)
POLICIES = ("carnator", "dense", "nirvana", "chorus", "chorus2")
#: the eviction policies (:func:`carnator.cache.eviction_policies`; a test keeps them equal), for the same reason
EVICTIONS = ("lru", "lcbfu")


class _UsageError(CarnatorError):
    """A command line argparse refuses; printed like every user mistake."""


class _HelpFormatter(argparse.HelpFormatter):
    """Help texts given as zero-argument callables are computed when shown: a command that does not show them does
    not import what they describe (torch, the benchmark specs)."""

    def _format_action(self, action):
        if callable(action.help):
            action.help = action.help()
        return super()._format_action(action)

    def _get_help_string(self, action):
        return action.help() if callable(action.help) else action.help


class _Parser(argparse.ArgumentParser):
    """argparse with carnator's one-line errors (``carnator: error: ...``, status 2; no usage block)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _later(text: Callable[[], str]) -> str:
    """A help text computed when shown (:class:`_HelpFormatter` calls it), passed where argparse types a string."""
    return cast(str, text)


def _embedded_default(key: str) -> str:
    """The embedded model's default ``key`` (frames, size, num_inference_steps, guidance_scale), from its manifest."""
    from importlib.resources import files

    return str(json.loads(files("carnator").joinpath("embedded/weights.json").read_text())["config"][key])


def _add_gen_args(p: argparse.ArgumentParser, cache_help: str | None = None) -> None:
    add_fields(p, EngineSpec, ["model"])
    p.add_argument("--cache-dir", default=None, help=cache_help or "cache directory (default: $CARNATOR_CACHE_DIR, else ~/.cache/carnator)")
    add_fields(p, EngineSpec, ["device"])
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="load a pipeline directory's weights in this dtype (modules the model keeps in float32 stay so; "
                        "default: float32, as diffusers loads without one; bfloat16 is how Wan and LTX run on a GPU)")
    add_fields(p, EngineConfig, ["capacity_bytes", "policy_options"])


def _add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=None, metavar="URL",
                   help="the cache store: sqlite:///PATH (a local directory; default: --cache-dir) or postgresql://USER@HOST/DB"
                        "[?schema=NAME] (a store shared by many processes and hosts; needs --blobs)")
    add_fields(p, EngineSpec, ["blobs"])


def _blobs_need_store(args) -> None:
    if getattr(args, "blobs", None) and not getattr(args, "store", None):
        raise CarnatorError("--blobs goes with --store postgresql://...")


def _store_url(args) -> str | None:
    """The store the command uses: --store, else --cache-dir (a user error when both are given)."""
    store = getattr(args, "store", None)
    if store and getattr(args, "cache_dir", None):
        raise CarnatorError("give --store or --cache-dir, not both")
    _blobs_need_store(args)
    return store or getattr(args, "cache_dir", None)


def _where(store) -> str:
    return str(getattr(store, "root", None) or store)


def _size_words(n: int | None) -> str:
    if n is None:
        return "unbounded"
    for unit, k in (("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if n >= k:
            return f"{n} B ({n / k:.1f} {unit})"
    return f"{n} B"


def _options_model(config: type) -> Any:
    """A strict pydantic model of the config dataclass ``config``'s fields (nested config dataclasses as models too;
    unknown fields refused), every field optional: it checks the fields an ``--option`` gives, as JSON."""
    import dataclasses
    import functools
    import types
    import typing

    from pydantic import ConfigDict, create_model

    @functools.cache
    def model(dc: type) -> Any:
        def field_type(hint: Any) -> Any:
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                return model(hint)
            origin, args = typing.get_origin(hint), typing.get_args(hint)
            if origin in (typing.Union, types.UnionType):
                return functools.reduce(lambda a, b: a | b, [field_type(a) for a in args])
            return hint

        hints = typing.get_type_hints(dc)
        fields: dict[str, Any] = {f.name: (field_type(hints[f.name]), None) for f in dataclasses.fields(dc)}
        return create_model(dc.__name__, __config__=ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True),
                            **fields)

    return model(config)


def _option_problem(name: str, config: type, opts: dict[str, Any]) -> str | None:
    """Why the JSON values ``opts`` do not fit the fields of the config dataclass ``config`` (pydantic, strict: a
    boolean is no integer, a string no number), naming the field; None when they fit."""
    import dataclasses
    import typing

    from pydantic import ValidationError

    try:
        _options_model(config).model_validate_json(json.dumps(opts))
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "extra_forbidden":  # an unknown field of a nested config: name its class and its fields
            owner: Any = config
            for part in loc[:-1]:
                owner = typing.get_type_hints(owner)[part]
            names = [f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner) else []
            return f"--option {name}.{loc[0]}: {getattr(owner, '__name__', owner)} has no field {loc[-1]!r}; its fields: {', '.join(names)}"
        return f"--option {name}.{'.'.join(loc)}: {err['msg'][0].lower()}{err['msg'][1:]}, got {json.dumps(err['input'])}"
    return None


def _policy_options(items: list[str]) -> dict[str, dict]:
    """``--option POLICY.FIELD=VALUE`` items as ``EngineConfig.policy_options``, each policy's config checked now."""
    import dataclasses
    import typing

    from .policies import get_policy_class, policy_names

    out: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name, dot, fld = key.strip().partition(".")
        if not sep or not dot or not name or not fld:
            raise CarnatorError(f"--option {item!r}: expected POLICY.FIELD=VALUE, e.g. carnator.modifiers=1")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name, {})[fld] = value
    for name, opts in out.items():
        klass = get_policy_class(name)
        if klass is None:
            raise CarnatorError(f"--option: unknown policy {name!r}; available: {', '.join(policy_names())}")
        cfg = getattr(klass(), "cfg", None)
        hints = typing.get_type_hints(type(cfg)) if dataclasses.is_dataclass(cfg) else {}
        unknown = sorted(set(opts) - set(hints))
        if unknown:
            fields = ", ".join(hints) or "none"
            raise CarnatorError(f"--option: {name} has no field {', '.join(unknown)}; its fields: {fields}")
        problem = _option_problem(name, type(cfg), opts) if dataclasses.is_dataclass(cfg) else None
        if problem:
            raise CarnatorError(problem)
        try:
            klass(**opts)
        except (TypeError, ValueError) as e:
            raise CarnatorError(f"--option {name}: {e}") from None
    return out


def _engine(args):
    from .engine import Carnator

    if not args.verbose:  # loading bars from diffusers/transformers would bury carnator's own output
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    values = field_values(EngineConfig, args)  # the command's engine options, parsed and checked by its parser
    if values.get("intra_cache") is not None:
        from .backbones.intra_cache import IntraCacheSpec

        IntraCacheSpec.parse(values["intra_cache"])  # a bad kind or option fails before the model loads
    values["policy_options"] = _policy_options(values.get("policy_options") or [])
    config = EngineConfig(**values)
    dtype = getattr(args, "dtype", None)
    torch_dtype = None
    if dtype is not None and args.model != "embedded":
        import torch

        torch_dtype = getattr(torch, dtype)
    return Carnator.from_pretrained(args.model, cache_dir=_store_url(args), device=args.device, config=config,
                                    blobs=getattr(args, "blobs", None), torch_dtype=torch_dtype)


def _params(args: argparse.Namespace) -> Params:
    """The request ``carnator generate``'s flags ask for."""
    from .request import Params

    return Params(prompt=args.prompt, seed=args.seed, policy=args.policy, negative_prompt=args.negative_prompt,
                  num_inference_steps=args.steps, num_frames=args.frames, height=args.height, width=args.width,
                  guidance_scale=args.guidance, tenant=args.tenant, store=not args.no_store, cache=args.cache)


def cmd_generate(args) -> int:
    from .video import check_fps, write_video

    out = Path(args.out)
    if out.suffix.lower() not in (".mp4", ".gif"):
        raise CarnatorError(f"--out must end in .mp4 or .gif, got {out.name!r}")
    if out.is_dir():
        raise CarnatorError(f"--out {str(out)!r} is a directory")
    check_fps(args.fps, out)  # before the model loads
    if args.server:
        from .client import generate_command

        return generate_command(args, out)
    eng = _engine(args)
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # created on the first step, so nothing is drawn for an exact hit or an invalid request
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (logs, pipes, CI)
            bar = tqdm(total=total, desc="denoising", unit="step", disable=True if args.quiet else None, leave=False)
        bar.update(done - bar.n)

    try:
        res = eng.run(_params(args), progress=progress)
    finally:
        if bar is not None:
            bar.close()
    try:
        write_video(res.frames, out, fps=args.fps)
    except OSError as e:
        raise CarnatorError(f"cannot write {out}: {e.strerror or e}") from e
    from .explain import describe

    eng.flush(res)  # an entry written behind (on a GPU) is stored while the video was written: its id is reported
    s, why = res.stats, describe(eng, res)
    total = s.timings.get("total", 0.0)
    if args.json:
        summary = {
            "out": str(out), "frames": list(res.frames.shape), "policy": s.policy, "hit": s.hit, "exact_hit": s.exact_hit,
            "source_id": s.source_id, "resume_step": s.resume_step, "entry_id": s.entry_id, "dit_forwards": s.dit_forwards,
            "seconds": {k: round(v, 4) for k, v in s.timings.items()}, **why.to_dict(),
        }
        if s.notes:
            summary["notes"] = s.notes
        print(json.dumps(summary, default=str))
        return 0
    saved = f" ({why.steps_saved} saved)" if why.steps_saved else ""
    print(f"{why.decision}: {why.reason}; {total:.2f} s, {why.steps_computed} of {why.steps} steps computed{saved}; wrote {out}")
    if args.verbose:
        details = {
            "frames": list(res.frames.shape), "policy": s.policy, "source_id": s.source_id, "resume_step": s.resume_step,
            "entry_id": s.entry_id, "dit_forwards": s.dit_forwards, "active_fraction": s.active_fraction,
            "mask_density": s.mask_density, "seconds": {k: round(v, 4) for k, v in s.timings.items()},
        }
        notes = dict(s.notes)
        sig = notes.pop("signature", None)
        if isinstance(sig, dict):  # the probe's reading: per noun its region (a base64 bit mask), size and colour
            notes["signature"] = f"{len(sig.get('nouns', {}))} nouns: {', '.join(sig.get('nouns', {}))} (--json has the masks)"
        details.update(notes)
        for k, v in details.items():
            if isinstance(v, dict):
                v = "  ".join(f"{kk}={vv}" for kk, vv in v.items())
            print(f"  {k}: {v}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    out = Path(args.out)
    fresh = args.cache_dir is None and not args.keep_cache
    if args.cache_dir is None:  # the demo's own cache, so that a second run tells the same story
        args.cache_dir = str(out / "cache")
    print(f"loading the model ({args.model}) ...", flush=True)
    eng = _engine(args)
    if fresh:
        eng.store.clear()
    rows = run_demo(eng, out, policy=args.policy, steps=args.steps)
    hits = sum(r["hit"] for r in rows)
    print(f"{hits} of {len(rows)} requests reused cached work; the page: {out / 'index.html'}")
    return 0


def _resume_steps(text: str) -> list[int]:
    try:
        steps = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step or steps separated by commas, got {text!r}") from None
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"resume steps must be integers >= 1, got {text!r}")
    return steps


def cmd_calibrate(args) -> int:
    from .calibrate.run import is_tiered, risk_problem, run_calibration
    from .calibrate.certify import CalibrationConfig

    if args.pairs < 4:
        raise CarnatorError("--pairs must be at least 4")
    if args.jobs < 1:
        raise CarnatorError("--jobs must be 1 or more")
    if args.warm < 1:
        raise CarnatorError("--warm must be 1 or more")
    if not args.select_only and (args.prompts is None) == (args.pairs_file is None):
        raise CarnatorError("give the requests to calibrate on: --prompts FILE (a prompt log, paired as recall pairs them) "
                            "or --pairs-file FILE (or --select-only to reuse the pairs already in --out)")
    # checked before any worker starts (run_calibration checks the same)
    tiered = is_tiered(args.resume_step or (), dict.fromkeys(args.tier_quality or ()), args.tier_scope)
    problem = risk_problem(args.risk, tiered=tiered, generate=not args.select_only, noise_floor=args.noise_floor)
    if problem:
        raise CarnatorError(problem)
    judge = _judge(args)
    rule = _quality_rule(args, judge)
    if args.jobs > 1 and args.shard is None and not args.select_only:
        # Workers generate and judge disjoint shards of the pairs, appending to one pairs.jsonl; the run below
        # then finds every pair done and only selects and certifies.
        import multiprocessing as mp

        import torch

        opts, threads = vars(args), torch.get_num_threads()
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            failed = pool.map(_worker_failure, [(opts, {"shard": (k, args.jobs)}, threads) for k in range(args.jobs)], chunksize=1)
        for k, err in enumerate(failed):
            if err:  # what it wrote is kept; the run below generates the pairs it left, in this process
                print(f"carnator: warning: calibrate worker {k + 1} of {args.jobs} stopped ({err}); "
                      "the pairs it left are generated here, one after another", file=sys.stderr)
    eng = _engine(args)
    pairs, source = None, None
    if not args.select_only:
        pairs, source = _calibration_pairs(args, eng)
    summary = run_calibration(eng, Path(args.out), pairs, judge=judge, rule=rule, source=source, steps=args.steps,
                              settings=_settings(args),
                              cfg=CalibrationConfig(delta=args.delta, confidence=args.confidence, text=args.text_threshold,
                                                    selection_confidence=args.selection_confidence, rule=args.rule),
                              resume_step=args.resume_step, shard=args.shard, tier_scope=args.tier_scope,
                              tier_rules=_tier_rules(args, judge, rule), noise_floor=args.noise_floor, risk=args.risk)
    if summary is not None:
        print(json.dumps(summary, indent=1, default=str))
    return 0


def _calibration_pairs(args, eng):
    """The pairs to generate and how they were drawn: a pairs file as it is, or a prompt log's first ``--warm`` requests
    as the cache and the rest as the stream, each paired with its first recalled warm request (as in service)."""
    if args.pairs_file is not None:
        rows = []
        for k, line in enumerate(Path(args.pairs_file).read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    d = json.loads(line)
                    rows.append((str(d["kind"]), str(d["source"]), int(d["source_seed"]), str(d["target"]), int(d["target_seed"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise CarnatorError(f"{args.pairs_file}, line {k + 1}: expected a JSON object with kind, source, "
                                        f"source_seed, target, target_seed ({e})") from None
        if len(rows) < args.pairs:
            raise CarnatorError(f"{args.pairs_file} holds {len(rows)} pairs; --pairs {args.pairs} were asked for")
        meta = Path(args.pairs_file).with_suffix(".meta.json")
        drawn = json.loads(meta.read_text()) if meta.is_file() else {"pairs_file": Path(args.pairs_file).name}
        return rows[: args.pairs], drawn
    from .bench.traces import prompt_trace
    from .calibrate.run import recall_pairs

    trace = prompt_trace(args.prompts, args.warm)
    top_k = eng.policy("carnator").cfg.top_k
    pairs = recall_pairs(trace.warm, trace.test, eng.embedder, eng.nouns, top_k=top_k, n=args.pairs)
    if len(pairs) < args.pairs:
        raise CarnatorError(f"only {len(pairs)} of {len(trace.test)} stream prompts of {args.prompts} found a recalled warm "
                            f"prompt with the same nouns (or one substituted); {args.pairs} pairs were asked for: "
                            "give more prompts or fewer --pairs")
    return pairs, {"pairs_from": "prompts", "prompts": Path(args.prompts).name, "warm": args.warm, "top_k": top_k}


def _settings(args) -> dict:
    """Generation settings given on the command line (each None: the model's default)."""
    return {k: v for k, v in (("height", getattr(args, "height", None)), ("width", getattr(args, "width", None)),
                              ("num_frames", getattr(args, "frames", None)), ("guidance_scale", getattr(args, "guidance", None)))
            if v is not None}


def _judge(args):
    from .judges import get_judge

    spec = args.judge
    if spec is None:
        if args.model != "embedded":
            raise CarnatorError("--judge is required for a model other than the embedded one, e.g. --judge clip=/path/to/clip")
        spec = "shapes"
    try:
        return get_judge(spec, device=getattr(args, "device", None))
    except ValueError as e:
        raise CarnatorError(f"--judge {spec}: {e}") from None

def cmd_bench(args) -> int:
    from .bench.report import to_markdown, write_html
    from .bench.run import run_bench
    from .bench.traces import Trace, prompt_trace
    from .engine import Carnator

    if args.keep_clips < 0:
        raise CarnatorError("--keep-clips must be 0 or more")
    if args.jobs < 1:
        raise CarnatorError("--jobs must be 1 or more")
    if args.report_only:
        out = Path(args.out)
        missing = [f for f in ("report.json", "requests.jsonl", "trace.json") if not (out / f).is_file()]
        if missing:
            raise CarnatorError(f"--report-only needs a finished bench directory; {out} lacks {', '.join(missing)}")
        path = write_html(out)
        print(f"wrote {path}")
        return 0
    if (args.trace is None) == (args.prompts is None):
        raise CarnatorError("give the workload: --prompts FILE (its first --warm prompts fill the caches, the next --test "
                            "are the stream) or --trace FILE (a trace.json)")
    judge = _judge(args)
    rule = _quality_rule(args, judge)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    base = _engine(args)
    for p in policies:
        base.policy(p)  # unknown names fail here, before any work

    def factory(cache_dir):
        eng = Carnator(base.pipe, cache_dir, adapter=base.adapter, config=base.config)
        eng._embedder = base._embedder
        return eng

    trace = Trace.load(Path(args.trace)) if args.trace is not None else prompt_trace(args.prompts, args.warm, args.test)
    if args.jobs > 1 and not args.worker:
        # Phase 1: the warm caches, several workers per policy (fills are independent). Phase 2: each policy's test
        # stream in one worker (its requests depend on what its earlier ones stored; dense's too, so every stream
        # runs under the same contention and their speeds compare). The workers append to one requests.jsonl; the
        # run below finds every row done and only writes the report.
        import multiprocessing as mp

        import torch

        order = ["dense"] + [p for p in policies if p != "dense"]
        stores = order[1:]
        threads = torch.get_num_threads()
        opts = vars(args)
        # On a machine of several GPUs, "--device cuda" spreads the workers over them (job j on GPU j mod count).
        gpus = torch.cuda.device_count() if str(args.device) == "cuda" and torch.cuda.is_available() else 0

        def on_gpu(j: int) -> dict:
            return {"_gpu": j % gpus} if gpus > 1 else {}

        # A fresh process per job: a worker's GPU is fixed when CUDA starts in it.
        with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1 if gpus > 1 else None) as pool:
            t0 = time.perf_counter()
            if stores:
                n = max(1, args.jobs // len(stores))
                jobs = [{"policies": p, "worker": True, "shard": {"warm_shard": (k, n)}} for p in stores for k in range(n)]
                pool.map(_worker, [(opts, {**o, **on_gpu(j)}, threads) for j, o in enumerate(jobs)], chunksize=1)
                print(f"warm caches filled in {time.perf_counter() - t0:.0f} s ({len(stores)} x {len(trace.warm)} requests, {n} workers each"
                      f"{f', over {gpus} GPUs' if gpus > 1 else ''})", flush=True)
            t0 = time.perf_counter()
            pool.map(_worker, [(opts, {"policies": p, "worker": True, "shard": {}, **on_gpu(j)}, threads)
                               for j, p in enumerate(order)], chunksize=1)
            print(f"test streams run in {time.perf_counter() - t0:.0f} s", flush=True)
    rep = run_bench(factory, trace, policies, Path(args.out), judge=judge, rule=rule, steps=args.steps, settings=_settings(args),
                    keep_clips=args.keep_clips,
                    only=args.worker, report=not args.worker, **args.shard)
    if rep is None:
        return 0
    print(to_markdown(rep))
    print(f"report: {Path(args.out) / 'report.html'}")
    return 0


def _worker(job: tuple[dict, dict, int]) -> None:
    """One part of a ``--jobs N`` run (calibrate: a shard of the pairs; bench: a shard of a policy's warm fill, or its
    test stream): the parent's subcommand on its options with ``overrides``, in its own process, with the parent's
    torch thread count (CPU results depend on it in the last bits, and the results must not depend on --jobs)."""
    import argparse

    import torch

    opts, overrides, threads = job
    overrides = dict(overrides)
    if "_gpu" in overrides:  # this worker's GPU (bench on several): set before CUDA starts in this fresh process
        os.environ["CUDA_VISIBLE_DEVICES"] = str(overrides.pop("_gpu"))
    torch.set_num_threads(threads)
    args = argparse.Namespace(**{**opts, "jobs": 1, **overrides})
    code = args.func(args)
    if code:
        raise CarnatorError(f"{args.func.__name__} worker {overrides} exited with {code}")


def _selection_confidence(text: str) -> float | None:
    if text == "point":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a confidence in (0, 1) or 'point', got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a confidence in (0, 1) or 'point', got {text!r}")
    return value


def _worker_failure(job: tuple[dict, dict, int]) -> str | None:
    """:func:`_worker`, returning its error's message instead of raising it (calibrate: a pair shard whose worker
    stopped is finished by the parent, rather than the error surfacing only after the other shards are done)."""
    try:
        _worker(job)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return f"{type(e).__name__}: {e}"
    return None


def _bank(args):
    from .cache import open_store

    return open_store(_store_url(args), blobs=args.blobs)


def cmd_cache(args) -> int:
    if args.action != "config" and (args.capacity is not None or args.eviction is not None):
        raise CarnatorError("--capacity and --eviction go with `carnator cache config`")
    try:
        capacity = parse_size(args.capacity) if args.capacity is not None else None
    except ValueError as err:
        raise CarnatorError(f"--capacity: {err}") from None
    with _bank(args) as bank:
        if args.action == "ls":
            rows = bank.entries(tenant=args.tenant)
            for e in rows:
                seed = "-" if e.seed is None else e.seed
                print(f"{e.id}  {e.tenant:<10} {e.nbytes:>10d} B  uses={e.use_count:<3d} seed={seed!s:<6} {e.prompt[:60]!r}")
            print(f"{len(rows)} entries in {_where(bank)}")
        elif args.action == "stats":
            st = bank.stats(args.tenant)
            print(f"cache: {_where(bank)}" + (f" (tenant {args.tenant})" if args.tenant else ""))
            print(f"entries: {st.count}  bytes: {st.bytes}  capacity: {_size_words(st.capacity_bytes)}  eviction: {st.eviction}")
            for tenant, ts in sorted(st.tenants.items()):
                print(f"  tenant {tenant}: {ts.count} entries, {ts.bytes} B")
        elif args.action == "verify":
            rep = bank.verify(tenant=args.tenant)
            notes = (f" (tenant {args.tenant})" if args.tenant else "") + (" (read-only: nothing repaired)" if rep.read_only else "")
            print(f"cache: {_where(bank)}{notes}")
            print(f"checked: {rep.checked}  quarantined: {len(rep.quarantined)}  missing: {len(rep.missing)}  lost: {len(rep.lost)}  "
                  f"recoveries: {len(rep.recoveries)}  orphans removed: {len(rep.orphans_removed)}")
            for line in rep.problems:
                print(f"  {line}")
            if rep.ok:
                print("ok")
            else:
                print(f"{len(rep.problems)} problem(s) found" + ("; read-only: nothing repaired" if rep.read_only else "; repaired"))
                return 1
        elif args.action == "config":
            if args.capacity is None and args.eviction is None:
                st = bank.stats()
                settings = (st.capacity_bytes, st.eviction)
            else:
                kw = {"eviction": args.eviction}
                if args.capacity is not None:
                    kw["capacity_bytes"] = capacity
                new = bank.configure(**kw)
                settings = (new.capacity_bytes, new.eviction)
            print(f"cache: {_where(bank)}")
            print(f"capacity: {_size_words(settings[0])}  eviction: {settings[1]}")
        elif args.action == "clear":
            if not _confirm_clear(bank, args):
                print("nothing deleted")
                return 1
            n = bank.clear(tenant=args.tenant)
            print(f"cleared {n} entries" + (f" of tenant {args.tenant}" if args.tenant else ""))
    return 0


def _confirm_clear(bank, args) -> bool:
    """``cache clear`` deletes only with ``--yes`` or a "y" typed at a terminal (no terminal: a user error)."""
    if args.yes:
        return True
    n = len(bank.entries(tenant=args.tenant))
    what = f"{n} entries" + (f" of tenant {args.tenant}" if args.tenant else "") + f" in {_where(bank)}"
    if not sys.stdin.isatty():
        raise CarnatorError(f"cache clear would delete {what}; add --yes to confirm")
    return input(f"delete {what}? [y/N] ").strip().lower() in ("y", "yes")


def _add_judge_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--judge", default=None, metavar="NAME[=ARG]",
                   help="the quality judge: clip=DIR (CLIP-T from a local CLIP model directory, with SSIM, PSNR against dense "
                        "and flicker), reference (SSIM, PSNR, flicker only), shapes (the embedded model's own judge: its clips read back) "
                        "or a judge a package registers. Default: shapes for the embedded model, else required")
    p.add_argument("--quality", action="append", default=[], metavar="SCORE=DELTA",
                   help=f"{what}: a reuse is acceptable iff each named judge score loses at most DELTA against dense on the same "
                        "request, and each SCORE>=FLOOR (SCORE<=CEILING) holds (repeatable; default: the judge's own rule: "
                        "clip: clip_t=0.02 and ssim>=0.5; shapes: fidelity=0.1 and artifact=0.02)")


def _parse_quality(items, judge, flag: str = "--quality") -> tuple[dict[str, float], dict[str, float]]:
    """SCORE=DELTA / SCORE>=FLOOR / SCORE<=CEILING items as (deltas, floors)."""
    deltas: dict[str, float] = {}
    floors: dict[str, float] = {}
    for item in items:
        for op in (">=", "<=", "="):
            k, sep, v = item.partition(op)
            if sep:
                break
        try:
            value = float(v)
        except ValueError:
            sep = ""
        if not sep or not k.strip():
            raise CarnatorError(f"{flag} {item!r}: expected SCORE=DELTA or SCORE>=FLOOR (SCORE<=CEILING), e.g. clip_t=0.02")
        k = k.strip()
        if op == "=":
            deltas[k] = value
            continue
        want = 1 if op == ">=" else -1
        if k in judge.directions and judge.directions[k] != want:
            better = "higher" if judge.directions[k] > 0 else "lower"
            raise CarnatorError(f"{flag} {item!r}: {k} is better {better}; write {k}{'>=' if better == 'higher' else '<='}{v}")
        floors[k] = value
    return deltas, floors


def _quality_rule(args, judge):
    from .judges import QualityRule

    deltas = dict(getattr(judge, "default_deltas", {}) or {})
    floors = dict(getattr(judge, "default_floors", {}) or {})
    if args.quality:
        deltas, floors = _parse_quality(args.quality, judge)
    if not deltas and not floors:
        raise CarnatorError(f"--quality: the {judge.name} judge has no default rule; name its scores, e.g. "
                            + " ".join(f"--quality {k}=0.02" for k in judge.directions))
    try:
        return QualityRule.for_judge(judge, floors, **deltas)
    except (ValueError, CarnatorError) as e:
        raise CarnatorError(f"--quality: {e}") from None


def _tier_rules(args, judge, rule) -> dict:
    """``--tier-quality KIND:SCORE=DELTA`` items as each named kind's rule: the ``rule`` with these scores added."""
    from .judges import QualityRule
    from .reuse.tiers import KINDS

    items: dict[str, list[str]] = {}
    for item in getattr(args, "tier_quality", None) or []:
        kind, sep, rest = item.partition(":")
        if not sep or kind.strip() not in KINDS:
            raise CarnatorError(f"--tier-quality {item!r}: expected KIND:SCORE=DELTA with KIND one of {', '.join(KINDS)}")
        items.setdefault(kind.strip(), []).append(rest)
    out = {}
    for kind, its in items.items():
        deltas, floors = _parse_quality(its, judge, "--tier-quality")
        try:
            out[kind] = QualityRule.for_judge(judge, {**rule.floors, **floors}, **{**rule.deltas, **deltas})
        except (ValueError, CarnatorError) as e:
            raise CarnatorError(f"--tier-quality: {e}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="carnator", description="Fast text-to-video generation by cross-request reuse.")
    ap.add_argument("-v", "--verbose", action="store_true", help="carnator's debug logging (generate: also every detail of the result)")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate one video", description="Generate one video, reusing cached work where the policy finds it safe; "
                       "prints one line: hit or miss, its source and reason, time and steps computed (--verbose or --json: every detail).")
    g.add_argument("prompt", help="what the video shows (the embedded model knows the shapes world's words only)")
    _add_gen_args(g)
    g.add_argument("--seed", type=int, default=0, help="seed of the initial noise, in [-2**63, 2**63 - 1]: the same prompt, seed and settings "
                                                       "give the same video (default: %(default)s)")
    g.add_argument("--policy", choices=POLICIES, default="carnator",
                   help="how cached work is reused: carnator (probe, compatibility test, region reuse), dense (none), or the "
                        "baselines nirvana, chorus, chorus2 (default: %(default)s)")
    g.add_argument("--negative-prompt", default=None, help="what the video should not show (default: the model's)")
    g.add_argument("--steps", type=int, default=None,
                   help=_later(lambda: f"denoising steps, at most 1000 (default: the model's; embedded: {_embedded_default('num_inference_steps')})"))
    g.add_argument("--frames", type=int, default=None,
                   help=_later(lambda: f"frames of the video (default: the model's; the embedded model makes {_embedded_default('frames')} only)"))
    g.add_argument("--height", type=int, default=None,
                   help=_later(lambda: f"height in pixels (default: the model's; the embedded model makes {_embedded_default('size')} only)"))
    g.add_argument("--width", type=int, default=None,
                   help=_later(lambda: f"width in pixels (default: the model's; the embedded model makes {_embedded_default('size')} only)"))
    g.add_argument("--guidance", type=float, default=None,
                   help=_later(lambda: f"classifier-free guidance scale, in [0, 100] (default: the model's; embedded: {_embedded_default('guidance_scale')})"))
    g.add_argument("--tenant", default="default", help="cache namespace: entries are reused within their tenant only (default: %(default)s)")
    g.add_argument("--out", default="out.mp4", help="output video, .mp4 (H.264) or .gif (default: ./%(default)s)")
    g.add_argument("--fps", type=int_in(1, 240), default=8, help="frames per second of the output, 1-240 (.gif: 1-50) (default: %(default)s)")
    g.add_argument("--no-store", action="store_true", help="do not add the result to the cache")
    g.add_argument("--cache", choices=("reuse", "exact", "off"), default=None,
                   help="what the request may read from the cache: reuse (exact hits and approximate reuse), exact (exact "
                        "hits only) or off (nothing: generate in full; still stored unless --no-store). Default: the "
                        "policy's (dense: off)")
    g.add_argument("--json", action="store_true", help="print every detail as one JSON object instead of the summary line")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="print every detail (timings, discrepancies, notes) under the summary line; carnator's debug logging")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    g.add_argument("--server", default=None, metavar="URL",
                   help="run the job on a carnator serve at URL instead of here (--model, --cache-dir, --device, "
                        "--capacity, --option, --intra-cache and --no-store stay the server's; --tenant is the API key's)")
    g.add_argument("--api-key", default=os.environ.get("CARNATOR_API_KEY"), metavar="KEY",
                   help="--server's API key (default: $CARNATOR_API_KEY)")
    _add_store_args(g)
    add_fields(g, EngineConfig, ["intra_cache"])
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="a short stream of related requests through the carnator policy, with a page that tells it",
                       description="Twelve related requests on the embedded model through a policy, each compared with a dense run of "
                                   "the same request right after it; writes the clips, demo.json and index.html to --out.")
    _add_gen_args(d, cache_help="cache directory (default: OUT/cache, emptied at the start unless --keep-cache; a directory "
                                "given here is never emptied)")
    d.add_argument("--policy", choices=POLICIES, default="carnator", help="the policy the stream runs through (default: %(default)s)")
    d.add_argument("--steps", type=int, default=None,
                   help=_later(lambda: f"denoising steps (default: the model's, {_embedded_default('num_inference_steps')}; the carnator "
                                "policy resumes at the step its thresholds file is certified at, 45 of 50 on the embedded model, scaled to fewer "
                                "steps)"))
    d.add_argument("--out", default="carnator-demo", help="output folder: clips, demo.json, index.html (default: ./%(default)s)")
    d.add_argument("--keep-cache", action="store_true",
                   help="start from what OUT/cache holds from an earlier run (the demo then says it replays)")
    d.set_defaults(func=cmd_demo)

    k = sub.add_parser("calibrate", help="select and certify compatibility thresholds for a model, its prompts and a judge",
                       description="Draw request pairs from a prompt log as recall draws them in service (or read them from a "
                                   "pairs file), generate each densely and through a forced reuse, judge both, then select "
                                   "thresholds on one split and certify them on the other (Clopper-Pearson). Resumable: an "
                                   "interrupted run continues where it stopped. Writes thresholds.json for --option "
                                   "carnator.thresholds=PATH (docs/CALIBRATION.md).")
    _add_gen_args(k)
    k.add_argument("--prompts", default=None, metavar="FILE",
                   help="a prompt log (one prompt per line, or JSON lines with prompt and seed): its first --warm prompts are "
                        "the cache, each later one is paired with the cached prompt recall hands the compatibility test first")
    k.add_argument("--pairs-file", default=None, metavar="FILE",
                   help="pairs to generate instead: JSON lines with kind, source, source_seed, target, target_seed")
    k.add_argument("--pairs", type=int, default=100, help="request-cache pairs (paper: 30 selection + 70 certification; default %(default)s)")
    k.add_argument("--warm", type=int, default=100, help="prompts of the log that form the cache (--prompts; default %(default)s)")
    k.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    k.add_argument("--frames", type=int, default=None, help="frames per clip (default: the model's)")
    k.add_argument("--height", type=int, default=None, help="clip height (default: the model's)")
    k.add_argument("--width", type=int, default=None, help="clip width (default: the model's)")
    k.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    k.add_argument("--resume-step", type=_resume_steps, default=None, metavar="STEP[,STEP...]",
                   help="the step a reuse resumes at (default: the policy's own setting, else 30); recorded in the thresholds file. "
                        "Several (5,10,20,45): risk tiers, each pair reused from every step and one step certified per kind of change "
                        "(one step with --tier-scope frame|region or --tier-quality: tiers at that step)")
    k.add_argument("--tier-scope", choices=["auto", "frame", "region"], default="auto",
                   help="risk tiers: how a tier's reuse recomputes: frame (every token from its step), region "
                        "(the probe's regions, the source kept outside them) or auto (frame for re-rolls and rewordings, region "
                        "for edits; default)")
    k.add_argument("--tier-quality", action="append", default=[], metavar="KIND:SCORE=DELTA",
                   help="risk tiers: a kind of change's own rule: the quality rule with this score added "
                        "(repeatable; e.g. colour:color=0.05: a colour edit that lost a colour dense shows is unsafe)")
    k.add_argument("--noise-floor", action="store_true",
                   help="also generate each target densely at another seed and report how often the rule fails it against "
                        "dense, per kind (the summary's noise_floor: what a reuse that is merely another sample scores)")
    k.add_argument("--risk", choices=["pair", "excess"], default="pair",
                   help="risk tiers: what counts as unsafe. pair (default): the reuse fails the rule against the dense run "
                        "of its request; excess: it fails and another dense sample of the request passes (needs "
                        "--noise-floor): the certificate then bounds how much more often a reuse fails than a fresh sample")
    k.add_argument("--delta", type=float, default=0.05, help="tolerated unsafe rate (paper 5%%)")
    k.add_argument("--confidence", type=float, default=0.90)
    k.add_argument("--selection-confidence", type=_selection_confidence, default=None, metavar="C|point",
                   help="thresholds are feasible in selection when the Clopper-Pearson bound at C of their unsafe share is "
                        "<= --delta; 'point' (default): when the share itself is (the paper)")
    k.add_argument("--rule", choices=["box", "linear"], default="box",
                   help="box: one threshold per discrepancy (the paper); linear: a logistic risk score over all of them, fitted "
                        "on the selection split, with one threshold (default %(default)s; docs/METHOD.md)")
    k.add_argument("--no-text-threshold", dest="text_threshold", action="store_false",
                   help="calibrate the paper's four signature thresholds only, leaving the recall-similarity one off")
    _add_judge_args(k, "the quality rule")
    k.add_argument("--out", default="carnator-calibration", help="output folder (pairs.jsonl, thresholds.json, calibration.json)")
    k.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="generate the pairs in N worker processes (set OMP_NUM_THREADS so that N x threads fits the cores)")
    add_fields(k, EngineConfig, ["cuda_graphs"])
    k.add_argument("--select-only", action="store_true",
                   help="generate no pairs: select and certify from every pair already in --out (e.g. under another --rule, "
                        "--delta or quality rule)")
    k.set_defaults(shard=None)  # set by _worker only
    k.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="compare policies on one workload (warm caches + a test stream), with a judge",
                       description="Fill each policy's cache with the warm requests (as misses), run the test stream through "
                                   "every policy in the same order and report hit rate, speedups against dense on the same "
                                   "requests, judge scores and the unsafe-hit rate (report.md/.html/.json).")
    _add_gen_args(b)
    b.add_argument("--prompts", default=None, metavar="FILE",
                   help="a prompt file: its first --warm prompts fill the caches, the next --test are the stream")
    b.add_argument("--trace", default=None, metavar="FILE", help="a trace.json (warm and test requests) instead")
    b.add_argument("--policies", default="dense,nirvana,chorus,chorus2,carnator")
    b.add_argument("--warm", type=int, default=12, help="warm-cache requests W (--prompts; paper: 1000)")
    b.add_argument("--test", type=int, default=None, help="test requests S (--prompts; default: the rest; paper: 300)")
    b.add_argument("--steps", type=int, default=None)
    b.add_argument("--frames", type=int, default=None, help="frames per clip (default: the model's)")
    b.add_argument("--height", type=int, default=None, help="clip height (default: the model's)")
    b.add_argument("--width", type=int, default=None, help="clip width (default: the model's)")
    b.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    b.add_argument("--out", default="carnator-bench", help="output folder (trace.json, requests.jsonl, report.json/.md/.html, clips/)")
    b.add_argument("--keep-clips", type=int, default=4, metavar="N",
                   help="keep GIF clips of dense and every policy for the first N hits of each policy, shown side by side "
                        "in report.html (default 4; 0: none)")
    _add_judge_args(b, "a hit is unsafe unless the rule accepts it")
    b.add_argument("--report-only", action="store_true", help="only rewrite report.html from the finished run in --out")
    b.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the policies in N processes at once (each loads the model; on a GPU the small embedded model "
                        "leaves room for several). Hits and quality equal a one-process run's; the speed columns are then "
                        "measured while the policies share the machine, so take speed from a --jobs 1 run")
    add_fields(b, EngineConfig, ["cuda_graphs", "latent_dtype", "intra_cache"])
    b.set_defaults(worker=False, shard={})  # set by _worker only
    b.set_defaults(func=cmd_bench)


    c = sub.add_parser("cache", help="inspect or manage the cache",
                       description="ls: list entries; stats: counts, bytes and settings; verify: check every entry "
                                   "(exit status 1 when anything was corrupt, missing or lost); clear: delete entries (asks "
                                   "first; --yes); config: show or set the cache's capacity and eviction policy (stored in the cache)")
    c.add_argument("action", choices=["ls", "stats", "verify", "clear", "config"])
    c.add_argument("--cache-dir", default=None, help="cache directory (default: $CARNATOR_CACHE_DIR, else ~/.cache/carnator)")
    c.add_argument("--tenant", default=None, help="only this tenant's entries (ls, stats, verify, clear; default: all)")
    c.add_argument("--capacity", default=None, metavar="SIZE", help="config: e.g. 40MB, 2GiB, 500000 (bytes) or none (unbounded)")
    c.add_argument("--eviction", default=None, choices=EVICTIONS, help="config: which entries go first when full")
    c.add_argument("-y", "--yes", action="store_true", help="clear: delete without asking")
    _add_store_args(c)
    c.set_defaults(func=cmd_cache)

    s = sub.add_parser("serve", help="the video jobs service: HTTP API, live events, web page, metrics (docs/SERVING.md)",
                       description="Serve text-to-video jobs over HTTP (OpenAI-style /v1/videos) with the cross-request "
                                   "cache, a web page at / and Prometheus metrics at /metrics; prints the URL. Needs the "
                                   "serve extra: pip install 'carnator[serve]'.")
    add_fields(s, ServeConfig)
    add_fields(s, EngineConfig, ["policy_options", "tenant_quota_bytes"])
    s.set_defaults(func=cmd_serve)

    a = sub.add_parser("audit", help="the live audit of a service's reuse: verdicts and bounds per kind and tier",
                       description="Report the shadow audits a carnator serve recorded in its job store (jobs.sqlite in "
                                   "the cache directory, or a postgresql:// --store): per kind of change and tier, the "
                                   "verdicts, the unsafe among them, the Clopper-Pearson bounds at the thresholds file's "
                                   "confidence, and whether the tier is disabled. Works offline, on a stopped server's store.")
    a.add_argument("--cache-dir", default=None, help="the server's cache directory (default: $CARNATOR_CACHE_DIR, else ~/.cache/carnator)")
    a.add_argument("--store", default=None, metavar="postgresql://...", help="the server's shared store (its job table)")
    a.add_argument("--thresholds", default=None, metavar="PATH",
                   help="only the verdicts of this thresholds file, with its delta and confidence (default: every file "
                        "the verdicts were recorded under, each at delta 0.05 / confidence 0.9 unless given)")
    a.add_argument("--delta", type=float_in(0, 1), default=None, help="delta (default: the thresholds file's, else 0.05)")
    a.add_argument("--confidence", type=float_in(0, 1), default=None, help="confidence (default: the file's, else 0.9)")
    a.add_argument("--verdicts", action="store_true", help="also list every verdict (job, kind, tier, scores)")
    a.add_argument("--json", action="store_true", help="one JSON object")
    a.set_defaults(func=cmd_audit)
    return ap


def cmd_audit(args) -> int:
    from .service.audit import certificate_of, format_report, live_bounds, thresholds_identity, verdicts_to_disable

    try:
        from .service.server import open_job_store
    except ImportError as e:
        raise CarnatorError(f"carnator audit needs the serve extra: pip install 'carnator[serve]' ({e.name} is missing)") from None
    from .cache import default_cache_dir

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if not args.store and not (cache_dir / "jobs.sqlite").is_file():
        raise CarnatorError(f"no job table in {cache_dir} (jobs.sqlite): pass the server's --cache-dir or --store")
    store = open_job_store(args.store, cache_dir)
    try:
        only = thresholds_identity(args.thresholds) if args.thresholds else None
        rows = store.audit_verdicts(only)
    finally:
        store.close()
    delta, conf = 0.05, 0.9
    if args.thresholds:
        cert = certificate_of(args.thresholds)
        delta, conf = cert.delta, cert.confidence
    delta = args.delta if args.delta is not None else delta
    conf = args.confidence if args.confidence is not None else conf
    reports: list[dict[str, Any]] = []
    for ident in dict.fromkeys(r["thresholds"] for r in rows) or ([only] if only else []):
        mine = [r for r in rows if r["thresholds"] == ident]
        reports.append({"thresholds": ident, "delta": delta, "confidence": conf,
                        "verdicts_to_disable": verdicts_to_disable(delta, conf),
                        "tiers": [{**t, "tier": f"{t['step']}/{t['of']}" if t["of"] else str(t["step"])}
                                  for t in live_bounds(mine, delta, conf)],
                        **({"verdicts": mine} if args.verdicts else {})})
    if args.json:
        print(json.dumps({"reports": reports}, default=str))
        return 0
    if not reports:
        print("no audit verdicts in this job store")
    for rep in reports:
        print(f"thresholds {rep['thresholds']}: delta {rep['delta']:g}, confidence {rep['confidence']:g} (all-unsafe "
              f"verdicts to disable a tier: {rep['verdicts_to_disable']})")
        for line in format_report(rep):
            print("  " + line)
        for v in rep.get("verdicts", []):
            scores = " ".join(f"{k}={v['scores']['reuse'].get(k)}/{v['scores']['dense'].get(k)}" for k in v["scores"].get("reuse", {}))
            print(f"    {v['job_id']} {v['kind']} {v['step']}/{v['of']} {'safe' if v['acceptable'] else 'UNSAFE'} "
                  f"reuse/dense {scores}")
    return 0


def cmd_serve(args) -> int:
    try:
        from .service.server import serve
    except ImportError as e:  # fastapi, uvicorn, ... (the serve extra)
        raise CarnatorError(f"carnator serve needs the serve extra: pip install 'carnator[serve]' ({e.name} is missing)") from None
    _blobs_need_store(args)
    if args.ray_address and not args.replicas:
        raise CarnatorError("--ray-address goes with --replicas N")
    if args.router != "affinity" and not args.replicas:
        raise CarnatorError("--router goes with --replicas N")
    engine_config: dict[str, Any] = {}  # the engine options serve takes (its engines' other settings are ServeConfig's)
    if args.policy_options:
        engine_config["policy_options"] = _policy_options(args.policy_options)
    if args.tenant_quota_bytes is not None:
        engine_config["tenant_quota_bytes"] = args.tenant_quota_bytes
    return serve(ServeConfig(**field_values(ServeConfig, args), engine_config=engine_config), verbose=args.verbose)


def _in_an_import(frame: Any) -> bool:
    """Whether Python code runs inside an import (a module's body or an extension's initialisation) at this frame."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C of the program. Inside an import it ends the process at once: an exception raised in an extension's
    initialisation can abort the interpreter (triton's libtriton, a nanobind module imported by torch, calls back into
    Python while it loads; a KeyboardInterrupt there is a C++ exception nothing catches: SIGABRT and a core). Elsewhere
    it unwinds as KeyboardInterrupt, so that pools, files and connections are closed on the way out."""
    if _in_an_import(frame):
        print("carnator: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (the console script, python -m), not a caller's main([...])
        import signal

        signal.signal(signal.SIGINT, _on_sigint)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # anywhere, start-up (imports, model loading) included: no traceback
        print("carnator: interrupted", file=sys.stderr)
        if argv is None:
            # The program itself (the console script, python -m): leave now with 130. An interrupt that passed through
            # an extension's embedded eval during start-up (torch's import) marks the interpreter, which would
            # otherwise end itself by SIGINT at exit however the exception was handled.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130


def _main(argv: list[str] | None) -> int:
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except _UsageError as e:
        print(f"carnator: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(level=logging.WARNING, format="carnator: %(levelname)s: %(message)s")
    if args.verbose:  # carnator's own debug lines, not every library's
        logging.getLogger("carnator").setLevel(logging.DEBUG)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except CarnatorError as e:
        print(f"carnator: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
