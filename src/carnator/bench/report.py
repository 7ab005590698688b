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

#: The per-policy numbers of report.json, in table order, with their column headings.
METRICS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "hit rate"),
    ("workload_e2e_speedup", "workload E2E speedup"),
    ("workload_dit_speedup", "workload DiT speedup"),
    ("hit_e2e_speedup", "hit E2E speedup"),
    ("hit_dit_speedup", "hit DiT speedup"),
    ("fidelity_all", "fidelity, all"),
    ("fidelity_hits", "fidelity, hits"),
    ("dense_fidelity_on_hits", "dense fidelity on the same hits"),
    ("artifact_all", "artifact, all"),
    ("artifact_hits", "artifact, hits"),
    ("dense_artifact_on_hits", "dense artifact on the same hits"),
    ("unsafe_hit_rate", "unsafe-hit rate"),
    ("bytes_per_entry", "bytes per cache entry"),
)

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

    lines = [f"{rep['requests']} test requests; unsafe = fidelity below dense by > {rep['delta_fidelity']} or artifact above by > {rep['delta_artifact']}", "",
             "| policy | hit rate | workload E2E x | workload DiT x | hit E2E x | hit DiT x | fidelity all | fidelity hits (dense) | artifact all | unsafe hits | MB/entry |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for pol, m in rep["policies"].items():
        lines.append(f"| {pol} | {f(m['hit_rate'], '{:.0%}')} | {f(m['workload_e2e_speedup'])} | {f(m['workload_dit_speedup'])} | {f(m['hit_e2e_speedup'])} | "
                     f"{f(m['hit_dit_speedup'])} | {f(m['fidelity_all'])} | {f(m['fidelity_hits'])} ({f(m['dense_fidelity_on_hits'])}) | {f(m['artifact_all'], '{:.3f}')} | "
                     f"{f(m['unsafe_hit_rate'], '{:.0%}')} | {f(None if m['bytes_per_entry'] is None else m['bytes_per_entry'] / 1e6)} |")
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

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    a1, a2 = fig.subplots(1, 2)
    _bars(a1, pols, [("all requests", col("fidelity_all")), ("hits", col("fidelity_hits")), ("dense, same hits", col("dense_fidelity_on_hits"))])
    a1.set_title("judge fidelity (higher is better)")
    _bars(a2, pols, [("all requests", col("artifact_all")), ("hits", col("artifact_hits")), ("dense, same hits", col("dense_artifact_on_hits"))],
          digits=3)
    a2.set_title("judge artifact (lower is better)")
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
             (f"<p>{fmt(rep['requests'])} test requests, policies {e(', '.join(pols))}. A hit is <i>unsafe</i> when its judge fidelity "
              f"is below dense's on the same request by more than {fmt(rep['delta_fidelity'])} or its artifact score is above dense's by more "
              f"than {fmt(rep['delta_artifact'])}. Speedups are dense time / policy time, summed over the requests counted.</p>")]

    parts.append("<h2>Plots</h2><div class=plots>")
    for t, png in plots(rep):
        parts.append(f"<img alt='{e(t)}' title='{e(t)}' src='data:image/png;base64,{png}'>")
    parts.append("</div>")

    parts.append("<h2>Every number (report.json)</h2><table id=numbers><tr><th class=l>policy</th>")
    parts += [f"<th>{e(h)}</th>" for _, h in METRICS]
    extra = sorted({k for p in pols for k in rep["policies"][p]} - {k for k, _ in METRICS})
    parts += [f"<th>{e(k)}</th>" for k in extra]
    parts.append("</tr>")
    for p in pols:
        m = rep["policies"][p]
        parts.append(f"<tr><td class=l>{e(p)}</td>" + "".join(f"<td>{e(fmt(m.get(k)))}</td>" for k, _ in METRICS)
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
        return f"{state}<br>fidelity {r['fidelity']:.2f}, artifact {r['artifact']:.3f}<br>E2E {r['e2e']:.2f} s"

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

    parts.append("<h2>Per request</h2><details><summary>every test request (hit / E2E s / fidelity / artifact per policy)</summary>"
                 "<table id=requests><tr><th>#</th><th class=l>kind</th><th class=l>prompt</th>")
    parts += [f"<th>{e(p)}</th>" for p in pols]
    parts.append("</tr>")
    for i in sorted({r["i"] for r in rows}):
        kind = by.get(("dense", i), {}).get("kind", "")
        cells = []
        for p in pols:
            r = by.get((p, i))
            cells.append("<td>-</td>" if r is None else
                         f"<td>{'hit' if r['hit'] else 'miss'} / {r['e2e']:.2f} / {r['fidelity']:.2f} / {r['artifact']:.3f}</td>")
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
