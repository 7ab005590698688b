#!/usr/bin/env python3
"""Held-out judge fidelity of the embedded model under one or more sampling schedules (the bar of issue 3: >= 0.90).

    python scripts/eval_embedded.py --device cuda -n 320 --probe-sigmas none,0.85,0.75 --out eval.json

Each schedule samples the same ``n`` held-out captions and seeds (train_embedded.py's evaluation); ``none`` is the
plain shifted schedule, a number the front-loaded one of EmbeddedConfig.probe_sigma.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_embedded import evaluate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=320)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weights", default=None, help="a train_embedded.py --out directory instead of the shipped weights")
    ap.add_argument("--flow-shift", type=float, default=3.0)
    ap.add_argument("--probe-sigmas", default="none")
    ap.add_argument("--out", default="eval.json")
    args = ap.parse_args()
    rows = []
    for ps in args.probe_sigmas.split(","):
        res, _ = evaluate(Path(args.weights) if args.weights else None, args.device, args.n, args.flow_shift,
                          None if ps == "none" else float(ps))
        print(json.dumps(res), flush=True)
        rows.append(res)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
