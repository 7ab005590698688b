"""The ``carnator`` command line on a saved tiny Wan pipeline.

User mistakes end with status 2 and exactly one stderr line ``carnator: error: ...`` (never a
traceback); ``generate`` writes real, decodable videos; ``cache ls|stats|verify|clear`` report and
manage what ``generate`` stored. In-process calls use a small fake recall embedder in place of
MiniLM (patched where the engine looks it up); the slow tests run the real thing in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import carnator.recall.embedder
from carnator.cli import main
from carnator.recall.embedder import TextEmbedder
from carnator.testing import hashed_embedder, tiny_pipeline
from carnator.video import read_video

PROMPT = "a red ball rolls past a blue cube"
TINY = ["--frames", "5", "--height", "16", "--width", "16", "--steps", "2", "--guidance", "5", "--device", "cpu", "--policy", "dense"]


#: the real default (MiniLM), before the autouse fixture below swaps in the fake one
REAL_DEFAULT_EMBEDDER = carnator.recall.embedder.default_embedder


def fake_embedder(dim: int = 32) -> TextEmbedder:
    return hashed_embedder(dim)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _offline_and_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(carnator.recall.embedder, "default_embedder", lambda: fake_embedder())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-wan")
    tiny_pipeline("wan").save_pretrained(d)
    return d


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, *words):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("carnator: error: ")
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


# ---- user mistakes -----------------------------------------------------------------------------


def test_unknown_model_path(capsys, tmp_path, cache):
    code, out, err = run(capsys, "generate", PROMPT, "--model", tmp_path / "no-such-model", "--cache-dir", cache, "--device", "cpu")
    assert_user_error(code, err, "model not found")
    assert out == ""


def test_unsupported_pipeline_dir(capsys, tmp_path, cache):
    d = tmp_path / "sd"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    code, _, err = run(capsys, "generate", PROMPT, "--model", d, "--cache-dir", cache, "--device", "cpu")
    assert_user_error(code, err, "unsupported pipeline class StableDiffusionPipeline", "WanPipeline")


def test_dir_without_model_index(capsys, tmp_path, cache):
    code, _, err = run(capsys, "generate", PROMPT, "--model", tmp_path, "--cache-dir", cache, "--device", "cpu")
    assert_user_error(code, err, "model_index.json")


@pytest.mark.parametrize(
    "args, words",
    [
        (["", *TINY], ["prompt is empty"]),
        ([PROMPT, *TINY, "--steps", "0"], ["num_inference_steps", "positive"]),
        ([PROMPT, *TINY, "--frames", "6"], ["num_frames"]),
        ([PROMPT, *TINY, "--height", "20"], ["multiples of 16"]),
        ([PROMPT, *TINY, "--guidance", "nan"], ["guidance_scale"]),
        ([PROMPT, *TINY, "--tenant", "no spaces allowed"], ["tenant"]),
        ([PROMPT, *TINY, "--policy", "nope"], ["--policy", "invalid choice: 'nope'", "dense"]),
        ([PROMPT, *TINY, "--device", "potato"], ["device"]),
        ([PROMPT, *TINY, "--seed", str(2**63)], ["seed must lie in [-2**63, 2**63 - 1]", str(2**63)]),
        ([PROMPT, *TINY, "--seed", str(-(2**63) - 1)], ["seed must lie in"]),
        ([PROMPT, *TINY, "--seed", "1.5"], ["--seed", "invalid int value"]),
        ([PROMPT, *TINY, "--steps", str(10**9)], ["num_inference_steps must be at most 1000", str(10**9)]),
        ([PROMPT, *TINY, "--guidance", "1e30"], ["guidance_scale must be a finite number in [0, 100]"]),
        ([PROMPT, *TINY, "--fps", "0"], ["--fps", "[1, 240]", "got 0"]),
        ([PROMPT, *TINY, "--fps", "-3"], ["--fps", "got -3"]),
        ([PROMPT, *TINY, "--fps", "many"], ["--fps", "'many'"]),
        ([PROMPT, *TINY, "--fps", "60", "--out", "OUT.gif"], ["fps must be an integer from 1 to 50 for .gif output, got 60"]),
        ([PROMPT, *TINY, "--option", "carnator.modifiers=abc"], ["--option carnator.modifiers: input should be a valid integer, got \"abc\""]),
        ([PROMPT, *TINY, "--option", "carnator.region=3"], ["--option carnator.region: input should be an object, got 3"]),
        ([PROMPT, *TINY, "--option", 'carnator.region={"hgih": 0.4}'], ["RegionConfig has no field 'hgih'", "its fields:"]),
        ([PROMPT, *TINY, "--option", "carnator.tested=null"], []),  # a valid option: the run fails on --steps 0 below instead
    ],
    ids=["empty-prompt", "steps-0", "frames", "size", "guidance-nan", "tenant", "policy", "device", "seed-2**63", "seed-below",
         "seed-float", "steps-1e9", "guidance-1e30", "fps-0", "fps-negative", "fps-word", "fps-gif", "option-type",
         "option-dataclass", "option-nested-field", "option-valid"],
)
def test_bad_request(capsys, model_dir, tmp_path, cache, args, words):
    out_file = tmp_path / "v.mp4"
    if "OUT.gif" in args:
        args, out_file = [a for a in args if a not in ("--out", "OUT.gif")], tmp_path / "v.gif"
    if not words:  # the arguments are fine: prove it by failing on something checked after them (the request)
        args, words = [*args, "--steps", "0"], ["num_inference_steps must be a positive integer, got 0"]
    code, out, err = run(capsys, "generate", *args, "--model", model_dir, "--cache-dir", cache, "--out", out_file)
    assert_user_error(code, err, *words)
    assert out == "" and not out_file.exists()


@pytest.mark.parametrize("args, words", [(["--pairs", "2"], ["--pairs", "at least 4"]), (["--jobs", "0"], ["--jobs"]),
                                         ([], ["--prompts FILE", "--pairs-file FILE"]),
                                         (["--model", "x", "--prompts", "p.txt"], ["--judge is required"]),
                                         (["--prompts", "p.txt", "--judge", "nope"], ["unknown judge 'nope'"]),
                                         (["--prompts", "p.txt", "--quality", "fidelity"], ["--quality", "SCORE=DELTA"]),
                                         (["--prompts", "p.txt", "--quality", "clip_t=0.02"], ["has no score clip_t"]),
                                         (["--prompts", "p.txt", "--option", "carnator.nope=1"], ["--option", "its fields"]),
                                         (["--select-only"], ["no pairs to select from", "without --select-only"])],
                         ids=["pairs", "jobs", "no-input", "model", "judge", "quality-form", "quality-score", "option", "select-only-empty"])
def test_bad_calibrate_args(capsys, tmp_path, args, words):
    code, out, err = run(capsys, "calibrate", *args, "--out", tmp_path / "cal", "--cache-dir", tmp_path / "cache")
    assert_user_error(code, err, *words)
    assert not (tmp_path / "cal").exists()


@pytest.mark.parametrize("name", ["video.avi", "video", "video.mp4.txt"])
def test_bad_out_extension(capsys, model_dir, tmp_path, cache, name):
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--out", tmp_path / name)
    assert_user_error(code, err, "--out", ".mp4")
    assert not cache.exists()  # refused before anything was loaded or created


def test_unwritable_out_path(capsys, model_dir, tmp_path, cache):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--no-store", "--model", model_dir, "--cache-dir", cache, "--out", blocker / "v.mp4")
    assert_user_error(code, err, "cannot write")


def test_unwritable_cache_dir(capsys, model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a directory cannot be made under a regular file, even by root
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", blocker / "cache", "--out", tmp_path / "v.mp4")
    assert_user_error(code, err, "cache directory", "not usable")
    for action in ("ls", "stats", "verify", "clear"):
        code, _, err = run(capsys, "cache", action, "--cache-dir", blocker / "cache")
        assert_user_error(code, err, "not usable")


def test_incompatible_cache_version(capsys, model_dir, tmp_path, cache):
    cache.mkdir()
    (cache / "VERSION").write_text("carnator-cache 999\n")
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--out", tmp_path / "v.mp4")
    assert_user_error(code, err, "format version 999")
    code, _, err = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert_user_error(code, err, "format version 999")
    assert (cache / "VERSION").read_text() == "carnator-cache 999\n"  # left alone


def test_foreign_version_marker(capsys, tmp_path, cache):
    cache.mkdir()
    (cache / "VERSION").write_text("something else entirely\n")
    code, _, err = run(capsys, "cache", "stats", "--cache-dir", cache)
    assert_user_error(code, err, "not a carnator cache marker")


@pytest.mark.slow
def test_user_error_in_a_real_process(model_dir, tmp_path):
    """The installed entry point, in its own process: status 2, one line, no traceback, no loading noise."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CARNATOR_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(
        [sys.executable, "-m", "carnator.cli", "generate", "", *TINY, "--model", str(model_dir), "--out", str(tmp_path / "v.mp4")],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.strip().splitlines() == ["carnator: error: the prompt is empty"]
    assert (tmp_path / "cache" / "VERSION").exists()  # the env var chose the cache


# ---- generate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", [".mp4", ".gif"])
def test_generate_writes_decodable_video(capsys, model_dir, tmp_path, cache, ext):
    out_file = tmp_path / "sub" / f"clip{ext}"
    code, out, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--out", out_file, "--fps", "4")
    assert code == 0, err
    frames = read_video(out_file)
    assert frames.shape == (5, 16, 16, 3) and frames.dtype == np.uint8
    assert frames.std() > 1  # not a blank clip
    # one human line: the decision, why, time, steps (2 steps, guidance 5: 4 DiT forwards, 2 per step)
    assert out.count("\n") == 1 and out.startswith("miss: the dense policy reuses nothing; ")
    assert out.rstrip().endswith(f" s, 2 of 2 steps computed; wrote {out_file}")
    assert "Traceback" not in err and "denoising" not in err  # no bar when stderr is not a terminal
    assert not list(out_file.parent.glob(".*.part"))  # no temp file left behind


def test_generate_json_and_exact_hit(capsys, model_dir, tmp_path, cache):
    args = ["generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--out", tmp_path / "a.gif", "--json", "--seed", "3",
            "--cache", "exact"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    first = json.loads(out)  # one JSON document, nothing else on stdout
    assert first["frames"] == [5, 16, 16, 3] and first["hit"] is False and first["exact_hit"] is False
    assert first["policy"] == "dense" and first["dit_forwards"] == 4 and first["entry_id"]
    assert {"encode", "dit", "decode", "total"} <= set(first["seconds"])

    code, out, err = run(capsys, *args)
    assert code == 0, err
    again = json.loads(out)
    assert again["exact_hit"] is True and again["source_id"] == first["entry_id"] and again["dit_forwards"] == 0
    assert read_video(tmp_path / "a.gif").shape[0] == 5


def test_generate_no_store(capsys, model_dir, tmp_path, cache):
    code, out, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--out", tmp_path / "a.mp4", "--no-store", "--json")
    assert code == 0, err
    assert json.loads(out)["entry_id"] is None
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert out.startswith("0 entries")


def test_progress_bar_on_a_terminal(capsys, model_dir, tmp_path, cache, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    base = ["generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--no-store"]
    code, _, err = run(capsys, *base, "--out", tmp_path / "a.gif")
    assert code == 0
    assert "denoising" in err and "/2 [" in err  # tqdm redraws at most every 0.1 s, so which count shows varies
    code, _, err = run(capsys, *base, "--out", tmp_path / "b.gif", "-q")
    assert code == 0 and "denoising" not in err


# ---- cache -------------------------------------------------------------------------------------


def _populate(capsys, model_dir, tmp_path, cache, tenant="default", seed=0):
    code, out, err = run(
        capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache,
        "--out", tmp_path / f"{tenant}-{seed}.gif", "--tenant", tenant, "--seed", seed, "--json",
    )
    assert code == 0, err
    return json.loads(out)["entry_id"]


def test_cache_ls_stats_verify_clear(capsys, model_dir, tmp_path, cache):
    a = _populate(capsys, model_dir, tmp_path, cache, "alice", 1)
    b = _populate(capsys, model_dir, tmp_path, cache, "bob", 2)

    code, out, err = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert code == 0, err
    assert a in out and b in out and PROMPT in out and "2 entries" in out and "seed=1" in out
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache, "--tenant", "bob")
    assert b in out and a not in out and "1 entries" in out

    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache)
    assert code == 0
    assert "entries: 2" in out and "tenant alice: 1 entries" in out and "tenant bob: 1 entries" in out
    assert "BankStats(" not in out  # readable, not a dataclass repr
    total = sum(f.stat().st_size for f in (cache / "blobs").glob("*.safetensors"))
    assert f"bytes: {total}" in out and "capacity: unbounded" in out and "eviction: lru" in out
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache, "--tenant", "bob")
    assert "entries: 1" in out and "tenant bob: 1 entries" in out and "alice" not in out  # no other tenant's name

    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 0 and "checked: 2" in out and "quarantined: 0" in out and out.strip().endswith("ok")

    path = cache / "blobs" / f"{a}.tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache, "--tenant", "bob")
    assert code == 0 and "checked: 1" in out and "(tenant bob)" in out  # alice's entry is not bob's to check
    code, out, err = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code == 1  # a problem was found
    assert "checked: 1" in out and "quarantined: 1" in out and f"corrupt: entry {a}" in out
    assert out.strip().endswith("1 problem(s) found; repaired")
    assert "Traceback" not in err

    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", cache, "--tenant", "alice", "--yes")
    assert "cleared 0 entries of tenant alice" in out  # alice's entry was quarantined already
    code, out, err = run(capsys, "cache", "clear", "--cache-dir", cache)  # no terminal to ask at: refused
    assert_user_error(code, err, "would delete 1 entries in", "--yes")
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert b in out and "1 entries" in out
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", cache, "-y")
    assert "cleared 1 entries" in out
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert out.startswith("0 entries")
    assert not list((cache / "blobs").glob("*.safetensors"))


def test_generate_capacity_is_the_caches_own(capsys, model_dir, tmp_path, cache):
    """A CLI generate grew a 40 MB-capped folder to 52.5 MB while `cache stats` said "unbounded": the cap was the
    opener's. ``--capacity`` now stores it in the cache: later runs without it keep the bound, and stats tells it."""
    _populate(capsys, model_dir, tmp_path, cache, "default", 1)
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache)
    size = int(out.split("bytes: ")[1].split()[0])
    cap = size + size // 2  # room for one entry, not two
    code, out, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--seed", 2,
                         "--out", tmp_path / "b.gif", "--capacity", cap, "--json")
    assert code == 0, err
    second = json.loads(out)["entry_id"]
    _populate(capsys, model_dir, tmp_path, cache, "default", 3)  # no --capacity: the stored bound holds
    code, out, _ = run(capsys, "cache", "stats", "--cache-dir", cache)
    assert "entries: 1" in out and f"capacity: {cap} B" in out and "eviction: lru" in out
    assert int(out.split("bytes: ")[1].split()[0]) <= cap
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert second not in out and "seed=3" in out
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--capacity", "none")
    assert_user_error(code, err, "--capacity none", "cache config")
    code, _, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--capacity", "lots")
    assert_user_error(code, err, "--capacity", "expected a size")


def test_cache_dir_from_environment(capsys, model_dir, tmp_path, monkeypatch):
    env_cache = tmp_path / "env-cache"
    monkeypatch.setenv("CARNATOR_CACHE_DIR", str(env_cache))
    code, out, err = run(capsys, "generate", PROMPT, *TINY, "--model", model_dir, "--out", tmp_path / "a.gif", "--json")
    assert code == 0, err
    entry = json.loads(out)["entry_id"]
    code, out, _ = run(capsys, "cache", "ls")
    assert entry in out and str(env_cache) in out


@pytest.mark.slow
def test_real_processes_with_default_embedder(model_dir, tmp_path):
    """`carnator generate` then `carnator cache ls` as separate processes, with the real MiniLM embedder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cache = tmp_path / "cache"
    out_file = tmp_path / "clip.mp4"
    gen = subprocess.run(
        [sys.executable, "-m", "carnator.cli", "generate", PROMPT, *TINY, "--model", str(model_dir), "--cache-dir", str(cache),
         "--out", str(out_file), "--json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert gen.returncode == 0, gen.stderr
    assert "Traceback" not in gen.stderr
    summary = json.loads(gen.stdout)
    assert summary["entry_id"] and read_video(out_file).shape == (5, 16, 16, 3)
    ls = subprocess.run([sys.executable, "-m", "carnator.cli", "cache", "ls", "--cache-dir", str(cache)],
                        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert ls.returncode == 0 and summary["entry_id"] in ls.stdout


def test_a_failed_worker_is_reported_not_raised():
    """calibrate --jobs: a worker that stops (its subcommand raises or exits non-zero) comes back as a message, so
    that the parent finishes its pairs instead of failing after the other shards are done."""
    from carnator.cli import _worker_failure
    from carnator.errors import CacheError

    def boom(args):
        raise CacheError("cache database x: database is locked")

    n = torch.get_num_threads()  # the worker sets its thread count: keep this process's
    assert _worker_failure(({"func": boom}, {"shard": (1, 2)}, n)) == "CacheError: cache database x: database is locked"
    assert "exited with 3" in _worker_failure(({"func": lambda args: 3}, {}, n))
    assert _worker_failure(({"func": lambda args: 0}, {}, n)) is None


def test_a_worker_given_a_gpu_sees_only_that_gpu(monkeypatch):
    """bench --jobs over several GPUs: a job's "_gpu" becomes the worker's CUDA_VISIBLE_DEVICES (set before CUDA
    starts in that fresh process) and is not passed on as an option."""
    from carnator.cli import _worker

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen = []
    assert _worker(({"func": lambda args: seen.append(vars(args)) or 0, "device": "cuda"}, {"_gpu": 3, "policies": "dense"}, torch.get_num_threads())) is None
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert "_gpu" not in seen[0] and seen[0]["policies"] == "dense" and seen[0]["jobs"] == 1


# ---- what a newcomer meets (issue 28) --------------------------------------------------------------


def test_policy_choices_are_the_registry():
    from carnator.cli import POLICIES
    from carnator.policies import policy_names

    assert sorted(POLICIES) == policy_names()


def test_eviction_choices_are_the_registry():
    from carnator.cache import eviction_policies
    from carnator.cli import EVICTIONS

    from carnator.cache import LCBFU, LRU, get_eviction

    assert set(EVICTIONS) <= set(eviction_policies())
    assert {type(get_eviction(n)) for n in EVICTIONS} == {LRU, LCBFU}  # every built-in one, and only those


def test_generate_help_shows_defaults_and_choices(capsys):
    code, out, _ = run(capsys, "generate", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for text in ("--seed SEED seed of the initial noise", "(default: 0)", "{carnator,dense,nirvana,chorus,chorus2}",
                 "(default: ./out.mp4)", "1-240 (.gif: 1-50) (default: 8)", "the embedded model makes 16 only",
                 "the embedded model makes 64 only", "embedded: 50)", "embedded: 4.0)", "(default: default)"):
        assert text in flat, text
    code, out, _ = run(capsys, "cache", "--help")
    assert code == 0 and "-y, --yes" in out and "asks first" in " ".join(out.split())


def test_serve_help_is_the_config_fields(capsys, monkeypatch):
    """``serve``'s options are made from the fields of ServeConfig (and two of EngineConfig): a field's help is its
    option's, with the field's default; a field with no help is no option."""
    import dataclasses

    from carnator.service.config import ServeConfig

    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no words broken at a hyphen
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0
    flat = " ".join(out.split())
    help_of = {f.name: f.metadata.get("help") for f in dataclasses.fields(ServeConfig)}
    assert "times a job is started before a server stopping mid-job fails it" == help_of["max_attempts"]
    for text in ("--max-attempts N times a job is started before a server stopping mid-job fails it (default: 2)",
                 "--retention DURATION finished jobs (completed, failed, cancelled)", "0 keeps them forever (default: 7d)",
                 "--port PORT port (default: 8000; 0: any free port, printed)", "--router {affinity,pow2} with --replicas",
                 "--tenant-quota SIZE cache bytes one tenant may keep", "--option POLICY.FIELD=VALUE set one field of a policy's config",
                 "--allow-uncertified let approximate reuse rest on thresholds no certified file backs"):
        assert text in flat, text
    for name, text in help_of.items():
        flag = "--" + {"retention_s": "retention"}.get(name, name.replace("_", "-"))
        assert (flag in out) == (text is not None), name  # fps, engine_config, audit_seed, ... are not options


def test_help_imports_no_torch():
    """``carnator --help``, the help of commands without --intra-cache, and usage errors import no torch (start-up:
    1.7 s before, 0.06 s after on the CI CPU; ``generate --help`` lists the intra-request caches' options, from a module
    that imports torch)."""
    code = (
        "import sys\n"
        "from carnator.cli import main\n"
        "assert main(['--help']) == 0 and main(['demo', '--help']) == 0 and main(['cache', '--help']) == 0\n"
        "assert main(['generate', 'x', '--fps', '0']) == 2\n"
        "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers', 'scipy') if m in sys.modules)\n"
        "print('heavy:', heavy, file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert "heavy: []" in p.stderr and "carnator: error: argument --fps" in p.stderr


def test_exact_hit_line_and_verbose_details(capsys, model_dir, tmp_path, cache):
    args = ["generate", PROMPT, *TINY, "--model", model_dir, "--cache-dir", cache, "--seed", "3", "--cache", "exact"]
    code, first, err = run(capsys, *args, "--out", tmp_path / "a.gif", "--json")
    assert code == 0, err
    entry = json.loads(first)["entry_id"]
    assert json.loads(first)["steps_computed"] == 2 and json.loads(first)["decision"] == "miss"
    code, out, err = run(capsys, *args, "--out", tmp_path / "b.gif")
    assert code == 0, err
    assert out == (f"exact hit: the same request as entry {entry[:8]} ({PROMPT!r}, seed 3): its stored video; "
                   f"{out.split('video; ')[1].split(' s,')[0]} s, 0 of 2 steps computed (2 saved); wrote {tmp_path / 'b.gif'}\n")
    code, out, err = run(capsys, *args, "--out", tmp_path / "c.gif", "--verbose")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("exact hit: ") and f"  source_id: {entry}" in lines and "  dit_forwards: 0" in lines
    assert any(line.startswith("  seconds: exact_lookup=") for line in lines)


@pytest.fixture
def embedded_cache(tmp_path):
    return tmp_path / "embedded-cache"


def test_carnator_hit_line_names_source_reason_and_steps(capsys, tmp_path, embedded_cache):
    """A re-roll (same prompt, another seed) on the embedded model hits the first request: the line names the source,
    the shipped file's re-roll tier and the steps: 29 to 31 of 32 (the tier is certified at step 45 of 50, which is 29
    of 32), and no probe (a frame tier reads none), found by its content key alone."""
    prompt = "a small red ball moving left on grass"
    base = ["generate", prompt, "--steps", "32", "--device", "cpu", "--cache-dir", embedded_cache]
    code, out, err = run(capsys, *base, "--seed", "1", "--out", tmp_path / "a.gif", "--json")
    assert code == 0, err
    first = json.loads(out)
    assert first["decision"] == "miss" and first["steps_computed"] == 32 and first["dit_forwards"] == 64
    assert first["reason"] == "nothing cached to reuse"
    code, out, err = run(capsys, *base, "--seed", "5", "--out", tmp_path / "b.gif")
    assert code == 0, err
    assert out.startswith(f"hit: re-roll of {first['entry_id'][:8]} (same content): whole frame from step 29 of 32, "
                          "100 % of tokens recomputed ")
    # recall by content only and no probe: no text or context distance is shown
    assert "text" not in out and "context" not in out
    assert out.rstrip().endswith(f" s, 3 of 32 steps computed (29 saved); wrote {tmp_path / 'b.gif'}")
    assert "mask" not in out and "==" not in out  # no base64 blob


def test_cache_clear_asks_at_a_terminal(capsys, model_dir, tmp_path, cache, monkeypatch):
    entry = _populate(capsys, model_dir, tmp_path, cache)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    answers = iter(["n", "y"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", cache)
    assert code == 1 and out.strip() == "nothing deleted"
    code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
    assert entry in out
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", cache)
    assert code == 0 and "cleared 1 entries" in out


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_inside_an_import_ends_at_once_and_elsewhere_unwinds(tmp_path):
    """An extension that calls back into Python while it loads (triton's libtriton, imported by torch) aborts the
    interpreter if a KeyboardInterrupt is raised there; the program's handler ends the process at once inside an import
    and raises KeyboardInterrupt elsewhere, so that finally blocks run."""
    (tmp_path / "slow_module.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                             "time.sleep(30)\nprint('the import went on')\n")
    child = ("import os, signal, sys, time\nfrom carnator import cli\nsignal.signal(signal.SIGINT, cli._on_sigint)\n"
             "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\nexcept KeyboardInterrupt:\n"
             "    print('unwound')\nsys.path.insert(0, sys.argv[1])\ntry:\n    import slow_module\nfinally:\n"
             "    print('finally ran')\n")
    p = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       preexec_fn=_default_sigint, check=False)
    assert (p.returncode, p.stdout, p.stderr) == (130, "unwound\n", "carnator: interrupted\n")


@pytest.mark.slow
def test_interrupt_and_bad_bytes_in_real_processes(tmp_path):
    """Ctrl-C while carnator starts (imports, model loading) ends with one line and status 130; a prompt of bytes that
    are not UTF-8 is a user error naming the character."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CARNATOR_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "carnator.cli", "generate", "a red ball", "--device", "cpu", "--out", str(tmp_path / "v.gif")]
    for delay in (0.3, 1.0, 2.5):
        # Ctrl-C delivered to the child as at a terminal: this process may by now ignore or block SIGINT (a library of an
        # earlier test), and both are inherited, so the child would never see it
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 130 and err == "carnator: interrupted\n" and out == "", (delay, p.returncode, err, out[-200:])
    p = subprocess.run([*map(os.fsencode, cmd[:4]), b"a red \xff ball", *map(os.fsencode, cmd[5:])],
                       capture_output=True, env=env, timeout=300, check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.decode().splitlines() == [
        "carnator: error: the prompt is not valid text: character 6 is U+DCFF, a lone surrogate (from a command line: bytes that are not UTF-8)"]
