"""Carnator's attention processors on the non-Wan families, against diffusers' own transformers.

On each family's tiny offline pipeline, the transformer is called with exactly the inputs the
adapter's ``predict`` gives it (one CFG batch), once with diffusers' processors (the reference) and
once with carnator's installed:

- a controller that asks for nothing reproduces diffusers' output;
- an all-True block mask equals dense; a mask that drops blocks equals diffusers' own processor with
  its self-attention SDPA replaced by SDPA under the expanded element mask (joint families: the
  video-video part masked, text keys and text queries always attended);
- the probe record: cross-attention (heads, N, positions) equal to the softmax of the module's own
  Q and K over the text keys (rows sum to <= 1); self-attention LSE equal to the dense one;
- the Active-token window: with Context = every token, Active tokens equal the dense block's outputs
  and the others pass unchanged;
- TGAA: scale 1 is bit-identical; another scale changes the cond row only;
- ``Carnator(pipe).generate(..., policy="carnator")`` hits a warm cache and reports a mask density.
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
from carnator.attention.controller import Amplification, WindowPlan
from carnator.backbones import adapter_for
from carnator.reuse import Thresholds
from carnator.testing import TINY_SETTINGS, hashed_embedder, tiny_pipeline

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

PROMPT = "a small red ball moving left on grass"
ATTN_FAMILIES = ["ltx", "cogvideox"]
# Sizes with a few blocks of tokens: LTX 3 x 8 x 8 = 192 tokens (blocks of 16); CogVideoX at 64 x 64, 3 x 4 x 4 = 48 (blocks of 8).
SETTINGS = {"ltx": TINY_SETTINGS["ltx"], "cogvideox": {**TINY_SETTINGS["cogvideox"], "height": 64, "width": 64}}
BLOCKS = {"ltx": 16, "cogvideox": 8}
JOINT = {"cogvideox"}


# ------------------------------------------------------------------------------------------- setup


class Case:
    """One family's tiny pipeline, adapter, and the transformer inputs of one ``predict`` call."""

    def __init__(self, family: str):
        self.family = family
        self.pipe = tiny_pipeline(family, 0)
        self.ad = adapter_for(self.pipe)
        self.req = self.ad.resolve(PROMPT, seed=0, **SETTINGS[family])
        self.block = BLOCKS[family]
        self.joint = family in JOINT
        self.diffusers_processors = [(b.attn1.processor, getattr(b, "attn2", b.attn1).processor) for b in self.blocks()]
        cond = self.ad.encode(self.req)
        lat = self.ad.prepare_latents(self.req, self.ad.make_generator(self.req))
        ts = self.ad.timesteps(self.req)
        self.kwargs: dict = {}
        tr = self.ad.transformer
        h = tr.register_forward_pre_hook(lambda m, a, kw: self.kwargs.update(kw), with_kwargs=True)
        try:
            self.ad.predict(lat, ts[0], 0, cond, self.req)
        finally:
            h.remove()
        self.branches = (1, 0) if cond.do_cfg else (0,)
        self.n = math.prod(self.ad.token_grid(self.req))

    @property
    def tr(self):
        return self.ad.transformer

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.tr(**self.kwargs)[0].float()

    def controller(self):
        ctrl = self.ad.attention()
        ctrl.reset()
        ctrl.branches, ctrl.step = self.branches, 0
        return ctrl

    def blocks(self):
        return self.tr.transformer_blocks

    def self_attn(self, layer: int):
        return self.blocks()[layer].attn1

    @contextlib.contextmanager
    def diffusers(self):
        """Diffusers' own processors for the duration (carnator's window-aware block forwards stay, idle)."""
        saved = [(b.attn1.processor, getattr(b, "attn2", b.attn1).processor) for b in self.blocks()]
        for b, (p1, p2) in zip(self.blocks(), self.diffusers_processors):
            b.attn1.set_processor(p1)
            if hasattr(b, "attn2"):
                b.attn2.set_processor(p2)
        try:
            yield
        finally:
            for b, (p1, p2) in zip(self.blocks(), saved):
                b.attn1.set_processor(p1)
                if hasattr(b, "attn2"):
                    b.attn2.set_processor(p2)


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
    """Diffusers' own processors, with each layer's self-attention SDPA under ``masks[layer]`` ((B, H, nb, nb)):
    for a joint attention (text first), the video-video part masked, text rows and columns kept."""
    layer_of = {id(b.attn1): i for i, b in enumerate(case.blocks())}
    current: list[int] = []
    hooks = [b.attn1.register_forward_pre_hook(lambda m, a: current.append(layer_of[id(m)])) for b in case.blocks()]

    def elem_for(layer: int, n_q: int) -> torch.Tensor:
        e = _element_mask(masks[layer], case.n, case.block)
        txt = n_q - case.n  # joint: text tokens first
        if txt:
            b, h = e.shape[:2]
            e = torch.cat([torch.ones(b, h, case.n, txt, dtype=torch.bool), e], dim=-1)
            e = torch.cat([torch.ones(b, h, txt, n_q, dtype=torch.bool), e], dim=-2)
        return e

    with case.diffusers():
        if case.family == "ltx":
            import diffusers.models.transformers.transformer_ltx as mod

            orig = mod.dispatch_attention_fn

            def dispatch(q, k, v, attn_mask=None, **kw):  # q, k, v: (B, S, H, D)
                if attn_mask is None and q.shape[1] == k.shape[1] == case.n and current:
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=elem_for(current.pop(), case.n))
                    return o.transpose(1, 2)
                return orig(q, k, v, attn_mask=attn_mask, **kw)

            name, patched = "dispatch_attention_fn", dispatch
        else:
            import diffusers.models.attention_processor as mod

            orig = mod.F

            def sdpa(q, k, v, attn_mask=None, **kw):  # q, k, v: (B, H, S, D), the joint sequence
                assert attn_mask is None and current
                return F.scaled_dot_product_attention(q, k, v, attn_mask=elem_for(current.pop(), q.shape[2]), **kw)

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
    their text keys K_t (H, L, d) with the text logit bias (H or 1, 1, L) or None, and video keys K_v (H, N, d)."""
    blk = case.blocks()[layer]
    got = {}

    def grab(name):
        def hook(m, a, kw):
            got.setdefault(name, (a, kw))
        return hook

    hooks = [blk.attn1.register_forward_pre_hook(grab("attn1"), with_kwargs=True)]
    if hasattr(blk, "attn2"):
        hooks.append(blk.attn2.register_forward_pre_hook(grab("attn2"), with_kwargs=True))
    try:
        case.forward()
    finally:
        for h in hooks:
            h.remove()
    b = case.branches.index(0)
    a1 = blk.attn1
    heads = a1.heads

    def arg(call, i, name):
        a, kw = call
        return kw[name] if name in kw else a[i]

    with torch.no_grad():
        if case.family == "ltx":
            from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

            x = arg(got["attn1"], 0, "hidden_states")[b : b + 1]
            rope = arg(got["attn1"], 3, "image_rotary_emb")
            rope = tuple(r[b : b + 1] for r in rope)
            qv = apply_rotary_emb(a1.norm_q(a1.to_q(x)), rope).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            kv = apply_rotary_emb(a1.norm_k(a1.to_k(x)), rope).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            a2 = blk.attn2
            x2 = arg(got["attn2"], 0, "hidden_states")[b : b + 1]
            enc = arg(got["attn2"], 1, "encoder_hidden_states")[b : b + 1]
            q2 = a2.norm_q(a2.to_q(x2)).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            kt = a2.norm_k(a2.to_k(enc)).unflatten(2, (heads, -1)).transpose(1, 2)[0]
            bias = arg(got["attn2"], 2, "attention_mask")[b].view(1, 1, -1)
            return q2, kt, bias, qv, kv
        from diffusers.models.embeddings import apply_rotary_emb

        x = arg(got["attn1"], 0, "hidden_states")[b : b + 1]
        enc = arg(got["attn1"], 1, "encoder_hidden_states")[b : b + 1]
        rope = arg(got["attn1"], 3, "image_rotary_emb")
        j = torch.cat([enc, x], dim=1)
        q = a1.norm_q(a1.to_q(j).unflatten(2, (heads, -1)).transpose(1, 2))
        k = a1.norm_k(a1.to_k(j).unflatten(2, (heads, -1)).transpose(1, 2))
        L = enc.shape[1]
        qv, kv = apply_rotary_emb(q[:, :, L:], rope)[0], apply_rotary_emb(k[:, :, L:], rope)[0]
        return qv, k[0, :, :L], None, qv, kv


# ------------------------------------------------------------------------------------------- tests


def test_adapter_declares_attention(case):
    assert case.ad.supports_attention
    assert case.ad.num_layers() == len(case.blocks())


def test_idle_controller_reproduces_diffusers(case):
    case.controller()
    with case.diffusers():
        ref = case.forward()
    out = case.forward()
    assert type(case.self_attn(0).processor).__module__.startswith("carnator.")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_all_true_mask_equals_dense(case):
    ctrl = case.controller()
    dense = case.forward()
    heads, nb = case.self_attn(0).heads, num_blocks(case.n, case.block)
    ctrl.use_masks(_masks(case, lambda layer, br: torch.ones(heads, nb, nb, dtype=torch.bool)))
    torch.testing.assert_close(case.forward(), dense, rtol=1e-5, atol=1e-6)


def test_dropping_mask_equals_masked_sdpa_reference(case):
    ctrl = case.controller()
    dense = case.forward()
    ms = _masks(case, lambda layer, br: _dropping_mask(case, layer, br))
    assert 0.2 < ms.density < 0.9
    ctrl.use_masks(ms)
    out = case.forward()
    ctrl.reset()
    per_layer = {
        layer: torch.stack([_dropping_mask(case, layer, br) for br in case.branches]) for layer in range(case.ad.num_layers())
    }
    with _masked_reference(case, per_layer):
        ref = case.forward()
    assert (out - dense).abs().max() > 1e-3
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_capture_records_every_layer_and_branch(case):
    ctrl = case.controller()
    from carnator.attention.controller import SparseConfig

    ctrl.sparse = SparseConfig(block=case.block, p=0.9)
    case.forward()
    c = ctrl.captured
    assert c is not None and c.q_len == case.n and c.block == case.block
    assert 0 < c.density <= 1
    for layer in range(case.ad.num_layers()):
        for br in case.branches:
            assert c.nearest(0, br, layer) is not None


def test_recording_matches_dense_softmax(case):
    ad = case.ad
    pos = ad.word_token_positions(PROMPT, "ball")
    ids = ad.prompt_token_ids(PROMPT)
    assert ad.pipe.tokenizer.decode([ids[p - ad.text_offset()] for p in pos]).strip() == "ball"
    ctrl = case.controller()
    ctrl.record_step, ctrl.record_layer, ctrl.record_positions = 0, 0, list(pos)
    q, kt, bias, qv, kv = _reference_qk(case, 0)
    ev = ctrl.evidence
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
    ctrl = case.controller()
    inp, dense_out, dense_txt = _block_io(case, 0)
    g = torch.Generator().manual_seed(5)
    active = torch.sort(torch.randperm(case.n, generator=g)[: case.n // 3]).values
    ctrl.window = WindowPlan(range(1), active, torch.arange(case.n))
    inp_w, out_w, txt_w = _block_io(case, 0)
    torch.testing.assert_close(inp_w, inp)
    torch.testing.assert_close(out_w[:, active], dense_out[:, active], rtol=1e-5, atol=1e-5)
    if case.joint:  # text tokens: recomputed, reading every text token and the Context (here all) video tokens
        torch.testing.assert_close(txt_w, dense_txt, rtol=1e-5, atol=1e-5)
    rest = torch.ones(case.n, dtype=torch.bool)
    rest[active] = False
    assert torch.equal(out_w[:, rest], inp[:, rest])
    # a smaller Context changes the Active tokens
    ctrl.window = WindowPlan(range(1), active, active)
    _, out_c, _ = _block_io(case, 0)
    assert (out_c[:, active] - dense_out[:, active]).abs().max() > 1e-4


def test_tgaa_amplifies_the_cond_row_only(case):
    ctrl = case.controller()
    dense = case.forward()
    pos = case.ad.word_token_positions(PROMPT, "ball")
    ctrl.amplify = Amplification(pos, 1.0)
    assert torch.equal(case.forward(), dense)
    ctrl.amplify = Amplification(pos, 4.0)
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
    cfg = EngineConfig(policy_options={"carnator": {"resume_step": 4, "thresholds": str(tau)}})
    eng = Carnator(pipe, tmp_path / "cache", config=cfg, embedder=hashed_embedder(64), adapter=ad)
    settings = {**SETTINGS[family], "num_inference_steps": steps}
    a = eng.generate("a small red ball moving left on grass", seed=1, **settings)
    assert not a.stats.hit
    entry = eng.bank.load(a.stats.entry_id)
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
