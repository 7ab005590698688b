#!/bin/bash
# One device call: the edit tiers' calibration continued (RESUME rows of an earlier call, device_stream.sh edits), its
# certified tiers written into the device copy of the shipped file (edit_tiers.py write), then the held-out stream
# (held_out_stream.py, W = 1,000 / S = 300) for dense, the new default, the default before tiers (content45) and NIRVANA.
#   RESUME=.cache/dev/edits-resume bash lab/scripts/tiers_device.sh OUT CAL_SECONDS STREAM_SECONDS
set -u
out=$1; cal=${2:-170}; st=${3:-330}
STEPS=${STEPS:-2,5,12} SCOPE=frame NOISE=1 JOBS=14 bash lab/scripts/device_stream.sh "$out" edits "$cal" 2>&1 | grep -v -E "Warn|warn" | tail -4
rm -f "$out"/edits/open_thresholds.json "$out"/edits/pairs.meta.json
export PYTHONPATH=$PWD/src:$PWD/lab/src:/tmp/dpk:$PWD/.cache/dev/py:$PWD/.cache/dev/db.zip
python3 lab/scripts/edit_tiers.py write --tiers "$out"/edits/thresholds.json > /dev/null && cp src/carnator/embedded/thresholds.json "$out"/edits/shipped-thresholds.json
python3 -c "import json; print({k: (v['step'], v['accepted'], v['unsafe'], round(v['bound'], 4)) for k, v in json.load(open('src/carnator/embedded/thresholds.json'))['thresholds']['tiers'].items()})"
VARIANTS=${VARIANTS:-default,content45,nirvana} SOURCES=0 bash lab/scripts/device_stream.sh "$out" stream "$st" 2>&1 | grep -v -E "Warn|warn" | tail -8
