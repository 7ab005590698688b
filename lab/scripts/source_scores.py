"""Issue 26, device call 1: (A) the judge's scores of every calibration source's own clip, (B) a re-roll hit's own sample.

(A) The calibration rows (lab/notebook/bench-embedded/calibration-h200-w1000-modifiers1-2933-pairs.jsonl.gz) do not
record how good the cached clip each reuse resumed from was. This regenerates every distinct (source caption, source
seed) of the pair list (``--pairs``: the ``stream_pairs(3000, MiniLM, warm=1000)`` list, as calibrate drew it) as
calibrate did (carnator policy, a miss, probe included) and judges it, so the admission gate (lever 1) can be applied
to the rows offline.

(B) Lever 6: for held-out captions never used in calibration, a cached source (seed a), the dense clip of seed b and a
re-roll hit for seed b under ``CarnatorConfig.own_sample`` in {0, 0.5, 1} at resume step 30, and 1 at resume steps 20 and 10: mean |pixel difference| (0-255) of the hit
to the source and to dense b, of dense b to the source, and the judge's scores.

    python3 lab/scripts/source_scores.py --pairs PAIRS.jsonl --out DIR [--jobs 12] [--own-n 48] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import numpy as np

_ENG = None
_JUDGE = None


def _engine(cache: str, device: str, **policy_options):
    from carnator import Carnator
    from carnator.engine import EngineConfig

    return Carnator.from_pretrained("embedded", cache, device=device,
                                    config=EngineConfig(cuda_graphs=device.startswith("cuda"), latent_dtype="float16",
                                                        policy_options=policy_options))


def _init(device: str, root: str):
    global _ENG, _JUDGE
    from carnator.judges import get_judge

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _ENG = _engine(f"{root}/w{os.getpid()}", device)
    _JUDGE = get_judge("shapes")


def _source(item):
    prompt, seed = item
    r = _ENG.generate(prompt, seed=seed, policy="carnator", cache="off", store=False)
    s = _JUDGE.score(r.frames, prompt)
    return {"source": prompt, "seed": seed, **{k: float(v) for k, v in s.items()}, "seconds": r.stats.timings["total"]}


def part_a(pairs_path: Path, out: Path, jobs: int, device: str, root: str, same_content: bool = False) -> None:
    pairs = [json.loads(line) for line in pairs_path.read_text().splitlines()]
    if same_content:  # only the pairs the content rule can accept need their source judged
        from carnator.signature.content import LexiconContent, content_distance

        read = LexiconContent.from_file(Path(__file__).resolve().parents[2] / "src/carnator/embedded/lexicon.json")
        pairs = [p for p in pairs if content_distance(read(p["source"]), read(p["target"])) == 0]
    items = sorted({(p["source"], int(p["source_seed"])) for p in pairs})
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs, initializer=_init, initargs=(device, root)) as pool, open(out / "sources.jsonl", "w") as f:
        for k, row in enumerate(pool.imap_unordered(_source, items, chunksize=4)):
            f.write(json.dumps(row) + "\n")
            if k % 100 == 0:
                print(f"[A] {k}/{len(items)} {time.time() - t0:.0f}s", flush=True)
    print(f"[A] {len(items)} sources judged in {time.time() - t0:.0f}s", flush=True)


def part_b(out: Path, n: int, device: str, root: str) -> None:
    from carnator.judges import get_judge
    from carnator.reuse import Thresholds
    from carnator_lab.world.captions import caption
    from carnator_lab.world.scene import sample_scene

    judge = get_judge("shapes")
    rng = np.random.default_rng(26026)   # not the calibration's seeds (0) nor the bench trace's (0)
    prompts = [caption(sample_scene(rng, split="heldout"), rng, split="heldout") for _ in range(n)]
    seeds = [(int(rng.integers(1 << 30)), int(rng.integers(1 << 30))) for _ in range(n)]
    probe = _engine(f"{root}/b-probe", device)
    tau_path = Path(root) / "content-only.json"
    Thresholds(math.inf, math.inf, math.inf, math.inf, content=0.0).save(
        tau_path, model_id=probe.model_identity, reading=probe.policy("carnator").reading(), meta={"certified": False})
    mixes = ("0.0@30", "0.5@30", "1.0@30", "1.0@20", "1.0@10")   # own_sample @ resume step
    engines = {m: _engine(f"{root}/b{m}", device, carnator={"thresholds": str(tau_path), "own_sample": float(m.split("@")[0]),
                                                           "resume_step": int(m.split("@")[1])}) for m in mixes}
    rows = []
    t0 = time.time()
    for i, (p, (a, b)) in enumerate(zip(prompts, seeds)):
        src = None
        for m, eng in engines.items():
            s = eng.generate(p, seed=a)
            eng.flush()  # written behind on a GPU: stored before the hit below recalls it
            src = s.frames if src is None else src
        dense = probe.generate(p, seed=b, policy="dense", store=False)
        row = {"prompt": p, "seed_source": a, "seed": b, "dense": judge.score(dense.frames, p),
               "dense_vs_source": float(np.abs(dense.frames.astype(np.float32) - src).mean()), "hits": {}}
        for m, eng in engines.items():
            h = eng.generate(p, seed=b, store=False)
            f = h.frames.astype(np.float32)
            row["hits"][str(m)] = {"hit": bool(h.stats.hit), "vs_source": float(np.abs(f - src).mean()),
                                   "vs_dense": float(np.abs(f - dense.frames).mean()), **judge.score(h.frames, p),
                                   "seconds": h.stats.timings["total"]}
        row["source"] = judge.score(src.astype(np.uint8), p)
        rows.append(row)
    (out / "own_sample.json").write_text(json.dumps(rows, indent=0))
    print(f"[B] {n} prompts in {time.time() - t0:.0f}s", flush=True)
    for m in mixes:
        hs = [r["hits"][str(m)] for r in rows if r["hits"][str(m)]["hit"]]
        print(f"[B] own_sample {m}: hits {len(hs)}/{n}, hit vs source {np.mean([h['vs_source'] for h in hs]):.2f}, "
              f"hit vs dense {np.mean([h['vs_dense'] for h in hs]):.2f}, dense vs source "
              f"{np.mean([r['dense_vs_source'] for r in rows]):.2f}; fidelity hit {np.mean([h['fidelity'] for h in hs]):.3f} "
              f"dense {np.mean([r['dense']['fidelity'] for r in rows]):.3f} source {np.mean([r['source']['fidelity'] for r in rows]):.3f}; "
              f"artifact hit {np.mean([h['artifact'] for h in hs]):.3f} dense {np.mean([r['dense']['artifact'] for r in rows]):.3f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--own-n", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--root", default="/tmp/source-scores")
    ap.add_argument("--same-content", action="store_true", help="only the sources of pairs whose prompts ask the same")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    Path(args.root).mkdir(parents=True)
    procs = []
    if args.own_n > 0:
        pb = mp.get_context("spawn").Process(target=part_b, args=(args.out, args.own_n, args.device, args.root))
        pb.start()
        procs.append(pb)
    if args.pairs is not None:
        part_a(args.pairs, args.out, args.jobs, args.device, args.root, args.same_content)
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
