"""What a finer token grid would cost the embedded model on the CPU (issue 3's speed bar: <= 5 s per clip).

    python lab/scripts/finer_grid_cost.py [--repeats 3]

Times one 50-step CFG generation (``sample_batch``, one prompt) of the shipped architecture and of the same
architecture with a finer spatial patch (random weights: the cost does not depend on them), torch threads as
the machine has. The probe's tail-frame IoU ceiling rises with a finer grid (scripts/probe_ceiling.py); this
measures what that would cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from carnator.embedded import load_pipeline
from carnator.embedded.model import EmbeddedPipeline
from carnator.embedded.sample import sample_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    shipped = load_pipeline("cpu")
    prompt = "a small red ball moving left on grass"
    for patch in ((2, 2, 2), (2, 1, 1)):
        cfg = dataclasses.replace(shipped.cfg, patch_size=patch)
        pipe = shipped if patch == tuple(shipped.cfg.patch_size) else EmbeddedPipeline(cfg, text_encoder=shipped.text_encoder)
        pipe.transformer.eval()
        tokens = (cfg.frames // patch[0]) * (cfg.size // cfg.codec_factor // patch[1]) * (cfg.size // cfg.codec_factor // patch[2])
        with torch.no_grad():
            sample_batch(pipe, [prompt], [0], steps=2)  # warm-up
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                sample_batch(pipe, [prompt], [r])
                times.append(time.perf_counter() - t0)
        print(f"patch {patch}: {tokens} tokens, {sum(p.numel() for p in pipe.transformer.parameters()) / 1e6:.2f} M parameters, "
              f"50-step CFG clip {min(times):.2f}-{max(times):.2f} s over {args.repeats} runs (torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
