"""Carnator's attention processors for HunyuanVideo transformers (HunyuanVideoTransformer3DModel).

HunyuanVideo's attention is *joint*: the video tokens (N, first) and the text tokens (L, *after*
them) attend in one softmax, with a key mask that drops the text padding. Its layers are the
dual-stream ``transformer_blocks`` (separate projections for the text, ``add_*_proj``) followed by
the single-stream ``single_transformer_blocks`` (one projection of the concatenated sequence); carnator
numbers them in that order (layer = dual index, then number of dual blocks + single index).

Installed by :func:`apply_carnator_attention`, the processors compute exactly what diffusers'
``HunyuanVideoAttnProcessor2_0`` computes, and the attention plan's duties run through
:func:`~.attention_common.joint_attention`: the probe record reads the video-text block (softmax of
the video queries over the valid text keys) and the video-video block; block masks cover the
video-video block (text keys and text queries always attended); TGAA biases the video queries' text
logits. The Active-token window runs both block kinds for the Active video tokens and every text
token, attending to the Context video tokens and every text token.
"""

from __future__ import annotations

import types

import torch

from ..attention.state import current
from .attention_common import install, joint_attention


class CarnatorHunyuanProcessor:
    """Processor for the joint attention ``attn`` of (dual- or single-stream) layer ``layer``."""

    def __init__(self, layer: int):
        self.layer = layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, kv_states=None, kv_rotary=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:
            raise NotImplementedError("carnator's HunyuanVideo processor needs the text tokens (joint attention)")
        ctrl = current()
        ctrl.fit_rows(hidden_states.shape[0])
        n_txt = encoder_hidden_states.shape[1]
        src = hidden_states if kv_states is None else kv_states

        def proj(linear, x):  # (B, S, C) -> (B, S, H, D)
            return linear(x).unflatten(2, (attn.heads, -1))

        if attn.add_q_proj is not None:  # dual-stream: the text has its own projections and norms
            qv, kv, vv = proj(attn.to_q, hidden_states), proj(attn.to_k, src), proj(attn.to_v, src)
            qt, kt, vt = proj(attn.add_q_proj, encoder_hidden_states), proj(attn.add_k_proj, encoder_hidden_states), proj(attn.add_v_proj, encoder_hidden_states)
            if attn.norm_q is not None:
                qv = attn.norm_q(qv)
            if attn.norm_k is not None:
                kv = attn.norm_k(kv)
            if attn.norm_added_q is not None:
                qt = attn.norm_added_q(qt)
            if attn.norm_added_k is not None:
                kt = attn.norm_added_k(kt)
        else:  # single-stream: one projection of [video, text]
            jq = torch.cat([hidden_states, encoder_hidden_states], dim=1)
            jk = jq if kv_states is None else torch.cat([src, encoder_hidden_states], dim=1)
            q, k, v = proj(attn.to_q, jq), proj(attn.to_k, jk), proj(attn.to_v, jk)
            if attn.norm_q is not None:
                q = attn.norm_q(q)
            if attn.norm_k is not None:
                k = attn.norm_k(k)
            qv, qt, kv, kt = q[:, :-n_txt], q[:, -n_txt:], k[:, :-n_txt], k[:, -n_txt:]
            vv, vt = v[:, :-n_txt], v[:, -n_txt:]
        if image_rotary_emb is not None:
            qv = apply_rotary_emb(qv, image_rotary_emb, sequence_dim=1)
            kv = apply_rotary_emb(kv, image_rotary_emb if kv_rotary is None else kv_rotary, sequence_dim=1)
        # The model's mask (B, 1, 1, N + L) keeps every video key: only its text part varies.
        text_valid = None
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise NotImplementedError("carnator's HunyuanVideo processor takes a boolean key mask (as the model builds it)")
            text_valid = attention_mask[..., -n_txt:]
        heads_first = [t.transpose(1, 2) for t in (qv, kv, vv, qt, kt, vt)]  # (B, H, S, D)
        out_v, out_t = joint_attention(ctrl, self.layer, tuple(heads_first[:3]), tuple(heads_first[3:]), text_first=False,
                                       text_valid=text_valid, windowed=kv_states is not None)
        out_v = out_v.transpose(1, 2).flatten(2, 3).to(qv.dtype)
        out_t = out_t.transpose(1, 2).flatten(2, 3).to(qv.dtype)
        if getattr(attn, "to_out", None) is not None:
            out_v = attn.to_out[1](attn.to_out[0](out_v))
        if getattr(attn, "to_add_out", None) is not None:
            out_t = attn.to_add_out(out_t)
        return out_v, out_t


def _rot(image_rotary_emb, idx):
    return None if image_rotary_emb is None else tuple(r[idx] for r in image_rotary_emb)


def _window_dual_forward(block, layer: int, original):
    """HunyuanVideoTransformerBlock.forward that, inside the window, recomputes only the Active video tokens (and the text)."""

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kwargs):
        ctrl = current()
        if not ctrl.in_window(layer):
            return original(hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis, *args, **kwargs)
        dev = hidden_states.device
        act, ctx = ctrl.window.active.to(dev), ctrl.window.context.to(dev)
        x, xc = hidden_states[:, act], hidden_states[:, ctx]
        n_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=temb)
        n_xc = self.norm1(xc, emb=temb)[0]
        n_e, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(encoder_hidden_states, emb=temb)
        att_x, att_e = self.attn(n_x, n_e, attention_mask, image_rotary_emb=_rot(freqs_cis, act), kv_states=n_xc, kv_rotary=_rot(freqs_cis, ctx))
        x = x + att_x * gate_msa.unsqueeze(1)
        enc = encoder_hidden_states + att_e * c_gate_msa.unsqueeze(1)
        n_x = self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        n_e = self.norm2_context(enc) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        x = x + gate_mlp.unsqueeze(1) * self.ff(n_x)
        enc = enc + c_gate_mlp.unsqueeze(1) * self.ff_context(n_e)
        out = hidden_states.clone()
        out[:, act] = x
        return out, enc

    return types.MethodType(forward, block)


def _window_single_forward(block, layer: int, original):
    """HunyuanVideoSingleTransformerBlock.forward that, inside the window, recomputes only the Active video tokens (and the text)."""

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, image_rotary_emb=None, *args, **kwargs):
        ctrl = current()
        if not ctrl.in_window(layer):
            return original(hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb, *args, **kwargs)
        dev = hidden_states.device
        act, ctx = ctrl.window.active.to(dev), ctrl.window.context.to(dev)
        n_txt = encoder_hidden_states.shape[1]
        joint = torch.cat([hidden_states[:, act], encoder_hidden_states], dim=1)
        n_j, gate = self.norm(joint, emb=temb)
        mlp = self.act_mlp(self.proj_mlp(n_j))
        n_xc = self.norm(hidden_states[:, ctx], emb=temb)[0]
        att_x, att_e = self.attn(n_j[:, :-n_txt], n_j[:, -n_txt:], attention_mask, image_rotary_emb=_rot(image_rotary_emb, act),
                                 kv_states=n_xc, kv_rotary=_rot(image_rotary_emb, ctx))
        h = torch.cat([torch.cat([att_x, att_e], dim=1), mlp], dim=2)
        h = gate.unsqueeze(1) * self.proj_out(h) + joint
        out = hidden_states.clone()
        out[:, act] = h[:, :-n_txt]
        return out, h[:, -n_txt:]

    return types.MethodType(forward, block)


def apply_carnator_attention(transformer) -> None:
    """Install carnator's processors (and window-aware block forwards) on a HunyuanVideoTransformer3DModel. Idempotent.

    Layers are numbered over the dual-stream blocks first, then the single-stream ones."""
    kinds = [(b, _window_dual_forward) for b in transformer.transformer_blocks]
    kinds += [(b, _window_single_forward) for b in transformer.single_transformer_blocks]
    install(transformer, [(blk, {blk.attn: CarnatorHunyuanProcessor(i)}, fwd) for i, (blk, fwd) in enumerate(kinds)])