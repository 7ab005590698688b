"""How often recall can reach the request an edit edits: for each single-change edit of the held-out stream's trace
(``world_trace(W, S, seed=0)``), whether its source is among the ``--k`` nearest cached prompts by sentence embedding
(the default MiniLM), and whether it is one change of a tier's kind away by content (``LexiconContent.neighbours``,
what recall one edit away reads). Prompts only: nothing is generated, so whether the source passed the admission gate
is not counted.

    python3 lab/scripts/recall_reach.py --warm 1000 --test 300 --k 10
"""

from __future__ import annotations

import argparse
import collections

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--kinds", default="object,place", help="the tiers' kinds of change recall reads one edit away")
    a = ap.parse_args()
    from carnator.cache.keys import content_key
    from carnator.embedded import HERE
    from carnator.recall.embedder import default_embedder
    from carnator.signature.content import LexiconContent, change_kind
    from carnator_lab.traces import world_trace

    read = LexiconContent.from_file(HERE / "lexicon.json")
    kinds = a.kinds.split(",")
    trace = world_trace(a.warm, a.test, seed=0)
    emb = default_embedder()
    warm = emb([r.prompt for r in trace.warm])
    keys = [content_key(read(r.prompt)) for r in trace.warm]
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in trace.test:
        if r.kind in ("reroll", "reword", "unrelated"):
            continue
        src = trace.warm[r.source].prompt
        kind = change_kind(r.prompt, src, read(r.prompt), read(src))
        near = {content_key(c) for c in read.neighbours(read(r.prompt), kinds)}
        top = np.argsort(-(warm @ emb(r.prompt)))[: a.k]
        c = counts[kind]
        c["edits"] += 1
        c[f"source in the sentence top-{a.k}"] += int(r.source in set(top.tolist()))
        c["source one edit away by content"] += int(keys[r.source] in near)
    for kind, c in sorted(counts.items()):
        print(f"{kind:7s} " + ", ".join(f"{k} {v}" for k, v in c.items()))


if __name__ == "__main__":
    main()
