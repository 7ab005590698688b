"""What ``carnator serve`` takes, as data (:class:`ServeConfig`): each option's flag, default and help live on its field
(the command line is made from them, :mod:`carnator.fieldargs`). Light: importing it loads no web stack and no torch."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..config import EngineSpec
from ..fieldargs import opt

__all__ = ["DEFAULT_RETENTION_S", "ServeConfig", "duration_words", "load_keys", "parse_duration"]

#: how long finished jobs and their videos are kept by default (``--retention``; 0: forever)
DEFAULT_RETENTION_S = 7 * 86400.0


def load_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """``keys.json``: ``{"API key": "tenant", ...}``; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    except ValueError as e:
        raise ValueError(f"{str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'{str(path)!r} must map API keys to tenants, e.g. {{"key-a": "tenant-a"}}')
    for k, t in data.items():
        if not k or not isinstance(t, str) or not t.strip() or any(c.isspace() or not c.isprintable() for c in k):
            raise ValueError(f"{str(path)!r}: every key must be printable text without spaces and every tenant a "
                             "non-empty string")
        if len(k) < 8:
            raise ValueError(f"{str(path)!r}: API keys must be at least 8 characters")
    return dict(data)


def parse_duration(text: str) -> float:
    """A duration like ``7d``, ``12h``, ``30m``, ``45s`` or ``3600`` (seconds) in seconds; 0 is allowed (forever)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text).lower())
    if m is None:
        raise ValueError(f"expected a duration like 7d, 12h, 30m, 45s, 3600 (seconds) or 0, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]


def duration_words(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


_SPEC = {f.name: f.metadata for f in dataclasses.fields(EngineSpec)}


@dataclass
class ServeConfig:
    """What ``carnator serve`` takes (its options, as data; the fields without a help are not options)."""

    host: str = field(default="127.0.0.1", metadata=opt("address to listen on (default: %(default)s; without --keys: loopback only)"))
    port: int = field(default=8000, metadata=opt("port (default: %(default)s; 0: any free port, printed)", range=(0, 65535)))
    model: str = field(default="embedded", metadata=_SPEC["model"])
    cache_dir: str | None = field(default=None, metadata=opt(
        "cache directory, also holding the job table (jobs.sqlite; with a postgresql:// --store, in that database) and "
        "the finished videos (default: $CARNATOR_CACHE_DIR, else ~/.cache/carnator)"))
    keys: dict[str, str] | None = field(default=None, metadata=opt(
        'API keys: {"key": "tenant", ...}; each tenant has its own cache and jobs (default: no auth, one tenant '
        "'default')", metavar="keys.json", parse=load_keys))
    max_queue: int = field(default=64, metadata=opt("jobs waiting at most; past it 429", range=(1, 1_000_000)))
    max_queue_per_tenant: int | None = field(default=None, metadata=opt(
        "jobs one tenant may have waiting (default: --max-queue, or half of it with --keys)", metavar="N",
        range=(1, 1_000_000)))
    device: str = field(default="cpu", metadata=opt("cpu (default), cuda (one worker per visible GPU) or cuda:N"))
    allow_uncertified: bool = field(default=False, metadata=opt(
        "let approximate reuse rest on thresholds no certified file backs (default: such a reuse is a miss)"))
    max_steps: int | None = field(default=None, metadata=opt(
        "most denoising steps a job may ask for (default: the model's limit)", metavar="N", range=(1, 1000)))
    max_attempts: int = field(default=2, metadata=opt(
        "times a job is started before a server stopping mid-job fails it", metavar="N", range=(1, 100)))
    fps: int = 8
    max_body_bytes: int = 256 * 1024
    engine_config: dict[str, Any] = field(default_factory=dict)
    store: str | None = field(default=None, metadata=opt(
        "the cache store: sqlite:///PATH (a local directory; default: the --cache-dir directory) or "
        "postgresql://USER@HOST/DB[?schema=NAME] (a store shared by many processes and hosts; needs --blobs; the job "
        "table goes there too, one server per schema)", metavar="URL"))
    blobs: str | None = field(default=None, metadata=_SPEC["blobs"])
    replicas: int = field(default=0, metadata=opt(
        "run N engine replicas on Ray Serve behind this server (with --device cuda one GPU each, or an equal share of "
        "the cards when N is more, else one CPU each); on one host they share the local cache, across hosts use a "
        "postgresql:// --store. Needs: pip install 'carnator[scale]' (default: none, the "
        "engines run in this process)", metavar="N", range=(1, 1024)))
    ray_address: str | None = field(default=None, metadata=opt(
        "with --replicas: the Ray cluster to join (auto: the one `ray start` runs here; default: start a local one)",
        metavar="ADDRESS"))
    router: Literal["affinity", "pow2"] = field(default="affinity", metadata=opt(
        "with --replicas: affinity (default: related prompts go to the replica that produced their recall neighbours "
        "unless it is busy) or pow2 (Ray Serve's default power-of-two choices, for comparison)"))
    separate_caches: bool = False
    affinity_busy_at: int = 1
    retention_s: float = field(default=DEFAULT_RETENTION_S, metadata=opt(
        "finished jobs (completed, failed, cancelled) and their videos are deleted this long after they end, e.g. 7d, "
        "12h, 30m, 3600 (seconds); 0 keeps them forever (default: %(default)s)", flag="retention", metavar="DURATION",
        parse=parse_duration, show=duration_words))
    audit: float = field(default=0.1, metadata=opt(
        "share of approximate hits re-run densely on idle device time and judged with the thresholds file's judge and "
        "rule, for a live bound per kind of change and tier (docs/SERVING.md); a tier whose audits show it unsafe is "
        "disabled. 0: off (default: %(default)s)", metavar="RATE", range=(0.0, 1.0)))
    audit_budget: float = field(default=0.1, metadata=opt(
        "most share of device time the audits take", metavar="SHARE", range=(0.0, 1.0)))
    audit_judge: str | None = field(default=None, metadata=opt(
        "the judge the thresholds file was certified by, when it needs an argument (e.g. clip=DIR); default: the one "
        "the file names", metavar="NAME[=ARG]"))
    audit_seed: int | None = None
