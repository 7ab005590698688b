"""Shadow audits (carnator.service.audit): a live per-(kind, tier) bound on the service's approximate hits.

Known answers: a deliberately loose thresholds file (the shipped one plus a colour tier that resumes at step 45 of 50,
when the embedded model has long settled the cached colour) has its colour hits found unsafe by the audits, and the
tier is disabled after exactly the number of all-unsafe verdicts the Clopper-Pearson arithmetic predicts; a user job
submitted while an audit runs starts within one denoising step of it; with the shipped file nothing is disabled. The
service runs in this process (its worker pool, engines and a PostgreSQL job table, as ``carnator serve --store
postgresql://`` keeps it), without HTTP; ``/metrics``, ``/audit`` and the page read the same report.
"""

from __future__ import annotations

import json
import time

import pytest

from carnator.request import Params

from carnator import Carnator, EngineConfig
from carnator.embedded.judge import DEFAULT_DELTAS, ShapesJudge
from carnator.policies.carnator import SHIPPED_THRESHOLDS
from carnator.calibrate.certify import clopper_pearson_lower, clopper_pearson_upper
from carnator.service.audit import CHANNEL, live_bounds, tier_state, verdicts_to_disable
from carnator.testing import hashed_embedder

pytest.importorskip("fastapi")
pytest.importorskip("psycopg")

STEPS = 8          # every job's denoising steps (a tier at 45 of 50 resumes at step 7 of 8)
DELTA, CONF = 0.05, 0.99


def test_the_arithmetic_of_a_disabled_tier():
    # n unsafe of n: the lower bound is the (1 - confidence) quantile of Beta(n, 1) = (1 - confidence) ** (1 / n)
    for n in (1, 2, 5):
        assert clopper_pearson_lower(n, n, CONF) == pytest.approx(0.01 ** (1 / n))
    # at 99 %: 0.01 (1 of 1) <= 0.05 < 0.1 (2 of 2): the second all-unsafe verdict disables; at 90 % the first (0.1)
    assert verdicts_to_disable(DELTA, CONF) == 2 and verdicts_to_disable(0.05, 0.9) == 1
    # the upper bound is no trigger: 0 unsafe of 10 bound above delta for lack of evidence alone
    assert clopper_pearson_upper(0, 10, 0.9) > 0.05 and not tier_state(10, 0, 0.05, 0.9)["disabled"]
    # one unsafe among many safe: not disabled (lower bound of 1 of 45 at 90 % is 0.23 %); stays disabled once it was
    assert not tier_state(45, 1, 0.05, 0.9)["disabled"]
    rows = [{"kind": "colour", "step": 45, "of": 50, "acceptable": a} for a in (False, False, True, True, True)]
    (t,) = live_bounds(rows, DELTA, CONF)
    assert t["disabled_after"] == 2 and t["disabled"] and t["n"] == 5 and t["unsafe"] == 2


def _loose_file(tmp_path, model_id_engine, colour_excess: bool = False) -> str:
    """The shipped thresholds plus frame tiers for re-rolls, rewordings and colour edits at step 45 of 50, judged by
    the shapes judge's own rule (fidelity 0.1, artifact 0.02), confidence 99 %. ``colour_excess``: the colour tier
    judged by the colour alone (within 0.05) and certified in excess of a fresh sample (``calibrate --risk excess``)."""
    doc = json.loads(SHIPPED_THRESHOLDS.read_text())
    tier = {"step": 45, "of": 50, "scope": "frame", "pairs": 120, "accepted": 120, "unsafe": 0, "bound": 0.019,
            "certified": True}
    doc["thresholds"]["tiers"] = {k: dict(tier) for k in ("re-roll", "rewording", "colour")}
    doc["meta"].update(rule={"deltas": dict(DEFAULT_DELTAS), "directions": dict(ShapesJudge.directions)},
                       judge=ShapesJudge().identity, delta=DELTA, confidence=CONF)
    doc["meta"]["tiers"] = {"colour": {"rule": {"deltas": {"color": 0.05}, "directions": {"color": 1}}, "risk": "excess"}} if colour_excess else {}
    path = tmp_path / "loose.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory):
    return Carnator.from_pretrained("embedded", cache_dir=tmp_path_factory.mktemp("c0"), device="cpu",
                                    embedder=hashed_embedder(64))


class Recorder:
    """Every event the service publishes (job events and the audit channel), with its time."""

    def __init__(self, hub):
        self.events: list[tuple[float, str, str, dict]] = []
        inner = hub.publish

        def publish(job_id, kind, data):
            self.events.append((time.monotonic(), job_id, kind, dict(data)))
            inner(job_id, kind, data)

        hub.publish = publish

    def first(self, job_id, kind, after=0.0):
        return next((e for e in self.events if e[1] == job_id and e[2] == kind and e[0] >= after), None)


def _service(tmp_path, base, url, thresholds: str | None):
    from carnator.service.pgjobs import PostgresJobStore
    from carnator.service.server import ServeConfig, Service

    opts = {"policy_options": {"carnator": {"thresholds": thresholds}}} if thresholds else {}
    eng = Carnator(base.pipe, tmp_path / "cache", config=EngineConfig(**opts), embedder=hashed_embedder(64),
                   adapter=base.adapter)
    store = PostgresJobStore(url, tmp_path / "videos")
    svc = Service(ServeConfig(cache_dir=str(tmp_path), audit=1.0, audit_budget=1.0), engines=[eng], store=store)
    return svc, Recorder(svc.hub)


def _submit(svc, prompt, seed):
    params = svc.validate(Params(prompt, seed, num_inference_steps=STEPS, cache="reuse"))
    job, _ = svc.store.submit("default", params.to_dict(tenant=False))
    svc.pool.notify()
    return job.id


def _wait(cond, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _done(svc, job_id):
    return _wait(lambda: (j := svc.store.get("default", job_id)) is not None and j.status in ("completed", "failed") and j,
                 what=f"job {job_id}")


def test_loose_colour_tier_is_audited_unsafe_and_disabled_after_the_predicted_verdicts(tmp_path, base_engine, pg_schema_url):
    svc, rec = _service(tmp_path, base_engine, pg_schema_url, _loose_file(tmp_path, base_engine))
    svc.start()
    try:
        assert svc.auditor.enabled and svc.auditor.cert.confidence == CONF
        src = _done(svc, _submit(svc, "a big red ball on grass", 1))
        assert src.stats["tier"] == "miss" and src.stats["stored"]
        a = _done(svc, _submit(svc, "a big blue ball on grass", 2))
        assert a.stats["tier"] == "reuse" and "colour" in a.stats["reason"], a.stats
        # the audit of A starts on the idle worker; a user job submitted during its first steps starts within one step
        _wait(lambda: rec.first(CHANNEL, "progress"), what="the audit's first step")
        t_sub = time.monotonic()
        b_id = _submit(svc, "a big green ball on grass", 3)
        started = _wait(lambda: rec.first(b_id, "in_progress"), what="job B to start")[0]
        audit_steps = [e for e in rec.events if e[1] == CHANNEL and e[2] == "progress" and t_sub <= e[0] <= started]
        assert len(audit_steps) <= 1, audit_steps   # the step in flight when B came, then the audit yielded
        assert rec.first(CHANNEL, "preempted", after=t_sub) is not None
        steps = [e[0] for e in rec.events if e[1] == CHANNEL and e[2] == "progress" and e[0] < t_sub]
        assert len(steps) >= 1
        b = _done(svc, b_id)
        assert b.stats["tier"] == "reuse" and "colour" in b.stats["reason"]
        # both audits then run (A again from its start): both unsafe (the clips keep the cached red)
        _wait(lambda: len(svc.store.audit_verdicts()) == 2, what="two verdicts")
        rows = svc.store.audit_verdicts()
        n = verdicts_to_disable(DELTA, CONF)
        assert n == 2
        assert [r["acceptable"] for r in rows] == [False, False]
        assert {r["job_id"] for r in rows} == {a.id, b.id}
        assert all(r["kind"] == "colour" and (r["step"], r["of"]) == (45, 50) for r in rows)
        assert all(r["scores"]["reuse"]["fidelity"] < r["scores"]["dense"]["fidelity"] - 0.1 for r in rows)
        assert not any("dense_other" in r["scores"] for r in rows)   # a per-pair tier: the dense run alone
        # disabled after exactly n verdicts: not after n - 1
        assert [r["disabled"] for r in rows] == [False, True]
        assert [r["n"] for r in rows] == [1, 2] and rows[1]["lower"] == pytest.approx(clopper_pearson_lower(2, 2, CONF))
        assert rows[0]["bound"] == 1.0 and rows[0]["lower"] == pytest.approx(0.01)
        pol = svc.engine.policy("carnator")
        _wait(lambda: ("colour", 45) in pol.disabled_tiers, what="the policy to disable the tier")
        # the unsafe hits' entries no longer serve (an exact repeat runs afresh)
        for r in rows:
            assert svc.engine.store.get(r["entry_id"]) is None
        # a colour edit now misses and says why; re-rolls still hit
        c = _done(svc, _submit(svc, "a big blue ball on grass", 4))
        assert c.stats["tier"] == "miss" and "colour tier (step 45 of 50) is disabled" in c.stats["reason"], c.stats
        r = _done(svc, _submit(svc, "a big red ball on grass", 5))
        assert r.stats["tier"] == "reuse" and "re-roll" in r.stats["reason"]
        text = svc.metrics.render().decode()
        assert 'carnator_audit_tier_disabled{kind="colour",tier="45/50"} 1.0' in text
        assert 'carnator_audit_verdicts{kind="colour",tier="45/50",verdict="unsafe"} 2.0' in text
        assert 'carnator_audit_bound{kind="colour",tier="45/50"} 1.0' in text
        rep = svc.auditor.report()
        (t,) = [t for t in rep["tiers"] if t["kind"] == "colour"]
        assert t["disabled_after"] == 2 and "default" not in json.dumps(rep)   # no tenant data
    finally:
        svc.stop()
    # a new server on the same job table and file: still disabled (the verdicts are durable)
    svc2, _ = _service(tmp_path / "again", base_engine, pg_schema_url, _loose_file(tmp_path, base_engine))
    try:
        assert ("colour", 45) in svc2.engine.policy("carnator").disabled_tiers
    finally:
        svc2.store.close()
    # `carnator audit` reads the same store offline
    from carnator.cli import main
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["audit", "--store", pg_schema_url, "--thresholds", _loose_file(tmp_path, base_engine)]) == 0
    text = out.getvalue()
    assert "colour" in text and "DISABLED after verdict 2" in text and "confidence 0.99" in text, text


def test_a_tier_certified_in_excess_of_a_fresh_sample_is_audited_against_one(tmp_path, base_engine, pg_schema_url):
    svc, _ = _service(tmp_path, base_engine, pg_schema_url, _loose_file(tmp_path, base_engine, colour_excess=True))
    svc.start()
    try:
        cert = svc.auditor.cert
        assert (cert.risk_for("colour"), cert.risk_for("re-roll")) == ("excess", "pair")
        _done(svc, _submit(svc, "a big red ball on grass", 1))
        a = _done(svc, _submit(svc, "a big blue ball on grass", 2))
        assert a.stats["tier"] == "reuse" and "colour" in a.stats["reason"], a.stats
        _wait(lambda: len(svc.store.audit_verdicts()) == 1, what="the verdict")
        (v,) = svc.store.audit_verdicts()
        # resumed at step 45 of 50 the hit keeps the cached red: it fails the colour rule against its dense run. The
        # tier counts a failure only where a fresh sample passes: another dense sample (another seed) was generated
        # and shows the asked blue, so the failure is the reuse's own and the verdict is unsafe
        sc = v["scores"]
        assert sc["reuse"]["color"] < sc["dense"]["color"] - 0.05 and sc["dense_other"]["color"] >= sc["dense"]["color"] - 0.05
        assert v["acceptable"] is False and (v["kind"], v["step"]) == ("colour", 45)
    finally:
        svc.stop()


def test_shipped_thresholds_audited_hits_disable_nothing(tmp_path, base_engine, pg_schema_url):
    svc, _ = _service(tmp_path, base_engine, pg_schema_url, None)
    svc.start()
    try:
        assert svc.auditor.enabled and svc.auditor.judge.name == "shapes"
        src = _done(svc, _submit(svc, "a big red ball on grass", 1))
        assert src.stats["tier"] == "miss"
        hit = _done(svc, _submit(svc, "a big red ball on grass", 2))
        assert hit.stats["tier"] == "reuse", hit.stats["reason"]
        _wait(lambda: len(svc.store.audit_verdicts()) == 1, what="the verdict")
        (v,) = svc.store.audit_verdicts()
        assert v["kind"] == "re-roll" and (v["step"], v["of"]) == (45, 50) and v["acceptable"] and not v["disabled"]
        assert not svc.engine.policy("carnator").disabled_tiers
        text = svc.metrics.render().decode()
        assert 'carnator_audit_tier_disabled{kind="re-roll",tier="45/50"} 0.0' in text
    finally:
        svc.stop()


def test_a_job_runs_by_the_disabled_set_it_carries_and_leaves_the_engines_policy_alone(tmp_path, base_engine):
    """What a replica does with the set its job carries (``carnator serve --replicas``): the job is decided by a copy
    of the engine's policy with exactly that set off (a colour edit misses naming its disabled tier), while the
    engine's own policy, which other jobs run by, keeps its own set (here none: the colour edit hits)."""
    import threading

    from carnator.policies.carnator import CarnatorPolicy

    eng = Carnator(base_engine.pipe, tmp_path / "cache",
                   config=EngineConfig(policy_options={"carnator": {"thresholds": _loose_file(tmp_path, base_engine)}}),
                   embedder=hashed_embedder(64), adapter=base_engine.adapter)
    pol = eng.policy("carnator")
    assert isinstance(pol, CarnatorPolicy) and not pol.disabled_tiers
    src = eng.run(Params("a big red ball on grass", 1, num_inference_steps=STEPS, cache="reuse"))
    assert not src.stats.hit
    off = pol.with_disabled([("colour", 45)])
    assert off.disabled_tiers == {("colour", 45)} and not pol.disabled_tiers and off.tiers is pol.tiers
    edit = Params("a big blue ball on grass", 2, num_inference_steps=STEPS, cache="reuse", store=False)
    got: dict[str, object] = {}
    # the same request at once on two threads, one by the job's set, one by the engine's own policy
    threads = [threading.Thread(target=lambda: got.__setitem__("off", eng.run(edit, policy=off))),
               threading.Thread(target=lambda: got.__setitem__("own", eng.run(edit)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    missed, hit = got["off"].stats, got["own"].stats   # type: ignore[attr-defined]
    assert not missed.hit and "colour tier (step 45 of 50) is disabled" in missed.reason, missed.reason
    assert missed.notes["disabled_tier"] == {"kind": "colour", "step": 45, "of": 50}
    assert hit.hit and "colour" in hit.reason and hit.notes["audit"] == {"kind": "colour", "step": 45, "of": 50}
    assert not pol.disabled_tiers
    with pytest.raises(Exception, match="policy instance"):
        eng.run(Params("a big red ball on grass", 3, policy="dense", num_inference_steps=STEPS), policy=off)
