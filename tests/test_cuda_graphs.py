"""CUDA graphs for idle forwards of the embedded model: when a forward may be replayed, and (on a GPU) that the
replay gives the eager forward's result."""

from __future__ import annotations

import pytest
import torch

from carnator.attention.blockmask import BlockMaskSet
from carnator.attention.state import Amplification, AttentionPlan, RecordSpec, SparseConfig, WindowPlan
from carnator.denoise import Program
from carnator.errors import InvalidRequestError


def test_a_step_is_idle_only_where_no_processor_would_act():
    """The loop replays a forward as a CUDA graph only at steps whose attention plan is idle."""
    from carnator.plan import Phase, ReusePlan

    def idle(program, steps):
        return [s for s in range(steps) if not program.attention(s).idle]

    assert idle(Program(), 10) == []
    assert idle(Program.probe(4, RecordSpec(1, (0,)), None), 10) == [3]  # the probe's record
    assert idle(Program(capture=SparseConfig(block=8, stride=5)), 12) == [0, 5, 10]  # mask capture every 5th step
    assert idle(Program(capture=SparseConfig(block=8, stride=5, steps=(5,))), 12) == [5]
    amp = Program(phases=(Phase(2, 4, amplify=Amplification((1,), 2.0)),))
    assert idle(amp, 6) == [2, 3]
    assert idle(Program(phases=(Phase(2, 4, amplify=Amplification((1,), 1.0)),)), 6) == []  # scale 1 is no amplification
    masks = BlockMaskSet.empty(num_heads=1, q_len=16, kv_len=16, block=8)
    assert idle(Program(phases=(Phase(3, 6, masks=True),), masks=masks), 8) == [3, 4, 5]
    assert idle(Program(phases=(Phase(3, 6, masks=True),)), 8) == []  # no masks bound: nothing applied
    assert AttentionPlan(window=WindowPlan(range(1, 2), torch.tensor([0]), torch.tensor([0, 1]))).idle is False
    assert AttentionPlan().idle and ReusePlan().phases == ()


def test_only_the_embedded_adapter_offers_graphs():
    from carnator.backbones import adapter_for
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
            res = eng.generate("a red ball moving left on grass", seed=3, policy=pol, cache="off")
            runs[graphs, pol] = torch.from_numpy(res.video)
        assert bool(eng.adapter.__dict__.get("_graphs")) == graphs
    for pol in ("dense", "carnator"):
        assert torch.allclose(runs[True, pol], runs[False, pol], atol=1e-5), float((runs[True, pol] - runs[False, pol]).abs().max())
