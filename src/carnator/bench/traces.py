"""Workload traces: a warm cache of W requests, then a test stream of S requests in a fixed order, identical for every
policy (the paper's protocol). A trace is saved as JSON (``trace.json``) or read from a prompt file."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CarnatorError

@dataclass(frozen=True)
class TraceRequest:
    prompt: str
    seed: int
    kind: str  # "warm" or one of MIX
    source: int | None = None  # index of the warm request it derives from


@dataclass
class Trace:
    warm: list[TraceRequest]
    test: list[TraceRequest]

    def save(self, path: Path) -> None:
        """Write atomically (a temporary file renamed over ``path``): parallel bench workers save the same trace."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"warm": [asdict(r) for r in self.warm], "test": [asdict(r) for r in self.test]}, indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Trace:
        d = json.loads(Path(path).read_text())
        return cls([TraceRequest(**r) for r in d["warm"]], [TraceRequest(**r) for r in d["test"]])


def load_prompts(path: str | os.PathLike) -> list[TraceRequest]:
    """Requests of a prompt file: one prompt per line (seed = its line number), or JSON lines ``{"prompt": ..., "seed":
    ...}`` (the seed optional); blank lines and lines starting with ``#`` are skipped."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CarnatorError(f"cannot read the prompt file {p}: {e}") from None
    out = []
    for k, line in enumerate(lines):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("{"):
            try:
                d = json.loads(text)
                out.append(TraceRequest(str(d["prompt"]), int(d.get("seed", k)), str(d.get("kind", "prompt"))))
            except (ValueError, KeyError, TypeError) as e:
                raise CarnatorError(f"{p}, line {k + 1}: expected a JSON object with a prompt ({e})") from None
        else:
            out.append(TraceRequest(text, k, "prompt"))
    if not out:
        raise CarnatorError(f"the prompt file {p} holds no prompt")
    return out


def prompt_trace(path: str | os.PathLike, warm: int, test: int | None = None) -> Trace:
    """A trace of a prompt file: its first ``warm`` requests warm the cache, the next ``test`` (default: the rest) are
    the stream."""
    reqs = load_prompts(path)
    if warm >= len(reqs):
        raise CarnatorError(f"the prompt file {path} holds {len(reqs)} prompts; --warm {warm} leaves none for the stream")
    stream = reqs[warm:] if test is None else reqs[warm:warm + test]
    return Trace([TraceRequest(r.prompt, r.seed, "warm") for r in reqs[:warm]], list(stream))
