"""Pieces the families' attention processors share.

Every family's processor (Wan's too) forms per-head Q and K of shape (B, H, N, d) and hands the cond
row's to :func:`record_cross` (visual queries over the text keys) or :func:`record_self` (visual
queries over the visual keys); both fill the step's :class:`EvidenceRecord` (:mod:`carnator.attention.state`).
:func:`joint_attention` is the whole attention of the joint text-video families (CogVideoX, HunyuanVideo).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.state import EvidenceRecord, StepAttention
from ..attention.kernels import masked_attention

__all__ = ["evidence_record", "joint_attention", "record_cross", "record_self"]


def _lse_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
    """Row log-sum-exp of softmax(q k^T * scale) for (H, N, d) inputs, chunked over queries."""
    out = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for a in range(0, q.shape[1], chunk):
        out[:, a:a + chunk] = torch.logsumexp(torch.einsum("hnd,hmd->hnm", q[:, a:a + chunk].float(), k.float()) * scale, dim=-1)
    return out


def evidence_record(ctrl: StepAttention, scale: float) -> EvidenceRecord:
    """The request's record, created at the first recording call of the probe forward."""
    rec = ctrl.evidence
    if rec is None:
        rec = ctrl.evidence = EvidenceRecord(positions=list(ctrl.record_positions), scale=scale)
    return rec


def record_cross(ctrl: StepAttention, q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None) -> None:
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


def record_self(ctrl: StepAttention, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
    """The cond row's self-attention Q, K (H, N, d) and row log-sum-exps (H, N) over the visual keys."""
    b = ctrl.branches.index(0)
    rec = evidence_record(ctrl, scale)
    rec.q, rec.k = q[b].detach().clone(), k[b].detach().clone()
    rec.lse = _lse_chunked(rec.q, rec.k, scale, ctrl.lse_chunk)


def _key_bias(valid: torch.Tensor) -> torch.Tensor:
    """Additive logit bias (0 / -inf) from a bool key mask."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill(~valid, float("-inf"))


def joint_attention(
    ctrl: StepAttention,
    layer: int,
    video: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    text_first: bool,
    text_valid: torch.Tensor | None = None,
    windowed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One joint text-video attention (CogVideoX, HunyuanVideo), as the step's attention plan asks; returns (out_video, out_text).

    video = (q_v, k_v, v_v), text = (q_t, k_t, v_t), each (B, H, S, d) after norms and RoPE; the model's
    sequence is text then video (``text_first``) or video then text. ``text_valid``: bool (B, 1, 1, L) of the
    text keys every query may attend (None: all; video keys are always valid). ``windowed``: the video
    queries are the Active tokens and the video keys the Context tokens (no recording, capture or mask).

    The probe record reads the joint attention's blocks: the video-text block as the cross-attention
    (the video queries' softmax over the valid text keys) and the video-video block as the self-attention.
    Block masks cover the video-video block: video queries attend to the allowed video key blocks and
    every valid text key; text queries attend to every valid key, as in the model. TGAA adds its bias to
    the video queries' text logits.
    """
    (qv, kv, vv), (qt, kt, vt) = video, text
    scale = qv.shape[-1] ** -0.5
    n_txt, n_kv = kt.shape[2], kv.shape[2]

    def joint(v_part: torch.Tensor, t_part: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return torch.cat([t_part, v_part] if text_first else [v_part, t_part], dim=dim)

    if not windowed:
        if ctrl.recording(layer):
            record_cross(ctrl, qv, kt, scale, None if text_valid is None else _key_bias(text_valid))
        if ctrl.recording(layer, self_attention=True):
            record_self(ctrl, qv, kv, scale)
        if ctrl.capturing(layer):
            ctrl.capture(layer, qv, kv)
    bm = None if windowed else ctrl.cached_mask(layer, qv.device)
    bias = ctrl.cross_bias(n_txt, qv.device, qv.dtype)
    k, v = joint(kv, kt), joint(vv, vt)
    key_mask = None
    if text_valid is not None:
        key_mask = joint(text_valid.new_ones(*text_valid.shape[:-1], n_kv), text_valid, -1)
    if bm is None and bias is None:
        out = F.scaled_dot_product_attention(joint(qv, qt), k, v, attn_mask=key_mask)
        return (out[:, :, n_txt:], out[:, :, :n_txt]) if text_first else (out[:, :, : qv.shape[2]], out[:, :, qv.shape[2]:])
    out_t = F.scaled_dot_product_attention(qt, k, v, attn_mask=key_mask)  # text queries: every valid key, as the model
    if bias is None:  # video queries: the allowed video key blocks and every valid text key
        assert bm is not None and ctrl.masks is not None  # (no mask and no bias returned above)
        blk = ctrl.masks.block
        if text_valid is None:
            out_v = masked_attention(qv, kv, vv, bm, block=blk, extra_k=kt, extra_v=vt)
        else:  # the valid text keys differ per row
            rows = []
            for b in range(qv.shape[0]):
                ok = text_valid[b].reshape(-1)
                rows.append(masked_attention(qv[b:b + 1], kv[b:b + 1], vv[b:b + 1], bm.table[b:b + 1], block=blk,
                                             extra_k=kt[b:b + 1, :, ok], extra_v=vt[b:b + 1, :, ok]))
            out_v = torch.cat(rows)
        return out_v, out_t
    # TGAA on the video-to-text logits (with a block mask too: as an element mask, at dense cost)
    logit = joint(bias.new_zeros(*bias.shape[:-1], n_kv), bias, -1)
    if key_mask is not None:
        logit = logit.masked_fill(~key_mask, float("-inf"))
    if bm is not None:
        assert ctrl.masks is not None  # a block table comes from the step's masks
        blk = ctrl.masks.block
        qi = torch.arange(qv.shape[2], device=qv.device) // blk
        ki = torch.arange(n_kv, device=qv.device) // blk
        elem = bm.table[:, :, qi][..., ki]
        allowed = joint(elem, elem.new_ones(*elem.shape[:-1], n_txt), -1)
        logit = logit.masked_fill(~allowed, float("-inf"))
    out_v = F.scaled_dot_product_attention(qv, k, v, attn_mask=logit)
    return out_v, out_t


def install(transformer, blocks) -> None:
    """Install carnator's processors and window-aware block forwards on ``transformer``. Idempotent.

    ``blocks``: ``(block, {attention module: processor}, window_forward)`` per layer, in layer order;
    ``window_forward(block, layer, original_forward)`` returns the block's new forward. Processors and forwards hold
    no request state: they read the running step's :func:`~carnator.attention.state.current` attention state and
    compute the unmodified attention outside any step.
    """
    if getattr(transformer, "_carnator_attention", False):
        return
    for i, (blk, processors, window_forward) in enumerate(blocks):
        for attn, proc in processors.items():
            attn.set_processor(proc)
        original = getattr(blk, "_carnator_original_forward", None) or blk.forward
        blk._carnator_original_forward = original
        blk.forward = window_forward(blk, i, original)
    transformer._carnator_attention = True
