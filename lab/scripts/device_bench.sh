#!/bin/bash
# The embedded-world protocol (carnator-lab bench) on the lent H200 within one device call, keeping what a cut leaves.
#
#   [RESUME=1] bash lab/scripts/device_bench.sh OUT SECONDS POLICIES W S JOBS [EXTRA BENCH ARGS...]
#
# RESUME=1 continues the run left in /tmp/carnator-bench by an earlier call on the same (still held) machine; the
# default starts from nothing.
# Runs `carnator-lab bench --warm W --test S --policies POLICIES --jobs JOBS --device cuda --latent-dtype float16`
# for at most SECONDS, then copies into OUT: requests.jsonl and trace.json (always: a run cut short still has
# every policy's rows for a prefix of the fixed test order), report.json/.md/.html (when it finished), each
# policy's cache size (caches.json) and the gzipped log. Assumes the carnator and carnator_lab packages importable (PYTHONPATH=src:lab/src).
set -u
out=$1; budget=$2; policies=$3; W=$4; S=$5; jobs=$6; shift 6
work=/tmp/carnator-bench
# A machine held warm between calls keeps /tmp: a cache filled for another trace would pollute this run's.
if [ "${RESUME:-0}" = 1 ] && [ -d "$work" ]; then
  echo "resuming: $(wc -l < "$work/requests.jsonl" 2>/dev/null || echo 0) rows done"; [ -f "$work.log" ] && mv "$work.log" "$work.log.1"
else
  rm -rf "$work" "$work.log" "$work.log.1"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # JOBS workers share the CPU: one thread each
t0=$(date +%s)
timeout -k 10 "$budget" python3 -m carnator_lab bench \
  --warm "$W" --test "$S" --policies "$policies" --jobs "$jobs" --device cuda --latent-dtype float16 \
  --keep-clips 4 --out "$work" "$@" > "$work.log" 2>&1
rc=$?
pkill -9 -f "carnator_lab" 2>/dev/null
echo "bench rc $rc after $(( $(date +%s) - t0 )) s"
grep -E "warm caches filled|test streams run" "$work.log"
tail -20 "$work.log"
mkdir -p "$out"
cp "$work/requests.jsonl" "$work/trace.json" "$out/" 2>/dev/null
for f in report.json report.md report.html; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
python3 - "$work" "$out/caches.json" <<'PY'
import json, sys
from pathlib import Path
from carnator.cache import CacheBank
res = {}
for d in sorted((Path(sys.argv[1]) / "caches").glob("*")):
    st = CacheBank(d).stats()
    res[d.name] = {"entries": st.count, "bytes": st.bytes, "warm_done": (d / ".warm").exists()}
Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
print(res)
PY
cat "$work.log.1" "$work.log" 2>/dev/null | gzip -c > "$out/log.gz"
