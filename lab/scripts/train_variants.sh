#!/usr/bin/env bash
# Train several variants of the embedded model side by side on one GPU (one device call), then
# measure each one's use of the attribute words (scripts/text_sensitivity.py), and pack the results
# so that they fit the device tool's return limit (8 files of <= 16 MiB):
#   $OUT/NAME.tar  - weights.safetensors (EMA) + weights.json + loss.csv + eval.json + train.log
#                    (+ sensitivity.txt)
#   $OUT/best-resume.safetensors, $OUT/best-opt.safetensors - the best variant's raw weights and
#   AdamW moments (with NAME.tar's files, a directory to --resume from)
#
#   bash lab/scripts/train_variants.sh OUT_DIR "a:--loss x0" "b:--loss x0 --fg-weight 8" ...
# Common arguments for every variant go in $TRAIN_ARGS. Variants share the GPU by time-slicing: four
# together ran at 340 ms/step each against 100 ms/step alone (H200, batch 512), 18 % more steps in
# all - worth it to compare settings side by side, not for speed. Each NAME.tar is written as soon as
# the training ends and gets sensitivity.txt appended afterwards, so a call cut off during the
# sensitivity runs still returns the weights and evaluations.
set -u
out=$1; shift
work=${WORK:-/tmp/variants}
mkdir -p "$out" "$work"
names=()
for spec in "$@"; do
    name=${spec%%:*}; args=${spec#*:}
    names+=("$name")
    # shellcheck disable=SC2086
    python lab/scripts/train_embedded.py ${TRAIN_ARGS:-} $args --out "$work/$name" > "$work/$name.log" 2>&1 &
done
wait

pack() {  # NAME FILES...: append the files that exist to $out/NAME.tar
    local name=$1; shift
    local have=()
    for f in "$@"; do [ -e "$work/$name/$f" ] && have+=("$f"); done
    if [ ${#have[@]} -gt 0 ]; then (cd "$work/$name" && tar rf "$out/$name.tar" "${have[@]}"); fi
}

for name in "${names[@]}"; do
    tail -4 "$work/$name.log"
    mkdir -p "$work/$name" && cp "$work/$name.log" "$work/$name/train.log"
    pack "$name" weights.safetensors weights.json loss.csv eval.json train.log
done
best=$(python - "$work" "${names[@]}" <<'EOF'
import json, sys
from pathlib import Path
work, names = Path(sys.argv[1]), sys.argv[2:]
scores = {}
for n in names:
    f = work / n / "eval.json"
    if f.exists():
        scores[n] = max(r["fidelity"] for r in json.loads(f.read_text()))
    print(n, scores.get(n), file=sys.stderr)
print(max(scores, key=scores.get) if scores else "")
EOF
)
if [ -n "$best" ]; then
    echo "best: $best"
    cp "$work/$best/resume.safetensors" "$out/best-resume.safetensors"
    cp "$work/$best/opt.safetensors" "$out/best-opt.safetensors"
fi
for name in "${names[@]}"; do
    python lab/scripts/text_sensitivity.py --weights "$work/$name" -n "${SENS_N:-96}" > "$work/$name/sensitivity.txt" 2>&1 &
done
wait
for name in "${names[@]}"; do
    cat "$work/$name/sensitivity.txt"
    pack "$name" sensitivity.txt
done
