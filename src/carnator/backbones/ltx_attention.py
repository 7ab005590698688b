"""Carnator's attention processors for LTX-Video transformers (LTXVideoTransformer3DModel).

LTX's blocks are laid out like Wan's: self-attention ``attn1`` over the visual tokens (RoPE on the
full inner dimension, before the head split), cross-attention ``attn2`` to the T5 tokens (with the
padding mask as an additive bias), a feed-forward, and per-sample (or per-token) AdaLN modulation.
Installed by :func:`apply_carnator_attention`, the processors compute exactly what diffusers'
``LTXVideoAttnProcessor`` computes, and additionally, as the running step's :class:`~carnator.attention.state.AttentionPlan` asks
(the same duties as :mod:`.wan_attention`):

- record probe evidence at one layer and step: cross-attention of the visual tokens to the chosen
  text positions (softmax over the text keys, padding masked) and self-attention Q, K and row
  log-sum-exps;
- capture the top-p block mask of every self-attention call, and apply a cached one
  (:func:`~carnator.attention.kernels.masked_attention`);
- in a window of middle layers, run each block only for the Active tokens, whose self-attention
  reads the Context tokens (the other tokens' hidden states pass unchanged);
- add the TGAA logit bias to the cond branch's cross-attention (chorus).

LTX's own processor rejects anything but a tensor mask, so block masks go through this processor.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..attention.state import current
from ..attention.kernels import masked_attention
from .attention_common import install, record_cross, record_self


def _rope(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # diffusers.models.transformers.transformer_ltx.apply_rotary_emb (x: B, S, C; cos/sin: B, S, C).
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


class CarnatorLTXProcessor:
    """Processor for one LTX attention module (``attn1`` self or ``attn2`` cross) of layer ``layer``."""

    def __init__(self, layer: int, cross: bool):
        self.layer = layer
        self.cross = cross

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, kv_states=None, kv_rotary=None):
        ctrl = current()
        ctrl.fit_rows(hidden_states.shape[0])
        batch = hidden_states.shape[0]
        if self.cross:
            src = encoder_hidden_states
        else:
            src = hidden_states if kv_states is None else kv_states
        if attention_mask is not None:  # as LTXVideoAttnProcessor: (B, 1, L) bias -> (B, H, 1, L)
            attention_mask = attn.prepare_attention_mask(attention_mask, src.shape[1], batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(src))
        v = attn.to_v(src)
        if image_rotary_emb is not None:
            q = _rope(q, image_rotary_emb)
            k = _rope(k, image_rotary_emb if kv_rotary is None else kv_rotary)
        q, k, v = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (q, k, v))  # B, H, N, D
        scale = q.shape[-1] ** -0.5

        if ctrl.recording(self.layer, self_attention=not self.cross) and kv_states is None:
            if self.cross:
                record_cross(ctrl, q, k, scale, attention_mask)
            else:
                record_self(ctrl, q, k, scale)

        if self.cross:
            bias = ctrl.cross_bias(k.shape[2], q.device, q.dtype)
            if bias is not None:
                attention_mask = bias if attention_mask is None else attention_mask + bias
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            if ctrl.capturing(self.layer) and kv_states is None:
                ctrl.capture(self.layer, q, k)
            bm = ctrl.cached_mask(self.layer, q.device) if kv_states is None else None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask) if bm is None else masked_attention(q, k, v, bm, block=ctrl.masks.block)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def _window_block_forward(block, layer: int, original):
    """LTXVideoTransformerBlock.forward that, inside the window, recomputes only the Active tokens."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, encoder_attention_mask=None):
        ctrl = current()
        if not ctrl.in_window(layer):
            return original(hidden_states, encoder_hidden_states, temb, image_rotary_emb, encoder_attention_mask)
        dev = hidden_states.device
        act, ctx = ctrl.window.active.to(dev), ctrl.window.context.to(dev)
        b = hidden_states.size(0)
        n_ada = self.scale_shift_table.shape[0]
        ada = self.scale_shift_table[None, None].to(temb.device) + temb.reshape(b, temb.size(1), n_ada, -1)
        mods = ada.unbind(dim=2)  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp: (B, 1 or N, C)
        per_token = ada.shape[1] > 1
        m_a = [m[:, act] if per_token else m for m in mods]
        m_c = [m[:, ctx] if per_token else m for m in mods]
        x, xc = hidden_states[:, act], hidden_states[:, ctx]
        n_a = self.norm1(x) * (1 + m_a[1]) + m_a[0]
        n_c = self.norm1(xc) * (1 + m_c[1]) + m_c[0]
        rot_a = rot_c = None
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            rot_a, rot_c = (cos[:, act], sin[:, act]), (cos[:, ctx], sin[:, ctx])
        att = self.attn1(n_a, None, None, rot_a, kv_states=n_c, kv_rotary=rot_c)
        x = x + att * m_a[2]
        x = x + self.attn2(x, encoder_hidden_states=encoder_hidden_states, image_rotary_emb=None, attention_mask=encoder_attention_mask)
        x = x + self.ff(self.norm2(x) * (1 + m_a[4]) + m_a[3]) * m_a[5]
        out = hidden_states.clone()
        out[:, act] = x
        return out

    return types.MethodType(forward, block)


def apply_carnator_attention(transformer) -> None:
    """Install carnator's processors (and window-aware block forwards) on an LTXVideoTransformer3DModel. Idempotent."""
    install(transformer, [
        (blk, {blk.attn1: CarnatorLTXProcessor(i, cross=False), blk.attn2: CarnatorLTXProcessor(i, cross=True)},
         _window_block_forward)
        for i, blk in enumerate(transformer.transformer_blocks)])