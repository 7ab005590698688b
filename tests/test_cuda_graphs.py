"""CUDA graphs for idle forwards of the embedded model: when a forward may be replayed, and (on a GPU) that the
replay gives the eager forward's result."""

from __future__ import annotations

import pytest
import torch

from carnator.attention.blockmask import BlockMaskSet
from carnator.attention.controller import Amplification, AttentionController, SparseConfig, WindowPlan
from carnator.errors import InvalidRequestError


def test_idle_at_is_false_wherever_a_processor_would_act():
    c = AttentionController()
    assert all(c.idle_at(s) for s in range(10))
    c.record_step = 3
    assert not c.idle_at(3) and c.idle_at(2) and c.idle_at(4)
    c.record_step = None
    c.sparse = SparseConfig(block=8, stride=5)
    assert [s for s in range(12) if not c.idle_at(s)] == [0, 5, 10]  # mask capture every 5th step
    c.sparse = SparseConfig(block=8, stride=5, steps=(5,))
    assert [s for s in range(12) if not c.idle_at(s)] == [5]
    c.sparse = None
    c.amplify = Amplification([1], 2.0, range(2, 4))
    assert [s for s in range(6) if not c.idle_at(s)] == [2, 3]
    c.amplify = Amplification([1], 1.0, None)  # scale 1 is no amplification
    assert c.idle_at(2)
    c.amplify = None
    c.masks = BlockMaskSet.empty(num_heads=1, q_len=16, kv_len=16, block=8)
    assert not c.idle_at(7)
    c.masks = None
    c.window = WindowPlan(range(1, 2), torch.tensor([0]), torch.tensor([0, 1]))
    assert not c.idle_at(7)
    c.reset()
    assert c.idle_at(7)


def test_only_the_embedded_adapter_offers_graphs():
    from carnator.backbones.base import adapter_for
    from carnator.testing import tiny_wan

    ad = adapter_for(tiny_wan())
    with pytest.raises(InvalidRequestError, match="CUDA graphs"):
        ad.use_cuda_graphs(True)
    ad.use_cuda_graphs(False)  # off is always fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_generation_equals_eager_on_cuda(tmp_path):
    """Dense and a carnator miss (probe recording, mask capture every 5th step: eager there, graphed elsewhere)."""
    from carnator import Carnator, EngineConfig

    runs = {}
    for graphs in (False, True):
        eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path / str(graphs), device="cuda",
                                       config=EngineConfig(cuda_graphs=graphs, store_video=False))
        for pol in ("dense", "carnator"):
            res = eng.generate("a red ball moving left on grass", seed=3, policy=pol, reuse=False)
            runs[graphs, pol] = torch.from_numpy(res.video)
        assert bool(eng.adapter.__dict__.get("_graphs")) == graphs
    for pol in ("dense", "carnator"):
        assert torch.allclose(runs[True, pol], runs[False, pol], atol=1e-5), float((runs[True, pol] - runs[False, pol]).abs().max())
