#!/bin/bash
# The service on the lent GPU (docs/SERVING.md's GPU rows). Device calls back to back (the machine keeps /tmp about
# 30 s between calls; the wheels and the model's files do not fit one carry together):
#   bash lab/scripts/serve_device.sh install            # carry .cache/w312: the serve extra's cp312 wheels -> /tmp/site
#   bash lab/scripts/serve_device.sh part DIR           # carry DIR: one part of the wheels (Ray's own in pieces) -> /tmp/wheels
#   bash lab/scripts/serve_device.sh install-parts      # join Ray's wheel and install /tmp/wheels -> /tmp/site
#   bash lab/scripts/serve_device.sh measure OUT [N]    # carry .cache/dev (or DEV=a copy of it): the library's dense
#        throughput (defaults and cuda_graphs) and scripts/load_test.py cache on and off on the card, N requests (default 80)
#   bash lab/scripts/serve_device.sh replicas OUT [N] [COUNTS]   # DEV as above: load_test.py with --replicas for each of
#        COUNTS (default "1 2 4") replicas sharing the card, the cache on, N requests each, each run cut at RUN_S (200) s
# .cache/wp1..3: `pip download -d W --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: "ray[serve]"`
#   plus .cache/w312's wheels (one opentelemetry-api), Ray's wheel cut with `split -b 38000000` into ray.part.a?
# .cache/w312: pip download -d .cache/w312 --python-version 3.12 --platform manylinux_2_28_x86_64 --platform
#   manylinux2014_x86_64 --only-binary=:all: fastapi uvicorn prometheus-client sse-starlette httpx av "psycopg[binary]" fsspec
set -u
case $1 in
  install)
    python3 -m pip install -q --no-index --find-links .cache/w312 --target /tmp/site .cache/w312/*.whl 2>&1 | tail -3
    ls /tmp/site | head -40 | tr '\n' ' '; echo ;;
  part)
    mkdir -p /tmp/wheels && cp "$2"/* /tmp/wheels/ && ls /tmp/wheels | wc -l ;;
  install-parts)
    cat /tmp/wheels/ray.part.* > /tmp/wheels/ray-2.56.1-cp312-cp312-manylinux2014_x86_64.whl && rm /tmp/wheels/ray.part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wheels/*.whl 2>&1 | tail -3
    PYTHONPATH=/tmp/site python3 -c "import ray, ray.serve, fastapi, av, psycopg; print('ray', ray.__version__)" ;;
  measure|replicas)
    out=$2; n=${3:-80}; dev=${DEV:-.cache/dev}
    rm -rf /tmp/dpk && python3 -m zipfile -e $dev/diffusers.zip /tmp/dpk
    export PYTHONPATH=$PWD/src:$PWD/lab/src:/tmp/site:/tmp/dpk:$dev/py:$dev/db.zip HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    export PATH=/tmp/site/bin:$PATH
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; date -u
    if [ "$1" = replicas ]; then
      for r in ${4:-1 2 4}; do
        timeout ${RUN_S:-200} python3 scripts/load_test.py --requests "$n" --clients 6 --steps 50 --max-queue 16 --modes reuse \
          --server-args "--device cuda --replicas $r ${SERVER_ARGS:-}" --out "$out/replicas$r.json" 2>&1 \
          | grep -v -E "Warning|warn\(" | tail -12
        pkill -f "ray::" ; sleep 2
      done
      exit
    fi
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
