#!/bin/bash
# Issue 26's device calls, each one call of the device tool (run from the repository root, `.cache/dev` carried:
# diffusers.zip, the MiniLM package under py/, pairs3000.jsonl = the stream_pairs(3000, MiniLM, warm=1000) list).
#
#   bash lab/scripts/device_stream.sh OUT sources          # source_scores.py: A (same-content sources judged), B (own sample, 8 prompts)
#   [VARIANTS=...] [SOURCES=0] [SEQUENTIAL=1] [FILL_NIRVANA=1] [KEEP_WARM=1] [WARM=1000 TEST=300] bash lab/scripts/device_stream.sh OUT stream SECONDS   # held_out_stream.py W = 1,000 / S = 300: dense and
#        VARIANTS (default shipped,gate,fast), with source_scores.py (A and B) beside it unless SOURCES=0
#   bash lab/scripts/device_stream.sh OUT content          # the pairs recall by content adds (content_pairs.py draw,
#        .cache/dev/content-pairs.jsonl): `carnator calibrate` rows, and their sources judged (source_scores.py A)
#   [STEPS="40 45"] bash lab/scripts/device_stream.sh OUT tiers   # lever 2: same-content pairs (.cache/dev/tier-pairs.jsonl)
#        calibrated at later resume steps
#   [FRAMES=81] bash lab/scripts/device_stream.sh OUT scale   # the tiers' plans at real size (Wan2.1-1.3B 480p, random
#        weights): carnator-lab bench-scale with frame-tier hits from steps 45, 12 and 5 beside dense, the region hit and NIRVANA
set -u
out=$1; mode=$2; budget=${3:-480}
# KEEP_DPK=1: diffusers already unpacked under /tmp/dpk (two runs side by side: the second must not unpack it again)
[ "${KEEP_DPK:-0}" = 1 ] || { rm -rf /tmp/dpk && python3 -m zipfile -e .cache/dev/diffusers.zip /tmp/dpk; }
export PYTHONPATH=$PWD/src:$PWD/lab/src:/tmp/dpk:$PWD/.cache/dev/py:$PWD/.cache/dev/db.zip HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
t0=$(date +%s)
keep() {  # whole lines of a calibrate run's pairs.jsonl (a cut leaves a partial last line), gzipped into OUT/NAME
  mkdir -p "$out/$2"
  python3 -c 'import json,sys; [print(l, end="") for l in open(sys.argv[1]) if l.endswith("\n") and json.loads(l)]' \
    "$1/pairs.jsonl" | gzip > "$out/$2/pairs.jsonl.gz"
  cp "$1"/*.json "$out/$2/" 2>/dev/null
}
case $mode in
  sources) python3 lab/scripts/source_scores.py --pairs .cache/dev/pairs3000.jsonl --out "$out/sources" --jobs 14 \
             --own-n 8 --same-content 2>&1 | grep --line-buffered -v -E "Warning|Loading weights|warn\(|text encoder reads" ;;
  stream) python3 lab/scripts/held_out_stream.py --out "$out/stream" --warm ${WARM:-1000} --test ${TEST:-300} --jobs 14 \
             --variants "${VARIANTS:-shipped,gate,fast}" --budget "$budget" $([ "${SEQUENTIAL:-0}" = 1 ] && echo --sequential) \
             $([ "${KEEP_WARM:-0}" = 1 ] && echo --keep-warm) $([ "${FILL_NIRVANA:-0}" = 1 ] && echo --fill-nirvana) \
             $([ "${SOURCES:-1}" = 1 ] && echo --sources .cache/dev/pairs3000.jsonl --sources-jobs 4 --own-n 8) 2>&1 | grep --line-buffered -v -E "Warning|Loading weights|warn\(|text encoder reads" ;;
  content)
    n=$(wc -l < .cache/dev/content-pairs.jsonl)
    python3 lab/scripts/source_scores.py --pairs .cache/dev/content-pairs.jsonl --out "$out/content-sources" --jobs 4 --own-n 0 \
      --root /tmp/content-sources 2>&1 | grep --line-buffered -v -E "Warning|Loading weights|warn\(|text encoder reads" &
    timeout -k 10 "$budget" python3 -c "import sys; from carnator.cli import main; sys.exit(main(sys.argv[1:]))" calibrate \
      --pairs-file .cache/dev/content-pairs.jsonl --pairs "$n" --judge shapes --quality fidelity=0.25 --quality artifact=0.1 \
      --device cuda --cuda-graphs --jobs 10 --cache-dir /tmp/content-cal-cache --out /tmp/content-cal 2>&1 \
      | grep --line-buffered -v -E "Warning|Loading weights|warn\(|text encoder reads" | tail -20
    wait
    keep /tmp/content-cal content-cal ;;
  tiers)
    # lever 2: the same-content pairs the shipped rule accepts (.cache/dev/tier-pairs.jsonl, content_pairs.py tiers) reused
    # from later resume steps, one calibrate run per step side by side
    n=$(wc -l < .cache/dev/tier-pairs.jsonl)
    for r in ${STEPS:-40 45}; do
      timeout -k 10 "$budget" python3 -c "import sys; from carnator.cli import main; sys.exit(main(sys.argv[1:]))" calibrate \
        --pairs-file .cache/dev/tier-pairs.jsonl --pairs "$n" --judge shapes --quality fidelity=0.25 --quality artifact=0.1 \
        --device cuda --cuda-graphs --jobs ${JOBS:-7} --resume-step $r --cache-dir /tmp/tier$r-cache --out /tmp/tier$r \
        > /tmp/tier$r.log 2>&1 &
    done
    wait
    for r in ${STEPS:-40 45}; do tail -3 /tmp/tier$r.log; keep /tmp/tier$r tier$r; done ;;
  edits)
    # [STEPS=2,5,12] [SCOPE=frame] [PAIRS=600] [NOISE=1] [RISK=pair|excess] [NAME=edits]: edit tiers (lab/scripts/edit_tiers.py
    # draw -> .cache/dev/edit-pairs.jsonl): each pair's target reused from every step of STEPS (and, NOISE=1, generated densely
    # at another seed: the rule's noise floor), one calibrate run; each edit kind judged by the rule plus the attribute it
    # asks (TIER_RULES), each row labelled as `calibrate --risk RISK` labels it; the tiers it certifies in OUT/NAME/thresholds.json.
    # Two runs side by side: NAME=a ... & NAME=b ... & wait (each its own /tmp/NAME)
    nm=${NAME:-edits}; pf=${PAIRS_FILE:-.cache/dev/edit-pairs.jsonl}; n=${PAIRS:-$(wc -l < $pf)}
    tq="--tier-quality colour:color=0.05 --tier-quality object:shape=0.05 --tier-quality small-object:shape=0.05 --tier-quality size:size=0.05 --tier-quality motion:motion=0.05 --tier-quality place:background=0.05"
    tq=${TIER_RULES:-$tq}
    # RESUME=DIR: the rows (pairs.jsonl, pairs.meta.json) of an earlier call of the same run, continued here
    [ -n "${RESUME:-}" ] && mkdir -p /tmp/$nm && cp "$RESUME"/pairs.jsonl "$RESUME"/pairs.meta.json /tmp/$nm/
    timeout -k 10 "$budget" python3 -c "import sys; from carnator.cli import main; sys.exit(main(sys.argv[1:]))" calibrate \
      --pairs-file $pf --pairs "$n" --judge shapes --quality fidelity=0.25 --quality artifact=0.1 $tq $([ "${NOISE:-1}" = 1 ] && echo --noise-floor) \
      --risk ${RISK:-pair} --device cuda --cuda-graphs --jobs ${JOBS:-14} --resume-step ${STEPS:-2,5,12} --tier-scope ${SCOPE:-frame} \
      --cache-dir /tmp/$nm-cache --out /tmp/$nm > /tmp/$nm.log 2>&1
    pkill -f "out /tmp/$nm\b" ; sleep 2; tail -3 /tmp/$nm.log; keep /tmp/$nm $nm
    gunzip -c "$out/$nm/pairs.jsonl.gz" > /tmp/$nm/pairs.jsonl   # whole lines only
    # the selection and certification over what finished (a cut run has no thresholds.json yet)
    timeout 60 python3 -c "import sys; from carnator.cli import main; sys.exit(main(sys.argv[1:]))" calibrate --select-only \
      --judge shapes --quality fidelity=0.25 --quality artifact=0.1 $tq --risk ${RISK:-pair} --resume-step ${STEPS:-2,5,12} \
      --tier-scope ${SCOPE:-frame} --out /tmp/$nm > /tmp/$nm-select.log 2>&1
    tail -5 /tmp/$nm-select.log; cp /tmp/$nm/*.json "$out/$nm/" 2>/dev/null ;;
  scale)
    python3 -m carnator_lab bench-scale wan2.1-1.3b --frames ${FRAMES:-81} --active-fraction 1.0 --densities 0.5 --no-kernels \
      --frame-steps ${FRAME_STEPS:-45,12,5} --baselines nirvana --out "$out/scale" 2>&1 | grep --line-buffered -v -E "Warning|warn\(" | tail -30 ;;
esac
echo "done in $(( $(date +%s) - t0 )) s"
