"""Reports of a bench run: report.md (a table) and report.html (one self-contained page).

report.html holds four plots (hit rate, speedup, quality, unsafe hits), a table of every number
in report.json, the per-request log, and, when the run kept clips (``run_bench(keep_clips=N)``),
side-by-side animated GIFs of dense and each policy for the same requests. Plots are drawn with
matplotlib's Agg canvas and every image is embedded as a base64 data URI, so the page is one file
that can be mailed or attached to an issue. Prompts and every other string from the run are
HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

#: The per-policy numbers of report.json that every run has, in table order, with their column headings; the judge's
#: scores the rule names come after the speedups (:func:`metrics`).
METRICS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "hit rate"),
    ("workload_e2e_speedup", "workload E2E speedup"),
    ("workload_dit_speedup", "workload DiT speedup"),
    ("hit_e2e_speedup", "hit E2E speedup"),
    ("hit_dit_speedup", "hit DiT speedup"),
    ("unsafe_hit_rate", "unsafe-hit rate"),
    ("bytes_per_entry", "bytes per cache entry"),
)


def scores(rep: dict) -> dict[str, int]:
    """The judge scores a report covers (those its quality rule names) and their better direction (+1 higher, -1 lower)."""
    rule = rep.get("rule") or {}
    dirs = dict(rule.get("directions") or {})
    for k in [*rule.get("deltas", {}), *rule.get("floors", {})]:
        dirs.setdefault(k, 1)
    return dirs


def metrics(rep: dict) -> tuple[tuple[str, str], ...]:
    """The per-policy numbers of ``rep`` in table order: :data:`METRICS` with, after the speedups, for each judge score
    its mean over all requests, over hits, and dense's over the same hits."""
    per_score = tuple(x for k in scores(rep) for x in ((f"{k}_all", f"{k}, all"), (f"{k}_hits", f"{k}, hits"),
                                                       (f"dense_{k}_on_hits", f"dense {k} on the same hits")))
    return METRICS[:5] + per_score + METRICS[5:]


def rule_text(rep: dict) -> str:
    """The quality rule in words (what makes a hit unsafe is its failing)."""
    from ..judges import QualityRule

    rule = rep.get("rule")
    return QualityRule.from_dict(rule).describe() if rule else "-"


def _num(v) -> str:
    return "-" if v is None else f"{v:.3g}"


PLOT_TITLES = ("Hit rate per policy", "Speedup vs dense per policy", "Quality: all requests and hits vs dense", "Unsafe-hit rate per policy")


def fmt(v) -> str:
    """How the HTML table writes a number of report.json: 4 significant digits, '-' for none."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---- markdown -------------------------------------------------------------------------------------


def to_markdown(rep: dict) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    names = list(scores(rep))
    lines = [f"{rep['requests']} test requests; a hit is unsafe unless {rule_text(rep)}", "",
             "| policy | hit rate | workload E2E x | workload DiT x | hit E2E x | hit DiT x | "
             + "".join(f"{k} all | {k} hits (dense) | " for k in names) + "unsafe hits | MB/entry |",
             "|---|---|---|---|---|---|" + "---|---|" * len(names) + "---|---|"]
    for pol, m in rep["policies"].items():
        lines.append(f"| {pol} | {f(m['hit_rate'], '{:.0%}')} | {f(m['workload_e2e_speedup'])} | {f(m['workload_dit_speedup'])} | {f(m['hit_e2e_speedup'])} | "
                     f"{f(m['hit_dit_speedup'])} | "
                     + "".join(f"{_num(m.get(f'{k}_all'))} | {_num(m.get(f'{k}_hits'))} ({_num(m.get(f'dense_{k}_on_hits'))}) | " for k in names)
                     + f"{f(m['unsafe_hit_rate'], '{:.0%}')} | {f(None if m['bytes_per_entry'] is None else m['bytes_per_entry'] / 1e6)} |")
    return "\n".join(lines) + "\n"


# ---- plots ----------------------------------------------------------------------------------------


def _png(fig) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _bars(ax, names: list[str], series: list[tuple[str, list]], *, percent: bool = False, ref: float | None = None, digits: int = 2) -> None:
    """Grouped bars; a missing value (None) draws no bar and is labelled 'n/a'."""
    import numpy as np

    x = np.arange(len(names))
    width = 0.8 / max(len(series), 1)
    for k, (label, vals) in enumerate(series):
        pos = x - 0.4 + width * (k + 0.5)
        heights = [0.0 if v is None else float(v) for v in vals]
        bars = ax.bar(pos, heights, width, label=label if len(series) > 1 else None)
        for b, v in zip(bars, vals):
            text = "n/a" if v is None else (f"{v:.0%}" if percent else f"{v:.{digits}f}")
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 1), textcoords="offset points")
    if ref is not None:
        ax.axhline(ref, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, names)
    if percent:
        ax.set_ylim(0, 1.12)
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    else:
        top = max([float(v) for _, vals in series for v in vals if v is not None] + [ref or 0.0, 1e-9])
        ax.set_ylim(0, top * 1.15)
    if len(series) > 1:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(series), frameon=False)


def plots(rep: dict) -> list[tuple[str, str]]:
    """The report's plots as (title, base64 PNG), in PLOT_TITLES order."""
    from matplotlib.figure import Figure

    pols = list(rep["policies"])
    m = rep["policies"]

    def col(key):
        return [m[p].get(key) for p in pols]

    out = []
    fig = Figure(figsize=(5, 3), layout="constrained")
    ax = fig.subplots()
    _bars(ax, pols, [("hit rate", col("hit_rate"))], percent=True)
    ax.set_ylabel("hits / test requests")
    ax.set_title(PLOT_TITLES[0])
    out.append((PLOT_TITLES[0], _png(fig)))

    fig = Figure(figsize=(7, 3.4), layout="constrained")
    ax = fig.subplots()
    _bars(ax, pols, [("workload E2E", col("workload_e2e_speedup")), ("workload DiT", col("workload_dit_speedup")),
                     ("hits E2E", col("hit_e2e_speedup")), ("hits DiT", col("hit_dit_speedup"))], ref=1.0)
    ax.set_ylabel("dense time / policy time")
    ax.set_title(PLOT_TITLES[1])
    out.append((PLOT_TITLES[1], _png(fig)))

    def finite(v):  # inf (PSNR of identical clips) cannot be drawn: its bar is labelled n/a
        return None if v is None or abs(v) == float("inf") else v

    names = scores(rep)
    fig = Figure(figsize=(max(5 * len(names), 5), 3.6), layout="constrained")
    axes = fig.subplots(1, max(len(names), 1), squeeze=False)[0]
    for ax, (k, d) in zip(axes, names.items()):
        _bars(ax, pols, [("all requests", [finite(v) for v in col(f"{k}_all")]), ("hits", [finite(v) for v in col(f"{k}_hits")]),
                         ("dense, same hits", [finite(v) for v in col(f"dense_{k}_on_hits")])], digits=3)
        ax.set_title(f"judge {k} ({'higher' if d > 0 else 'lower'} is better)")
    fig.suptitle(PLOT_TITLES[2])
    out.append((PLOT_TITLES[2], _png(fig)))

    fig = Figure(figsize=(5, 3), layout="constrained")
    ax = fig.subplots()
    _bars(ax, pols, [("unsafe-hit rate", col("unsafe_hit_rate"))], percent=True)
    ax.set_ylabel("unsafe hits / hits")
    ax.set_title(PLOT_TITLES[3])
    out.append((PLOT_TITLES[3], _png(fig)))
    return out


# ---- clips ----------------------------------------------------------------------------------------


def clip_requests(rows: list[dict], order: list[str], n: int) -> list[int]:
    """Test requests whose clips a run keeps: the first ``n`` hits of each non-dense policy (union, sorted)."""
    keep: set[int] = set()
    for pol in order:
        if pol == "dense":
            continue
        hits = sorted(r["i"] for r in rows if r["policy"] == pol and r["hit"])
        keep.update(hits[:n])
    return sorted(keep)


def _gif_uri(path: Path) -> str:
    return "data:image/gif;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


# ---- html -----------------------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;font-size:13px;margin:.5em 0}
td,th{border:1px solid #bbb;padding:2px 6px;text-align:right}td.l,th.l{text-align:left}th{background:#eee}
.plots img{margin:4px;vertical-align:top;border:1px solid #ddd}figure{display:inline-block;margin:4px;width:150px;vertical-align:top;font-size:11px}
figure img{width:128px;height:128px;image-rendering:pixelated}.clips{border-top:1px solid #ccc;padding:6px 0}.hit{color:#060}.miss{color:#777}
.prompt{font-family:monospace}"""


def render_html(rep: dict, rows: list[dict], prompts: list[str], out: Path | None = None, *, title: str = "carnator bench") -> str:
    """The page as a string. ``rows`` are requests.jsonl's rows, ``prompts`` the test prompts in
    order; ``out`` is the bench directory that kept clips are read from (None: no clips)."""
    e = html.escape
    pols = list(rep["policies"])
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>{e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>",
             (f"<p>{fmt(rep['requests'])} test requests, policies {e(', '.join(pols))}. A hit is <i>unsafe</i> unless "
              f"{e(rule_text(rep))} (its judge's scores against dense on the same request). Speedups are dense time / policy time, "
              "summed over the requests counted.</p>")]
    cols, names = metrics(rep), list(scores(rep))

    parts.append("<h2>Plots</h2><div class=plots>")
    for t, png in plots(rep):
        parts.append(f"<img alt='{e(t)}' title='{e(t)}' src='data:image/png;base64,{png}'>")
    parts.append("</div>")

    parts.append("<h2>Every number (report.json)</h2><table id=numbers><tr><th class=l>policy</th>")
    parts += [f"<th>{e(h)}</th>" for _, h in cols]
    extra = sorted({k for p in pols for k in rep["policies"][p]} - {k for k, _ in cols})
    parts += [f"<th>{e(k)}</th>" for k in extra]
    parts.append("</tr>")
    for p in pols:
        m = rep["policies"][p]
        parts.append(f"<tr><td class=l>{e(p)}</td>" + "".join(f"<td>{e(fmt(m.get(k)))}</td>" for k, _ in cols)
                     + "".join(f"<td>{e(fmt(m.get(k)))}</td>" for k in extra) + "</tr>")
    parts.append("</table><p>" + ", ".join(f"{e(k)} = {e(fmt(v))}" for k, v in rep.items() if k != "policies") + "</p>")

    by = {(r["policy"], r["i"]): r for r in rows}

    def caption(r: dict | None) -> str:
        if r is None:
            return "<span class=miss>not run</span>"
        if r["policy"] == "dense":
            state = "<span class=miss>reference</span>"
        elif r["hit"]:
            state = "<span class=hit>exact hit</span>" if r.get("exact") else f"<span class=hit>hit, resume step {e(fmt(r.get('resume_step')))}</span>"
        else:
            state = "<span class=miss>miss (ran dense)</span>"
        return f"{state}<br>{e(', '.join(f'{k} {_num(r.get(k))}' for k in names))}<br>E2E {r['e2e']:.2f} s"

    shown = []
    if out is not None:
        for i in sorted({r["i"] for r in rows}):
            kept = [by[(p, i)].get("clip") for p in pols if p != "dense" and (p, i) in by]
            if any(c and (out / c).exists() for c in kept):
                shown.append(i)
    parts.append("<h2>Clips: dense and each policy on the same request</h2>")
    if not shown:
        parts.append("<p>No clips were kept (run <code>carnator bench --keep-clips N</code>, or no policy hit).</p>")
    for i in shown:
        prompt = prompts[i] if i < len(prompts) else ""
        kind = by.get(("dense", i), {}).get("kind", "")
        parts.append(f"<div class=clips><b>request {i}</b> ({e(str(kind))}): <span class=prompt>{e(prompt)}</span><br>")
        for p in pols:
            r = by.get((p, i))
            clip = out / r["clip"] if r is not None and r.get("clip") else None
            img = f"<img alt='{e(p)}' src='{_gif_uri(clip)}'>" if clip is not None and clip.exists() else "<i>clip not kept</i>"
            parts.append(f"<figure>{img}<figcaption><b>{e(p)}</b><br>{caption(r)}</figcaption></figure>")
        parts.append("</div>")

    parts.append(f"<h2>Per request</h2><details><summary>every test request (hit / E2E s / {e(' / '.join(names))} per policy)</summary>"
                 "<table id=requests><tr><th>#</th><th class=l>kind</th><th class=l>prompt</th>")
    parts += [f"<th>{e(p)}</th>" for p in pols]
    parts.append("</tr>")
    for i in sorted({r["i"] for r in rows}):
        kind = by.get(("dense", i), {}).get("kind", "")
        cells = []
        for p in pols:
            r = by.get((p, i))
            cells.append("<td>-</td>" if r is None else
                         f"<td>{'hit' if r['hit'] else 'miss'} / {r['e2e']:.2f}" + "".join(f" / {_num(r.get(k))}" for k in names) + "</td>")
        parts.append(f"<tr><td>{i}</td><td class=l>{e(str(kind))}</td><td class='l prompt'>{e(prompts[i] if i < len(prompts) else '')}</td>{''.join(cells)}</tr>")
    parts.append("</table></details></body></html>\n")
    return "".join(parts)


def write_html(out: Path, rep: dict | None = None, rows: list[dict] | None = None, prompts: list[str] | None = None) -> Path:
    """Write ``out/report.html`` from a bench directory (report.json, requests.jsonl, trace.json)."""
    out = Path(out)
    if rep is None:
        rep = json.loads((out / "report.json").read_text())
    if rows is None:
        rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line.strip()]
    if prompts is None:
        prompts = [r["prompt"] for r in json.loads((out / "trace.json").read_text())["test"]]
    path = out / "report.html"
    tmp = out / ".report.html.part"
    tmp.write_text(render_html(rep, rows, prompts, out), encoding="utf-8")
    tmp.replace(path)
    return path
