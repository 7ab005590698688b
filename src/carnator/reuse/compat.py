"""The compatibility test (PAPER steps 1 and 5): noun filter, discrepancies, thresholds.

Recall keeps a cached candidate ``j`` for query ``q`` only if their noun sets are identical or differ
by exactly one substitution (:func:`noun_diff`). The Early Signatures of the two are then compared:

* ``d_context`` = max over shared nouns of CIEDE2000(c_q,o, c_j,o) (0 if no noun is shared);
* for the substituted pair ``(o_q, o_j)`` only:
  ``d_size`` = ``|log(A_q / A_j)|``; ``d_shape`` = 1 - Dice of the two tail-frame masks after cropping
  each to its bounding box and resizing to a common size; ``d_color`` = CIEDE2000(c_q, c_j).

and, beyond the paper, ``d_text`` = 1 - the recall-embedding cosine of the two prompts (``tau_text`` = ``inf``,
off, unless calibrated: on the embedded world, recall hands the test cached requests that differ from the
query in several attributes at once, which the signature does not separate; docs/METHOD.md).

The candidate is compatible iff every applicable ``d_k <= tau_k`` (:func:`compatible`); the first
compatible candidate in recall order wins (:func:`first_compatible`). A missing noun or an undefined
colour (empty tail mask) makes the affected discrepancies ``inf``, i.e. incompatible unless that
threshold is switched off (``inf``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import CarnatorError
from ..signature.colour import ciede2000
from ..signature.signature import EarlySignature, NounSignature, normalize_noun
from .tiers import Tier

__all__ = [
    "THRESHOLDS_FORMAT_VERSION",
    "CompatConfig",
    "Discrepancies",
    "NounDiff",
    "Thresholds",
    "compatible",
    "discrepancies",
    "CompatResult",
    "explain",
    "first_compatible",
    "noun_diff",
    "shape_distance",
]

THRESHOLDS_FORMAT_VERSION = 1
"""Version of the thresholds JSON file written by :meth:`Thresholds.save`."""

_THRESHOLDS_FORMAT = "carnator-thresholds"
DIMENSIONS = ("context", "size", "shape", "color", "text")


# ---- noun filter ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NounDiff:
    """How the noun sets of a query and a candidate relate.

    Attributes:
        shared: canonical nouns present in both, sorted.
        substituted: ``(query noun, candidate noun)`` when exactly one noun differs, else ``None``.
    """

    shared: tuple[str, ...]
    substituted: tuple[str, str] | None = None


def noun_diff(nq: Iterable[str], nj: Iterable[str]) -> NounDiff | None:
    """The noun filter ``|N(q) \\ N(j)| = |N(j) \\ N(q)| <= 1`` (PAPER step 1).

    Nouns are canonicalized (:func:`~carnator.signature.signature.normalize_noun`: whitespace
    collapsed, lower-cased) and duplicates merged. Returns ``None`` when the filter rejects the pair.
    """
    q = {normalize_noun(n) for n in nq} - {""}
    j = {normalize_noun(n) for n in nj} - {""}
    only_q, only_j = q - j, j - q
    if len(only_q) != len(only_j) or len(only_q) > 1:
        return None
    shared = tuple(sorted(q & j))
    if not only_q:
        return NounDiff(shared=shared, substituted=None)
    return NounDiff(shared=shared, substituted=(next(iter(only_q)), next(iter(only_j))))


# ---- discrepancies --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompatConfig:
    """Knobs of the discrepancy computation; the paper gives none of these values."""

    area_floor: float = 1e-3
    """Areas are clamped to at least this fraction of the tail frame before ``|log(A_q / A_j)|``, so
    that an empty region gives a large but finite ``d_size`` (``|log(1e-3)| = 6.9``, beyond the
    paper's ``tau_size = 2.17``). Chosen default."""
    shape_size: int = 16
    """Both bounding-box crops are resized to ``shape_size x shape_size`` before Dice. Chosen
    default (the paper says "a common size")."""
    shape_resample: Literal["area", "nearest"] = "area"
    """``"area"``: each output cell takes the exact area-weighted coverage of the input cells under
    it and is set where coverage ``>= shape_threshold``; ``"nearest"``: output cell ``k`` copies
    input cell ``floor((k + 0.5) * n_in / n_out)``. Chosen default: area."""
    shape_threshold: float = 0.5
    """Coverage at or above which an area-resampled cell is inside the mask. Chosen default."""

    def __post_init__(self) -> None:
        if not self.area_floor > 0.0:
            raise ValueError(f"CompatConfig: area_floor must be > 0, got {self.area_floor}")
        if self.shape_size < 1:
            raise ValueError(f"CompatConfig: shape_size must be >= 1, got {self.shape_size}")
        if self.shape_resample not in ("area", "nearest"):
            raise ValueError(f"CompatConfig: shape_resample must be 'area' or 'nearest', got {self.shape_resample!r}")
        if not 0.0 < self.shape_threshold <= 1.0:
            raise ValueError(f"CompatConfig: shape_threshold must lie in (0, 1], got {self.shape_threshold}")


@dataclass(frozen=True)
class Discrepancies:
    """The discrepancies of one (query, candidate) pair.

    ``size``, ``shape`` and ``color`` are ``None`` when not applicable (no substituted noun); ``text``
    (1 - recall cosine) is ``None`` when not measured; a ``None`` dimension passes every threshold. ``inf`` marks an undefined value (missing noun, empty
    region) and fails every finite threshold.
    """

    context: float
    size: float | None = None
    shape: float | None = None
    color: float | None = None
    text: float | None = None
    content: float | None = None
    """Beyond the paper: how many content items (objects with their attributes, the place) only one of the
    two prompts asks for (:func:`carnator.signature.content.content_distance`; 0: a rewording or a re-roll); ``None``
    when not measured, ``inf`` when the candidate has no recorded content."""

    def to_dict(self) -> dict[str, float | str | None]:
        """JSON-able dict (``inf`` written as the string ``"inf"``)."""
        return {k: (None if v is None else ("inf" if math.isinf(v) else float(v))) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Discrepancies:
        def conv(v: Any) -> float | None:
            return None if v is None else float(v)

        return cls(context=float(d["context"]), size=conv(d.get("size")), shape=conv(d.get("shape")), color=conv(d.get("color")),
                   text=conv(d.get("text")), content=conv(d.get("content")))


def _area_weights(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)`` matrix: the share of output cell k covered by input cell i (rows sum to 1)."""
    edges_out = np.arange(n_out + 1) * (n_in / n_out)
    lo = np.maximum(edges_out[:-1, None], np.arange(n_in)[None, :])
    hi = np.minimum(edges_out[1:, None], np.arange(n_in)[None, :] + 1)
    return np.clip(hi - lo, 0.0, None) / (n_in / n_out)


def _crop_resize(mask: np.ndarray, cfg: CompatConfig) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    crop = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    s = cfg.shape_size
    h, w = crop.shape
    if cfg.shape_resample == "nearest":
        rows = np.minimum(((np.arange(s) + 0.5) * h / s).astype(np.int64), h - 1)
        cols = np.minimum(((np.arange(s) + 0.5) * w / s).astype(np.int64), w - 1)
        return crop[rows[:, None], cols[None, :]]
    cover = _area_weights(h, s) @ crop.astype(np.float64) @ _area_weights(w, s).T
    return cover >= cfg.shape_threshold - 1e-9


def shape_distance(mask_q: np.ndarray, mask_j: np.ndarray, cfg: CompatConfig = CompatConfig()) -> float:
    """``d_shape = 1 - Dice`` of two 2-D masks after cropping each to its bounding box and resizing
    both to ``cfg.shape_size`` squared.

    The aspect ratio is deliberately discarded (size differences are ``d_size``'s job). Two empty masks
    give 0, one empty mask gives 1.
    """
    a, b = np.asarray(mask_q, dtype=bool), np.asarray(mask_j, dtype=bool)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"shape_distance expects 2-D masks, got {a.shape} and {b.shape}")
    ea, eb = not a.any(), not b.any()
    if ea or eb:
        return 0.0 if (ea and eb) else 1.0
    ra, rb = _crop_resize(a, cfg), _crop_resize(b, cfg)
    denom = int(ra.sum()) + int(rb.sum())
    if denom == 0:  # both vanished in resampling (cannot happen with threshold <= 0.5 and a full bbox)
        return 0.0
    return float(1.0 - 2.0 * np.logical_and(ra, rb).sum() / denom)


def _colour_distance(a: NounSignature | None, b: NounSignature | None) -> float:
    if a is None or b is None or a.lab is None or b.lab is None:
        return math.inf
    return float(ciede2000(a.lab, b.lab))


def discrepancies(
    sig_q: EarlySignature,
    sig_j: EarlySignature,
    diff: NounDiff,
    cfg: CompatConfig = CompatConfig(),
    similarity: float | None = None,
    content: float | None = None,
) -> Discrepancies:
    """The discrepancies of query signature ``sig_q`` against candidate signature ``sig_j``.

    ``diff`` is :func:`noun_diff` of the two noun lists (query first); ``similarity`` the recall cosine of the
    two prompts (``d_text = max(0, 1 - similarity)``; ``None``: not measured); ``content`` the content distance of the
    two prompts (passed through; ``None``: not measured).
    """
    text = None if similarity is None else max(0.0, 1.0 - float(similarity))
    context = 0.0
    for noun in diff.shared:
        context = max(context, _colour_distance(sig_q.get(noun), sig_j.get(noun)))
    if diff.substituted is None:
        return Discrepancies(context=context, text=text, content=content)
    oq, oj = diff.substituted
    a, b = sig_q.get(oq), sig_j.get(oj)
    if a is None or b is None:
        return Discrepancies(context=context, size=math.inf, shape=math.inf, color=math.inf, text=text, content=content)
    size = abs(math.log(max(a.area, cfg.area_floor) / max(b.area, cfg.area_floor)))
    return Discrepancies(
        context=context,
        size=size,
        shape=shape_distance(a.mask_tail, b.mask_tail, cfg),
        color=_colour_distance(a, b),
        text=text,
        content=content,
    )


# ---- thresholds -----------------------------------------------------------------------------------


def _carnator_version() -> str:
    import carnator  # local import: carnator/__init__ pulls in the engine, which may import this module

    return str(getattr(carnator, "__version__", "unknown"))


RISK_FEATURES = ("context", "size", "shape", "color", "text", "no_substitution")
"""The inputs of :class:`RiskScore`: ``log(1 + d)`` of each discrepancy, and 1 when no noun was substituted."""
_NOT_APPLICABLE = 50.0   # size / shape / colour of a pair without a substituted noun (the flag tells the two apart)
_UNDEFINED = 1000.0      # inf: a missing noun or an empty region
_TEXT_UNMEASURED = 1.0   # d_text when the recall similarity is unknown: as far as an unrelated prompt


def risk_features(d: Discrepancies) -> np.ndarray:
    """``(len(RISK_FEATURES),)`` float64 inputs of a :class:`RiskScore` for one pair's discrepancies.

    Each discrepancy ``v`` enters as ``log(1 + v)``; ``inf`` as ``log(1 + 1000)``; a not-applicable size, shape or
    colour (no substituted noun) as ``log(1 + 50)``, with the last feature 1; an unmeasured ``text`` as
    ``log(1 + 1)``. NaN stays NaN (and the score then rejects).
    """
    def conv(v: float | None, none: float) -> float:
        if v is None:
            return none
        v = float(v)
        if math.isnan(v):
            return math.nan
        return _UNDEFINED if v == math.inf else max(v, 0.0)

    x = [conv(d.context, 0.0), conv(d.size, _NOT_APPLICABLE), conv(d.shape, _NOT_APPLICABLE), conv(d.color, _NOT_APPLICABLE),
         conv(d.text, _TEXT_UNMEASURED)]
    return np.array([*np.log1p(x), 1.0 if d.size is None else 0.0], dtype=np.float64)


@dataclass(frozen=True)
class RiskScore:
    """A learned decision rule, beyond the paper: a pair is compatible when its estimated risk
    ``sigmoid(weights . risk_features(d) + bias)`` is ``<= threshold``.

    The paper's rule is a box, one threshold per discrepancy. On the embedded world the discrepancies are weak
    alone (AUC 0.62-0.77) and a logistic regression on all of them separates better (cross-validated AUC 0.80;
    docs/METHOD.md). ``carnator calibrate --rule linear`` fits the weights on the selection split and
    selects and certifies ``threshold`` as the box's thresholds are (:func:`carnator.calibrate.certify.calibrate`).
    """

    weights: tuple[float, ...]
    bias: float
    threshold: float

    def __post_init__(self) -> None:
        w = tuple(float(v) for v in self.weights)
        if len(w) != len(RISK_FEATURES) or not all(math.isfinite(v) for v in w) or not math.isfinite(float(self.bias)):
            raise ValueError(f"RiskScore needs {len(RISK_FEATURES)} finite weights and a finite bias")
        if math.isnan(float(self.threshold)):
            raise ValueError("RiskScore threshold must not be NaN")
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "bias", float(self.bias))
        object.__setattr__(self, "threshold", float(self.threshold))

    def risk(self, d: Discrepancies) -> float:
        """The estimated probability that reusing for this pair is unacceptable (NaN for NaN inputs)."""
        z = float(np.dot(self.weights, risk_features(d))) + self.bias
        return float(1.0 / (1.0 + math.exp(-z))) if z >= 0 else float(math.exp(z) / (1.0 + math.exp(z)))

    def accepts(self, d: Discrepancies) -> bool:
        return bool(self.risk(d) <= self.threshold)  # NaN compares False: rejected

    def to_dict(self) -> dict[str, Any]:
        return {"features": list(RISK_FEATURES), "weights": list(self.weights), "bias": self.bias, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RiskScore:
        if list(d.get("features", RISK_FEATURES)) != list(RISK_FEATURES):
            raise ValueError(f"risk score features {d.get('features')} are not this version's {list(RISK_FEATURES)}")
        return cls(weights=tuple(d["weights"]), bias=float(d["bias"]), threshold=float(d["threshold"]))


@dataclass(frozen=True)
class Thresholds:
    """Thresholds ``tau`` of the compatibility test; ``inf`` switches a dimension off.

    Defaults are the paper's certified thresholds on its setup (PAPER step 5; Wan2.2-TI2V-5B,
    VidProM): context 1.62, size 2.17, shape 1.00, colour 7.58, and no text threshold (the paper has
    none). They are only meaningful for that model; calibrate (:mod:`carnator.calibrate.certify`) for any other.
    A file without ``text`` (written before it existed) loads with it off.
    """

    context: float = 1.62
    size: float = 2.17
    shape: float = 1.00
    color: float = 7.58
    text: float = math.inf
    content: float = math.inf
    """Beyond the paper: the most content items the two prompts may differ in (0: only rewordings and
    re-rolls; ``inf``: off, as in files written before it existed)."""
    risk: RiskScore | None = None
    """A learned decision rule applied on top of the per-dimension thresholds (None: the paper's box alone)."""
    tiers: tuple[Any, ...] = ()
    """Beyond the paper: risk tiers (:class:`carnator.reuse.tiers.Tier`), one certified resume step and scope per kind
    of change. With tiers a candidate is reused by its kind's tier, and a kind without one is a miss."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if any(not isinstance(t, Tier) for t in self.tiers):
            raise ValueError("Thresholds.tiers must hold Tier objects")
        if self.risk is not None and not isinstance(self.risk, RiskScore):
            raise ValueError(f"Thresholds.risk must be a RiskScore or None, got {type(self.risk).__name__}")
        for k in (*DIMENSIONS, "content"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or math.isnan(v) or v == -math.inf:
                raise ValueError(f"threshold {k} must be a finite number or +inf (off), got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict; a switched-off (``inf``) threshold is written as ``null``; ``risk`` only when set."""
        out: dict[str, Any] = {k: (None if math.isinf(getattr(self, k)) else float(getattr(self, k))) for k in DIMENSIONS}
        if not math.isinf(self.content):
            out["content"] = float(self.content)
        if self.risk is not None:
            out["risk"] = self.risk.to_dict()
        if self.tiers:
            out["tiers"] = {t.kind: t.to_dict() for t in self.tiers}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Thresholds:
        risk = RiskScore.from_dict(d["risk"]) if d.get("risk") is not None else None
        tiers = tuple(Tier.from_dict({"kind": k, **t}) for k, t in (d.get("tiers") or {}).items())
        return cls(**{k: (math.inf if d.get(k) is None else float(d[k])) for k in (*DIMENSIONS, "content")}, risk=risk,
                   tiers=tiers)

    def save(self, path: str | os.PathLike[str], *, model_id: str, meta: Mapping[str, Any] | None = None,
             reading: Mapping[str, Any] | None = None) -> None:
        """Write the thresholds as JSON, recording the model identity and the carnator version.

        Args:
            path: file to write (parent directories are created).
            model_id: identity of the model the thresholds were calibrated for (e.g. the pipeline's
                ``name_or_path`` or a weights hash); :meth:`load` refuses files for another model.
            meta: optional JSON-able extras (calibration summary, delta, alpha, ...).
            reading: the settings that shape the discrepancies the thresholds apply to (the policy's
                :meth:`~carnator.policies.carnator.CarnatorPolicy.reading`: probe layer, modifiers, region
                knobs); :meth:`load` refuses the file for a policy that reads signatures differently.
        """
        doc = {
            "format": _THRESHOLDS_FORMAT,
            "format_version": THRESHOLDS_FORMAT_VERSION,
            "model_id": str(model_id),
            "carnator_version": _carnator_version(),
            "thresholds": self.to_dict(),
            "meta": dict(meta or {}),
        }
        if reading is not None:
            doc["reading"] = json.loads(json.dumps(dict(reading)))  # JSON-normal (tuples -> lists), as load compares it
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share a temporary
        tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, p)

    @staticmethod
    def file_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The ``meta`` a thresholds file records (calibration summary, ``certified``, ...); {} if it has none."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return {}
        meta = doc.get("meta") if isinstance(doc, dict) else None
        return meta if isinstance(meta, dict) else {}

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, model_id: str, reading: Mapping[str, Any] | None = None,
             judge: str | None = None) -> Thresholds:
        """Read thresholds written by :meth:`save`.

        ``reading``: the caller's signature-reading settings; when both it and the file give them, every setting
        the file records must be equal (a file without them, from before they were recorded, is not checked).
        ``judge``: the identity of the judge the caller requires the thresholds to have been certified by (the file's
        ``meta.judge``, e.g. ``clip:<hash of its weights>``); None accepts any.

        Raises:
            CarnatorError: the file is missing or unreadable, is not a thresholds file, has another
                format version, was calibrated for a different ``model_id``, or under another reading.
        """
        p = Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CarnatorError(f"thresholds file {p} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CarnatorError(f"thresholds file {p} is unreadable: {str(e).splitlines()[0]}") from None
        if not isinstance(doc, dict) or doc.get("format") != _THRESHOLDS_FORMAT:
            raise CarnatorError(f"{p} is not a carnator thresholds file")
        if doc.get("format_version") != THRESHOLDS_FORMAT_VERSION:
            raise CarnatorError(
                f"thresholds file {p} has format version {doc.get('format_version')!r}; "
                f"this carnator reads version {THRESHOLDS_FORMAT_VERSION}: recalibrate"
            )
        if doc.get("model_id") != str(model_id):
            raise CarnatorError(
                f"thresholds file {p} was calibrated for model {doc.get('model_id')!r}, not {str(model_id)!r}: "
                "recalibrate for this model"
            )
        theirs = doc.get("reading")
        if reading is not None and isinstance(theirs, dict):
            ours = json.loads(json.dumps(dict(reading)))
            differ = sorted(k for k in theirs if ours.get(k) != theirs[k])
            if differ:
                detail = ", ".join(f"{k}: file {theirs[k]!r}, policy {ours.get(k)!r}" for k in differ)
                raise CarnatorError(
                    f"thresholds file {p} was calibrated for signatures read another way ({detail}): "
                    "recalibrate, or configure the policy as the file says"
                )
        if judge is not None:
            meta: dict[str, Any] = doc["meta"] if isinstance(doc.get("meta"), dict) else {}
            if meta.get("judge") != judge:
                raise CarnatorError(f"thresholds file {p} was certified by judge {meta.get('judge')!r}, not {judge!r}: "
                                    "recalibrate with this judge")
        try:
            return cls.from_dict(doc["thresholds"])
        except (KeyError, TypeError, ValueError) as e:
            raise CarnatorError(f"thresholds file {p} has invalid thresholds: {e}") from None


def compatible(d: Discrepancies, tau: Thresholds) -> bool:
    """True iff every applicable discrepancy is ``<= `` its threshold (``None`` = not applicable;
    NaN always fails; an ``inf`` threshold accepts anything, even ``inf``) and, when ``tau.risk`` is set, its
    risk score accepts the pair."""
    for k in (*DIMENSIONS, "content"):
        v = getattr(d, k)
        if v is None:
            continue
        if not v <= getattr(tau, k):
            return False
    return tau.risk is None or tau.risk.accepts(d)


@dataclass(frozen=True)
class CompatResult:
    """What :func:`first_compatible` found: the winner's ``index`` (None: a miss) and the discrepancies of every
    candidate tested, in order, up to and including the winner."""

    index: int | None
    tested: tuple[Discrepancies, ...] = ()


def first_compatible(
    sig_q: EarlySignature,
    candidates: Iterable[tuple[EarlySignature, NounDiff] | tuple[EarlySignature, NounDiff, float | None]
                         | tuple[EarlySignature, NounDiff, float | None, float | None]],
    tau: Thresholds,
    cfg: CompatConfig = CompatConfig(),
) -> CompatResult:
    """The first compatible candidate in the given (recall) order (PAPER step 5); the carnator policy's decision.

    Each candidate is ``(signature, noun diff[, recall similarity[, content distance]])``; without a similarity ``d_text``
    is unmeasured, without a content distance ``d_content``.
    """
    tested: list[Discrepancies] = []
    for i, cand in enumerate(candidates):
        sig_j, diff, *rest = cand
        d = discrepancies(sig_q, sig_j, diff, cfg, similarity=rest[0] if rest else None,
                          content=rest[1] if len(rest) > 1 else None)
        tested.append(d)
        if compatible(d, tau):
            return CompatResult(i, tuple(tested))
    return CompatResult(None, tuple(tested))


def explain(d: Discrepancies, tau: Thresholds) -> str:
    """One line: each measured discrepancy against its threshold, failing ones first, and the risk rule if any
    (``"shape 0.62 > 0.41, context 1.20 <= 1.62"``). A dimension neither measured (infinite: no probe ran, no noun to
    compare) nor read (no threshold) is left out."""

    def num(v: float) -> str:
        return "inf" if math.isinf(v) else f"{v:.2f}"

    parts = []
    for k in ("content", *DIMENSIONS):
        v, t = getattr(d, k), getattr(tau, k)
        if v is None or (math.isinf(v) and math.isinf(t)):
            continue
        ok = v <= t
        parts.append((ok, f"{k} {num(v)}" if math.isinf(t) else f"{k} {num(v)} {'<=' if ok else '>'} {num(t)}"))
    if tau.risk is not None:
        r = tau.risk.risk(d)
        ok = tau.risk.accepts(d)
        parts.insert(0, (ok, f"risk {r:.3f} {'<=' if ok else '>'} {tau.risk.threshold:.3f}"))
    parts.sort(key=lambda p: p[0])  # failing first (stable)
    return ", ".join(t for _, t in parts) or "no discrepancy measured"
