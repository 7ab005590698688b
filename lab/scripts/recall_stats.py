"""Recall-stage statistics on real prompts, in the paper's trace protocol.

    python lab/scripts/recall_stats.py [--prompts ../shared/data/prompts/vidprom_dev.tsv] [--warm 1000] [--test 300]
                                   [--seeds 0,1,2,3,4] [--k 10] [--json out.json]

Reads a prompt set (a .tsv with a ``prompt`` column, or a .txt with one prompt a line) from the
shared data folder; it is read where it lies and never copied (the VidProM prompts are
CC BY-NC 4.0, research use only). Prompts are de-duplicated (lower-cased, whitespace collapsed),
then per seed shuffled: the first W form the warm cache, the next S the test stream, disjoint by
text. No generation runs: for each test prompt only the recall stage does, as the engine would:

- the recall embedding (MiniLM, ``carnator.recall.embedder.default_embedder``) ranks the warm prompts by
  cosine and keeps the top K (paper: 10);
- the shared text gate of the baselines (``TextGate``, cosine of the nearest >= 0.65) passes or not;
- carnator's noun filter (``extract_nouns`` + ``noun_diff``: identical noun sets or exactly one
  substitution) is applied to the top-K candidates and to the top-1.

It prints, per seed and pooled over seeds, how often each passes and the distribution of the best
cosine (binned at NIRVANA's resume-step thresholds), as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "vidprom_dev.tsv"
#: Best-cosine bins: below the gate, then NIRVANA's table (0.65 -> step 5, 0.75 -> 10, 0.85 -> 15, 0.90 -> 20, 0.95 -> 25).
BINS: tuple[float, ...] = (0.5, 0.65, 0.75, 0.85, 0.90, 0.95)


def read_prompts(path: Path) -> tuple[list[str], list[str]]:
    """(prompts, topics) of a .tsv with a ``prompt`` column (and maybe ``topic``) or a .txt of lines."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".tsv":
        head = lines[0].split("\t")
        pi = head.index("prompt")
        ti = head.index("topic") if "topic" in head else None
        rows = [ln.split("\t") for ln in lines[1:] if ln.strip()]
        return [r[pi].strip() for r in rows], [r[ti] if ti is not None else "" for r in rows]
    prompts = [ln.strip() for ln in lines if ln.strip()]
    return prompts, [""] * len(prompts)


def dedupe(prompts: list[str], topics: list[str]) -> tuple[list[str], list[str]]:
    """Drop repeated prompts (lower-cased, whitespace collapsed), keeping the first."""
    seen, p_out, t_out = set(), [], []
    for p, t in zip(prompts, topics):
        key = re.sub(r"\s+", " ", p.lower()).strip()
        if key and key not in seen:
            seen.add(key)
            p_out.append(p)
            t_out.append(t)
    return p_out, t_out


def split(n: int, warm: int, test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a warm set and a disjoint test stream drawn without replacement."""
    if warm + test > n:
        raise ValueError(f"{warm} warm + {test} test prompts needs {warm + test} distinct prompts, the set has {n}")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[:warm], perm[warm:warm + test]


@dataclass(frozen=True)
class RecallRow:
    """What the recall stage saw for one test prompt."""

    best_cos: float          # cosine of the nearest warm prompt
    gate: bool               # shared text gate: best_cos >= threshold
    top1_noun: bool          # noun filter passes for the nearest warm prompt
    top1_identical: bool     # ... with identical noun sets
    topk_noun: int           # top-K candidates that pass the noun filter (carnator's recall keeps these)
    topk_noun_gated: int     # ... among those with cosine >= the gate threshold
    same_topic: bool | None  # the nearest warm prompt has the same topic (None: no topics)
    empty_nouns: bool        # the test prompt has no nouns


def recall_rows(warm_vecs: np.ndarray, test_vecs: np.ndarray, warm_nouns: list[set[str]], test_nouns: list[set[str]], *,
                k: int = 10, gate: float | None = None, warm_topics: list[str] | None = None,
                test_topics: list[str] | None = None) -> list[RecallRow]:
    """The recall stage for every test prompt against the warm set (unit vectors, cosine = dot)."""
    from carnator.policies.baselines import TextGate
    from carnator.reuse.compat import noun_diff

    gate = TextGate().min_similarity if gate is None else gate
    sims = np.asarray(test_vecs, dtype=np.float64) @ np.asarray(warm_vecs, dtype=np.float64).T
    k = min(k, sims.shape[1])
    rows = []
    for t in range(sims.shape[0]):
        top = np.argsort(-sims[t], kind="stable")[:k]
        diffs = [noun_diff(test_nouns[t], warm_nouns[j]) for j in top]
        d1 = diffs[0]
        best = float(sims[t, top[0]])
        same = None
        if warm_topics is not None and test_topics is not None and test_topics[t]:
            same = warm_topics[top[0]] == test_topics[t]
        rows.append(RecallRow(
            best_cos=best, gate=best >= gate, top1_noun=d1 is not None, top1_identical=d1 is not None and d1.substituted is None,
            topk_noun=sum(d is not None for d in diffs),
            topk_noun_gated=sum(d is not None and bool(sims[t, j] >= gate) for d, j in zip(diffs, top)),
            same_topic=same, empty_nouns=not test_nouns[t],
        ))
    return rows


def summarize(rows: list[RecallRow], k: int) -> dict:
    """Pass rates and the best-cosine distribution of a list of :class:`RecallRow`."""
    n = len(rows)
    best = np.array([r.best_cos for r in rows])
    edges = (-1.0, *BINS, 1.0 + 1e-9)
    hist = {f"[{lo:.2f},{hi:.2f})" if hi <= 1 else f">={lo:.2f}": int(((best >= lo) & (best < hi)).sum()) for lo, hi in pairwise(edges)}
    topics = [r.same_topic for r in rows if r.same_topic is not None]
    return {
        "n": n, "k": k,
        "gate_pass": sum(r.gate for r in rows),
        "top1_noun_pass": sum(r.top1_noun for r in rows),
        "top1_noun_identical": sum(r.top1_identical for r in rows),
        "top1_noun_substitution": sum(r.top1_noun and not r.top1_identical for r in rows),
        "gate_and_top1_noun": sum(r.gate and r.top1_noun for r in rows),
        "topk_any_noun_pass": sum(r.topk_noun > 0 for r in rows),
        "topk_any_noun_pass_gated": sum(r.topk_noun_gated > 0 for r in rows),
        "topk_candidates_passing": sum(r.topk_noun for r in rows),
        "topk_candidates": n * k,
        "empty_noun_sets": sum(r.empty_nouns for r in rows),
        "top1_same_topic": int(sum(topics)) if topics else None,
        "best_cos_quantiles": {q: float(np.quantile(best, q / 100)) for q in (0, 10, 25, 50, 75, 90, 100)} if n else {},
        "best_cos_mean": float(best.mean()) if n else None,
        "best_cos_hist": hist,
    }


def recall_stats(warm: list[str], test: list[str], embed, nouns=None, *, k: int = 10, gate: float | None = None) -> dict:
    """Convenience for small sets: embed and extract nouns, then :func:`recall_rows` + :func:`summarize`."""
    from carnator.signature.nouns import extract_nouns

    nouns = nouns or extract_nouns
    rows = recall_rows(embed(warm), embed(test), [set(nouns(p)) for p in warm], [set(nouns(p)) for p in test], k=k, gate=gate)
    return summarize(rows, min(k, len(warm)))


def _pct(a, n):
    return "-" if a is None or not n else f"{100 * a / n:.1f} %"


def markdown(per_seed: dict[int, dict], pooled: dict) -> str:
    cols = [*(f"seed {s}" for s in per_seed), "pooled"]
    stats = [*per_seed.values(), pooled]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(s) for s in stats) + " |")

    row("test prompts", lambda s: str(s["n"]))
    row("text gate passes (top-1 cosine >= 0.65)", lambda s: _pct(s["gate_pass"], s["n"]))
    row("noun filter passes, top-1", lambda s: _pct(s["top1_noun_pass"], s["n"]))
    row("... identical noun sets", lambda s: _pct(s["top1_noun_identical"], s["n"]))
    row("... one substitution", lambda s: _pct(s["top1_noun_substitution"], s["n"]))
    row("text gate and noun filter, top-1", lambda s: _pct(s["gate_and_top1_noun"], s["n"]))
    row(f"noun filter passes for some top-{pooled['k']} candidate (carnator recall non-empty)", lambda s: _pct(s["topk_any_noun_pass"], s["n"]))
    row("... for some candidate with cosine >= 0.65", lambda s: _pct(s["topk_any_noun_pass_gated"], s["n"]))
    row(f"top-{pooled['k']} candidates passing the noun filter", lambda s: _pct(s["topk_candidates_passing"], s["topk_candidates"]))
    row("test prompts with no nouns", lambda s: _pct(s["empty_noun_sets"], s["n"]))
    row("top-1 has the same VidProM topic", lambda s: _pct(s["top1_same_topic"], s["n"]))
    row("best cosine mean", lambda s: f"{s['best_cos_mean']:.3f}")
    for q in (10, 25, 50, 75, 90):
        row(f"best cosine p{q}", lambda s, q=q: f"{s['best_cos_quantiles'][q]:.3f}")
    row("best cosine max", lambda s: f"{s['best_cos_quantiles'][100]:.3f}")
    for b in pooled["best_cos_hist"]:
        row(f"best cosine in {b}", lambda s, b=b: _pct(s["best_cos_hist"][b], s["n"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--warm", type=int, default=1000, help="warm-cache prompts W (paper: 1000)")
    ap.add_argument("--test", type=int, default=300, help="test prompts S (paper: 300)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="one trace per seed, comma-separated")
    ap.add_argument("--k", type=int, default=10, help="recall top-K (paper: 10)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)

    from carnator.recall.embedder import default_embedder
    from carnator.signature.nouns import extract_nouns, spacy_available

    t0 = time.perf_counter()
    prompts, topics = read_prompts(args.prompts)
    n_read = len(prompts)
    prompts, topics = dedupe(prompts, topics)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    splits = {s: split(len(prompts), args.warm, args.test, s) for s in seeds}
    used = sorted({int(i) for w, t in splits.values() for i in (*w, *t)})
    emb = default_embedder()
    vecs = np.zeros((len(prompts), emb.dim), dtype=np.float32)
    vecs[used] = emb([prompts[i] for i in used])
    t_embed = time.perf_counter() - t0
    nouns = {i: set(extract_nouns(prompts[i])) for i in used}

    per_seed, all_rows = {}, []
    for s, (w, t) in splits.items():
        rows = recall_rows(vecs[w], vecs[t], [nouns[int(i)] for i in w], [nouns[int(i)] for i in t], k=args.k,
                           warm_topics=[topics[i] for i in w], test_topics=[topics[i] for i in t])
        per_seed[s] = summarize(rows, min(args.k, len(w)))
        all_rows += rows
    pooled = summarize(all_rows, min(args.k, args.warm))
    meta = {
        "prompts": str(args.prompts), "read": n_read, "distinct": len(prompts), "warm": args.warm, "test": args.test, "seeds": seeds,
        "k": args.k, "embedder": emb.name, "nouns": "spaCy en_core_web_sm" if spacy_available() else "carnator fallback heuristic (no spaCy)",
        "mean_nouns_per_prompt": float(np.mean([len(v) for v in nouns.values()])),
        "embed_seconds": round(t_embed, 1), "total_seconds": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(meta, indent=1))
    print(markdown(per_seed, pooled))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "per_seed": per_seed, "pooled": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
