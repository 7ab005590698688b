"""Pieces the families' attention processors share (evidence recording at the probe layer).

Every family's processor forms per-head Q and K of shape (B, H, N, d) and hands the cond row's to
:func:`record_cross` (visual queries over the text keys) or :func:`record_self` (visual queries over
the visual keys); both fill the controller's :class:`EvidenceRecord` exactly as the Wan processor does.
"""

from __future__ import annotations

import torch

from ..attention.controller import AttentionController, EvidenceRecord
from .wan_attention import _lse_chunked

__all__ = ["evidence_record", "record_cross", "record_self"]


def evidence_record(ctrl: AttentionController, scale: float) -> EvidenceRecord:
    """The request's record, created at the first recording call of the probe forward."""
    if ctrl.evidence is None:
        ctrl.evidence = EvidenceRecord(positions=list(ctrl.record_positions), scale=scale)
    return ctrl.evidence


def record_cross(ctrl: AttentionController, q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None) -> None:
    """Cross-attention probabilities (H, N, positions) of the cond row's queries to the recorded text positions.

    q: (B, H, N, d) visual queries; k: (B, H, L, d) text keys; bias: additive logit bias broadcastable to
    (B, H, 1, L) (the text padding mask), applied before the softmax over the L text keys. Chunked over queries.
    """
    b = ctrl.branches.index(0)
    rec = evidence_record(ctrl, scale)
    pos = torch.as_tensor(rec.positions, dtype=torch.long, device=q.device)
    kb = k[b].float()
    bb = None if bias is None else bias[b if bias.shape[0] > 1 else 0].float()
    cols = []
    for a in range(0, q.shape[2], ctrl.lse_chunk):
        logits = torch.einsum("hnd,hmd->hnm", q[b, :, a:a + ctrl.lse_chunk].float(), kb) * scale
        if bb is not None:
            logits = logits + bb
        cols.append(torch.softmax(logits, dim=-1)[..., pos])
    rec.cross = torch.cat(cols, dim=1)


def record_self(ctrl: AttentionController, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
    """The cond row's self-attention Q, K (H, N, d) and row log-sum-exps (H, N) over the visual keys."""
    b = ctrl.branches.index(0)
    rec = evidence_record(ctrl, scale)
    rec.q, rec.k = q[b].detach().clone(), k[b].detach().clone()
    rec.lse = _lse_chunked(rec.q, rec.k, scale, ctrl.lse_chunk)
