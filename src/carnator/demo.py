"""``carnator demo``: a short stream of related requests on the embedded model through a policy, and a page that
tells what happened to each.

Every request runs through the policy and, right after it, densely (the same prompt and seed; nothing reused,
nothing stored): a hit's speedup is its own dense run's time over its time, measured one after the other under the
same load; an exact hit is served from the cache (its time, no ratio over a near-zero time) and a miss does dense's
work (no ratio: it would only show the load). Steps are counted beside the seconds (denoising steps whose DiT forwards
ran; a dense run computes them all), which do not depend on the load. The page (``index.html``, static, no script)
shows the totals, the cumulative time against dense, and per request the decision and its reason (the source
entry, each discrepancy against its threshold), the time and steps saved, and the clip beside its dense clip and
its source's clip. ``demo.json`` holds the same numbers.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

#: (prompt, seed): a stream of related requests, as a newcomer would send them: a first generation, a re-roll (another
#: seed), rewordings (a framing prefix, style and quality words, synonyms), then one change at a time (motion, object,
#: colour, size, place), an exact repeat, an unrelated prompt and its rewording. With the shipped file (and the embedded
#: model's admission gate, its shapes judge) each kind of change with a certified tier reuses (re-rolls, rewordings, and
#: the place edit from its own earlier step); the others, the small ball's object among them (a small object's
#: replacement has no certified tier), are generated anew (docs/BENCHMARKS.md); each line says why.
STREAM: list[tuple[str, int]] = [
    ("a small red ball moving left on grass", 1),
    ("a small red ball moving left on grass", 5),
    ("footage of a small red ball moving left on grass, 4k", 6),
    ("on a grassy field, a tiny red circle slides to the left, cinematic", 12),
    ("a small red ball moving right on grass", 2),
    ("a small red box moving left on grass", 3),
    ("a small blue ball moving left on grass", 4),
    ("a big red ball moving left on grass", 13),
    ("a small red ball moving left in the snow", 14),
    ("a small red ball moving left on grass", 1),
    ("a big yellow star bouncing at night", 7),
    ("a big yellow star bouncing at night, high quality", 8),
]

COMPARISON = (
    "Each request runs through the policy and then, right after it, densely: the same prompt and seed, nothing reused "
    "and nothing stored. A hit's speedup is that dense run's time over its own, both measured under the same load. An "
    "exact hit is served from the cache: its time is reading the stored video, and no speedup is given over it. A miss "
    "does dense's work, so it has no speedup either: its time against dense's shows only the load on the machine. "
    "Steps are the denoising steps whose DiT forwards ran (a hit computes its probe and the steps after its resume "
    "step; an exact hit none), which the load does not change."
)


def _say(line: str) -> None:
    print(line, flush=True)  # (a pipe would otherwise hold the lines back until the end)


def run_demo(engine, out: Path, policy: str = "carnator", steps: int | None = None, progress=_say,
             stream: list[tuple[str, int]] | None = None) -> list[dict]:
    """Run ``stream`` (default :data:`STREAM`) on ``engine`` through ``policy``; write the clips, ``demo.json`` and
    ``index.html`` to ``out``. Returns the per-request rows (``demo.json``'s ``requests``)."""
    stream = STREAM if stream is None else list(stream)
    from .explain import describe
    from .video import write_video

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bank = engine.store
    held = len(bank.entries())
    cache = {"dir": str(bank.root), "entries_at_start": held, "replaying": held > 0}
    if held:
        progress(f"cache: {bank.root} holds {held} entries from an earlier run: replaying (hits may come from that run; "
                 "`carnator demo` without --keep-cache or --cache-dir starts from an empty cache)")
    else:
        progress(f"cache: {bank.root} (empty: a fresh start)")
    progress("each request is followed by a dense run of the same request (same prompt and seed, nothing reused or stored); "
             "a hit's speedup compares the two under the same load; an exact hit is served from the cache and a miss "
             "does dense's work, so neither has one")
    progress("warming up (not timed): the model's kernels and the recall embedder ...")
    # One-time costs (model kernels, the recall embedder) are paid before anything is timed; seed 0 is outside the stream.
    first = stream[0][0]
    engine.generate(first, seed=0, policy="dense", num_inference_steps=2, store=False, cache="off")
    engine.embedder(first)

    rows: list[dict] = []
    made_by: dict[str, int] = {}  # cache entry id -> the request of this run that stored it
    for i, (prompt, seed) in enumerate(stream):
        res = engine.generate(prompt, seed=seed, policy=policy, num_inference_steps=steps)
        engine.flush(res)  # its entry written (behind, on a GPU) before the dense run is timed and the next request recalls
        ref = engine.generate(prompt, seed=seed, policy="dense", num_inference_steps=steps, store=False, cache="off")
        s, why = res.stats, describe(engine, res)
        gif, dense_gif = f"{i:02d}.gif", f"{i:02d}-dense.gif"
        write_video(res.frames, out / gif)
        write_video(ref.frames, out / dense_gif)
        # The clip of the hit's source, or of the candidate a miss's compatibility test refused.
        other = s.source_id or why.tested_id
        src_row = made_by.get(other) if other else None
        src_gif = None
        if src_row is not None:
            src_gif = rows[src_row]["gif"]
        elif other is not None:  # an entry from an earlier run (replaying): its stored clip
            tensors = bank.load(other, ["video"])
            if tensors is not None and "video" in tensors:
                src_gif = f"cached-{other[:8]}.gif"
                write_video(tensors["video"].numpy(), out / src_gif)
        t, td = round(s.timings["total"], 3), round(ref.stats.timings["total"], 3)  # ms: what demo.json and the page show
        diff = float(np.abs(res.frames.astype(np.int16) - ref.frames.astype(np.int16)).mean())
        change = None
        if why.source_prompt is not None:  # what this request asks differently from the entry it was compared with
            from .signature.content import change_kind

            change = ("exact repeat" if s.exact_hit else  # (the kind of change reads prompts only: a repeat is no re-roll)
                      change_kind(prompt, why.source_prompt, engine.content(prompt), engine.content(why.source_prompt)))
        row = {
            "i": i, "prompt": prompt, "seed": seed, "change": change, "decision": why.decision, "reason": why.reason, "headline": why.to_dict()["headline"],
            "hit": s.hit, "exact": s.exact_hit, "source": s.source_id, "tested": why.tested_id, "source_request": src_row,
            "source_prompt": why.source_prompt, "source_seed": why.source_seed, "source_gif": src_gif,
            "resume_step": s.resume_step, "mask_density": s.mask_density, "active_fraction": s.active_fraction,
            "checks": why.to_dict()["checks"], "risk": why.to_dict()["risk"],
            "seconds": t, "dense_seconds": td, "speedup": round(td / t, 2) if s.hit and not s.exact_hit and t > 0 else None,
            "steps": why.steps, "steps_computed": why.steps_computed, "steps_saved": why.steps_saved,
            "dit_forwards": s.dit_forwards, "dense_dit_forwards": ref.stats.dit_forwards,
            "mean_abs_diff_from_dense": round(diff, 2), "entry": s.entry_id, "gif": gif, "dense_gif": dense_gif,
        }
        rows.append(row)
        if s.entry_id:
            made_by[s.entry_id] = i
        timing = (f"{t:.3f}s, served from the cache" if s.exact_hit else
                  f"{t:6.2f}s, dense {td:6.2f}s (x{row['speedup']})" if row["speedup"] is not None else
                  f"{t:6.2f}s, dense {td:6.2f}s (a miss: dense's work)")
        progress(f"{i:2d} {why.decision:9s} {timing}, {why.steps_computed:3d} of "
                 f"{why.steps} steps  {prompt!r} seed={seed}" + (f"  [{change}]" if change else "") + f"\n   {why.reason}")
    totals = _totals(rows)
    progress(f"total: {totals['hits']} of {totals['requests']} requests reused cached work ({totals['exact_hits']} exact); "
             f"{totals['seconds']:.1f} s against dense {totals['dense_seconds']:.1f} s (x{totals['speedup']}); "
             f"{totals['steps_computed']} of {totals['steps']} steps computed")
    doc = {"policy": policy, "steps": rows[0]["steps"], "cache": cache, "comparison": COMPARISON, "totals": totals, "requests": rows}
    (out / "demo.json").write_text(json.dumps(doc, indent=1))
    (out / "index.html").write_text(render_page(doc))
    return rows


def _totals(rows: list[dict]) -> dict:
    t = sum(r["seconds"] for r in rows)
    td = sum(r["dense_seconds"] for r in rows)
    hits = sum(r["hit"] for r in rows)
    return {
        "requests": len(rows), "hits": hits, "exact_hits": sum(r["exact"] for r in rows),
        "hit_rate": round(hits / len(rows), 3) if rows else 0.0,
        "seconds": round(t, 3), "dense_seconds": round(td, 3), "saved_seconds": round(td - t, 3),
        "speedup": round(td / t, 2) if t > 0 else None,
        "steps": sum(r["steps"] for r in rows), "steps_computed": sum(r["steps_computed"] for r in rows),
        "dit_forwards": sum(r["dit_forwards"] for r in rows), "dense_dit_forwards": sum(r["dense_dit_forwards"] for r in rows),
    }


# ---- the page ------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222;line-height:1.4}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:.35em .5em;vertical-align:top;text-align:left}
th{background:#f4f4f4}#totals td:first-child{color:#555}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.decision{font-weight:600}.decision.exact-hit{color:#1a7f37}.decision.hit{color:#0a58ca}.decision.miss{color:#777}
tr.hit,tr.exact-hit{background:#f5f9ff}td.clips{white-space:nowrap}
.reason{max-width:26em;font-size:.9em}.checks{font-size:.85em;color:#444;margin:.2em 0 0;padding-left:1.1em}
.pass{color:#1a7f37}.fail{color:#b42318}
figure{display:inline-block;margin:0 .3em 0 0;text-align:center;font-size:.75em;color:#555;width:100px;white-space:normal;vertical-align:top}
img{image-rendering:pixelated;width:96px;height:96px;display:block;margin:auto}
.note{color:#555;font-size:.9em;max-width:60em}
"""


def render_page(doc: dict) -> str:
    """The demo's page: a static HTML document (the clips are the GIFs beside it)."""
    t, rows, esc = doc["totals"], doc["requests"], html.escape
    cache = doc["cache"]
    cache_line = (f"The cache at <code>{esc(cache['dir'])}</code> held {cache['entries_at_start']} entries from an earlier run: "
                  "this run <strong>replays</strong> them, and its hits may come from that run."
                  if cache["replaying"] else f"The cache at <code>{esc(cache['dir'])}</code> was empty at the start.")
    totals = [
        ("requests", f"{t['requests']}"),
        ("reused cached work", f"{t['hits']} of {t['requests']} ({t['hit_rate'] * 100:.0f} %), {t['exact_hits']} of them exact"),
        ("time", f"{t['seconds']:.2f} s against {t['dense_seconds']:.2f} s dense: x{t['speedup']}, {t['saved_seconds']:.2f} s saved"),
        ("denoising steps computed", f"{t['steps_computed']} of {t['steps']} ({t['steps'] - t['steps_computed']} saved)"),
        ("DiT forwards", f"{t['dit_forwards']} of {t['dense_dit_forwards']}"),
    ]
    totals_html = "".join(f"<tr><td>{k}</td><td class='total' data-key='{k}'>{esc(v)}</td></tr>" for k, v in totals)
    body = "".join(_row_html(r) for r in rows)
    return (
        "<!doctype html><html lang=en><meta charset=utf-8><meta name=viewport content='width=device-width'>"
        f"<title>carnator demo ({esc(doc['policy'])})</title><style>{_CSS}</style>"
        f"<h1>carnator demo: {t['requests']} related requests through the {esc(doc['policy'])} policy</h1>"
        f"<p class=note>{cache_line} {doc['steps']} denoising steps per request.</p>"
        f"<h2>Totals</h2><table id=totals>{totals_html}</table>"
        f"<p class=note>{esc(doc['comparison'])}</p>"
        f"<h2>Cumulative time</h2>{cumulative_plot(rows)}"
        "<h2>Requests</h2><table id=requests><thead><tr><th class=num>#</th><th>request</th><th>decision and reason</th>"
        "<th class=num>seconds</th><th class=num>dense</th><th class=num>speedup</th><th class=num>steps computed</th>"
        f"<th>clips: this request, dense, the source (a miss: the candidate refused)</th></tr></thead><tbody>{body}</tbody></table></html>\n"
    )


def _row_html(r: dict) -> str:
    esc = html.escape
    kind = r["decision"].replace(" ", "-")
    checks = ""
    if r["risk"]:  # a risk rule decides: the score against its threshold, from every discrepancy
        ok = r["risk"]["value"] <= r["risk"]["threshold"]
        dims = ", ".join(f"{esc(c['name'])} {_fmt(c['value'])}" for c in r["checks"])
        checks = (f"<ul class=checks><li class={'pass' if ok else 'fail'}>risk score {r['risk']['value']:.3f} "
                  f"{'&le;' if ok else '&gt;'} {r['risk']['threshold']:.3f}</li><li>from {dims}</li></ul>")
    elif r["checks"]:  # one threshold per discrepancy
        items = "".join(
            f"<li>{esc(c['name'])} {_fmt(c['value'])} (off)</li>" if c["threshold"] is None else
            f"<li class={'pass' if c['passed'] else 'fail'}>{esc(c['name'])} {_fmt(c['value'])} {'&le;' if c['passed'] else '&gt;'} {_fmt(c['threshold'])}</li>"
            for c in r["checks"]
        )
        checks = f"<ul class=checks>{items}</ul>"
    src = ""
    if r["source"] or r["tested"]:
        who = f"request {r['source_request']}" if r["source_request"] is not None else "an earlier run"
        label = f"source: {who}" if r["source"] else f"refused: {who}"
        if r["source_gif"]:
            src = f"<figure><img src='{esc(r['source_gif'])}' alt='source clip'><figcaption>{esc(label)}</figcaption></figure>"
        else:
            src = f"<figure><figcaption>{esc(label)} (no clip stored)</figcaption></figure>"
    clips = (f"<figure><img src='{esc(r['gif'])}' alt='clip'><figcaption>this request</figcaption></figure>"
             f"<figure><img src='{esc(r['dense_gif'])}' alt='dense clip'><figcaption>dense (differs by {r['mean_abs_diff_from_dense']:.1f}/255)</figcaption></figure>{src}")
    return (
        f"<tr class='{kind}' data-i='{r['i']}'><td class=num>{r['i']}</td>"
        f"<td class=request>{esc(r['prompt'])}<br><small>seed {r['seed']}</small></td>"
        f"<td class=reason><span class='decision {kind}'>{esc(r['decision'])}</span>: {esc(r['headline'])}{checks}</td>"
        f"<td class='num seconds'>{r['seconds']:.2f}</td><td class='num dense-seconds'>{r['dense_seconds']:.2f}</td>"
        f"<td class='num speedup'>{_speedup_html(r)}</td>"
        f"<td class='num steps'>{r['steps_computed']} of {r['steps']}</td><td class=clips>{clips}</td></tr>"
    )


def _speedup_html(r: dict) -> str:
    if r["exact"]:
        return "from the cache"
    return "miss" if r["speedup"] is None else f"x{r['speedup']}"


def _fmt(v) -> str:
    return v if isinstance(v, str) else f"{v:.2f}"


def cumulative_plot(rows: list[dict], width: int = 640, height: int = 280) -> str:
    """Inline SVG: cumulative seconds after each request, the policy's against dense's, each request a dot coloured by
    its decision."""
    n = len(rows)
    pol = np.cumsum([r["seconds"] for r in rows]).tolist()
    den = np.cumsum([r["dense_seconds"] for r in rows]).tolist()
    top = max(den + pol + [1e-9]) * 1.05
    left, right, bottom, up = 56, 16, 40, 14

    def x(k: int) -> float:
        return left + (width - left - right) * (k + 1) / n

    def y(v: float) -> float:
        return height - bottom - (height - bottom - up) * v / top

    def line(vals, cls):
        pts = " ".join(f"{x(k):.1f},{y(v):.1f}" for k, v in enumerate([0.0] + vals, start=-1))
        return f"<polyline class='{cls}' points='{pts}' fill=none stroke-width=2 />"

    colours = {"exact hit": "#1a7f37", "hit": "#0a58ca", "miss": "#999"}
    dots = "".join(
        f"<circle class='dot {r['decision'].replace(' ', '-')}' cx='{x(k):.1f}' cy='{y(pol[k]):.1f}' r=4 fill='{colours[r['decision']]}'>"
        f"<title>{r['i']}: {html.escape(r['decision'])}, {r['seconds']:.2f} s (dense {r['dense_seconds']:.2f} s)</title></circle>"
        for k, r in enumerate(rows)
    )
    step = _tick(top)
    yt = "".join(
        f"<line x1={left} x2={width - right} y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#eee'/>"
        f"<text x={left - 6} y='{y(v) + 4:.1f}' text-anchor=end>{v:g}</text>"
        for v in np.arange(0, top, step).round(6).tolist()
    )
    xt = "".join(f"<text x='{x(k):.1f}' y={height - bottom + 16} text-anchor=middle>{r['i']}</text>" for k, r in enumerate(rows))
    return (
        f"<svg id=cumulative xmlns='http://www.w3.org/2000/svg' width={width} height={height} font-size=11 font-family='sans-serif'>"
        f"{yt}{xt}<text x={(left + width) / 2} y={height - 6} text-anchor=middle>request</text>"
        f"<text transform='translate(14,{height / 2}) rotate(-90)' text-anchor=middle>cumulative seconds</text>"
        f"<g stroke='#c0392b'>{line(den, 'dense')}</g><g stroke='#0a58ca'>{line(pol, 'policy')}</g>{dots}"
        f"<g transform='translate({left + 10},{up + 6})'><rect width=12 height=3 y=-3 fill='#c0392b'/><text x=18 y=1>dense, each request</text>"
        f"<rect width=12 height=3 y=13 fill='#0a58ca'/><text x=18 y=17>the policy</text></g></svg>"
    )


def _tick(top: float) -> float:
    raw = top / 5
    mag = 10 ** np.floor(np.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return float(m * mag)
    return float(10 * mag)
