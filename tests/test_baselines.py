"""NIRVANA and Chorus II policies on the tiny offline Wan pipeline."""

from __future__ import annotations

import pytest

from carnator import Carnator
from carnator.policies.baselines import TextGate, nirvana_resume_step
from carnator.testing import TINY_SETTINGS, tiny_pipeline

from test_carnator_policy import bag_of_words_embedder


@pytest.mark.parametrize(
    "sim,steps,expected",
    [(0.99, 50, 25), (0.951, 50, 25), (0.95, 50, 20), (0.91, 50, 20), (0.86, 50, 15), (0.80, 50, 10), (0.70, 50, 5), (0.65, 50, None), (0.2, 50, None), (0.99, 8, 4), (0.70, 8, 1)],
)
def test_nirvana_table(sim, steps, expected):
    assert nirvana_resume_step(sim, steps) == expected


def _engine(tmp_path, apply="always"):
    """The tiny Wan pipeline on the CPU; masks captured and applied there too unless ``apply`` says otherwise
    (SparseConfig.apply's default "auto" applies them only where a block-sparse kernel runs: CUDA)."""
    from carnator import EngineConfig

    opts = {"sparse": {"apply": apply}}
    return Carnator(tiny_pipeline("wan"), tmp_path, embedder=bag_of_words_embedder(),
                    config=EngineConfig(policy_options={"chorus2": opts, "carnator": opts}))


def test_nirvana_resumes_from_the_text_nearest_entry(tmp_path):
    eng = _engine(tmp_path)
    st = dict(TINY_SETTINGS["wan"], num_inference_steps=8)
    a = eng.generate("a red ball on grass", seed=1, policy="nirvana", **st)
    assert not a.stats.hit
    b = eng.generate("a red ball on grass", seed=2, policy="nirvana", **st)  # re-roll: similarity 1.0
    assert b.stats.hit and b.stats.source_id == a.stats.entry_id and b.stats.resume_step == 4
    assert b.stats.dit_forwards == 2 * (8 - 4)
    c = eng.generate("an astronaut riding a horse", seed=3, policy="nirvana", **st)  # below the gate
    assert not c.stats.hit and c.stats.dit_forwards == 2 * 8


def test_chorus2_reuses_only_masks(tmp_path):
    eng = _engine(tmp_path)
    st = dict(TINY_SETTINGS["wan"], num_inference_steps=4)
    a = eng.generate("a red ball on grass", seed=1, policy="chorus2", **st)
    assert any(k.startswith("attn.") for k in eng.store.load(a.stats.entry_id))
    b = eng.generate("a red ball on grass", seed=2, policy="chorus2", **st)
    assert b.stats.hit and 0 < b.stats.mask_density <= 1 and b.stats.dit_forwards == 2 * 4
    dense = eng.generate("a red ball on grass", seed=2, policy="dense", store=False, **st)
    # Same noise and prompt; only the attention connectivity differs.
    assert b.frames.shape == dense.frames.shape


@pytest.mark.parametrize("policy", ["chorus2", "carnator"])
def test_masks_are_neither_captured_nor_applied_where_no_block_sparse_kernel_runs(tmp_path, policy):
    """SparseConfig.apply "auto" (the default) on the CPU: a mask would only add the cost of a masked dense
    attention, so nothing is recorded, and Chorus II (which reuses nothing else) serves a re-roll densely."""
    import numpy as np

    from carnator.attention.state import SparseConfig

    assert SparseConfig().applies("cpu") is False and SparseConfig(apply="always").applies("cpu") is True
    assert SparseConfig(block=128).applies("cuda") is True and SparseConfig(block=32).applies("cuda") is False
    assert SparseConfig(apply="never").applies("cuda") is False
    eng = _engine(tmp_path, apply="auto")
    st = dict(TINY_SETTINGS["wan"], num_inference_steps=8)
    a = eng.generate("a red ball on grass", seed=1, policy=policy, **st)
    assert not any(k.startswith("attn.") for k in eng.store.load(a.stats.entry_id))
    if policy == "chorus2":
        b = eng.generate("a red ball on grass", seed=2, policy=policy, **st)
        dense = eng.generate("a red ball on grass", seed=2, policy="dense", store=False, **st)
        assert not b.stats.hit and b.stats.mask_density is None
        np.testing.assert_array_equal(b.frames, dense.frames)


def test_gate_threshold_is_shared_default():
    assert TextGate().min_similarity == 0.65


@pytest.mark.parametrize("policy, opts, kept", [
    ("dense", {}, set(range(10))),
    ("nirvana", {}, {0, 1, 2, 3, 4}),                 # the table's 5, 10, ..., 25 of 50 -> 1, 2, 3, 4, 5 of 10, minus one
    ("carnator", {"resume_step": 6}, {5, 6, 7, 8, 9}),  # resume at 6 reads traj.5 .. traj.9
    ("chorus", {}, {2, 3, 4, 5, 6, 7}),               # stages (3, 8): traj.2 .. traj.7
    ("chorus2", {}, set()),                           # masks only
])
def test_an_entry_keeps_the_latents_its_policy_can_resume_from(tmp_path, policy, opts, kept):
    from carnator import EngineConfig

    eng = Carnator(tiny_pipeline("wan"), tmp_path, embedder=bag_of_words_embedder(), config=EngineConfig(policy_options={policy: opts}))
    r = eng.generate("a red ball on grass", seed=1, policy=policy, **dict(TINY_SETTINGS["wan"], num_inference_steps=10))
    keys = eng.store.load(r.stats.entry_id).keys()
    assert {int(k[5:]) for k in keys if k.startswith("traj.")} == kept and "video" in keys
    # "all" keeps every step whatever the policy
    eng2 = Carnator(tiny_pipeline("wan"), tmp_path / "all", embedder=bag_of_words_embedder(),
                    config=EngineConfig(capture_steps="all", policy_options={policy: opts}))
    r2 = eng2.generate("a red ball on grass", seed=1, policy=policy, **dict(TINY_SETTINGS["wan"], num_inference_steps=10))
    assert {k for k in eng2.store.load(r2.stats.entry_id) if k.startswith("traj.")} == {f"traj.{i}" for i in range(10)}


@pytest.mark.parametrize("policy", ["nirvana", "chorus", "chorus2", "carnator"])
def test_reuse_false_fills_the_cache_with_a_miss_that_stores_what_a_first_miss_stores(tmp_path, policy):
    """``generate(cache="off")`` (how bench fills its warm cache): a re-roll, which would reuse the first entry,
    runs as a miss instead - dense's frames - and stores the same tensors the first miss stored."""
    import numpy as np

    eng = _engine(tmp_path)
    st = dict(TINY_SETTINGS["wan"], num_inference_steps=8)
    first = eng.generate("a red ball on grass", seed=1, policy=policy, **st)
    again = eng.generate("a red ball on grass", seed=2, policy=policy, cache="off", **st)
    assert not first.stats.hit and not again.stats.hit
    assert again.stats.dit_forwards == 2 * 8 and again.stats.entry_id not in (None, first.stats.entry_id)
    assert sorted(eng.store.load(first.stats.entry_id)) == sorted(eng.store.load(again.stats.entry_id))
    dense = eng.generate("a red ball on grass", seed=2, policy="dense", store=False, **st)
    np.testing.assert_array_equal(again.frames, dense.frames)
    # with reuse (the default) the same re-roll is served from the cache (carnator: its random-weight signatures
    # fail the thresholds, but the entries are recalled; cache="off" recalled none)
    third = eng.generate("a red ball on grass", seed=3, policy=policy, **st)
    assert third.stats.notes["candidates"] == 2 and again.stats.notes["candidates"] == 0 if policy == "carnator" else third.stats.hit
    # and an exact repeat is not served from the exact tier either
    exact = eng.generate("a red ball on grass", seed=2, policy=policy, cache="off", **st)
    assert not exact.stats.exact_hit and exact.stats.dit_forwards == 2 * 8
