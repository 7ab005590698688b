"""Why a request hit or missed (:mod:`carnator.explain`), on the embedded model with its shipped thresholds: a
re-roll hits its first generation, a colour edit misses; the numbers named are the policy's own. Both shipped files:
the default (the two prompts ask the same, the source passed the admission gate) and, for an engine without the gate,
``thresholds-nogate.json`` (a certified risk score over the Early Signature, plus the content check)."""

from __future__ import annotations

import pytest

from carnator import Carnator
from carnator.engine import EngineConfig
from carnator.explain import describe
from carnator.testing import hashed_embedder

PROMPT = "a small red ball moving left on grass"
STEPS = 32  # the carnator policy probes 4 steps and resumes at step 30


def _stream(cache, **carnator):
    cfg = EngineConfig(policy_options={"carnator": carnator}) if carnator else None
    eng = Carnator.from_pretrained("embedded", cache, device="cpu", embedder=hashed_embedder(64), config=cfg)
    # each described right after it ran, as the CLI and the demo do (a later entry would be recalled too)
    first = eng.generate(PROMPT, seed=1, num_inference_steps=STEPS)
    first.why = describe(eng, first)
    reroll = eng.generate(PROMPT, seed=5, num_inference_steps=STEPS)
    reroll.why = describe(eng, reroll)
    edit = eng.generate(PROMPT.replace("red", "blue"), seed=3, num_inference_steps=STEPS)
    edit.why = describe(eng, edit)
    return eng, first, reroll, edit


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """Without the admission gate (``admitted_only`` off): the no-gate file and its risk score."""
    return _stream(tmp_path_factory.mktemp("explain") / "cache", admitted_only=False)


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """The default engine (the embedded model's shapes judge is the gate): the shipped file."""
    return _stream(tmp_path_factory.mktemp("explain-gated") / "cache")


def test_the_engine_loads_the_file_its_gate_allows(stream, gated):
    pol, gpol = stream[0].policy("carnator"), gated[0].policy("carnator")
    assert "thresholds-nogate.json (certified)" in pol.thresholds_source and pol.tau.risk is not None
    assert "thresholds.json (certified)" in gpol.thresholds_source and gpol.tau.risk is None and gpol.tau.content == 0
    assert gated[0].store.get(gated[1].stats.entry_id).extra["admitted"] is True


def test_a_hit_under_the_content_rule_names_the_check_that_decided(gated):
    eng, first, reroll, _ = gated
    why = reroll.why
    assert why.decision == "hit" and why.source_id == first.stats.entry_id and why.risk is None
    assert why.checks[0].name == "content" and (why.checks[0].value, why.checks[0].threshold) == (0, 0)
    # found by its content key: no sentence similarity measured, no probe ran: content is the only check
    assert [c.name for c in why.checks] == ["content"]
    assert why.reason == (f"compatible with entry {first.stats.entry_id[:8]} ({PROMPT!r}, seed 1): content 0.00 <= 0.00; "
                          f"resumed at step 29 of {STEPS}")


def test_a_colour_edit_under_the_content_rule_misses_on_content(gated):
    eng, first, reroll, edit = gated
    why = edit.why
    assert why.decision == "miss" and why.tested_id in (first.stats.entry_id, reroll.stats.entry_id)
    assert why.checks[0].name == "content" and why.checks[0].value == 2 and not why.checks[0].passed
    # the shipped rule recalls by content only: nothing cached asks the same; the explanation names the nearest
    # cached request by sentence and what it asks differently
    assert why.headline.startswith("nothing cached asks the same; the nearest cached request, entry ")
    assert why.headline.endswith("differs in color red -> blue") and why.reason.endswith("(content 2.00 > 0.00)")
    assert edit.stats.notes["recall"] == "content" and edit.stats.notes["candidates"] == 0


def test_steps_are_dit_forwards_over_cfg_branches(stream):
    eng, first, reroll, _ = stream
    assert first.stats.dense_forwards == 2 * STEPS  # guidance 4 > 1: two branches a step
    a, b = first.why, reroll.why
    assert (a.decision, a.steps_computed, a.dit_forwards) == ("miss", STEPS, 2 * STEPS)
    # the hit: its 4 probe steps and steps 30 and 31
    assert (b.decision, b.steps_computed, b.steps_saved, b.dit_forwards) == ("hit", 6, STEPS - 6, 12)


def test_a_hit_names_its_source_and_the_policys_numbers(stream):
    eng, first, reroll, _ = stream
    why = reroll.why
    assert why.source_id == first.stats.entry_id and (why.source_prompt, why.source_seed) == (PROMPT, 1)
    d = reroll.stats.notes["discrepancies"]
    assert {c.name: c.value for c in why.checks} == {k: v for k, v in d.items() if v is not None}
    risk, threshold = why.risk
    assert risk <= threshold == eng.policy("carnator").tau.risk.threshold
    assert why.reason.startswith(f"compatible with entry {first.stats.entry_id[:8]} ({PROMPT!r}, seed 1): risk {risk:.3f} <= ")
    assert why.headline == f"compatible with entry {first.stats.entry_id[:8]} ({PROMPT!r}, seed 1); resumed at step 30 of {STEPS}"
    # the tested candidates the policy records (a miss's reason reads them) are the winner with the same numbers
    tested = reroll.stats.notes["tested"]
    assert [t["id"] for t in tested] == [first.stats.entry_id] and tested[0]["risk"] == pytest.approx(risk)
    assert {k: v for k, v in tested[0]["discrepancies"].items() if v is not None} == {c.name: c.value for c in why.checks}


def test_a_miss_names_the_candidate_refused_and_why(stream):
    eng, first, reroll, edit = stream
    why = edit.why
    k = edit.stats.notes["candidates"]
    # the re-roll's own entry is a reuse (it began at step 30): never a source, so the first generation is the one
    assert why.decision == "miss" and k == 1 and why.tested_id == first.stats.entry_id
    risk, threshold = why.risk
    assert risk > threshold  # the policy refused it: the recomputed risk agrees
    # the same nouns (ball, grass), none substituted: size, shape and colour do not apply (Discrepancies); the
    # content check (what the prompts ask: one ball's colour differs, so one item on each side) refuses it too
    checks = {c.name: c for c in why.checks}
    assert why.checks[0].name == "content"   # the failing check first
    assert set(checks) == {"content", "context", "text"}
    assert checks["content"].value == 2 and checks["content"].threshold == 0 and not checks["content"].passed
    assert why.reason.startswith(f"1 cached candidate with matching nouns; the first, entry {why.tested_id[:8]} (")
    assert f"failed the compatibility test: risk {risk:.3f} > {threshold:.3f} (" in why.reason
    assert why.reason.startswith(why.headline + ": risk ") and why.headline.endswith("failed the compatibility test")


def test_a_rewording_in_synonyms_names_only_the_content_check(gated):
    """'circle' for 'ball': no noun is shared, so the paper's d_context is 0 by definition; no probe ran, so the line
    does not show it as if it had been measured."""
    eng, first, _, _ = gated
    res = eng.generate("on a grassy field, a tiny red circle slides to the left", seed=12, num_inference_steps=STEPS)
    why = describe(eng, res)
    assert why.decision == "hit" and res.stats.notes["probe"] == "skipped"
    assert [c.name for c in why.checks] == ["content"] and "context" not in why.reason
