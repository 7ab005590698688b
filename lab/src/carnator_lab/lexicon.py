"""The embedded model's caption lexicon (``carnator/embedded/lexicon.json``), generated from the shapes world: the
library reads nouns of the embedded model's prompts from it without importing the world."""

from __future__ import annotations

import json
from pathlib import Path

import carnator

LEXICON_PATH = Path(carnator.__file__).resolve().parent / "embedded" / "lexicon.json"


def lexicon() -> dict:
    """The lexicon document: the world's vocabulary and every phrase its captions use, with the nouns of object and
    place phrases (as :func:`carnator.embedded.world.captions.nouns` reads them)."""
    from carnator.embedded.world import captions as c

    from .world.captions import vocabulary

    phrases = []
    for words, (kind, value) in sorted(c._LEXICON.items()):
        noun = None
        if kind == "shape":
            noun = words[0]
        elif kind == "background":
            noun = c._PLACE_NOUN.get(words, words[-1])
        phrases.append({"words": " ".join(words), "kind": {"shape": "object", "background": "place"}.get(kind, kind), "noun": noun,
                        "value": value})
    return {"about": "The embedded model's caption lexicon: every phrase its captions use, longest match first; nouns of object and "
                     "place phrases (the noun filter's input) and each phrase's canonical value (what it asks: synonyms share one; the content reader's input). Generated from the shapes world by `carnator-lab export-lexicon`; "
                     "a lab test keeps the two equal.",
            "vocabulary": vocabulary(), "phrases": phrases}


def write_lexicon(path: Path = LEXICON_PATH) -> None:
    Path(path).write_text(json.dumps(lexicon(), indent=0) + "\n")
