"""Caption grammar of the shapes world: captions, exact parsing, nouns, vocabulary and edits.

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .scene import COLORS, OPPOSITE_MOTION, SHAPES, SIZES, Obj, Scene, as_rng, backgrounds_for, colors_for, split_of

__all__ = [
    "Style", "EditPair", "EDIT_KINDS", "TEMPLATES", "TRAIN_TEMPLATES", "HELDOUT_TEMPLATES", "PREFIXES", "SUFFIXES",
    "caption", "random_style", "parse", "nouns", "vocabulary", "edit",
]

# --------------------------------------------------------------------------------------------
# lexicon
# --------------------------------------------------------------------------------------------

SHAPE_NOUNS: dict[str, tuple[str, ...]] = {
    "circle": ("ball", "circle", "disk"),
    "square": ("square", "box", "block"),
    "triangle": ("triangle",),
    "ring": ("ring", "donut", "hoop"),
    "star": ("star",),
    "diamond": ("diamond", "rhombus"),
    "cross": ("cross",),
}
SIZE_WORDS: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "big": ("big", "large", "huge")}
COLOR_WORDS: dict[str, tuple[str, ...]] = {c: (c,) for c in COLORS}

#: motion phrases: (participle, 3rd-person present)
MOTION_PHRASES: dict[str, tuple[tuple[str, str], ...]] = {
    "left": (("moving left", "moves left"), ("sliding to the left", "slides to the left"), ("drifting left", "drifts left")),
    "right": (("moving right", "moves right"), ("sliding to the right", "slides to the right"), ("drifting right", "drifts right")),
    "up": (("moving up", "moves up"), ("rising", "rises"), ("floating upward", "floats upward")),
    "down": (("moving down", "moves down"), ("falling", "falls"), ("sinking", "sinks")),
    "bouncing": (("bouncing", "bounces"), ("bouncing up and down", "bounces up and down"), ("hopping", "hops")),
    "still": (("staying still", "stays still"), ("resting", "rests"), ("standing still", "stands still")),
    "growing": (("growing", "grows"), ("getting bigger", "gets bigger"), ("expanding", "expands")),
    "shrinking": (("shrinking", "shrinks"), ("getting smaller", "gets smaller"), ("contracting", "contracts")),
}

#: place phrases: (phrase, its head noun)
BACKGROUND_PHRASES: dict[str, tuple[tuple[str, str], ...]] = {
    "sky": (("in the sky", "sky"), ("in a clear sky", "sky"), ("among the clouds", "clouds")),
    "grass": (("on grass", "grass"), ("on a grassy field", "field"), ("on the lawn", "lawn")),
    "snow": (("in the snow", "snow"), ("on fresh snow", "snow"), ("on a snowy slope", "slope")),
    "desert": (("in the desert", "desert"), ("on desert sand", "sand"), ("on a sandy dune", "dune")),
    "night": (("at night", "night"), ("in the dark night", "night"), ("under the stars", "stars")),
    **{c: ((f"on a {c} background", "background"), (f"against a {c} backdrop", "backdrop"), (f"in front of a {c} wall", "wall"))
       for c in ("gray", "teal", "maroon")},
}

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


# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------

def _build_lexicon() -> dict[tuple[str, ...], tuple[str, str]]:
    lex: dict[tuple[str, ...], tuple[str, str]] = {}

    def add(phrase: str, kind: str, value: str):
        lex[tuple(phrase.split())] = (kind, value)

    for s, ws in SHAPE_NOUNS.items():
        for w in ws:
            add(w, "shape", s)
    for s, ws in SIZE_WORDS.items():
        for w in ws:
            add(w, "size", s)
    for c, ws in COLOR_WORDS.items():
        for w in ws:
            add(w, "color", c)
    for m, phrases in MOTION_PHRASES.items():
        for part, fin in phrases:
            add(part, "motion", m)
            add(fin, "motion", m)
    for b, phrases in BACKGROUND_PHRASES.items():
        for p, _ in phrases:
            add(p, "background", b)
            # also the phrase without its leading preposition / article ("grassy field", "gray backdrop")
            words = p.split()
            for k in range(1, len(words)):
                if words[k - 1] in ("in", "on", "at", "among", "under", "against", "of", "a", "an", "the", "front"):
                    add(" ".join(words[k:]), "background", b)
                else:
                    break
    return lex


_LEXICON = _build_lexicon()
_MAX_PHRASE = max(len(k) for k in _LEXICON)
# head noun of each place phrase (for nouns()); keyed like the lexicon
_PLACE_NOUN = {tuple(p.split()): n for phrases in BACKGROUND_PHRASES.values() for p, n in phrases}


def _spans(words: list[str]):
    """Longest-match known phrases of ``words``: ``(kind, value, start, length)``; unknown words are skipped."""
    i = 0
    while i < len(words):
        for n in range(min(_MAX_PHRASE, len(words) - i), 0, -1):
            key = tuple(words[i: i + n])
            if key in _LEXICON:
                yield (*_LEXICON[key], i, n)
                i += n
                break
        else:
            i += 1


def _tokens(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """Longest-match tokens ``(kind, value, words)`` of the known phrases; unknown words are skipped."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return [(kind, value, tuple(words[i: i + n])) for kind, value, i, n in _spans(words)]


#: owners of phrases that describe no object (:func:`word_roles`)
FILLER, PLACE = -1, -2


def _attach(text: str) -> tuple[int, list[list]]:
    """The word count of ``text`` and its phrases ``[kind, value, start, length, owner]``; owner is the
    index of the object the phrase describes, :data:`PLACE` or :data:`FILLER`.

    Size and colour words attach to the next shape noun, a motion phrase to the last object still
    without one (else the next noun); attributes after the last noun make an object of unknown shape
    (with any motion still pending); a motion with no object left over is a filler.
    """
    words = re.findall(r"[a-z0-9]+", text.lower())
    toks: list[list] = []
    pending: list[list] = []          # size/colour phrases waiting for their noun
    pending_motion: list[list] = []
    has_motion: list[bool] = []       # per object so far
    for kind, value, i, n in _spans(words):
        t = [kind, value, i, n, FILLER]
        toks.append(t)
        if kind == "background":
            t[4] = PLACE
        elif kind in ("size", "color"):
            pending.append(t)
        elif kind == "shape":
            for u in pending + [t] + pending_motion:
                u[4] = len(has_motion)
            has_motion.append(bool(pending_motion))
            pending, pending_motion = [], []
        elif has_motion and not has_motion[-1]:
            t[4] = len(has_motion) - 1
            has_motion[-1] = True
        else:
            pending_motion.append(t)
    if pending:
        for u in pending + pending_motion:
            u[4] = len(has_motion)
    return len(words), toks


def parse(text: str) -> Scene:
    """Text -> Scene; attributes the text does not state are ``None`` (a partial scene).

    Size and colour words attach to the next shape noun, a motion phrase to the last object
    (or the next one if none came yet), the place phrase to the scene. Exact on our captions.
    """
    _, toks = _attach(text)
    background = next((value for _, value, _, _, owner in toks if owner == PLACE), None)
    objs = [dict.fromkeys(("shape", "color", "size", "motion")) for _ in range(1 + max((t[4] for t in toks), default=-1))]
    for kind, value, _, _, owner in toks:
        if owner < 0:
            continue
        o = objs[owner]
        if kind in ("size", "color"):
            o[kind] = o[kind] or value        # the first one counts
        else:
            o[kind] = value                   # the noun; the last pending motion phrase counts
    return Scene(background, tuple(Obj(**o) for o in objs))


def word_roles(text: str) -> list[int]:
    """What each word of ``text`` (``WordTokenizer.words`` order) describes: the index of the object
    whose size, colour, noun or motion phrase it belongs to, :data:`PLACE` for the place phrase, or
    :data:`FILLER` - attached as :func:`parse` attaches them. Training uses it to ground each object's
    words in the object's pixels.
    """
    n_words, toks = _attach(text)
    roles = [FILLER] * n_words
    for _, _, i, n, owner in toks:
        roles[i: i + n] = [owner] * n
    return roles


def nouns(text: str, canonical: bool = False) -> list[str]:
    """Object nouns then the place noun, lower-case, in order: "a red ball on a grassy field" -> ["ball", "field"].

    ``canonical=True`` gives scene ids instead (["circle", "grass"]).
    """
    obj, place = [], []
    for kind, value, words in _tokens(text):
        if kind == "shape":
            obj.append(value if canonical else words[0])
        elif kind == "background":
            place.append(value if canonical else _PLACE_NOUN.get(words, words[-1]))
    return obj + place


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
