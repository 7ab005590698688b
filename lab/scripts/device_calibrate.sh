#!/bin/bash
# `carnator calibrate` on the lent GPU within one device call, keeping what a cut leaves.
#
#   [RESUME=1] bash lab/scripts/device_calibrate.sh OUT SECONDS PAIRS W JOBS [EXTRA CALIBRATE ARGS...]
#
# Runs `carnator-lab calibrate --pairs PAIRS --warm W --jobs JOBS --device cuda --cuda-graphs` for at most SECONDS, then
# copies into OUT: pairs.jsonl and pairs.meta.json (always: every pair is appended as it finishes, so a run cut short
# keeps what it did, and `carnator calibrate` on another machine resumes or selects from them), thresholds.json and
# calibration.json (when it finished) and the gzipped log. RESUME=1 continues the run left in /tmp/carnator-calibrate
# by an earlier call on the same (still held) machine. Assumes the carnator and carnator_lab packages importable (PYTHONPATH=src:lab/src).
set -u
out=$1; budget=$2; pairs=$3; W=$4; jobs=$5; shift 5
work=/tmp/carnator-calibrate
[ "${RESUME:-0}" = 1 ] || rm -rf "$work" "$work.log"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # JOBS workers share the CPU: one thread each
t0=$(date +%s)
timeout -k 10 "$budget" python3 -m carnator_lab calibrate \
  --pairs "$pairs" --warm "$W" --jobs "$jobs" --device cuda --cuda-graphs --cache-dir "$work/cache" --out "$work" "$@" \
  >> "$work.log" 2>&1
rc=$?
pkill -9 -f "carnator_lab" 2>/dev/null
echo "calibrate rc $rc after $(( $(date +%s) - t0 )) s; $(wc -l < "$work/pairs.jsonl" 2>/dev/null || echo 0) pairs"
tail -5 "$work.log"
mkdir -p "$out"
# A pair cut mid-write leaves a partial last line: keep whole lines only.
[ -f "$work/pairs.jsonl" ] && python3 -c 'import json,sys; [print(l, end="") for l in open(sys.argv[1]) if l.endswith("\n") and json.loads(l)]' "$work/pairs.jsonl" > "$out/pairs.jsonl"
for f in pairs.meta.json thresholds.json calibration.json; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
gzip -c "$work.log" > "$out/log.gz"
