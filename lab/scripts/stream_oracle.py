"""Issue 26: the most hits a rule that reuses only a request asking the same could score on the held-out stream.

For each test request of ``world_trace(W, S, seed=0)`` (the stream ``held_out_stream.py`` runs): does any earlier request
(a warm one, or an earlier test request) ask the same (the same content key under the embedded model's content
reader)? Those are the only requests such a rule can hit; the admission gate and reuses' own entries (never sources)
can only lower the count. Prints the count per kind of request; needs no GPU and generates nothing.

    python3 lab/scripts/stream_oracle.py [--warm 1000 --test 300]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--test", type=int, default=300)
    args = ap.parse_args()
    from carnator.cache.keys import content_key
    from carnator.embedded import HERE
    from carnator.signature.content import LexiconContent
    from carnator_lab.traces import world_trace

    read = LexiconContent.from_file(HERE / "lexicon.json")  # the embedded adapter's content reader
    trace = world_trace(args.warm, args.test, seed=0)
    seen = collections.Counter(content_key(read(r.prompt)) for r in trace.warm)
    per_kind: dict[str, list[int]] = {}
    for r in trace.test:
        key = content_key(read(r.prompt))
        got = per_kind.setdefault(r.kind, [0, 0])
        got[0] += 1
        got[1] += int(key is not None and seen[key] > 0)
        seen[key] += 1
    total = sum(n for n, _ in per_kind.values())
    can = sum(k for _, k in per_kind.values())
    print(f"{can} of {total} test requests ({can / total:.1%}) have an earlier request that asks the same")
    for kind, (n, k) in sorted(per_kind.items()):
        print(f"  {kind:10s} {k:4d} of {n}")


if __name__ == "__main__":
    main()
