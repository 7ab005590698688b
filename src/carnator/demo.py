"""``carnator demo``: a short stream of related requests on the embedded model through a policy.

Prints per request whether it hit, its source, resume step, mask density and speedup over a dense
reference (the median E2E time of three dense generations of the stream's first prompt, run after a
short warm-up with seeds outside the stream and not stored), and writes the clips plus an HTML page
that shows them.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

#: (prompt, seed): a session of related requests: first generations, a noun substitution, a
#: colour change, a context change, a re-roll, a rewording, an exact repeat and an unrelated prompt.
STREAM: list[tuple[str, int]] = [
    ("a small red ball moving left on grass", 1),
    ("a small red box moving left on grass", 2),
    ("a small blue ball moving left on grass", 3),
    ("a small red ball moving left on snow", 4),
    ("a small red ball moving left on grass", 5),
    ("on a grassy field, a tiny red circle slides to the left", 6),
    ("a small red ball moving left on grass", 1),
    ("a big yellow star bouncing in the night sky", 7),
    ("a big yellow star bouncing at night", 8),
    ("a big yellow triangle bouncing at night", 9),
    ("a big white star bouncing at night", 10),
    ("a big yellow star growing at night", 11),
]


def run_demo(engine, out: Path, policy: str = "carnator", steps: int | None = None, progress=print) -> list[dict]:
    from .video import write_video

    out.mkdir(parents=True, exist_ok=True)
    # The dense reference, measured like every request but after the one-time costs (model kernels,
    # the recall embedder) are paid; the median of three (single runs were seen up to 40 % slow on the 2-core CPU);
    # seeds 0, 1000, 1001 are outside the stream and nothing is stored.
    first = STREAM[0][0]
    engine.generate(first, seed=0, policy="dense", num_inference_steps=2, store=False)
    engine.embedder(first)
    refs = sorted(engine.generate(first, seed=sd, policy="dense", num_inference_steps=steps, store=False).stats.timings["total"]
                  for sd in (0, 1000, 1001))
    ref = refs[1]
    progress(f"dense reference: {ref:.2f}s (median of {', '.join(f'{r:.2f}' for r in refs)})")
    rows = []
    for i, (prompt, seed) in enumerate(STREAM):
        res = engine.generate(prompt, seed=seed, policy=policy, num_inference_steps=steps)
        s = res.stats
        total = s.timings["total"]
        gif = f"{i:02d}.gif"
        write_video(res.frames, out / gif)
        row = {
            "i": i, "prompt": prompt, "seed": seed, "hit": s.hit, "exact": s.exact_hit, "source": s.source_id,
            "resume_step": s.resume_step, "mask_density": s.mask_density, "active_fraction": s.active_fraction,
            "seconds": round(total, 3), "speedup": round(ref / total, 2), "gif": gif,
        }
        rows.append(row)
        kind = "exact" if s.exact_hit else ("hit" if s.hit else "miss")
        dens = "-" if s.mask_density is None else f"{s.mask_density:.2f}"
        progress(f"{i:2d} {kind:5s} src={str(s.source_id)[:8]:8s} resume={str(s.resume_step):4s} density={dens:5s} "
                 f"{total:6.2f}s x{row['speedup']}  {prompt!r} seed={seed}")
    (out / "demo.json").write_text(json.dumps(rows, indent=1))
    cells = "".join(
        f"<figure><img src='{r['gif']}' width=128 height=128><figcaption>{r['i']}: {html.escape(r['prompt'])} (seed {r['seed']})<br>"
        f"{'exact hit' if r['exact'] else ('hit' if r['hit'] else 'miss')}, {r['seconds']} s, x{r['speedup']}</figcaption></figure>"
        for r in rows
    )
    (out / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>carnator demo</title><style>body{font-family:sans-serif}"
        "figure{display:inline-block;width:180px;vertical-align:top;font-size:12px}img{image-rendering:pixelated}</style>"
        f"<h1>carnator demo ({html.escape(policy)})</h1>{cells}"
    )
    return rows
