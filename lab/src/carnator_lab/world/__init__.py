"""Procedural "shapes world": scenes, a vectorised torch renderer, a caption grammar and (from the library,
:mod:`carnator.embedded.world`) the parser and the judge that read a caption and a clip back.

    from carnator_lab.world import sample_scenes, render, caption, parse, judge
    scenes = sample_scenes(8, rng=0)                      # list[Scene]
    video, masks = render(scenes, frames=16, size=64)     # (B,3,T,H,W) float, (B,n,T,H,W) bool
    text = caption(scenes[0], rng=0)                      # "a small red ball moving left on grass"
    report = judge(video[0], text)                        # report.fidelity, report.artifact
"""

from carnator.embedded.world.judge import JudgeReport, ObjectReading, Reading, judge, read

from .captions import (
    EDIT_KINDS, HELDOUT_TEMPLATES, TEMPLATES, TRAIN_TEMPLATES, EditPair, Style, caption, edit, nouns, parse,
    random_style, vocabulary,
)
from .render import Layout, Rendered, layout, render, shape_sdf, to_uint8
from .scene import (
    BACKGROUNDS, COLORS, MOTIONS, SHAPES, SIZES, Obj, Scene, compatible, sample_scene, sample_scenes, split_of,
)

__all__ = [
    "Scene", "Obj", "SHAPES", "COLORS", "BACKGROUNDS", "SIZES", "MOTIONS", "compatible", "sample_scene",
    "sample_scenes", "split_of", "render", "Rendered", "layout", "Layout", "shape_sdf", "to_uint8",
    "caption", "parse", "nouns", "vocabulary", "edit", "EditPair", "EDIT_KINDS", "Style", "random_style",
    "TEMPLATES", "TRAIN_TEMPLATES", "HELDOUT_TEMPLATES", "judge", "read", "JudgeReport", "Reading",
    "ObjectReading",
]
