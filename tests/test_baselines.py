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


def _engine(tmp_path):
    return Carnator(tiny_pipeline("wan"), tmp_path, embedder=bag_of_words_embedder())


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
    assert any(k.startswith("attn.") for k in eng.bank.load(a.stats.entry_id))
    b = eng.generate("a red ball on grass", seed=2, policy="chorus2", **st)
    assert b.stats.hit and 0 < b.stats.mask_density <= 1 and b.stats.dit_forwards == 2 * 4
    dense = eng.generate("a red ball on grass", seed=2, policy="dense", store=False, **st)
    # Same noise and prompt; only the attention connectivity differs.
    assert b.frames.shape == dense.frames.shape


def test_gate_threshold_is_shared_default():
    assert TextGate().min_similarity == 0.65
