"""Caption grammar of the shapes world: captions, vocabulary and edits (parsing and nouns: the library's).

A caption is ``[prefix] <template filled with object clauses and a place phrase> [suffix]``:

    "a video of a small red ball moving left on grass, 4k"
    "on a grassy field, a small red circle slides to the left and a big blue box rises"

Every attribute is always spelled out (so ``parse(caption(scene)) == scene``); wording varies by
template, synonyms (1-3 nouns per shape, 3 phrases per size, motion and place) and fillers that
do not change the video. The vocabulary is closed, so :func:`parse` is exact on our captions and
best-effort (longest phrase match, unknown words skipped) on other text.

A :class:`Style` fixes every wording choice; captions of two scenes under one style differ only
in the words of the attributes that differ, which is how :func:`edit` builds minimal pairs.
Templates are split into train and held-out ones (``TRAIN_TEMPLATES`` / ``HELDOUT_TEMPLATES``);
held-out templates only recombine words that train templates use.

The lexicon and the parser (:func:`parse`, :func:`nouns`, :func:`word_roles`) live in the library
(:mod:`carnator.embedded.world.captions`, which the embedded model's judge reads with) and are re-exported here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from carnator.embedded.world.captions import (
    BACKGROUND_PHRASES, COLOR_WORDS, FILLER, MOTION_PHRASES, PLACE, SHAPE_NOUNS, SIZE_WORDS, nouns, parse, word_roles,
)

from .scene import OPPOSITE_MOTION, SHAPES, SIZES, Scene, as_rng, backgrounds_for, colors_for, split_of

__all__ = [
    "Style", "EditPair", "EDIT_KINDS", "TEMPLATES", "TRAIN_TEMPLATES", "HELDOUT_TEMPLATES", "PREFIXES", "SUFFIXES",
    "caption", "random_style", "parse", "nouns", "word_roles", "vocabulary", "edit", "SHAPE_NOUNS", "SIZE_WORDS",
    "COLOR_WORDS", "MOTION_PHRASES", "BACKGROUND_PHRASES", "FILLER", "PLACE",
]

#: fillers that do not change the video; prefixes only go before noun-phrase templates
PREFIXES: tuple[str, ...] = ("", "a video of", "footage of", "a clip of", "an animation of", "a cinematic shot of")
SUFFIXES: tuple[str, ...] = ("", ", cinematic", ", 4k", ", high quality", ", 4k, high quality", ", hd, smooth motion")


@dataclass(frozen=True)
class Template:
    """``text`` with {objs} (object clauses joined by "and"), {bg} / {Bg} (place phrase)."""

    text: str
    clause: str          # "part": "a red ball moving left", "fin": "a red ball moves left", "is": "... is moving left"
    np_start: bool       # a noun phrase: may take a prefix filler ("a video of ...")


TEMPLATES: dict[str, Template] = {
    # train
    "part_bg": Template("{objs} {bg}", "part", True),
    "fin_bg": Template("{objs} {bg}", "fin", False),
    "bg_fin": Template("{bg}, {objs}", "fin", False),
    "there_bg": Template("there is {objs} {bg}", "part", False),
    "bg_there": Template("{bg} there is {objs}", "part", False),
    "bg_see": Template("{bg}, you can see {objs}", "part", False),
    # held-out (recombine train words only)
    "is_bg": Template("{objs} {bg}", "is", False),
    "see_bg": Template("you can see {objs} {bg}", "part", False),
    "bg_is": Template("{bg}, {objs}", "is", False),
}
HELDOUT_TEMPLATES: tuple[str, ...] = ("is_bg", "see_bg", "bg_is")
TRAIN_TEMPLATES: tuple[str, ...] = tuple(t for t in TEMPLATES if t not in HELDOUT_TEMPLATES)

#: number of synonym slots in a Style: place, then (size, noun, motion) per object
_N_SYN = 1 + 3 * 2


@dataclass(frozen=True)
class Style:
    """Every wording choice of a caption; synonym picks are indices taken modulo the option count."""

    template: str = "part_bg"
    prefix: str = ""
    suffix: str = ""
    syn: tuple[int, ...] = (0,) * _N_SYN


def random_style(rng=None, split: str | None = "train") -> Style:
    """A random Style; ``split`` 'train' / 'heldout' / None picks from those templates."""
    rng = as_rng(rng)
    names = {"train": TRAIN_TEMPLATES, "heldout": HELDOUT_TEMPLATES, None: tuple(TEMPLATES)}[split]
    tpl = names[rng.integers(len(names))]
    prefix = PREFIXES[rng.integers(len(PREFIXES))] if TEMPLATES[tpl].np_start else ""
    suffix = SUFFIXES[rng.integers(len(SUFFIXES))]
    return Style(tpl, prefix, suffix, tuple(int(x) for x in rng.integers(0, 6, _N_SYN)))


def _fix_articles(text: str) -> str:
    return re.sub(r"\b([Aa])n? (?=[aeiou])", r"\1n ", re.sub(r"\b([Aa])n (?=[^aeiou\W])", r"\1 ", text))


def caption(scene: Scene, rng=None, style: Style | None = None, split: str | None = "train") -> str:
    """Caption a complete scene. ``style`` fixes the wording; else a random one (``rng``, ``split``)."""
    if style is None:
        style = random_style(rng, split)
    tpl = TEMPLATES[style.template]
    syn = style.syn
    clauses = []
    for i, o in enumerate(scene.objects):
        s_size, s_noun, s_mot = syn[1 + 3 * i: 4 + 3 * i]
        size = SIZE_WORDS[o.size][s_size % len(SIZE_WORDS[o.size])]
        noun = SHAPE_NOUNS[o.shape][s_noun % len(SHAPE_NOUNS[o.shape])]
        part, fin = MOTION_PHRASES[o.motion][s_mot % len(MOTION_PHRASES[o.motion])]
        motion = {"part": part, "fin": fin, "is": "is " + part}[tpl.clause]
        clauses.append(f"a {size} {o.color} {noun} {motion}")
    bg_opts = BACKGROUND_PHRASES[scene.background]
    bg = bg_opts[syn[0] % len(bg_opts)][0]
    text = tpl.text.format(objs=" and ".join(clauses), bg=bg)
    if style.prefix:
        text = f"{style.prefix} {text}"
    return _fix_articles(text + style.suffix)


def vocabulary() -> list[str]:
    """Every word a caption can contain (sorted; punctuation aside, captions only use ',')."""
    texts = [t.text.format(objs="", bg="") for t in TEMPLATES.values()] + ["a an and is"]
    texts += list(PREFIXES) + list(SUFFIXES)
    for table in (SHAPE_NOUNS, SIZE_WORDS, COLOR_WORDS):
        texts += [w for ws in table.values() for w in ws]
    texts += [p for ps in MOTION_PHRASES.values() for pair in ps for p in pair]
    texts += [p for ps in BACKGROUND_PHRASES.values() for p, _ in ps]
    return sorted({w for t in texts for w in re.findall(r"[a-z0-9]+", t.lower())})


# --------------------------------------------------------------------------------------------
# edits
# --------------------------------------------------------------------------------------------

EDIT_KINDS: tuple[str, ...] = ("noun", "context", "color", "size", "motion", "reword")


@dataclass(frozen=True)
class EditPair:
    """Two related captions. ``index``: the edited object (None for context / reword)."""

    kind: str
    source: Scene
    target: Scene
    source_text: str
    target_text: str
    index: int | None = None
    style: Style | None = None
    target_style: Style | None = None


def _pick(rng, options):
    if not options:
        raise ValueError("no valid edit for this scene")
    return options[rng.integers(len(options))]


def edit(scene: Scene, kind: str, rng=None, style: Style | None = None, split: str | None = None,
         caption_split: str | None = "train") -> EditPair:
    """A caption pair of the given kind for a complete scene.

    kinds: "noun" (one object's shape, e.g. ball -> box), "context" (background), "color" (one
    object's colour, compatible with the background and distinct from the other object's),
    "size" (one object's), "motion" (one object's motion reversed: left<->right, up<->down,
    growing<->shrinking, still<->bouncing), "reword" (same scene, another style). Except for
    "reword" both captions share one ``style`` (random from ``caption_split`` if None), so only
    the edited attribute's words differ. ``split`` ('train' / 'heldout') restricts the target
    scene to that attribute split (ValueError if impossible).
    """
    rng = as_rng(rng)
    scene.validate()
    if style is None:
        style = random_style(rng, caption_split)
    ok = (lambda s: True) if split is None else (lambda s: split_of(s) == split)
    index = None
    if kind == "reword":
        target, t_style = scene, style
        for _ in range(100):
            t_style = random_style(rng, caption_split)
            if caption(scene, style=t_style) != caption(scene, style=style):
                break
        return EditPair(kind, scene, scene, caption(scene, style=style), caption(scene, style=t_style), None, style, t_style)
    if kind == "context":
        cands = [Scene(b, scene.objects) for b in backgrounds_for([o.color for o in scene.objects]) if b != scene.background]
    else:
        index = int(rng.integers(len(scene.objects)))
        o = scene.objects[index]
        others = [p.color for k, p in enumerate(scene.objects) if k != index]
        if kind == "noun":
            cands = [scene.replace_object(index, shape=s) for s in SHAPES if s != o.shape]
        elif kind == "color":
            cands = [scene.replace_object(index, color=c) for c in colors_for(scene.background)
                     if c != o.color and c not in others]
        elif kind == "size":
            cands = [scene.replace_object(index, size=s) for s in SIZES if s != o.size]
        elif kind == "motion":
            cands = [scene.replace_object(index, motion=OPPOSITE_MOTION[o.motion])]
        else:
            raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
    target = _pick(rng, [c for c in cands if ok(c)])
    return EditPair(kind, scene, target, caption(scene, style=style), caption(target, style=style), index, style, style)
