"""Entry size and hit frames with the stored latents in float32 against float16 (embedded model, CPU).

    python lab/scripts/entry_dtype.py

Three prompts, each generated with one seed and then re-rolled with another (a reuse hit), once per dtype, each in a
fresh cache; prints bytes per entry and how far the hits' frames lie apart between the two dtypes (0-255 scale).
"""
import json
import tempfile

import numpy as np

from carnator import Carnator, EngineConfig
out = {}
prompts = [("a small red ball moving left on grass", 1, 5), ("a big blue box moving right on sand", 2, 6), ("a green triangle moving up on snow", 3, 7)]
for dtype in ["float32", "float16"]:
    with tempfile.TemporaryDirectory() as d:
        eng = Carnator.from_pretrained("embedded", cache_dir=d, device="cpu", config=EngineConfig(latent_dtype=dtype))
        hits = []
        for p, s1, s2 in prompts:
            eng.generate(p, seed=s1)
            r = eng.generate(p, seed=s2)
            hits.append((r.stats.hit, r.frames))
        st = eng.store.stats()
        out[dtype] = dict(entries=st.count, bytes=st.bytes, per_entry_mb=st.bytes / st.count / 1e6, hits=[h for h, _ in hits])
        out[dtype]["_frames"] = [f for _, f in hits]
a, b = out["float32"].pop("_frames"), out["float16"].pop("_frames")
out["hit_frames_mean_abs_diff_255"] = [float(np.abs(x.astype(float) - y.astype(float)).mean()) for x, y in zip(a, b)]
out["hit_frames_max_abs_diff_255"] = [int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(a, b)]
print(json.dumps(out, indent=1))
