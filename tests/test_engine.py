"""The engine's user-facing behaviour on the offline tiny Wan pipeline.

``Carnator.generate`` with the dense policy must give exactly what the diffusers pipeline gives; an
identical request must come back from the exact-hit tier without a single transformer call; every
entry must hold the request's whole trajectory; bad input, bad model paths and a bad cache are
one-line :class:`CarnatorError` subclasses, never crashes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from carnator.backbones import adapter_for
from carnator.cache import CacheBank
from carnator.denoise import Program, run_steps, start
from carnator.recall.embedder import TextEmbedder
from carnator.engine import Carnator, EngineConfig
from carnator.errors import CarnatorError, InvalidRequestError, ModelLoadError
from carnator.request import to_uint8
from carnator.testing import hashed_embedder, tiny_pipeline

PROMPT = "a red ball rolls past a blue cube"
SEED = 5
# Small enough to be quick, big enough that both CFG branches and several steps run.
S = dict(num_frames=5, height=16, width=16, num_inference_steps=3, guidance_scale=5.0)
STEPS = S["num_inference_steps"]


def fake_embedder(dim: int = 32) -> TextEmbedder:
    """Deterministic hashed bag of words (no model to load)."""
    return hashed_embedder(dim)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: a second intra-op thread costs far more than it gives."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def ref_pipe():
    """A second, independently built, identical pipeline for reference runs."""
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def ref_video(ref_pipe):
    gen = torch.Generator("cpu").manual_seed(SEED)
    return ref_pipe(PROMPT, generator=gen, output_type="np", **S).frames[0]


@pytest.fixture
def engine(pipe, tmp_path):
    return Carnator(pipe, tmp_path / "cache", embedder=fake_embedder())


@pytest.fixture(scope="module")
def saved_dir(pipe, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-wan")
    pipe.save_pretrained(d)
    return d


def gen(eng: Carnator, prompt: str = PROMPT, **kw):
    """``eng.generate`` with this file's request: the dense policy with exact hits (``cache="exact"``), SEED and the
    small settings S."""
    return eng.generate(prompt, **{"seed": SEED, "policy": "dense", "cache": "exact", **S, **kw})


def count_forwards(module: torch.nn.Module):
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


# ---- dense generation ---------------------------------------------------------------------------


def test_dense_generate_equals_pipeline(engine, ref_video):
    steps_seen = []
    res = gen(engine, progress=lambda done, total: steps_seen.append((done, total)))
    ref = to_uint8(ref_video)
    # the tiny model must not saturate, or equality would prove little
    assert ref.std() > 2 and len(np.unique(ref)) > 20
    assert res.frames.dtype == np.uint8 and res.frames.shape == (5, 16, 16, 3)
    np.testing.assert_array_equal(res.frames, ref)
    assert float(np.abs(res.video - ref_video).max()) <= 1e-6
    st = res.stats
    assert st.policy == "dense" and st.hit is False and st.exact_hit is False
    assert {"encode", "dit", "decode", "total"} <= set(st.timings)
    assert all(v >= 0 for v in st.timings.values())
    assert st.timings["total"] >= st.timings["dit"]
    assert st.dit_forwards == 2 * STEPS  # CFG: two transformer calls a step
    assert st.entry_id is not None and st.entry_id in engine.store
    assert steps_seen == [(i, STEPS) for i in range(1, STEPS + 1)]
    assert res.request.num_inference_steps == STEPS and res.request.seed == SEED


def test_identical_request_is_exact_hit(engine, pipe):
    first = gen(engine)
    calls, handle = count_forwards(pipe.transformer)
    try:
        again = gen(engine)
    finally:
        handle.remove()
    assert again.stats.exact_hit and again.stats.hit
    assert again.stats.source_id == first.stats.entry_id
    assert again.stats.dit_forwards == 0 and calls == []
    assert again.frames.dtype == np.uint8
    np.testing.assert_array_equal(again.frames, first.frames)
    assert engine.store.get(first.stats.entry_id).use_count == 1
    assert "total" in again.stats.timings


@pytest.mark.parametrize(
    "change",
    [
        dict(seed=SEED + 1),
        dict(tenant="other-tenant"),
        dict(negative_prompt="blurry, low quality"),
        dict(num_inference_steps=2),
        dict(guidance_scale=4.0),
        dict(num_frames=9),
        dict(prompt=PROMPT + " slowly"),
    ],
    ids=lambda c: next(iter(c)),
)
def test_changed_request_is_not_exact_hit(engine, pipe, change):
    gen(engine)
    assert engine.is_cached(PROMPT, seed=SEED, **S)
    kw = {"seed": SEED, **S, **change}
    prompt = kw.pop("prompt", PROMPT)
    assert not engine.is_cached(prompt, **kw)
    calls, handle = count_forwards(pipe.transformer)
    try:
        res = gen(engine, **change)
    finally:
        handle.remove()
    assert engine.is_cached(prompt, **kw)
    assert not res.stats.exact_hit and not res.stats.hit
    assert res.stats.dit_forwards > 0 and len(calls) == res.stats.dit_forwards
    assert len(engine.store) == 2  # the changed request is an entry of its own


def test_store_false_keeps_nothing(engine):
    res = gen(engine, store=False)
    assert res.stats.entry_id is None and len(engine.store) == 0
    assert not gen(engine, store=False).stats.exact_hit


# ---- trajectory capture -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_entry_stores_whole_trajectory(pipe, ref_pipe, tmp_path, dtype):
    """The stored trajectory is the loop's latents: bit for bit in float32, their float16 rounding by default."""
    engine = Carnator(pipe, tmp_path / "cache", embedder=fake_embedder(), config=EngineConfig(latent_dtype=dtype))
    res = gen(engine)
    tensors = engine.store.load(res.stats.entry_id)
    assert tensors is not None
    assert {f"traj.{i}" for i in range(STEPS)} | {"video"} <= set(tensors)
    np.testing.assert_array_equal(tensors["video"].numpy(), res.frames)
    assert set(engine.store.load(res.stats.entry_id, ["video"])) == {"video"}  # an exact hit reads the video alone

    # The latents the loop produced, recorded independently by a hook on a separate pipeline.
    ad = adapter_for(ref_pipe)
    req = ad.resolve(PROMPT, seed=SEED, **S)
    seen: dict[int, torch.Tensor] = {}
    st = start(ad, req)

    class Recorder(Program):  # the loop's latent after each step, as a program sees it
        def after_step(self, step, state):
            seen[step] = state.latents.clone()

    run_steps(ad, st, ad.encode(req), req, program=Recorder())
    assert sorted(seen) == list(range(STEPS))
    for k in range(STEPS):
        stored = tensors[f"traj.{k}"]
        assert stored.dtype == getattr(torch, dtype) and stored.shape == seen[k].shape
        assert torch.equal(stored, seen[k].cpu().to(stored.dtype)), f"traj.{k} differs from the loop's latent"
    assert not torch.equal(tensors["traj.0"], tensors["traj.1"])
    assert engine.store.get(res.stats.entry_id).extra["steps"] == STEPS


# ---- a damaged cache is a miss, never a crash ---------------------------------------------------


def _blob(engine, entry_id, kind="video"):
    """An entry's blob: an exact hit reads its video blob alone, reuse its tensors blob."""
    return engine.store.root / "blobs" / f"{entry_id}.{kind}.safetensors"


def test_corrupt_exact_hit_entry_is_recomputed(engine, caplog):
    first = gen(engine)
    path = _blob(engine, first.stats.entry_id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    again = gen(engine)
    assert not again.stats.exact_hit and again.stats.dit_forwards == 2 * STEPS
    np.testing.assert_array_equal(again.frames, first.frames)
    assert again.stats.entry_id not in (None, first.stats.entry_id)
    assert first.stats.entry_id not in engine.store
    assert any((engine.store.root / "quarantine").iterdir())
    # the recomputed entry serves the next identical request
    assert gen(engine).stats.exact_hit


def test_missing_exact_hit_file_is_recomputed(engine):
    first = gen(engine)
    _blob(engine, first.stats.entry_id).unlink()
    again = gen(engine)
    assert not again.stats.exact_hit
    np.testing.assert_array_equal(again.frames, first.frames)


def test_failed_admission_still_returns_the_video(engine, caplog):
    """The cache's blob directory turns into a file (disk trouble): the result is returned, not stored."""
    tensors = engine.store.root / "blobs"
    for f in tensors.iterdir():
        f.unlink()
    tensors.rmdir()
    tensors.write_text("not a directory")
    res = gen(engine)
    assert res.frames.shape == (5, 16, 16, 3)
    assert res.stats.entry_id is None and "store_error" in res.stats.notes
    assert len(engine.store) == 0
    assert "could not store" in caplog.text


def test_admission_oserror_is_not_fatal(engine, monkeypatch):
    def boom(*_, **__):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine.store, "admit", boom)
    res = gen(engine)
    assert res.stats.entry_id is None and "No space left" in res.stats.notes["store_error"]


def test_entries_of_another_embedder_are_never_recalled(pipe, tmp_path):
    """Recall embeddings of two embedders are not comparable: the compatibility key carries the embedder's identity,
    so workers with another embedder (even one of the same size) share the folder without mixing entries."""
    a = Carnator(pipe, tmp_path, embedder=fake_embedder(32))
    first = gen(a, policy="nirvana", cache="reuse")
    assert gen(a, policy="nirvana", cache="reuse", seed=SEED + 1).stats.source_id == first.stats.entry_id  # recalled by its own
    b = Carnator(pipe, tmp_path, embedder=fake_embedder(16))
    res = gen(b, policy="nirvana", cache="reuse", seed=SEED + 2)
    assert not res.stats.hit and res.stats.entry_id is not None and "store_error" not in res.stats.notes
    assert a.compat_key(res.request, "nirvana") != b.compat_key(res.request, "nirvana")


def test_dense_runs_densely_unless_it_asks_for_exact_hits(engine):
    """A user asking for dense gets a dense run (issue 28): the dense policy reads no cache by default."""
    first = gen(engine)
    again = engine.generate(PROMPT, seed=SEED, policy="dense", **S)
    assert not again.stats.exact_hit and again.stats.dit_forwards == 2 * STEPS
    np.testing.assert_array_equal(again.frames, first.frames)
    assert gen(engine).stats.exact_hit  # cache="exact": the stored video


# ---- user mistakes ------------------------------------------------------------------------------


def test_unknown_policy_lists_available(engine):
    with pytest.raises(InvalidRequestError) as ei:
        gen(engine, policy="no-such-policy")
    msg = str(ei.value)
    assert "no-such-policy" in msg and "dense" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt=""),
        dict(prompt="   \n "),
        dict(num_inference_steps=0),
        dict(num_inference_steps=-2),
        dict(num_inference_steps=2.5),
        dict(num_frames=6),  # Wan needs 4k+1 frames
        dict(num_frames=0),
        dict(height=20),  # Wan needs multiples of 16
        dict(width=24),
        dict(guidance_scale=float("nan")),
        dict(guidance_scale=float("inf")),
        dict(guidance_scale=-1.0),
        dict(tenant=""),
        dict(tenant="a tenant with spaces"),
        dict(tenant="../escape"),
        dict(seed="7"),
    ],
    ids=lambda b: "-".join(f"{k}={v!r}" for k, v in b.items()),
)
def test_bad_input_is_one_line_invalid_request(engine, pipe, bad):
    calls, handle = count_forwards(pipe.transformer)
    try:
        with pytest.raises(InvalidRequestError) as ei:
            gen(engine, **bad)
    finally:
        handle.remove()
    msg = str(ei.value)
    assert msg and "\n" not in msg
    assert calls == [] and len(engine.store) == 0


# ---- loading ------------------------------------------------------------------------------------


def _model_dir(tmp_path, index):
    d = tmp_path / "model"
    d.mkdir()
    if index is not None:
        (d / "model_index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return d


@pytest.mark.parametrize(
    "index, words",
    [
        (None, "model_index.json"),
        ({"_class_name": "StableDiffusionPipeline"}, "unsupported pipeline class StableDiffusionPipeline"),
        ("{not json", "not a valid"),
        ({"no_class": 1}, "not a valid"),
        ({"_class_name": "WanPipeline"}, "could not load WanPipeline"),  # index without components
    ],
    ids=["no-index", "unsupported", "bad-json", "no-class", "no-components"],
)
def test_from_pretrained_bad_dir(tmp_path, index, words):
    d = _model_dir(tmp_path, index)
    with pytest.raises(ModelLoadError) as ei:
        Carnator.from_pretrained(str(d), tmp_path / "cache", device="cpu", embedder=fake_embedder())
    assert words in str(ei.value) and "\n" not in str(ei.value)


def test_from_pretrained_missing_path_creates_no_cache(tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        Carnator.from_pretrained(str(tmp_path / "nope"), tmp_path / "cache", device="cpu")
    assert not (tmp_path / "cache").exists()


def test_from_pretrained_lists_supported_classes(tmp_path):
    d = _model_dir(tmp_path, {"_class_name": "StableDiffusionPipeline"})
    with pytest.raises(ModelLoadError) as ei:
        Carnator.from_pretrained(d, tmp_path / "cache", device="cpu")
    assert "WanPipeline" in str(ei.value) and "LTXPipeline" in str(ei.value)


@pytest.mark.parametrize("device", ["potato", "cuda:99"])
def test_from_pretrained_bad_device(saved_dir, tmp_path, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 99:  # pragma: no cover
        pytest.skip("machine has that many GPUs")
    with pytest.raises(ModelLoadError, match="device"):
        Carnator.from_pretrained(str(saved_dir), tmp_path / "cache", device=device)


def test_from_pretrained_bad_cache_dir_fails_before_loading(saved_dir, tmp_path, monkeypatch):
    import diffusers

    def must_not_load(*a, **k):  # pragma: no cover - the failure under test
        raise AssertionError("the model was loaded before the cache directory was checked")

    monkeypatch.setattr(diffusers.WanPipeline, "from_pretrained", must_not_load)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CarnatorError, match="not usable"):
        Carnator.from_pretrained(str(saved_dir), blocker / "cache", device="cpu")


def test_from_pretrained_saved_pipeline(saved_dir, tmp_path, engine, ref_video):
    loaded = Carnator.from_pretrained(str(saved_dir), tmp_path / "cache2", device="cpu", embedder=fake_embedder())
    assert type(loaded.pipe).__name__ == "WanPipeline"
    res = gen(loaded)
    np.testing.assert_array_equal(res.frames, to_uint8(ref_video))
    # The same weights keep one identity whether built in memory or loaded from any directory.
    assert loaded.model_identity == engine.model_identity


def test_saved_pipeline_shares_cache_with_in_memory_one(saved_dir, pipe, tmp_path):
    mem = Carnator(pipe, tmp_path / "shared", embedder=fake_embedder())
    first = gen(mem)
    disk = Carnator.from_pretrained(str(saved_dir), tmp_path / "shared", device="cpu", embedder=fake_embedder())
    again = gen(disk)
    assert again.stats.exact_hit and again.stats.source_id == first.stats.entry_id


def test_cache_dir_env_is_honoured(pipe, tmp_path, monkeypatch):
    target = tmp_path / "from-env"
    monkeypatch.setenv("CARNATOR_CACHE_DIR", str(target))
    eng = Carnator(pipe, embedder=fake_embedder())
    assert eng.store.root == target
    res = gen(eng)
    assert (target / "blobs" / f"{res.stats.entry_id}.video.safetensors").exists()
    assert CacheBank(target).get(res.stats.entry_id) is not None


def test_open_bank_can_be_passed(pipe, tmp_path):
    bank = CacheBank(tmp_path / "b")
    eng = Carnator(pipe, bank, embedder=fake_embedder())
    assert eng.store is bank


@pytest.mark.slow
def test_default_embedder_is_minilm(pipe, tmp_path):
    eng = Carnator(pipe, tmp_path)
    res = gen(eng)
    assert res.stats.entry_id is not None
    meta = eng.store.get(res.stats.entry_id)
    assert meta.embedding.shape == (384,)
    # semantically close prompts are closer than unrelated ones
    e = eng.embedder
    near = float(e(PROMPT) @ e("a red ball rolling past a blue box"))
    far = float(e(PROMPT) @ e("stock market prices fell sharply today"))
    assert near > far + 0.2


def test_an_attention_plan_applies_inside_its_step_only(tmp_path, ref_video):
    """The processors hold no request state: a plan applies to the forwards of its own step, in its own thread; the
    same transformer outside any step, or in a second engine over the same pipeline, computes the plain attention."""
    from carnator.attention.blockmask import BlockMaskSet, num_blocks
    from carnator.attention.state import AttentionPlan, AttentionSession, attention_step
    from carnator.request import Request

    pipe = tiny_pipeline("wan")
    first = Carnator(pipe, tmp_path / "a", embedder=fake_embedder())
    first.adapter.ensure_attention()
    t, h, w = first.adapter.token_grid(Request(prompt=PROMPT, seed=SEED, **S))
    n, heads, block = t * h * w, pipe.transformer.config.num_attention_heads, 1
    nb = num_blocks(n, block)
    ms = BlockMaskSet.empty(num_heads=heads, q_len=n, kv_len=n, block=block)
    for layer in range(first.adapter.num_layers()):
        for br in (0, 1):
            ms.add(0, br, layer, torch.eye(nb, dtype=torch.bool).expand(heads, nb, nb).clone())  # own block only
    x = torch.randn(1, 16, t, 2 * h, 2 * w, generator=torch.Generator().manual_seed(0))  # patch (1, 2, 2)
    kw = {"hidden_states": x, "timestep": torch.tensor([500.0]), "encoder_hidden_states": torch.randn(1, 8, pipe.transformer.config.text_dim), "return_dict": False}
    with torch.no_grad():
        with attention_step(AttentionPlan(masks=ms), AttentionSession(), 0):
            masked = pipe.transformer(**kw)[0]
        plain = pipe.transformer(**kw)[0]
    assert (masked - plain).abs().max() > 1e-3  # the plan is real: applied, it changes a forward
    second = Carnator(pipe, tmp_path / "b", embedder=fake_embedder())  # a new adapter on the same transformer
    assert float(np.abs(gen(second, store=False).video - ref_video).max()) <= 1e-6


def test_two_requests_in_two_threads_give_the_frames_each_gives_alone(tmp_path):
    """One engine, two threads, different requests and policies at once (a probe recording evidence, a reuse applying
    a blend and a window): each result equals the one it gives alone, bit for bit (own scheduler, own attention
    state; the issue-29 outside test saw 10 of 10 such runs raise before the redesign)."""
    import threading

    eng = Carnator.from_pretrained("embedded", tmp_path / "c", device="cpu", embedder=hashed_embedder(64))
    jobs = [("a small red ball moving left on grass", 5, "carnator"), ("a big yellow star bouncing at night", 8, "dense"),
            ("a small blue ball moving left on grass", 3, "nirvana")]
    eng.generate(jobs[0][0], seed=1, num_inference_steps=34)  # the re-roll's source: job 0 is a hit
    alone = {j: eng.generate(p, seed=s, policy=pol, num_inference_steps=34, store=False) for j, (p, s, pol) in enumerate(jobs)}
    assert alone[0].stats.hit
    for _ in range(2):
        got, errors = {}, []

        def run(j):
            try:
                p, s, pol = jobs[j]
                got[j] = eng.generate(p, seed=s, policy=pol, num_inference_steps=34, store=False)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(len(jobs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for j in range(len(jobs)):
            assert got[j].stats.hit == alone[j].stats.hit
            assert np.array_equal(got[j].frames, alone[j].frames), f"job {j} differs when run beside the others"


@pytest.mark.parametrize("kw, words", [
    ({"capture_steps": "some"}, '"auto", "all", "none"'),
    ({"capture_steps": [1, "2"]}, "must hold ints"),
    ({"latent_dtype": "int8"}, "latent_dtype"),
])
def test_a_bad_engine_config_is_a_clear_error(kw, words):
    from carnator.engine import EngineConfig

    with pytest.raises(ValueError, match=words):
        EngineConfig(**kw)
    EngineConfig(capture_steps=[0, 4], latent_dtype="float16")  # valid ones pass


def test_an_engine_without_its_transformer_checks_and_embeds_but_holds_no_weights(tmp_path):
    """``dit=False`` (``carnator serve --replicas``' ingress): the transformer (and for a diffusers model the text
    encoder and VAE) are shapes on the meta device, no bytes of weights; requests resolve and key as with the full
    engine, prompts embed, and generating is refused in one line."""
    from carnator.testing import tiny_wan

    def weight_bytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")

    tiny_wan().save_pretrained(tmp_path / "wan")
    for model, parts in (("embedded", ("transformer",)), (str(tmp_path / "wan"), ("transformer", "text_encoder", "vae"))):
        full = Carnator.from_pretrained(model, cache_dir=tmp_path / "full", device="cpu", embedder=hashed_embedder())
        # (the embedded model's identity is its weights' checksum, known without them; a diffusers model's comes from
        # an engine that has its weights: a replica)
        given = {} if model == "embedded" else {"model_identity": full.model_identity}
        front = Carnator.from_pretrained(model, cache_dir=tmp_path / "front", device="cpu", embedder=hashed_embedder(),
                                         dit=False, **given)
        assert full.dit and not front.dit and weight_bytes(full.pipe.transformer) > 0
        assert all(weight_bytes(getattr(front.pipe, n)) == 0 for n in parts), model
        req, ref = (e.resolve("a red ball moving left on grass", seed=3) for e in (front, full))
        assert req == ref and front.compat_key(req) == full.compat_key(ref) and front.policy("carnator").name == "carnator"
        assert np.array_equal(front.embed(req.prompt), full.embed(req.prompt))
        with pytest.raises(InvalidRequestError):
            front.resolve("a red ball", seed=3, num_frames=10_000)
        with pytest.raises(CarnatorError, match="without its transformer"):
            front.generate("a red ball moving left on grass", seed=3)
