"""lab/scripts/edit_tiers.py: a selected step certified on pooled rows (known counts, the bound as certify_tiers
computes it) and the shipped file's tiers merged, not replaced."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
import sys
from pathlib import Path

from carnator.calibrate.certify import CalibrationConfig, clopper_pearson_upper, split_pairs

ROOT = Path(__file__).resolve().parents[2]
RULE = {"deltas": {"fidelity": 0.25, "artifact": 0.1, "size": 0.05}, "directions": {"fidelity": 1, "artifact": -1, "size": 1}}


def _script():
    spec = importlib.util.spec_from_file_location("edit_tiers", ROOT / "lab" / "scripts" / "edit_tiers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["edit_tiers"] = mod
    spec.loader.exec_module(mod)
    return mod


def _row(i: int, step: int, hit: bool, size: float, kind: str = "size") -> dict:
    good = {"fidelity": 1.0, "artifact": 0.0, "size": 1.0}
    return {"i": i, "change": kind, "kind": kind, "resume_step": step, "num_steps": 50, "scope": "frame", "hit": hit,
            "dense": good, "reuse": {**good, "size": size}, "acceptable": size >= 0.95}


def test_certify_pools_a_runs_certification_split_with_later_runs(tmp_path):
    et = _script()
    # run A: 20 size pairs at steps 5 and 12 (pairs 3 and 4 unsafe at 5), 6 colour pairs that must not count
    a = [_row(i, s, True, 0.5 if (s == 5 and i in (3, 4)) else 1.0) for i in range(20) for s in (5, 12)]
    a += [_row(100 + i, 5, True, 0.0, kind="colour") for i in range(6)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in a))
    # run B: 10 new pairs at step 5 only, one not reused (the source failed its gate), one unsafe
    b = [_row(i, 5, i != 0, 0.0 if i == 7 else 1.0) for i in range(10)]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in b))
    cert = set(split_pairs(20, CalibrationConfig())[1].tolist())   # as certify_tiers splits run A's 20 size pairs
    bad_a = len(cert & {3, 4})
    tier = et.certify("size", 5, [f"{tmp_path / 'a.jsonl.gz'}:cert", str(tmp_path / "b.jsonl")], RULE, tmp_path / "t.json")
    assert tier["certified_on"] == [{"rows": "a.jsonl.gz:cert", "pairs": len(cert), "reused": len(cert),
                                     "unsafe": bad_a},
                                    {"rows": "b.jsonl", "pairs": 10, "reused": 9, "unsafe": 1}]
    assert (tier["pairs"], tier["accepted"], tier["unsafe"]) == (len(cert) + 10, len(cert) + 9, bad_a + 1)
    assert tier["bound"] == clopper_pearson_upper(bad_a + 1, len(cert) + 9, 0.9) and tier["certified"] is False
    assert json.loads((tmp_path / "t.json").read_text())["thresholds"]["tiers"]["size"]["step"] == 5


def test_write_keeps_the_shipped_edit_tiers_and_adds_a_certified_one(tmp_path):
    et = _script()
    shipped = tmp_path / "thresholds.json"
    shutil.copy(ROOT / "src" / "carnator" / "embedded" / "thresholds.json", shipped)
    before = json.loads(shipped.read_text())["thresholds"]["tiers"]
    # 60 size pairs, none unsafe: certified (bound 3.8 % at 90 %)
    rows = [_row(i, 5, True, 1.0) for i in range(60)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    et.certify("size", 5, [str(tmp_path / "r.jsonl")], RULE, tmp_path / "t.json")
    tiers = et.write(tmp_path / "t.json", shipped)
    assert set(tiers) == set(before) | {"size"}
    assert all(tiers[k] == before[k] for k in before if k not in ("re-roll", "rewording"))   # place kept as it was
    assert tiers["size"] == {"kind": "size", "step": 5, "of": 50, "scope": "frame", "pairs": 60, "accepted": 60,
                             "unsafe": 0, "bound": clopper_pearson_upper(0, 60, 0.9), "certified": True}
    doc = json.loads(shipped.read_text())
    assert doc["meta"]["tiers"]["size"]["certified_on"][0]["reused"] == 60 and "place" in doc["meta"]["tiers"]
    # an uncertified tier is not written
    rows[0]["reuse"]["size"] = 0.0
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    et.certify("size", 5, [str(tmp_path / "r.jsonl")], RULE, tmp_path / "t2.json")
    shutil.copy(ROOT / "src" / "carnator" / "embedded" / "thresholds.json", shipped)
    assert "size" not in et.write(tmp_path / "t2.json", shipped) or before.get("size")


def test_certify_under_the_excess_risk_counts_only_failures_a_fresh_sample_does_not_share(tmp_path):
    et = _script()
    # 10 size pairs at step 5: pairs 1-3 lose the size; pairs 2 and 3's other dense sample loses it too
    rows = [_row(i, 5, True, 0.0 if i in (1, 2, 3) else 1.0) for i in range(10)]
    for r in rows:
        r["dense_other"] = {**r["dense"], "size": 0.0 if r["i"] in (2, 3, 7) else 1.0}
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair = et.certify("size", 5, [str(tmp_path / "r.jsonl")], RULE, tmp_path / "p.json")
    excess = et.certify("size", 5, [str(tmp_path / "r.jsonl")], RULE, tmp_path / "e.json", risk="excess")
    assert (pair["unsafe"], pair["risk"]) == (3, "pair") and (excess["unsafe"], excess["risk"]) == (1, "excess")
    assert excess["bound"] == clopper_pearson_upper(1, 10, 0.9)


def test_certify_records_what_selected_the_step_per_step_under_its_risk(tmp_path):
    et = _script()
    # selection rows: 8 size pairs at steps 5 and 12; pair 1 fails at 5 (its other sample passes), pairs 1-3 at 12
    # (pair 3's other sample fails too); pair 0 not reused at 12; 4 colour pairs that must not count
    sel = [_row(i, 5, True, 0.0 if i == 1 else 1.0) for i in range(8)]
    sel += [_row(i, 12, i != 0, 0.0 if i in (1, 2, 3) else 1.0) for i in range(8)]
    sel += [_row(100 + i, 5, True, 0.0, kind="colour") for i in range(4)]
    for r in sel:
        r["dense_other"] = {**r["dense"], "size": 0.0 if r["i"] == 3 else 1.0}
    (tmp_path / "sel.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sel))
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(_row(i, 5, True, 1.0)) + "\n" for i in range(30)))
    tier = et.certify("size", 5, [str(tmp_path / "new.jsonl")], RULE, tmp_path / "t.json", risk="excess",
                      selected_on=[str(tmp_path / "sel.jsonl")])
    assert tier["selection"] == {"risk": "excess", "on": [{"rows": "sel.jsonl", "pairs": 8}],
                                 "5": {"reused": 8, "unsafe": 1}, "12": {"reused": 7, "unsafe": 2}}
    assert (tier["accepted"], tier["unsafe"]) == (30, 0)   # the selection rows are not certification rows
    part = et.selection("size", [f"{tmp_path / 'sel.jsonl'}:sel"], RULE, "pair")
    chosen = set(split_pairs(8, CalibrationConfig())[0].tolist())
    assert part["on"] == [{"rows": "sel.jsonl:sel", "pairs": len(chosen)}]
    assert part["5"] == {"reused": len(chosen), "unsafe": len(chosen & {1})}
