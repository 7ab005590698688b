"""What a prompt asks for, read so that rewording does not change it.

The paper's text evidence is the recall cosine of the two sentences. It barely moves between "left" and "right", and it
moves for a "footage of" prefix or a ", 4k" suffix that asks for nothing. The *content* of a prompt is instead the
multiset of what it asks: each object with its attributes (size, colour, noun, motion) and the place. Two prompts ask the
same thing iff their contents are equal; ``content_distance`` counts the items only one of them has.

Two readers:

- :class:`LexiconContent` for a closed caption grammar (the embedded model's ``lexicon.json``): phrases map to a
  canonical ``value`` (synonyms are equal: "ball" = "circle", "slides to the left" = "moves left"), size and colour
  words attach to the next object noun, a motion phrase to the last object still without one. Words outside the
  lexicon (prefixes, style and quality words, templates) ask for nothing. Exact on the grammar's captions.
- :func:`heuristic_content` for real prompts: the lower-cased content words minus stop words and a list of style,
  quality and framing words (:data:`STYLE_WORDS`), with a crude plural fold. It does not know synonyms, so a reworded
  real prompt may still differ; it never calls an edit of a content word a rewording.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from .nouns import _STOP

__all__ = ["STYLE_WORDS", "LexiconContent", "content_change", "content_distance", "heuristic_content"]

#: words that ask for no content: quality, style, rendering and framing ("a video of", "footage of", ", 4k")
STYLE_WORDS = frozenset("""
4k 8k 16k hd uhd fhd hdr 1080p 720p high quality highly best masterpiece detailed detail details ultra realistic
photorealistic photo realism cinematic cinematography cinema film filmic movie footage video clip shot shots scene
animation animated render rendered rendering style styled trending artstation unreal engine octane smooth motion
beautiful stunning amazing epic dramatic professional award winning sharp focus lighting lit vivid vibrant
depth field bokeh aesthetic aesthetics composition view camera stock
""".split())


def heuristic_content(text: str) -> list[str]:
    """Content items of a real prompt: ``word:<w>`` for each content word (stop, style and framing words dropped,
    a plural ``s`` folded), sorted."""
    out = []
    for w in re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)?", text.lower()):
        if w in _STOP or w in STYLE_WORDS or len(w) < 2:
            continue
        if len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(f"word:{w}")
    return sorted(out)


class LexiconContent:
    """Content of a closed caption grammar's prompts (see the module). ``phrases``: dicts with ``words``, ``kind``
    ("object", "size", "color", "motion", "place") and ``value`` (the canonical attribute; the words if absent).
    A prompt with a word outside ``vocabulary`` falls back to ``fallback``."""

    def __init__(self, vocabulary: Iterable[str], phrases: Sequence[dict], fallback=heuristic_content):
        self.vocabulary = frozenset(vocabulary)
        self.phrases = {tuple(p["words"].split()): (p["kind"], str(p.get("value") or p["words"])) for p in phrases}
        self.longest = max((len(k) for k in self.phrases), default=1)
        self.fallback = fallback

    @classmethod
    def from_file(cls, path) -> LexiconContent:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(doc["vocabulary"], doc["phrases"])

    def values(self, kind: str) -> list[str]:
        """The canonical values the grammar has for ``kind`` ("object", "size", "color", "motion", "place"), sorted."""
        return sorted({v for k, v in self.phrases.values() if k == kind})

    def neighbours(self, content: Sequence[str], kinds: Iterable[str]) -> list[list[str]]:
        """The contents one change of ``kinds`` away from ``content`` (the kinds of :func:`change_kind`: "object",
        "small-object", "colour", "size", "motion", "place"): one object's attribute set to another of the grammar's
        values, or the place set to another (a place added or removed is not among them: the edits a tier is
        calibrated on replace one). A request's cached source under an edit tier asks one of these, however far its
        sentence lies from the request's. Sorted contents, ``content`` itself not among them."""
        fields = {k: f for f, k in _FIELD_KIND.items()}   # "colour" -> "color"
        want = set(kinds)
        base = sorted(content)
        out: dict[str, list[str]] = {}

        def add(items: list[str]) -> None:
            c = sorted(items)
            if c != base:
                out.setdefault("\n".join(c), c)

        for i, item in enumerate(base):
            if item.startswith("place:"):
                if "place" in want:
                    for v in self.values("place"):
                        add(base[:i] + [f"place:{v}"] + base[i + 1:])
                continue
            if not item.startswith("object:"):
                continue
            parts = _fields(item)
            for kind in sorted(want - {"place"}):
                field = "object" if kind == "small-object" else fields.get(kind)
                if field not in parts or field == "word":
                    continue
                if field == "object" and _object_kind(parts) != kind:
                    continue   # a big object's replacement is not a small object's, nor the other way round
                for v in self.values(field):
                    if v != parts[field]:
                        new = "|".join(f"{f}:{v if f == field else parts[f]}" for f in parts)
                        add(base[:i] + [new] + base[i + 1:])
        return list(out.values())

    def _spans(self, words: list[str]):
        i = 0
        while i < len(words):
            for n in range(min(self.longest, len(words) - i), 0, -1):
                hit = self.phrases.get(tuple(words[i:i + n]))
                if hit is not None:
                    yield hit
                    i += n
                    break
            else:
                i += 1

    def __call__(self, text: str) -> list[str]:
        words = re.findall(r"[a-z0-9]+", text.lower())
        if not words or not set(words) <= self.vocabulary:
            return self.fallback(text)
        objects: list[dict] = []
        places: list[str] = []
        pending: dict = {}
        pending_motion: list[str] = []
        for kind, value in self._spans(words):
            if kind == "place":
                places.append(value)
            elif kind in ("size", "color"):
                pending.setdefault(kind, value)   # the first one counts (as the world's parser reads it)
            elif kind == "object":
                o = {"size": None, "color": None, "motion": None, **pending, "object": value}
                if pending_motion:
                    o["motion"] = pending_motion[-1]
                objects.append(o)
                pending, pending_motion = {}, []
            elif kind == "motion":
                if objects and objects[-1]["motion"] is None:
                    objects[-1]["motion"] = value
                else:
                    pending_motion.append(value)
        if pending or pending_motion:   # attributes after the last noun: an object of unknown shape
            objects.append({"size": None, "color": None, "motion": pending_motion[-1] if pending_motion else None,
                            **pending, "object": None})
        items = [f"object:{o['object']}|size:{o['size']}|color:{o['color']}|motion:{o['motion']}" for o in objects]
        items += [f"place:{p}" for p in places]
        return sorted(items)


def content_distance(a: Sequence[str] | None, b: Sequence[str] | None) -> float:
    """How many content items only one of the two prompts has (multisets; 0: they ask the same). ``inf`` when either
    content is unknown (an entry stored before contents were recorded)."""
    if a is None or b is None:
        return float("inf")
    ca, cb = Counter(a), Counter(b)
    return float(sum(((ca - cb) + (cb - ca)).values()))


def _fields(item: str) -> dict[str, str]:
    return dict(part.split(":", 1) for part in item.split("|"))


def content_change(query: Sequence[str] | None, source: Sequence[str] | None) -> str:
    """A short human reading of what the query asks differently from the source ("motion left -> right", "place grass
    -> snow", "same content"); for the reason printed per request."""
    if query is None or source is None:
        return "content unknown"
    cq, cs = Counter(query), Counter(source)
    only_q, only_s = sorted((cq - cs).elements()), sorted((cs - cq).elements())
    if not only_q and not only_s:
        return "same content"
    if len(only_q) == 1 and len(only_s) == 1:
        fq, fs = _fields(only_q[0]), _fields(only_s[0])
        if fq.keys() == fs.keys():
            changed = [f"{k} {fs[k]} -> {fq[k]}" for k in fq if fq[k] != fs[k]]
            return ", ".join(changed)
    parts = []
    if only_s:
        parts.append("source asks " + "; ".join(only_s))
    if only_q:
        parts.append("request asks " + "; ".join(only_q))
    return " / ".join(parts)


_FIELD_KIND = {"object": "object", "size": "size", "color": "colour", "motion": "motion", "word": "word"}


def _object_kind(fields: dict) -> str:
    """The kind of an object's replacement: "small-object" for a small object (its shape is settled in fewer steps
    than a big one's, so it has its own tier), "object" otherwise."""
    return "small-object" if fields.get("size") == "small" else "object"


def change_kind(query_text: str, source_text: str, query: Sequence[str] | None, source: Sequence[str] | None) -> str:
    """The kind of change from a cached request to a new one: "re-roll" (the same prompt), "rewording" (the same
    content in other words), "object" / "colour" / "size" / "motion" (one object's attribute; "small-object" for the
    object of a small one), "place" (the place replaced by another), "place-added" / "place-removed", "count" (another
    number of objects), "several" (more than one of these), or "unknown" (a content not recorded). Used to certify
    and report per kind (:func:`carnator.calibrate.certify.stratified_certification`)."""
    if " ".join(query_text.lower().split()) == " ".join(source_text.lower().split()):
        return "re-roll"
    if query is None or source is None:
        return "unknown"
    cq, cs = Counter(query), Counter(source)
    only_q, only_s = sorted((cq - cs).elements()), sorted((cs - cq).elements())
    if not only_q and not only_s:
        return "rewording"
    objs_q = sum(1 for i in query if i.startswith("object:"))
    objs_s = sum(1 for i in source if i.startswith("object:"))
    if objs_q != objs_s:
        return "count"
    kinds = set()
    place_q = any(i.startswith("place:") for i in only_q)
    place_s = any(i.startswith("place:") for i in only_s)
    if place_q or place_s:   # a place replaced by another is not a place added to (or taken from) a scene
        kinds.add("place" if place_q and place_s else "place-added" if place_q else "place-removed")
    oq = [_fields(i) for i in only_q if not i.startswith("place:")]
    os_ = [_fields(i) for i in only_s if not i.startswith("place:")]
    if len(oq) == 1 and len(os_) == 1 and oq[0].keys() == os_[0].keys():
        kinds |= {_FIELD_KIND.get(k, k) for k in oq[0] if oq[0][k] != os_[0][k]}
    elif oq or os_:
        kinds.add("several")
    if kinds == {"object"}:
        return _object_kind(oq[0])
    return kinds.pop() if len(kinds) == 1 else "several"
