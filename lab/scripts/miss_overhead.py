"""Where a carnator miss spends the time a dense request does not, stage by stage, on one engine.

    python lab/scripts/miss_overhead.py [--device cuda --cuda-graphs] [-n 30] [--out FILE.json]

For ``-n`` distinct shapes-world prompts (held-out split, after 3 warm-up requests), one process runs each as
``dense`` without storing it (as the bench's dense baseline), as a ``carnator`` miss that stores its entry (its own
tenant, so nothing is recalled), and as a ``carnator`` miss with ``store=False``. Prints the mean of every stage of
``stats.timings`` per variant; the difference of the two carnator rows is the store, that of the second and the
first the whole miss overhead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict

import numpy as np

from carnator import Carnator
from carnator_lab.traces import world_trace
from carnator.engine import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = EngineConfig(cuda_graphs=args.cuda_graphs, latent_dtype="float16" if args.device == "cuda" else "float32",
                       write_behind=False)  # the difference of the stored and unstored rows is the store
    eng = Carnator.from_pretrained("embedded", tempfile.mkdtemp(prefix="carnator-miss-"), device=args.device, config=cfg)
    prompts = [r.prompt for r in world_trace(args.n + 3, 0, seed=7, split="heldout").warm]
    variants = {"dense": dict(policy="dense", store=False), "carnator miss, stored": dict(policy="carnator"),
                "carnator miss, not stored": dict(policy="carnator", store=False)}
    times: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
    for i, p in enumerate(prompts):
        for j, (name, kw) in enumerate(variants.items()):
            res = eng.generate(p, seed=i, tenant=f"t{i}v{j}", **kw)
            assert not res.stats.hit
            if i >= 3:
                for k, v in res.stats.timings.items():
                    times[name][k].append(v)
    stages = sorted({k for t in times.values() for k in t}, key=lambda k: (k == "total", k))
    print("| variant | " + " | ".join(stages) + " |")
    print("|---|" + "---|" * len(stages))
    summary = {}
    for name, t in times.items():
        summary[name] = {k: float(np.mean(t[k])) if t.get(k) else None for k in stages}
        print(f"| {name} | " + " | ".join("-" if summary[name][k] is None else f"{summary[name][k]:.4f}" for k in stages) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "cuda_graphs": args.cuda_graphs, "n": args.n, "mean_seconds": summary}, f, indent=1)


if __name__ == "__main__":
    main()
