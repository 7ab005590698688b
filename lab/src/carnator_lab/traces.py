"""Shapes-world benchmark traces in the paper's protocol: a warm cache of W requests, then a disjoint test stream of S
requests in a fixed order, identical for every policy.

Mix (stated, per test request): re-roll of a warm prompt 20 %, noun substitution 20 %, colour change 10 %, size change
10 %, context change 10 %, motion reversal 10 %, rewording 10 %, unrelated new scene 10 %. Real sessions are dominated
by re-rolls and small edits (the VidProM note in shared/data/README.md); the unrelated share keeps misses in the stream.
"""

from __future__ import annotations

import numpy as np

from carnator.bench.traces import Trace, TraceRequest

MIX: tuple[tuple[str, float], ...] = (
    ("reroll", 0.2), ("noun", 0.2), ("color", 0.1), ("size", 0.1), ("context", 0.1), ("motion", 0.1), ("reword", 0.1), ("unrelated", 0.1),
)


def world_trace(warm: int, test: int, seed: int = 0, split: str = "heldout") -> Trace:
    """A shapes-world trace; test prompts use the held-out split (never seen in training)."""
    from .world.captions import caption, edit
    from .world.scene import sample_scene

    rng = np.random.default_rng(seed)
    scenes = [sample_scene(rng, split=split) for _ in range(warm)]
    w = [TraceRequest(caption(s, rng, split=split), int(rng.integers(1 << 30)), "warm") for s in scenes]
    kinds, probs = zip(*MIX)
    t: list[TraceRequest] = []
    while len(t) < test:
        kind = str(rng.choice(kinds, p=np.asarray(probs) / sum(probs)))
        j = int(rng.integers(warm))
        if kind == "reroll":
            t.append(TraceRequest(w[j].prompt, int(rng.integers(1 << 30)), kind, j))
        elif kind == "unrelated":
            t.append(TraceRequest(caption(sample_scene(rng, split=split), rng, split=split), int(rng.integers(1 << 30)), kind))
        else:
            try:
                e = edit(scenes[j], kind, rng, caption_split=split)
            except ValueError:
                continue
            # The edit re-captions the source; keep the warm wording for the source side by using the target only.
            t.append(TraceRequest(e.target_text, int(rng.integers(1 << 30)), kind, j))
    return Trace(w, t)
