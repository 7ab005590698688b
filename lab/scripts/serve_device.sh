#!/bin/bash
# The service on the lent GPU (docs/SERVING.md's GPU rows). Two device calls back to back (the machine keeps /tmp about
# 30 s between calls; the wheels and the model's files do not fit one carry together):
#   bash lab/scripts/serve_device.sh install            # carry .cache/w312: the serve extra's cp312 wheels -> /tmp/site
#   bash lab/scripts/serve_device.sh measure OUT [N]    # carry .cache/dev: the library's dense throughput (defaults and
#        cuda_graphs) and scripts/load_test.py cache on and off on the card, N requests (default 80)
# .cache/w312: pip download -d .cache/w312 --python-version 3.12 --platform manylinux_2_28_x86_64 --platform
#   manylinux2014_x86_64 --only-binary=:all: fastapi uvicorn prometheus-client sse-starlette httpx av "psycopg[binary]" fsspec
set -u
case $1 in
  install)
    python3 -m pip install -q --no-index --find-links .cache/w312 --target /tmp/site .cache/w312/*.whl 2>&1 | tail -3
    ls /tmp/site | head -40 | tr '\n' ' '; echo ;;
  measure)
    out=$2; n=${3:-80}
    rm -rf /tmp/dpk && python3 -m zipfile -e .cache/dev/diffusers.zip /tmp/dpk
    export PYTHONPATH=$PWD/src:$PWD/lab/src:/tmp/site:/tmp/dpk:$PWD/.cache/dev/py:$PWD/.cache/dev/db.zip HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; date -u
    python3 - "$out" <<'PY'
import json, sys, time
import torch
from carnator import Carnator, EngineConfig
out = {}
for name, cfg in (("defaults", EngineConfig()), ("cuda_graphs", EngineConfig(cuda_graphs=True))):
    eng = Carnator.from_pretrained("embedded", device="cuda", config=cfg)
    prompts = [f"a big {c} ball moving left on grass" for c in ("red", "blue", "green", "yellow")]
    for k in range(3):   # warm-up (graph capture, kernels)
        eng.generate(prompts[k % 4], seed=100 + k, policy="dense", store=False)
    torch.cuda.synchronize(); t = time.perf_counter(); m = 20
    for k in range(m):
        eng.generate(prompts[k % 4], seed=k, policy="dense", store=False)
    torch.cuda.synchronize(); s = (time.perf_counter() - t) / m
    out[name] = {"seconds_per_request": round(s, 4), "requests": m, "steps": eng.resolve(prompts[0], seed=0).num_inference_steps,
                 "cuda_graphs": eng.config.cuda_graphs}
    print(name, out[name], flush=True)
    del eng; torch.cuda.empty_cache()
out["device"] = torch.cuda.get_device_name(0)
open(sys.argv[1] + "/library.json", "w").write(json.dumps(out, indent=1))
PY
    timeout 420 python3 scripts/load_test.py --requests "$n" --clients 6 --steps 50 --max-queue 16 \
      --server-args "--device cuda ${SERVER_ARGS:-}" --out "$out/load.json" 2>&1 | grep -v -E "Warning|warn\(" | tail -25 ;;
esac
