"""carnator_lab.train's grounding pieces: the processor that keeps cross-attention maps computes
exactly what diffusers' own Wan processor does, and the grounding loss has hand-computed values."""

from __future__ import annotations


import pytest
import torch

from carnator.embedded import EmbeddedConfig
from carnator.embedded.model import build_transformer


@pytest.fixture(scope="module")
def script():
    import carnator_lab.train as train

    return train


def test_grounded_cross_attention_equals_wan_processor(script):
    torch.manual_seed(0)
    cfg = EmbeddedConfig()
    attn = build_transformer(cfg).blocks[2].attn2.eval()
    x = torch.randn(2, 37, cfg.num_heads * cfg.head_dim)
    text = torch.randn(2, 11, cfg.num_heads * cfg.head_dim)
    with torch.no_grad():
        ref = attn(x, encoder_hidden_states=text)
        maps: list[torch.Tensor] = []
        attn.set_processor(script.GroundedCrossAttention(maps))
        out = attn(x, encoder_hidden_states=text)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(maps) == 1 and maps[0].shape == (2, 37, 11)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 37))      # head-mean of softmax rows


def test_grounding_loss_hand_computed(script):
    # one clip, 4 visual tokens, 3 words: word 0 describes object 0 (tokens 0, 1), word 1 the place
    # (role 2: tokens 2, 3), word 2 is a filler (role -1) and must not count.
    cover = torch.tensor([[[1.0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 1.0, 1.0]]])
    roles = torch.tensor([[0, 2, -1]])
    a = torch.tensor([[[0.5, 0.0, 0.9], [0.25, 0.0, 0.05], [0.25, 0.5, 0.05], [0.0, 0.5, 0.0]]])  # (B, N, L)
    # word 0: share on tokens {0, 1} = 0.75 / 1.0 -> (0.25)^2; word 1: share on {2, 3} = 1 -> 0
    got = script.grounding_loss([a], cover, roles)
    assert got.item() == pytest.approx(0.25 ** 2 / 2)
    # two layers average; an object absent from the clip (zero coverage) is not counted
    roles2 = torch.tensor([[0, 1, -1]])
    assert script.grounding_loss([a, a], cover, roles2).item() == pytest.approx(0.25 ** 2)
