"""The shapes world: the motions' geometry, the held-out split and the sampler.

The vocabularies, :class:`Scene` / :class:`Obj` and the colour science live in the library
(:mod:`carnator.embedded.world.scene`, which the embedded model's judge reads with) and are re-exported here.
"""

from __future__ import annotations

import hashlib

import numpy as np
from carnator.embedded.world.scene import (
    BACKGROUNDS, BACKGROUNDS_LIST, COLORS, COLORS_LIST, CONTRAST, MIN_CONTRAST, MOTIONS, SHAPE_EXTENT, SHAPES, SIZE_RADIUS,
    SIZES, Obj, Scene, backgrounds_for, colors_for, compatible, delta_e, srgb_to_lab,
)

__all__ = [
    "BACKGROUNDS", "BACKGROUNDS_LIST", "COLORS", "COLORS_LIST", "CONTRAST", "MIN_CONTRAST", "MOTIONS", "SHAPE_EXTENT",
    "SHAPES", "SIZE_RADIUS", "SIZES", "Obj", "Scene", "backgrounds_for", "colors_for", "compatible", "delta_e",
    "srgb_to_lab", "OPPOSITE_MOTION", "TRAVEL", "BOUNCE", "GROW", "HELDOUT_RATE", "HELDOUT_SHAPE_COLOR",
    "HELDOUT_SHAPE_MOTION", "split_of", "as_rng", "sample_scene", "sample_scenes",
]

#: the "reversed" motion used by motion edits (still and bouncing swap)
OPPOSITE_MOTION: dict[str, str] = {
    "left": "right", "right": "left", "up": "down", "down": "up",
    "growing": "shrinking", "shrinking": "growing", "still": "bouncing", "bouncing": "still",
}

#: straight-line travel over the clip (left/right/up/down), fraction of the frame side (27 px at 64)
TRAVEL = 0.42
#: bounce height (two bounces over the clip), fraction of the frame side (22 px at 64)
BOUNCE = 0.34
#: scale at the first / last frame of a growing object (shrinking: reversed); geometric in time,
#: so the median scale is 1 and "small"/"big" describe the middle of the clip
GROW = (0.75, 1 / 0.75)


# --------------------------------------------------------------------------------------------
# held-out split of attribute combinations
# --------------------------------------------------------------------------------------------

# About 1 in HELDOUT_RATE (shape, colour) and (shape, motion) pairs, chosen by a fixed hash, never
# occur in training: (diamond, green), (star, red), (triangle, yellow); (ring, down),
# (square, bouncing). The embedded model was trained with this split: changing it invalidates
# its held-out evaluation.
HELDOUT_RATE = 10


def _stable_hash(*parts: str) -> int:
    return int.from_bytes(hashlib.md5("|".join(("carnator-world",) + parts).encode()).digest()[:8], "little")


HELDOUT_SHAPE_COLOR: frozenset[tuple[str, str]] = frozenset(
    (s, c) for s in SHAPES for c in COLORS if _stable_hash("sc", s, c) % HELDOUT_RATE == 0
)
HELDOUT_SHAPE_MOTION: frozenset[tuple[str, str]] = frozenset(
    (s, m) for s in SHAPES for m in MOTIONS if _stable_hash("sm", s, m) % HELDOUT_RATE == 0
)


def split_of(scene: Scene) -> str:
    """'heldout' if any object shows a held-out (shape, colour) or (shape, motion) pair, else 'train'.

    Deterministic (a fixed hash of the attribute names), independent of background, size and
    caption wording. Every shape, colour and motion still occurs in training.
    """
    for o in scene.objects:
        if (o.shape, o.color) in HELDOUT_SHAPE_COLOR or (o.shape, o.motion) in HELDOUT_SHAPE_MOTION:
            return "heldout"
    return "train"


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------

def as_rng(rng) -> np.random.Generator:
    """Accept a numpy Generator, an int seed or None."""
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def sample_scene(rng=None, n_objects: int | None = None, split: str | None = "train", p_two: float = 0.5) -> Scene:
    """A random complete scene.

    Background, shapes, sizes and motions are uniform; colours are uniform over those compatible
    with the background, and two objects never share a colour (so the judge can tell them apart
    even where they touch). ``split`` ('train' / 'heldout' / None for any) rejection-samples.
    """
    rng = as_rng(rng)
    for _ in range(10_000):
        bg = BACKGROUNDS_LIST[rng.integers(len(BACKGROUNDS_LIST))]
        n = n_objects or (2 if rng.random() < p_two else 1)
        cols = colors_for(bg)
        picked = rng.choice(len(cols), size=n, replace=False)
        objs = tuple(
            Obj(SHAPES[rng.integers(len(SHAPES))], cols[k], SIZES[rng.integers(len(SIZES))], MOTIONS[rng.integers(len(MOTIONS))])
            for k in picked
        )
        scene = Scene(bg, objs)
        if split is None or split_of(scene) == split:
            return scene
    raise RuntimeError(f"could not sample a {split} scene")


def sample_scenes(n: int, rng=None, **kw) -> list[Scene]:
    rng = as_rng(rng)
    return [sample_scene(rng, **kw) for _ in range(n)]

