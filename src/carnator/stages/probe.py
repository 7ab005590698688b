"""The dense probe and what is read from it (PAPER steps 2-4).

:func:`probe` runs the request's first steps densely (they are part of its own trajectory) and records, at the last
of them, the cross-attention of every visual token to each noun's tokens and the self-attention of one layer.
:func:`read_signature` turns that record into Evidence Regions and, with one VAE decode of the probe step's
clean-latent estimate, the request's Early Signature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..attention.state import EvidenceRecord, RecordSpec, SparseConfig
from ..backbones.base import BackboneAdapter, Conditioning
from ..denoise import DenoiseState, Program, run_steps
from ..plan import ProbeSpec
from ..request import Request
from ..signature import EarlySignature, early_signature, evidence_region, select_seeds


@dataclass(frozen=True, eq=False)
class Evidence:
    """What the probe recorded: each noun's text-token positions and the attention record of the probe step."""

    positions: Mapping[str, tuple[int, ...]]
    record: EvidenceRecord | None
    step: int


def probe(adapter: BackboneAdapter, state: DenoiseState, cond: Conditioning, req: Request, spec: ProbeSpec,
          positions: Mapping[str, tuple[int, ...]], *, capture: set[int] | None = None, sparse: SparseConfig | None = None,
          progress: Callable[[int], None] | None = None, cancel: Callable[[], bool] | None = None) -> Evidence:
    """Run steps ``[state.next_step, spec.steps)`` densely, recording evidence at step ``spec.steps - 1``."""
    layer = spec.layer if spec.layer is not None else adapter.num_layers() // 2
    record = RecordSpec(layer, tuple(sorted({p for ps in positions.values() for p in ps})))
    run_steps(adapter, state, cond, req, spec.steps, program=Program.probe(spec.steps, record, sparse), capture=capture,
              progress=progress, cancel=cancel)
    ev = state.attention.record.evidence.pop((spec.steps - 1, layer), None)
    return Evidence(positions=dict(positions), record=ev, step=spec.steps - 1)


def read_signature(adapter: BackboneAdapter, state: DenoiseState, req: Request, evidence: Evidence,
                   spec: ProbeSpec) -> tuple[EarlySignature, dict[str, np.ndarray]]:
    """The Early Signature and each noun's Evidence Region (a bool token-grid mask; empty when the noun has no token
    or nothing was recorded)."""
    grid = adapter.token_grid(req)
    ev = evidence.record
    regions: dict[str, np.ndarray] = {}
    for noun, pos in evidence.positions.items():
        if not pos or ev is None or ev.cross is None:
            regions[noun] = np.zeros(grid, dtype=bool)
            continue
        cols = [ev.positions.index(p) for p in pos]
        C = ev.cross[:, :, cols].float().mean(dim=(0, 2)).cpu().numpy()
        seeds = select_seeds(C, grid, spec.region)
        regions[noun] = evidence_region(C, ev.self_attention_columns, seeds, grid, spec.region).mask
    x0 = adapter.predicted_x0(state.scheduler, state.last_input, state.last_prediction, evidence.step)
    with adapter.vae_lock:
        tail = adapter.decode_tail(x0, req)
    return early_signature(regions, tail), regions
