"""Carnator's attention processors for CogVideoX transformers (CogVideoXTransformer3DModel).

CogVideoX has one *joint* attention per block (``attn1``): the text tokens (L, first) and the video
tokens (N, after them) attend to each other in one softmax; the video part gets RoPE. Installed by
:func:`apply_carnator_attention`, the processor computes exactly what diffusers'
``CogVideoXAttnProcessor2_0`` computes, and additionally, as the running step's :class:`~carnator.attention.state.AttentionPlan` asks:

- record probe evidence at one layer and step, from the joint attention's blocks: the
  video-text block as the cross-attention (softmax of the video queries over the L text keys, i.e.
  the block renormalised per row, the analogue of a cross-attention layer) and the video-video
  block as the self-attention (video Q, K and row log-sum-exps over the N video keys);
- capture the top-p block mask of the video-video block, and apply a cached one to it: video
  queries attend to the allowed video key blocks *and every text key*; text queries attend to
  everything (:func:`~carnator.attention.kernels.masked_attention` with ``extra_k``);
- in a window of middle layers, run each block only for the Active video tokens and every text
  token, attending to the Context video tokens and every text token (the other video tokens'
  hidden states pass unchanged; the text stream is recomputed, reading only the Context tokens);
- add the TGAA logit bias to the cond branch's video-to-text logits (chorus).
"""

from __future__ import annotations

import types

import torch

from ..attention.state import current
from .attention_common import install, joint_attention


class CarnatorCogVideoXProcessor:
    """Processor for the joint attention ``attn1`` of layer ``layer``."""

    def __init__(self, layer: int):
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None, kv_states=None, kv_rotary=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise NotImplementedError("carnator's CogVideoX processor takes no attention mask (the pipelines pass none)")
        ctrl = current()
        ctrl.fit_rows(hidden_states.shape[0])
        n_txt = encoder_hidden_states.size(1)
        heads = attn.heads

        def heads_of(x):  # (B, S, H*D) -> (B, H, S, D)
            return x.view(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)

        joint_q = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        joint_kv = joint_q if kv_states is None else torch.cat([encoder_hidden_states, kv_states], dim=1)
        q = heads_of(attn.to_q(joint_q))
        k = heads_of(attn.to_k(joint_kv))
        v = heads_of(attn.to_v(joint_kv))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q[:, :, n_txt:] = apply_rotary_emb(q[:, :, n_txt:], image_rotary_emb)
            if not attn.is_cross_attention:
                k[:, :, n_txt:] = apply_rotary_emb(k[:, :, n_txt:], image_rotary_emb if kv_rotary is None else kv_rotary)
        video = (q[:, :, n_txt:], k[:, :, n_txt:], v[:, :, n_txt:])
        text = (q[:, :, :n_txt], k[:, :, :n_txt], v[:, :, :n_txt])
        out_v, out_t = joint_attention(ctrl, self.layer, video, text, text_first=True, windowed=kv_states is not None)
        out = torch.cat([out_t, out_v], dim=2)
        b = out.shape[0]
        out = out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])
        out = attn.to_out[1](attn.to_out[0](out))
        enc_out, out = out.split([n_txt, out.size(1) - n_txt], dim=1)
        return out, enc_out


def _window_block_forward(block, layer: int, original):
    """CogVideoXBlock.forward that, inside the window, recomputes only the Active video tokens (and the text)."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_kwargs=None):
        ctrl = current()
        if not ctrl.in_window(layer):
            return original(hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs)
        dev = hidden_states.device
        act, ctx = ctrl.window.active.to(dev), ctrl.window.context.to(dev)
        n_txt = encoder_hidden_states.size(1)
        x, xc = hidden_states[:, act], hidden_states[:, ctx]
        n_x, n_e, gate_msa, enc_gate_msa = self.norm1(x, encoder_hidden_states, temb)
        n_xc, _, _, _ = self.norm1(xc, encoder_hidden_states, temb)
        rot_a = rot_c = None
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            rot_a, rot_c = (cos[act], sin[act]), (cos[ctx], sin[ctx])
        att_x, att_e = self.attn1(n_x, n_e, None, image_rotary_emb=rot_a, kv_states=n_xc, kv_rotary=rot_c)
        x = x + gate_msa * att_x
        enc = encoder_hidden_states + enc_gate_msa * att_e
        n_x, n_e, gate_ff, enc_gate_ff = self.norm2(x, enc, temb)
        ff = self.ff(torch.cat([n_e, n_x], dim=1))
        x = x + gate_ff * ff[:, n_txt:]
        enc = enc + enc_gate_ff * ff[:, :n_txt]
        out = hidden_states.clone()
        out[:, act] = x
        return out, enc

    return types.MethodType(forward, block)


def apply_carnator_attention(transformer) -> None:
    """Install carnator's processors (and window-aware block forwards) on a CogVideoXTransformer3DModel. Idempotent."""
    install(transformer, [
        (blk, {blk.attn1: CarnatorCogVideoXProcessor(i)}, _window_block_forward)
        for i, blk in enumerate(transformer.transformer_blocks)])