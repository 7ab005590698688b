"""Carnator's attention processors for Wan transformers (WanTransformer3DModel; also the embedded model).

Installed by :func:`apply_carnator_attention`, they compute exactly what diffusers'
``WanAttnProcessor`` computes, and additionally, as the running step's :class:`~carnator.attention.state.AttentionPlan` asks:

- record probe evidence at one layer and step (cross-attention to chosen text positions, chunked
  over queries; self-attention Q, K and row log-sum-exps, so any column can be formed later);
- capture the top-p block mask of every self-attention call (sparse-connectivity recording);
- apply a cached block mask to self-attention (block-sparse: FlexAttention on CUDA, exact masked
  SDPA elsewhere);
- in a window of middle layers, run each block only for the Active tokens, whose self-attention
  reads the Context tokens (a gather/scatter: the other tokens' hidden states pass unchanged);
- amplify the cond branch's cross-attention to chosen text tokens (chorus's TGAA).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..attention.state import current
from ..attention.kernels import masked_attention
from .attention_common import install, record_cross, record_self


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # As diffusers' WanAttnProcessor (x: B, N, H, D; cos/sin: 1, N, 1, D).
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class CarnatorWanProcessor:
    """Processor for one Wan attention module (``attn1`` self or ``attn2`` cross) of layer ``layer``."""

    def __init__(self, layer: int, cross: bool):
        self.layer = layer
        self.cross = cross

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, kv_states=None, kv_rotary=None):
        if attn.add_k_proj is not None:
            raise NotImplementedError("image-conditioned Wan (I2V) is not supported by carnator's processors")
        ctrl = current()
        ctrl.fit_rows(hidden_states.shape[0])
        if self.cross:
            src = encoder_hidden_states
        else:
            src = hidden_states if kv_states is None else kv_states
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(src)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(src).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            q = _rope(q, *rotary_emb)
            k = _rope(k, *(rotary_emb if kv_rotary is None else kv_rotary))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # B, H, N, D
        scale = q.shape[-1] ** -0.5

        if ctrl.recording(self.layer, self_attention=not self.cross) and kv_states is None:
            if self.cross:
                record_cross(ctrl, q, k, scale)
            else:
                record_self(ctrl, q, k, scale)

        if self.cross:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctrl.cross_bias(k.shape[2], q.device, q.dtype))
        else:
            if ctrl.capturing(self.layer) and kv_states is None:
                ctrl.capture(self.layer, q, k)
            bm = ctrl.cached_mask(self.layer, q.device) if kv_states is None else None
            out = F.scaled_dot_product_attention(q, k, v) if bm is None else masked_attention(q, k, v, bm, block=ctrl.masks.block)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _window_block_forward(block, layer: int, original):
    """WanTransformerBlock.forward that, inside the window, recomputes only the Active tokens."""

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        ctrl = current()
        if not ctrl.in_window(layer):
            return original(hidden_states, encoder_hidden_states, temb, rotary_emb)
        act, ctx = ctrl.window.active.to(hidden_states.device), ctrl.window.context.to(hidden_states.device)
        x, xc = hidden_states[:, act], hidden_states[:, ctx]
        if temb.ndim == 4:  # per-token modulation (Wan2.2 TI2V)
            mod = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
            m_a = [m.squeeze(2)[:, act] for m in mod]
            m_c = [m.squeeze(2)[:, ctx] for m in mod]
        else:
            m_a = m_c = list((self.scale_shift_table + temb.float()).chunk(6, dim=1))
        shift, scale_, gate, c_shift, c_scale, c_gate = m_a
        n_a = (self.norm1(x.float()) * (1 + scale_) + shift).type_as(x)
        n_c = (self.norm1(xc.float()) * (1 + m_c[1]) + m_c[0]).type_as(xc)
        cos, sin = rotary_emb
        att = self.attn1(n_a, None, None, (cos[:, act], sin[:, act]), kv_states=n_c, kv_rotary=(cos[:, ctx], sin[:, ctx]))
        x = (x.float() + att * gate).type_as(x)
        x = x + self.attn2(self.norm2(x.float()).type_as(x), encoder_hidden_states, None, None)
        ff = self.ffn((self.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x))
        x = (x.float() + ff.float() * c_gate).type_as(x)
        out = hidden_states.clone()
        out[:, act] = x
        return out

    return types.MethodType(forward, block)


def apply_carnator_attention(transformer) -> None:
    """Install carnator's processors (and window-aware block forwards) on a WanTransformer3DModel. Idempotent."""
    install(transformer, [
        (blk, {blk.attn1: CarnatorWanProcessor(i, cross=False), blk.attn2: CarnatorWanProcessor(i, cross=True)},
         _window_block_forward)
        for i, blk in enumerate(transformer.blocks)])