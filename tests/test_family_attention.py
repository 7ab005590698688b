"""Carnator's attention processors on every family (Wan, LTX-Video, CogVideoX, HunyuanVideo), against diffusers.

On each family's tiny offline pipeline, the transformer is called with exactly the inputs the
adapter's ``predict`` gives it (one CFG batch), once with diffusers' processors (the reference) and
once with carnator's installed:

- an attention plan that asks for nothing reproduces diffusers' output;
- an all-True block mask equals dense; a mask that drops blocks equals diffusers' own processor with
  its self-attention SDPA replaced by SDPA under the expanded element mask (joint families: the
  video-video part masked, text keys and text queries always attended);
- the probe record: cross-attention (heads, N, positions) equal to the softmax of the module's own
  Q and K over the text keys (rows sum to <= 1); self-attention LSE equal to the dense one;
- the Active-token window: with Context = every token, Active tokens equal the dense block's outputs
  and the others pass unchanged;
- TGAA: scale 1 is bit-identical; another scale changes the cond row only;
- ``Carnator(pipe).generate(..., policy="carnator")`` hits a warm cache and reports a mask density;
  chorus (TGAA, window) and chorus2 (mask reuse) hit too.
Plus known answers for the shared pieces: ``masked_attention(extra_k=...)`` and ``joint_attention``
(rows with different valid text keys, TGAA together with a block mask).
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F

from carnator import Carnator, EngineConfig
from carnator.attention.blockmask import BlockMaskSet, num_blocks
from carnator.attention.state import Amplification, AttentionPlan, AttentionSession, RecordSpec, SparseConfig, StepAttention, WindowPlan, attention_step
from carnator.backbones import adapter_for
from carnator.reuse import Thresholds
from carnator.testing import TINY_SETTINGS, hashed_embedder, tiny_pipeline

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

PROMPT = "a small red ball moving left on grass"
ATTN_FAMILIES = ["wan", "ltx", "cogvideox", "hunyuan"]
# Sizes with a few blocks of tokens: LTX 3 x 8 x 8 = 192 tokens (blocks of 16); Wan and CogVideoX at 64 x 64,
# and HunyuanVideo, 3 x 4 x 4 = 48 (blocks of 8).
SETTINGS = {
    "wan": {**TINY_SETTINGS["wan"], "height": 64, "width": 64},
    "ltx": TINY_SETTINGS["ltx"],
    "cogvideox": {**TINY_SETTINGS["cogvideox"], "height": 64, "width": 64},
    "hunyuan": TINY_SETTINGS["hunyuan"],
}
BLOCKS = {"wan": 8, "ltx": 16, "cogvideox": 8, "hunyuan": 8}
JOINT = {"cogvideox", "hunyuan"}
NEGATIVE = "blurry, low quality"


# ------------------------------------------------------------------------------------------- setup


class Case:
    """One family's tiny pipeline, adapter, and the transformer inputs of one ``predict`` call."""

    def __init__(self, family: str):
        self.family = family
        self.pipe = tiny_pipeline(family, 0)
        self.ad = adapter_for(self.pipe)
        if family == "hunyuan":  # true CFG: two forwards, batched here (uncond first) so rows carry different text masks
            self.ad.true_cfg_scale = 3.0
        self.req = self.ad.resolve(PROMPT, seed=0, negative_prompt=NEGATIVE, **SETTINGS[family])
        self.block = BLOCKS[family]
        self.joint = family in JOINT
        self.diffusers_processors = [[m.processor for m in self.attn_modules(b)] for b in self.blocks()]
        cond = self.ad.encode(self.req)
        assert cond.do_cfg
        lat = self.ad.prepare_latents(self.req, self.ad.make_generator(self.req))
        ts = self.ad.timesteps(self.ad.new_scheduler(), self.req)
        self.plan, self.session = AttentionPlan(), AttentionSession()
        calls: list[dict] = []
        tr = self.ad.transformer
        h = tr.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
        try:
            self.ad.predict(lat, ts[0], 0, cond, self.req)
        finally:
            h.remove()
        if len(calls) == 2:  # (cond, uncond) forwards -> one (uncond, cond) batch
            calls = [{k: torch.cat([calls[1][k], v]) if isinstance(v, torch.Tensor) else v for k, v in calls[0].items()}]
        self.kwargs = calls[0]
        self.branches = (1, 0)
        self.n = math.prod(self.ad.token_grid(self.req))

    def blocks(self) -> list:
        tr = self.pipe.transformer
        if self.family == "wan":
            return list(tr.blocks)
        return list(tr.transformer_blocks) + list(getattr(tr, "single_transformer_blocks", []))

    @staticmethod
    def attn_modules(block) -> list:
        return [getattr(block, n) for n in ("attn1", "attn2", "attn") if hasattr(block, n)]

    def self_attn(self, layer: int):
        return self.attn_modules(self.blocks()[layer])[0]

    @contextlib.contextmanager
    def diffusers(self):
        """Diffusers' own processors for the duration (carnator's window-aware block forwards stay, idle)."""
        saved = [[m.processor for m in self.attn_modules(b)] for b in self.blocks()]

        def put(procs):
            for b, ps in zip(self.blocks(), procs):
                for m, p in zip(self.attn_modules(b), ps):
                    m.set_processor(p)

        put(self.diffusers_processors)
        try:
            yield
        finally:
            put(saved)

    @property
    def tr(self):
        return self.ad.transformer

    def forward(self) -> torch.Tensor:
        """One transformer forward at step 0 under the plan of :meth:`attend` (idle by default)."""
        with torch.no_grad(), attention_step(self.plan, self.session, 0) as st:
            st.branches = self.branches
            return self.tr(**self.kwargs)[0].float()

    def attend(self, **plan) -> AttentionSession:
        """Run the next forwards under ``AttentionPlan(**plan)`` with a fresh session (its record)."""
        self.ad.ensure_attention()
        self.plan = AttentionPlan(**plan)
        self.session = AttentionSession()
        return self.session


@pytest.fixture(scope="module", params=ATTN_FAMILIES)
def case(request):
    return Case(request.param)


def _masks(case: Case, fill) -> BlockMaskSet:
    """A mask set with, for every branch and layer at step 0, ``fill(layer, branch) -> (H, nb, nb)`` bool."""
    heads = case.self_attn(0).heads
    ms = BlockMaskSet.empty(num_heads=heads, q_len=case.n, kv_len=case.n, block=case.block)
    for layer in range(case.ad.num_layers()):
        for br in case.branches:
            ms.add(0, br, layer, fill(layer, br))
    return ms


def _dropping_mask(case: Case, layer: int, br: int) -> torch.Tensor:
    """Random blocks with the diagonal kept (every query block keeps a key block); about half dropped."""
    heads, nb = case.self_attn(0).heads, num_blocks(case.n, case.block)
    g = torch.Generator().manual_seed(100 * layer + br)
    m = torch.rand(heads, nb, nb, generator=g) < 0.4
    m |= torch.eye(nb, dtype=torch.bool)
    return m


def _element_mask(block_mask: torch.Tensor, n: int, block: int) -> torch.Tensor:
    idx = torch.arange(n) // block
    return block_mask[..., idx, :][..., idx]


class _FunctionalWith:
    """torch.nn.functional with scaled_dot_product_attention replaced (for a module that calls F.sdpa)."""

    def __init__(self, sdpa):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name):
        return getattr(F, name)


@contextlib.contextmanager
def _masked_reference(case: Case, masks: dict[int, torch.Tensor]):
    """Diffusers' own processors, with each layer's self-attention SDPA under ``masks[layer]`` ((B, H, nb, nb)); for
    a joint attention the video-video part masked, every (valid) text key and every text query kept."""
    layer_of = {id(case.self_attn(i)): i for i in range(len(case.blocks()))}
    current: list[int] = []
    hooks = [case.self_attn(i).register_forward_pre_hook(lambda m, a: current.append(layer_of[id(m)])) for i in range(len(case.blocks()))]

    def elem_for(layer: int, s_len: int, text_first: bool, key_mask=None) -> torch.Tensor:
        e = _element_mask(masks[layer], case.n, case.block)
        b, h, n = *e.shape[:2], case.n
        full = torch.ones(b, h, s_len, s_len, dtype=torch.bool)
        vid = slice(s_len - n, s_len) if text_first else slice(0, n)
        full[:, :, vid, vid] = e
        return full if key_mask is None else full & key_mask

    with case.diffusers():
        if case.family in ("wan", "ltx", "hunyuan"):
            if case.family == "wan":
                import diffusers.models.transformers.transformer_wan as mod
            elif case.family == "ltx":
                import diffusers.models.transformers.transformer_ltx as mod
            else:
                import diffusers.models.transformers.transformer_hunyuan_video as mod

            orig = mod.dispatch_attention_fn

            def dispatch(q, k, v, attn_mask=None, **kw):  # q, k, v: (B, S, H, D); joint: video first
                if current and (case.joint or (attn_mask is None and q.shape[1] == k.shape[1] == case.n)):
                    elem = elem_for(current.pop(), q.shape[1], False, attn_mask)
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=elem)
                    return o.transpose(1, 2)
                return orig(q, k, v, attn_mask=attn_mask, **kw)

            name, patched = "dispatch_attention_fn", dispatch
        else:
            import diffusers.models.attention_processor as mod

            orig = mod.F

            def sdpa(q, k, v, attn_mask=None, **kw):  # q, k, v: (B, H, S, D), the joint sequence, text first
                assert attn_mask is None and current
                return F.scaled_dot_product_attention(q, k, v, attn_mask=elem_for(current.pop(), q.shape[2], True), **kw)

            name, patched = "F", _FunctionalWith(sdpa)
        setattr(mod, name, patched)
        try:
            yield
        finally:
            setattr(mod, name, orig)
            for h in hooks:
                h.remove()


def _reference_qk(case: Case, layer: int):
    """From the inputs diffusers' modules receive and their own projections (cond row): video queries Q (H, N, d),
    their text keys K_t (H, L, d) with the text logit bias (1, 1, L) or None, and the video self-attention's Q, K (H, N, d)."""
    blk = case.blocks()[layer]
    got = {}

    def grab(name):
        def hook(m, a, kw):
            got.setdefault(name, (a, kw))

        return hook

    hooks = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in enumerate(case.attn_modules(blk))]
    try:
        case.forward()
    finally:
        for h in hooks:
            h.remove()
    b = case.branches.index(0)
    a1 = case.self_attn(layer)
    heads = a1.heads

    def arg(i, pos, name):
        a, kw = got[i]
        v = kw[name] if name in kw else a[pos]
        return v[b : b + 1] if isinstance(v, torch.Tensor) else v

    def split(lin, x):  # (1, S, C) -> (1, S, H, D)
        return lin(x).unflatten(2, (heads, -1))

    def hd(x):  # (1, S, H, D) -> (H, S, D)
        return x.transpose(1, 2)[0]

    with torch.no_grad():
        if case.family == "wan":  # RoPE as diffusers' WanAttnProcessor: pairs (0::2, 1::2), cos/sin (1, N, 1, D)

            def rope(t, cos, sin):
                x1, x2 = t.unflatten(-1, (-1, 2)).unbind(-1)
                out = torch.empty_like(t)
                out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
                out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
                return out

            x, rot = arg(0, 0, "hidden_states"), arg(0, 3, "rotary_emb")
            qv = rope(a1.norm_q(a1.to_q(x)).unflatten(2, (heads, -1)), *rot)
            kv = rope(a1.norm_k(a1.to_k(x)).unflatten(2, (heads, -1)), *rot)
            a2 = blk.attn2
            x2, enc = arg(1, 0, "hidden_states"), arg(1, 1, "encoder_hidden_states")
            q2 = a2.norm_q(a2.to_q(x2)).unflatten(2, (heads, -1))
            kt = a2.norm_k(a2.to_k(enc)).unflatten(2, (heads, -1))
            return hd(q2), hd(kt), None, hd(qv), hd(kv)
        if case.family == "ltx":
            from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

            x, rope = arg(0, 0, "hidden_states"), arg(0, 3, "image_rotary_emb")
            rope = tuple(r[b : b + 1] for r in rope)
            qv = apply_rotary_emb(a1.norm_q(a1.to_q(x)), rope).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            kv = apply_rotary_emb(a1.norm_k(a1.to_k(x)), rope).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            a2 = blk.attn2
            x2, enc = arg(1, 0, "hidden_states"), arg(1, 1, "encoder_hidden_states")
            q2 = a2.norm_q(a2.to_q(x2)).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            kt = a2.norm_k(a2.to_k(enc)).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            return q2, kt, arg(1, 2, "attention_mask").view(1, 1, -1), qv, kv
        from diffusers.models.embeddings import apply_rotary_emb

        x, enc, rope = arg(0, 0, "hidden_states"), arg(0, 1, "encoder_hidden_states"), arg(0, 3, "image_rotary_emb")
        L = enc.shape[1]
        if case.family == "cogvideox":  # text first; LayerNorm per head after the head split
            j = torch.cat([enc, x], dim=1)
            q = a1.norm_q(split(a1.to_q, j).transpose(1, 2))
            k = a1.norm_k(split(a1.to_k, j).transpose(1, 2))
            qv, kv = apply_rotary_emb(q[:, :, L:], rope)[0], apply_rotary_emb(k[:, :, L:], rope)[0]
            return qv, k[0, :, :L], None, qv, kv
        # HunyuanVideo: video first, text last, text padding masked
        mask = arg(0, 2, "attention_mask")
        bias = torch.zeros(L).masked_fill(~mask.reshape(-1)[-L:], float("-inf")).view(1, 1, L)
        if a1.add_q_proj is not None:  # dual-stream
            qv, kv = a1.norm_q(split(a1.to_q, x)), a1.norm_k(split(a1.to_k, x))
            kt = a1.norm_added_k(split(a1.add_k_proj, enc))
        else:
            j = torch.cat([x, enc], dim=1)
            q, k = a1.norm_q(split(a1.to_q, j)), a1.norm_k(split(a1.to_k, j))
            qv, kv, kt = q[:, :-L], k[:, :-L], k[:, -L:]
        qv = apply_rotary_emb(qv, rope, sequence_dim=1)
        kv = apply_rotary_emb(kv, rope, sequence_dim=1)
        return hd(qv), hd(kt), bias, hd(qv), hd(kv)


def _layers(case: Case) -> list[int]:
    """Layer 0 and the last (for HunyuanVideo: the dual- and the single-stream block)."""
    return sorted({0, len(case.blocks()) - 1})


# ------------------------------------------------------------------------------------------- tests


def test_adapter_declares_attention(case):
    assert case.ad.supports_attention
    assert case.ad.num_layers() == len(case.blocks())


def test_idle_plan_reproduces_diffusers(case):
    case.attend()
    with case.diffusers():
        ref = case.forward()
    out = case.forward()
    assert type(case.self_attn(0).processor).__module__.startswith("carnator.")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_all_true_mask_equals_dense(case):
    case.attend()
    dense = case.forward()
    heads, nb = case.self_attn(0).heads, num_blocks(case.n, case.block)
    case.attend(masks=_masks(case, lambda layer, br: torch.ones(heads, nb, nb, dtype=torch.bool)))
    torch.testing.assert_close(case.forward(), dense, rtol=1e-5, atol=1e-6)


def test_dropping_mask_equals_masked_sdpa_reference(case):
    case.attend()
    dense = case.forward()
    ms = _masks(case, lambda layer, br: _dropping_mask(case, layer, br))
    assert 0.2 < ms.density < 0.9
    case.attend(masks=ms)
    out = case.forward()
    case.attend()
    per_layer = {
        layer: torch.stack([_dropping_mask(case, layer, br) for br in case.branches]) for layer in range(case.ad.num_layers())
    }
    with _masked_reference(case, per_layer):
        ref = case.forward()
    assert (out - dense).abs().max() > 1e-3
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_capture_records_every_layer_and_branch(case):
    session = case.attend(capture=SparseConfig(block=case.block, p=0.9))
    case.forward()
    c = session.record.captured
    assert c is not None and c.q_len == case.n and c.block == case.block
    assert 0 < c.density <= 1
    for layer in range(case.ad.num_layers()):
        for br in case.branches:
            assert c.nearest(0, br, layer) is not None


def test_recording_matches_dense_softmax(case):
    for layer in _layers(case):
        _check_recording(case, layer)


def _check_recording(case: Case, layer: int):
    ad = case.ad
    pos = ad.word_token_positions(PROMPT, "ball")
    ids = ad.prompt_token_ids(PROMPT)
    assert ad.pipe.tokenizer.decode([ids[p - ad.text_offset()] for p in pos]).strip() == "ball"
    session = case.attend(record=RecordSpec(layer, tuple(pos)))
    q, kt, bias, qv, kv = _reference_qk(case, layer)
    ev = session.record.evidence.get((0, layer))
    heads = case.self_attn(0).heads
    assert ev is not None and ev.cross.shape == (heads, case.n, len(pos))
    rows = ev.cross.sum(-1)
    assert (rows <= 1 + 1e-5).all() and (rows > 0).all()
    # cross: the softmax of the module's own video queries over the text keys (padding masked as the model masks it)
    logits = q @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    torch.testing.assert_close(ev.cross, torch.softmax(logits, dim=-1)[..., pos], rtol=1e-4, atol=1e-6)
    # self: the recorded Q, K are the module's; the LSE is the dense one; every row's columns sum to 1
    torch.testing.assert_close(ev.q, qv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ev.k, kv, rtol=1e-5, atol=1e-5)
    assert ev.scale == pytest.approx(1 / math.sqrt(qv.shape[-1]))
    s = qv @ kv.transpose(-1, -2) * ev.scale
    torch.testing.assert_close(ev.lse, torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ev.self_attention_columns(range(case.n)), torch.softmax(s, dim=-1), rtol=1e-4, atol=1e-6)


def _block_io(case: Case, layer: int):
    """(input hidden states, output hidden states, output text states or None) of block ``layer``."""
    blk = case.blocks()[layer]
    got = {}
    h = blk.register_forward_hook(lambda m, a, kw, out: got.update(inp=kw.get("hidden_states", a[0] if a else None), out=out), with_kwargs=True)
    try:
        case.forward()
    finally:
        h.remove()
    out = got["out"]
    return (got["inp"], out[0], out[1]) if isinstance(out, tuple) else (got["inp"], out, None)


def test_window_recomputes_active_tokens_only(case):
    for layer in _layers(case):
        _check_window(case, layer)


def _check_window(case: Case, layer: int):
    case.attend()
    inp, dense_out, dense_txt = _block_io(case, layer)
    g = torch.Generator().manual_seed(5)
    active = torch.sort(torch.randperm(case.n, generator=g)[: case.n // 3]).values
    case.attend(window=WindowPlan(range(layer, layer + 1), active, torch.arange(case.n)))
    inp_w, out_w, txt_w = _block_io(case, layer)
    torch.testing.assert_close(inp_w, inp)
    torch.testing.assert_close(out_w[:, active], dense_out[:, active], rtol=1e-5, atol=1e-5)
    if case.joint:  # text tokens: recomputed, reading every text token and the Context (here all) video tokens
        torch.testing.assert_close(txt_w, dense_txt, rtol=1e-5, atol=1e-5)
    rest = torch.ones(case.n, dtype=torch.bool)
    rest[active] = False
    assert torch.equal(out_w[:, rest], inp[:, rest])
    # a smaller Context changes the Active tokens
    case.attend(window=WindowPlan(range(layer, layer + 1), active, active))
    _, out_c, _ = _block_io(case, layer)
    assert (out_c[:, active] - dense_out[:, active]).abs().max() > 1e-4


def test_tgaa_amplifies_the_cond_row_only(case):
    case.attend()
    dense = case.forward()
    pos = tuple(case.ad.word_token_positions(PROMPT, "ball"))
    case.attend(amplify=Amplification(pos, 1.0))
    assert torch.equal(case.forward(), dense)
    case.attend(amplify=Amplification(pos, 4.0))
    out = case.forward()
    b = case.branches.index(0)
    assert (out[b] - dense[b]).abs().max() > 1e-4
    for u in range(len(case.branches)):
        if u != b:
            assert torch.equal(out[u], dense[u])


@pytest.mark.parametrize("family", ATTN_FAMILIES)
def test_carnator_policy_hits_warm_cache(family, tmp_path):
    pipe = tiny_pipeline(family, 0)
    ad = adapter_for(pipe)
    steps = 6
    tau = tmp_path / "tau.json"
    Thresholds(context=math.inf, size=math.inf, shape=math.inf, color=math.inf).save(tau, model_id=ad.model_identity())
    # masks captured and applied on the CPU too (the default "auto" applies them only where flex runs)
    cfg = EngineConfig(policy_options={"carnator": {"resume_step": 4, "thresholds": str(tau), "sparse": {"apply": "always"}}})
    eng = Carnator(pipe, tmp_path / "cache", config=cfg, embedder=hashed_embedder(64), adapter=ad)
    settings = {**SETTINGS[family], "num_inference_steps": steps}
    a = eng.generate("a small red ball moving left on grass", seed=1, **settings)
    assert not a.stats.hit
    entry = eng.store.load(a.stats.entry_id)
    assert any(k.startswith("attn.") for k in entry) and any(k.startswith("evidence.") for k in entry)
    b = eng.generate("a small red box moving left on grass", seed=2, **settings)
    s = b.stats
    assert s.hit and s.source_id == a.stats.entry_id and s.resume_step == 4
    assert s.mask_density is not None and 0 < s.mask_density <= 1
    assert 0 <= s.active_fraction <= 1
    assert b.video.shape[0] == settings["num_frames"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_masked_attention_with_always_attended_keys(backend):
    """masked_attention(extra_k=...) equals one softmax over the allowed keys and every extra key (flex: eager here)."""
    from carnator.attention.kernels import masked_attention

    g = torch.Generator().manual_seed(0)
    b, h, n, L, d, blk = 2, 3, 37, 11, 8, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    ek, ev = (torch.randn(b, h, L, d, generator=g) for _ in range(2))
    nb = num_blocks(n, blk)
    bm = torch.rand(b, h, nb, nb, generator=g) < 0.4
    bm[:, :, 0] = False  # a query block with no masked key still attends the extra keys
    elem = torch.cat([_element_mask(bm, n, blk), torch.ones(b, h, n, L, dtype=torch.bool)], dim=-1)
    s = torch.cat([q @ k.transpose(-1, -2), q @ ek.transpose(-1, -2)], dim=-1) / math.sqrt(d)
    ref = torch.softmax(s.masked_fill(~elem, -math.inf), dim=-1) @ torch.cat([v, ev], dim=2)
    out = masked_attention(q, k, v, bm, block=blk, backend=backend, extra_k=ek, extra_v=ev)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ATTN_FAMILIES)
def test_chorus_hits_with_amplification_and_window(family, tmp_path):
    eng = Carnator(tiny_pipeline(family, 0), tmp_path, embedder=hashed_embedder(64))
    settings = {**SETTINGS[family], "num_inference_steps": 8}
    a = eng.generate("a red ball on grass", seed=1, policy="chorus", **settings)
    b = eng.generate("a blue ball on grass", seed=2, policy="chorus", **settings)
    s = b.stats
    assert not a.stats.hit and s.hit and s.resume_step == 2 and s.notes["stages"] == [2, 6]
    assert s.notes["amplified_tokens"] == 4  # the bytes of "blue"
    assert "fallback" not in s.notes and 0 < s.active_fraction <= 1


@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("tgaa", [False, True])
def test_joint_attention_known_answer(text_first, tgaa):
    """joint_attention with a block mask, rows with different valid text keys and (optionally) TGAA, against one
    masked softmax over the whole joint sequence: video-video limited to the mask, padded text keys never attended,
    text queries dense, and log(scale) added to the cond row's video-to-text logits of the amplified positions."""
    from carnator.backbones.attention_common import joint_attention

    g = torch.Generator().manual_seed(3)
    b, h, n, L, d, blk = 2, 2, 20, 6, 8, 4
    qv, kv, vv = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    qt, kt, vt = (torch.randn(b, h, L, d, generator=g) for _ in range(3))
    valid = torch.ones(b, 1, 1, L, dtype=torch.bool)
    valid[0, ..., 4:] = False  # row 0 (uncond) has 4 valid text tokens, row 1 all 6
    nb = num_blocks(n, blk)
    bms = {br: (torch.rand(h, nb, nb, generator=g) < 0.4) | torch.eye(nb, dtype=torch.bool) for br in (1, 0)}
    ms = BlockMaskSet.empty(num_heads=h, q_len=n, kv_len=n, block=blk)
    for br, m in bms.items():
        ms.add(0, br, 0, m)
    amp = [1, 2]
    plan = AttentionPlan(masks=ms, amplify=Amplification(tuple(amp), 3.0) if tgaa else None)
    ctrl = StepAttention(plan, AttentionSession(), 0, branches=(1, 0))
    out_v, out_t = joint_attention(ctrl, 0, (qv, kv, vv), (qt, kt, vt), text_first=text_first, text_valid=valid)

    def joint(v_part, t_part):
        return torch.cat([t_part, v_part] if text_first else [v_part, t_part], dim=2)

    q, k, v = joint(qv, qt), joint(kv, kt), joint(vv, vt)
    s_len = n + L
    vid = torch.arange(L, s_len) if text_first else torch.arange(n)
    txt = torch.arange(L) if text_first else torch.arange(n, s_len)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    allowed = torch.ones(b, h, s_len, s_len, dtype=torch.bool)
    allowed[..., txt] = valid.expand(b, h, s_len, L)
    for row, br in enumerate(ctrl.branches):
        allowed[row][:, vid[:, None], vid[None, :]] = _element_mask(bms[br], n, blk)
    if tgaa:
        cond = ctrl.branches.index(0)
        logits[cond][:, vid[:, None], txt[amp][None, :]] += math.log(3.0)
    ref = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(out_v, ref[:, :, vid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_t, ref[:, :, txt], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ATTN_FAMILIES)
def test_chorus2_reuses_the_neighbours_block_masks(family, tmp_path):
    cfg = EngineConfig(policy_options={"chorus2": {"sparse": {"apply": "always"}}})  # on the CPU too
    eng = Carnator(tiny_pipeline(family, 0), tmp_path, config=cfg, embedder=hashed_embedder(64))
    settings = {**SETTINGS[family], "num_inference_steps": 3}
    a = eng.generate("a red ball on grass", seed=1, policy="chorus2", **settings)
    b = eng.generate("a blue ball on grass", seed=2, policy="chorus2", **settings)
    assert not a.stats.hit and b.stats.hit and b.stats.source_id == a.stats.entry_id
    assert 0 < b.stats.mask_density <= 1
