"""Nouns of a prompt, for the noun filter and the Evidence Regions (PAPER step 1).

A noun extractor is any ``text -> list[str]``; the engine takes one (``Carnator(..., nouns=...)``), by default its
adapter's (:meth:`~carnator.backbones.base.BackboneAdapter.noun_extractor`). :func:`extract_nouns` serves real
models: spaCy's English pipeline when one is installed (optional extra ``carnator[nlp]`` plus a model such as
``en_core_web_sm``), else a stop-word heuristic (content words that are not adjectives, verbs or adverbs by a small
lexicon and suffix rules). :class:`LexiconNouns` is exact on a closed caption grammar (the embedded model's).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from functools import lru_cache

_STOP = set(
    """a an the and or but of in on at to from with without by for over under above below into onto
    through across along around behind beside between near far up down left right there here this that
    these those it its is are was were be been being has have had do does did very just some any
    all each every no not one two three four five several many few more most other such as than
    then so too also while when where who whom which what how his her their our your my me you we they
    he she them him us i am slowly quickly gently softly high low fast slow""".split()
)
_ADJ = set(
    """red orange yellow green cyan blue purple pink white black gray grey brown golden silver dark
    light bright big small large tiny huge little giant beautiful cinematic realistic photorealistic
    detailed epic dramatic cute old young new ancient modern happy sad 4k 8k hd uhd hq high-quality
    colorful vibrant misty foggy sunny snowy rainy grassy sandy fresh smooth""".split()
)
_NON_NOUN_SUFFIX = ("ing", "ly", "ed", "ful", "ous", "ive", "ic", "al", "ish")


@lru_cache(maxsize=1)
def _spacy():
    try:
        import spacy

        return spacy.load("en_core_web_sm")
    except Exception:  # not installed, or no English pipeline
        return None


def spacy_available() -> bool:
    return _spacy() is not None


def noun_phrase_spans(text: str, noun: str, modifiers: int = 0) -> list[tuple[int, int]]:
    """Character spans of every whole-word, case-insensitive occurrence of ``noun`` in ``text``, each extended to the
    left over at most ``modifiers`` words that modify it: the words right before it, up to a stop word (article,
    preposition, conjunction, pronoun, number word, ...) or anything but spaces between two words ("a big red ball,
    two cats" -> "big red ball" for "ball" at ``modifiers >= 2``; "cats" keeps no modifier). ``modifiers=0``: the
    noun's own spans. (Chorus's prompt diff names attributes from an adjective lexicon instead,
    :func:`carnator.policies.chorus.attributes`: it compares words, this marks tokens.)"""
    # Linear in the text: each occurrence looks back over at most ``modifiers`` words, found by bisection (a scan
    # of every earlier word per occurrence made "a red ball " * 10000 run for over 15 minutes).
    words = [m.span() for m in re.finditer(r"[A-Za-z0-9]+", text)]
    ends = [e for _, e in words]
    out = []
    for m in re.finditer(rf"\b{re.escape(noun)}\b", text, flags=re.IGNORECASE):
        start, taken = m.start(), 0
        k = bisect_right(ends, m.start())  # words[:k] end before the noun
        while k > 0 and taken < modifiers:
            a, b = words[k - 1]
            if text[a:b].lower() in _STOP or text[b:start].strip():
                break
            start, taken, k = a, taken + 1, k - 1
        out.append((start, m.end()))
    return out


def heuristic_nouns(text: str) -> list[str]:
    """Dependency-free nouns of a real prompt: content words that are not stop words, adjectives (a small lexicon),
    numbers, or verbs and adverbs by their suffix."""
    out = []
    for w in re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)?", text.lower()):
        if w in _STOP or w in _ADJ or w.isdigit() or len(w) < 3:
            continue
        if w.endswith(_NON_NOUN_SUFFIX) and not w.endswith(("ring", "king", "ship", "ball", "animal", "crystal")):
            continue
        out.append(w)
    return list(dict.fromkeys(out))


def extract_nouns(text: str, *, use_spacy: bool | None = None) -> list[str]:
    """Lower-cased nouns of ``text`` in order of appearance, duplicates merged: spaCy's English pipeline when one is
    installed, else :func:`heuristic_nouns`. The default noun extractor for real models."""
    nlp = _spacy() if use_spacy in (None, True) else None
    if nlp is None:
        return heuristic_nouns(text)
    return list(dict.fromkeys(t.text.lower() for t in nlp(text) if t.pos_ in ("NOUN", "PROPN")))


class LexiconNouns:
    """The nouns of a closed caption grammar (a model trained on one, such as the embedded model): the prompt's words
    are split into the lexicon's phrases, longest match first; object phrases give their noun in order, then place
    phrases their head noun. A prompt with a word outside ``vocabulary`` falls back to ``fallback``.

    ``phrases``: (words, kind, noun) triples, kind "object", "place" or any other (a phrase that names no noun).
    """

    def __init__(self, vocabulary, phrases, fallback=extract_nouns):
        self.vocabulary = frozenset(vocabulary)
        self.phrases = {tuple(w.split()): (kind, noun) for w, kind, noun in phrases}
        self.longest = max((len(k) for k in self.phrases), default=1)
        self.fallback = fallback

    @classmethod
    def from_file(cls, path) -> LexiconNouns:
        import json
        from pathlib import Path

        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(doc["vocabulary"], [(p["words"], p["kind"], p["noun"]) for p in doc["phrases"]])

    def __call__(self, text: str) -> list[str]:
        words = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)?", text.lower())
        if not words or not set(words) <= self.vocabulary:
            return self.fallback(text)
        words = re.findall(r"[a-z0-9]+", text.lower())
        objects, places, i = [], [], 0
        while i < len(words):
            for n in range(min(self.longest, len(words) - i), 0, -1):
                hit = self.phrases.get(tuple(words[i:i + n]))
                if hit is not None:
                    kind, noun = hit
                    if kind == "object":
                        objects.append(noun)
                    elif kind == "place":
                        places.append(noun)
                    i += n
                    break
            else:
                i += 1
        return objects + places
