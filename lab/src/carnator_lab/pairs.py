"""Shapes-world calibration pairs: as recall draws them from a stream in the benchmark mix, or as edits of one scene."""

from __future__ import annotations

import numpy as np

from carnator.calibrate.run import recall_pairs
from carnator.errors import CarnatorError

from .traces import MIX


def _edit_mix() -> tuple[str, ...]:
    # The traces' mix (shares in tenths), so that the pairs the thresholds are certified on come in the proportions of
    # the stream they serve: every run of 10 pairs holds each share.
    return tuple(kind for kind, share in MIX for _ in range(round(share * 10)))


EDIT_MIX = _edit_mix()
UNRELATED_TRIES = 64


def make_pairs(n: int, seed: int = 0):
    """n (kind, source caption, source seed, target caption, target seed) tuples from the train split."""
    from carnator.reuse import noun_diff

    from .world.captions import caption, edit
    from .world.captions import nouns as extract_nouns
    from .world.scene import sample_scene

    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        kind = EDIT_MIX[len(out) % len(EDIT_MIX)]
        scene = sample_scene(rng, split="train")
        if kind == "reroll":
            text = caption(scene, rng)
            out.append((kind, text, int(rng.integers(1 << 30)), text, int(rng.integers(1 << 30))))
            continue
        if kind == "unrelated":
            # A new scene, paired with an unrelated cached one that recall's noun filter would still pass to the
            # compatibility test (as the stream's unrelated requests reach it); drawn again if none is found.
            target = caption(scene, rng)
            nouns = extract_nouns(target)
            for _ in range(UNRELATED_TRIES):
                source = caption(sample_scene(rng, split="train"), rng)
                if source != target and noun_diff(nouns, extract_nouns(source)) is not None:
                    out.append((kind, source, int(rng.integers(1 << 30)), target, int(rng.integers(1 << 30))))
                    break
            continue
        try:
            e = edit(scene, kind, rng)
        except ValueError:
            continue
        out.append((kind, e.source_text, int(rng.integers(1 << 30)), e.target_text, int(rng.integers(1 << 30))))
    return out


def stream_pairs(n: int, embedder, *, warm: int = 100, top_k: int = 10, seed: int = 0):
    """n (kind, source caption, source seed, target caption, target seed) tuples as recall draws them in service:
    :func:`recall_pairs` over a trace of ``warm`` train-split warm requests and a stream in the traces' mix
    (:func:`carnator_lab.traces.world_trace`)."""
    from .traces import world_trace
    from .world.captions import nouns

    trace = world_trace(warm, 6 * n + 50, seed=seed, split="train")
    out = recall_pairs(trace.warm, trace.test, embedder, nouns, top_k=top_k, n=n)
    if len(out) < n:
        raise CarnatorError(f"only {len(out)} of {len(trace.test)} stream requests found a recall candidate; {n} pairs were asked for")
    return out


