"""Reading shapes-world captions: the lexicon and the exact parser.

Every attribute of a caption is spelled out with a closed vocabulary (1-3 nouns per shape, 3 phrases
per size, motion and place), so :func:`parse` is exact on the world's captions and best-effort
(longest phrase match, unknown words skipped) on other text: "a video of a small red ball moving left on
grass, 4k" -> one small red circle moving left, on grass. Writing captions (templates, styles, fillers,
edits) is carnator-lab's (``carnator_lab.world.captions``).
"""

from __future__ import annotations

import re

from .scene import COLORS, Obj, Scene

__all__ = ["SHAPE_NOUNS", "SIZE_WORDS", "COLOR_WORDS", "MOTION_PHRASES", "BACKGROUND_PHRASES", "FILLER", "PLACE",
           "parse", "word_roles", "nouns"]

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
    :data:`FILLER` - attached as :func:`parse` attaches them. The training (carnator-lab) uses it to ground each object's
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
