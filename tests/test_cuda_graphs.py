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


def test_graphs_are_the_default_on_a_cuda_device_only(tmp_path):
    """``EngineConfig.cuda_graphs`` None (the default, also ``carnator serve --device cuda``'s): on for a CUDA device
    where the family has them and no intra-request cache runs; the CPU keeps the eager forward. Given: as given."""
    from carnator import Carnator, EngineConfig
    from carnator.engine import cuda_graphs_for
    from carnator.service.server import ServeConfig

    assert EngineConfig().cuda_graphs is None
    assert cuda_graphs_for(None, device="cuda", supported=True, intra_cache=False) is True
    assert cuda_graphs_for(None, device="cuda:1", supported=True, intra_cache=False) is True
    assert cuda_graphs_for(None, device=torch.device("cuda", 0), supported=True, intra_cache=False) is True
    assert cuda_graphs_for(None, device="cpu", supported=True, intra_cache=False) is False
    assert cuda_graphs_for(None, device="cuda", supported=False, intra_cache=False) is False  # Wan, ...: not refused
    assert cuda_graphs_for(None, device="cuda", supported=True, intra_cache=True) is False
    assert cuda_graphs_for(False, device="cuda", supported=True, intra_cache=False) is False
    assert cuda_graphs_for(True, device="cpu", supported=True, intra_cache=False) is True
    assert "cuda_graphs" not in ServeConfig(device="cuda").engine_config  # serve's engines take the default
    eng = Carnator.from_pretrained("embedded", cache_dir=tmp_path, device="cpu")
    assert eng.cuda_graphs is False and eng.adapter._cuda_graphs is False


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
