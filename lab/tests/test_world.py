"""The shapes world: renderer, caption grammar, and the judge validated on rendered ground truth."""

from __future__ import annotations

import re
from itertools import product

import numpy as np
import pytest
import torch

from carnator_lab.world import (
    BACKGROUNDS, COLORS, EDIT_KINDS, HELDOUT_TEMPLATES, MOTIONS, SHAPES, SIZES, TEMPLATES, TRAIN_TEMPLATES, Obj, Scene,
    caption, compatible, edit, judge, nouns, parse, random_style, read, render, sample_scene, sample_scenes, split_of,
    to_uint8, vocabulary,
)
from carnator_lab.world.captions import FILLER, PLACE, PREFIXES, SUFFIXES, Style, word_roles
from carnator_lab.world.render import layout, shape_sdf
from carnator_lab.world.scene import HELDOUT_SHAPE_COLOR, HELDOUT_SHAPE_MOTION

N_CLEAN, N_NOISY = 160, 32
ATTRS = ("shape", "color", "size", "motion")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny CPU ops: torch's thread pool only adds overhead (badly so on a shared machine)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(1234)
    scenes = sample_scenes(N_CLEAN, rng, split=None)
    gen = torch.Generator().manual_seed(1234)
    video, masks = render(scenes, generator=gen)
    noisy = to_uint8(video[:N_NOISY] + 0.03 * torch.randn(video[:N_NOISY].shape, generator=gen))
    clips = to_uint8(video)
    texts = [caption(s, rng, split=None) for s in scenes]
    readings = [read(c) for c in clips]
    return dict(scenes=scenes, clips=clips, masks=masks.numpy(), noisy=noisy, texts=texts, readings=readings, rng=rng)


def _accuracy(scenes, readings, masks):
    """Per-attribute hits, objects matched to ground truth by mask IoU."""
    hits = {a: [] for a in ("background",) + ATTRS}
    clip_ok, ious = [], []
    for i, (sc, rd) in enumerate(zip(scenes, readings)):
        ok = rd.background == sc.background
        hits["background"].append(ok)
        free = list(range(len(rd.objects)))
        for j, o in enumerate(sc.objects):
            gt = masks[i, j]
            cand = [((rd.objects[k].masks & gt).sum() / max((rd.objects[k].masks | gt).sum(), 1), k) for k in free]
            iou, k = max(cand, default=(0.0, None))
            ious.append(iou)
            r = rd.objects[k] if iou > 0.2 else None
            if r is not None:
                free.remove(k)
            for a in ATTRS:
                h = r is not None and getattr(r, a) == getattr(o, a)
                hits[a].append(h)
                ok &= h
        clip_ok.append(ok and not free)  # and no spurious objects
    return {a: float(np.mean(h)) for a, h in hits.items()}, float(np.mean(clip_ok)), float(np.mean(ious))


# ------------------------------------------------------------------------------------------------
# judge on rendered ground truth
# ------------------------------------------------------------------------------------------------

def test_judge_reads_clean_renders(world):
    acc, clip, iou = _accuracy(world["scenes"], world["readings"], world["masks"])
    assert all(v >= 0.98 for v in acc.values()), acc
    assert clip >= 0.98, clip
    assert iou >= 0.95, iou


def test_judge_reads_noisy_renders(world):
    readings = [read(c) for c in world["noisy"]]
    acc, clip, iou = _accuracy(world["scenes"][:N_NOISY], readings, world["masks"][:N_NOISY])
    assert all(v >= 0.95 for v in acc.values()), acc
    assert clip >= 0.9, clip


def test_judge_reads_blurred_renders(world):
    """Generated clips are soft: a Gaussian blur of 1 px (like a VAE decode) must not fool the judge."""
    from scipy import ndimage

    n = 24
    clips = world["clips"][:n].astype(np.float32) / 255
    soft = ndimage.gaussian_filter(clips, sigma=(0, 0, 1.0, 1.0, 0))
    readings = [read(c) for c in soft]
    assert np.median([r.blur for r in readings]) > 0.5
    acc, clip, _ = _accuracy(world["scenes"][:n], readings, world["masks"][:n])
    assert all(v >= 0.95 for v in acc.values()), acc


def test_fidelity_one_on_clean_renders(world):
    reps = [judge(None, t, reading=r) for t, r in zip(world["texts"], world["readings"])]
    fid = np.array([r.fidelity for r in reps])
    assert (fid == 1.0).mean() >= 0.98, fid
    assert np.mean([r.artifact for r in reps]) < 0.001
    assert all(r.checks for r in reps)


@pytest.mark.parametrize("kind", ["noun", "color", "motion", "size", "context"])
def test_fidelity_drops_for_wrong_prompt(world, kind):
    rng = np.random.default_rng(7)
    drops = []
    for sc, rd in list(zip(world["scenes"], world["readings"]))[:40]:
        e = edit(sc, kind, rng)
        right = judge(None, e.source_text, reading=rd)
        wrong = judge(None, e.target_text, reading=rd)
        drops.append(wrong.fidelity < right.fidelity)
    assert np.mean(drops) >= 0.95


def _ghost_pairs(n, seed):
    rng = np.random.default_rng(seed)
    return [edit(sample_scene(rng, n_objects=1), "noun", rng) for _ in range(n)]


def test_ghost_of_substituted_object_raises_artifact():
    pairs = _ghost_pairs(16, 3)
    # the new object alone, and with a half-transparent ghost of the old one elsewhere / in place
    tgt, _ = render([p.target for p in pairs], generator=torch.Generator().manual_seed(0))
    src_elsewhere, _ = render([p.source for p in pairs], generator=torch.Generator().manual_seed(1))
    src_inplace, _ = render([p.source for p in pairs], generator=torch.Generator().manual_seed(0))
    clean = to_uint8(tgt)
    ghost1 = to_uint8(0.5 * tgt + 0.5 * src_elsewhere)
    ghost2 = to_uint8(0.5 * tgt + 0.5 * src_inplace)
    a0 = np.array([judge(clean[i], p.target_text).artifact for i, p in enumerate(pairs)])
    a1 = np.array([judge(ghost1[i], p.target_text).artifact for i, p in enumerate(pairs)])
    a2 = np.array([judge(ghost2[i], p.target_text).artifact for i, p in enumerate(pairs)])
    assert a0.max() < 0.002
    assert (a1 > a0 + 0.002).mean() >= 0.9, (a0, a1)
    assert a2.mean() > a0.mean() + 0.001 and (a2 > a0).mean() >= 0.7, (a0, a2)


def test_judge_accepts_formats():
    sc = Scene("grass", (Obj("star", "red", "big", "left"),))
    v, _ = render([sc])
    text = "a big red star moving left on grass"
    for clip in (v[0], v[0].permute(1, 2, 3, 0), to_uint8(v)[0], v[0].permute(1, 2, 3, 0).numpy()):
        rep = judge(clip, text)
        assert rep.fidelity == 1.0 and rep.background == "grass" and rep.objects[0].shape == "star"
    rep = judge(v[0], "a red star")  # partial prompt: only stated attributes count
    assert rep.fidelity == 1.0 and set(rep.checks) == {"0.shape", "0.color"}
    assert np.isnan(judge(v[0], "hello world").fidelity)
    empty = torch.zeros_like(v[0]) + torch.tensor([0.5, 0.5, 0.5])[:, None, None, None]
    rep = judge(empty, "a red ball moving left on a gray background")
    assert rep.objects == [] and rep.background == "gray" and rep.fidelity == 0.25 and rep.artifact == 0


def test_colour_science_matches_skimage():
    skc = pytest.importorskip("skimage.color")
    from carnator_lab.world.scene import delta_e, srgb_to_lab

    x, y = np.random.default_rng(0).random((2, 5000, 3))
    assert np.allclose(srgb_to_lab(x), skc.rgb2lab(x[:, None])[:, 0], atol=1e-6)
    assert np.allclose(delta_e(srgb_to_lab(x), srgb_to_lab(y)), skc.deltaE_ciede2000(srgb_to_lab(x), srgb_to_lab(y)), atol=1e-6)


# ------------------------------------------------------------------------------------------------
# renderer
# ------------------------------------------------------------------------------------------------

def test_render_shapes_and_determinism():
    scenes = sample_scenes(6, 0, split=None)
    v1, m1 = render(scenes, frames=9, size=32, generator=torch.Generator().manual_seed(5))
    v2, m2 = render(scenes, frames=9, size=32, generator=torch.Generator().manual_seed(5))
    assert v1.shape == (6, 3, 9, 32, 32) and v1.dtype == torch.float32
    assert m1.shape[:2] == (6, max(len(s.objects) for s in scenes)) and m1.dtype == torch.bool
    assert 0 <= v1.min() and v1.max() <= 1
    assert torch.equal(v1, v2) and torch.equal(m1, m2)
    for b, s in enumerate(scenes):
        assert all(m1[b, j].flatten(1).any(1).all() for j in range(len(s.objects)))
        assert not m1[b, len(s.objects):].any()


def test_motion_is_large_and_objects_stay_inside():
    scenes = [Scene("gray", (Obj(sh, "red", sz, m),)) for sh, sz, m in product(SHAPES, SIZES, MOTIONS)]
    L = layout(scenes, generator=torch.Generator().manual_seed(0))
    travel = torch.stack([L.cx[:, 0, -1] - L.cx[:, 0, 0], L.cy[:, 0, -1] - L.cy[:, 0, 0]], -1)
    for s, d in zip(scenes, travel):
        m = s.objects[0].motion
        if m in ("left", "right", "up", "down"):
            assert d.abs().max() >= 20
    bounce = [i for i, s in enumerate(scenes) if s.objects[0].motion == "bouncing"]
    assert ((L.cy[bounce, 0].amax(-1) - L.cy[bounce, 0].amin(-1)) >= 20).all()
    lo = (L.cx - L.ext[..., 0]).amin(), (L.cy - L.ext[..., 1]).amin()
    hi = (L.cx + L.ext[..., 0]).amax(), (L.cy + L.ext[..., 1]).amax()
    assert min(lo) >= 0 and max(hi) <= 63


def test_two_objects_start_apart():
    scenes = sample_scenes(300, 2, n_objects=2, split=None)
    L = layout(scenes, frames=16, generator=torch.Generator().manual_seed(0))
    g = np.arange(64, dtype=np.float32)
    overlap = np.zeros((len(scenes), 16), bool)
    full = []
    for j in range(2):
        sdf = np.stack([
            shape_sdf(s.objects[j].shape, (g[None, None, :] - L.cx[b, j, :, None, None].numpy()) / L.r[b, j, :, None, None].numpy(),
                      (g[None, :, None] - L.cy[b, j, :, None, None].numpy()) / L.r[b, j, :, None, None].numpy())
            for b, s in enumerate(scenes)])
        full.append(sdf <= 0)
    overlap = (full[0] & full[1]).any((2, 3))                      # (B, T)
    assert overlap[:, 0].mean() <= 0.01                            # apart at the start (bar rare infeasible cases)
    assert overlap.any(1).mean() <= 0.15                           # and mostly on every frame


def test_sampler_respects_colours_and_split():
    rng = np.random.default_rng(0)
    for _ in range(500):
        s = sample_scene(rng)
        s.validate()
        assert split_of(s) == "train"
        assert all(compatible(o.color, s.background) for o in s.objects)
        assert len({o.color for o in s.objects}) == len(s.objects)
    assert split_of(sample_scene(rng, split="heldout")) == "heldout"
    with pytest.raises(ValueError):
        Scene("grass", (Obj("circle", "green", "big", "left"),)).validate()


# ------------------------------------------------------------------------------------------------
# captions
# ------------------------------------------------------------------------------------------------

def _scenes(n=60, seed=0):
    return sample_scenes(n, seed, split=None)


def test_parse_inverts_caption_for_every_template():
    for i, sc in enumerate(_scenes()):
        for tpl in TEMPLATES:
            for syn in range(3):
                style = Style(tpl, PREFIXES[i % len(PREFIXES)] if TEMPLATES[tpl].np_start else "",
                              SUFFIXES[(i + syn) % len(SUFFIXES)], (syn + i,) + (syn,) * 3 + (syn + 1,) * 3)
                text = caption(sc, style=style)
                assert parse(text) == sc, (text, parse(text), sc)
    rng = np.random.default_rng(1)
    for sc in _scenes(200, 1):
        text = caption(sc, rng, split=None)
        assert parse(text) == sc, text


def test_word_roles_hand_computed():
    text = "on a grassy field, a small red circle slides to the left and a big box rises"
    P, F = PLACE, FILLER
    assert word_roles(text) == [P, P, P, P, F, 0, 0, 0, 0, 0, 0, 0, F, F, 1, 1, 1]
    # a motion phrase before its noun ("there is ... rising"? no: "you can see" + "is" clauses)
    assert word_roles("a red ball is moving left and a box, 4k") == [F, 0, 0, F, 0, 0, F, F, 1, F]


def test_word_roles_agree_with_parse_for_every_template():
    """The words given to object i parse, alone, to object i; the place words to the background."""
    rng = np.random.default_rng(3)
    for sc in _scenes(40, 2):
        for tpl in TEMPLATES:
            style = random_style(rng, None)
            text = caption(sc, style=Style(tpl, style.prefix if TEMPLATES[tpl].np_start else "", style.suffix, style.syn))
            words = re.findall(r"[a-z0-9]+", text.lower())
            roles = word_roles(text)
            assert len(roles) == len(words)
            for i, o in enumerate(sc.objects):
                assert parse(" ".join(w for w, r in zip(words, roles) if r == i)).objects == (o,), (text, roles)
            assert parse(" ".join(w for w, r in zip(words, roles) if r == PLACE)).background == sc.background, text


def test_captions_read_naturally():
    sc = Scene("grass", (Obj("circle", "red", "small", "left"),))
    assert caption(sc, style=Style("part_bg")) == "a small red ball moving left on grass"
    assert caption(sc, style=Style("bg_fin", syn=(1, 0, 1, 1) + (0,) * 3)) == \
        "on a grassy field, a small red circle slides to the left"
    two = Scene("snow", (Obj("square", "orange", "big", "up"), Obj("star", "blue", "small", "still")))
    t = caption(two, style=Style("part_bg", "a video of", ", 4k"))
    assert t == "a video of a big orange square moving up and a small blue star staying still in the snow, 4k"
    assert caption(Scene("desert", (Obj("ring", "orange", "big", "up"),)), style=Style("part_bg", "a clip of")).startswith("a clip of a big")


def test_parse_partial_and_free_text():
    assert parse("a red ball") == Scene(None, (Obj("circle", "red", None, None),))
    assert parse("Footage of a HUGE blue box bouncing in the snow, 4K!") == \
        Scene("snow", (Obj("square", "blue", "big", "bouncing"),))
    assert parse("something else entirely") == Scene(None, ())


def test_nouns():
    assert nouns("a red ball moving left on grass") == ["ball", "grass"]
    assert nouns("on a grassy field, a small red circle slides to the left and a big box rises") == ["circle", "box", "field"]
    assert nouns("a video of a tiny star at night, 4k") == ["star", "night"]
    assert nouns("a red ball moving left on grass", canonical=True) == ["circle", "grass"]
    rng = np.random.default_rng(2)
    for sc in _scenes(100, 2):
        text = caption(sc, rng, split=None)
        ns = nouns(text)
        assert len(ns) == len(sc.objects) + 1 and all(n == n.lower() and n in text for n in ns)
        assert nouns(text, canonical=True) == [o.shape for o in sc.objects] + [sc.background]


def test_vocabulary_covers_every_caption_word():
    vocab = set(vocabulary())
    assert len(vocab) == len(vocabulary())
    rng = np.random.default_rng(3)
    for sc in _scenes(300, 3):
        for split in ("train", "heldout"):
            words = re.findall(r"[^\s,]+", caption(sc, rng, split=split))
            assert set(words) <= vocab, set(words) - vocab
    for kind in EDIT_KINDS:
        e = edit(_scenes(1, 4)[0], kind, rng)
        assert set(re.findall(r"[^\s,]+", e.target_text)) <= vocab


def test_edits_change_exactly_the_intended_attribute():
    rng = np.random.default_rng(4)
    field = {"noun": "shape", "color": "color", "size": "size", "motion": "motion"}
    for sc in _scenes(120, 4):
        for kind in EDIT_KINDS:
            e = edit(sc, kind, rng)
            assert parse(e.source_text) == sc and parse(e.target_text) == e.target
            assert e.source_text != e.target_text
            e.target.validate()
            if kind == "reword":
                assert e.target == sc
            elif kind == "context":
                assert e.target.background != sc.background and e.target.objects == sc.objects
            else:
                assert e.target.background == sc.background
                for j, (a, b) in enumerate(zip(sc.objects, e.target.objects)):
                    for attr in ATTRS:
                        same = getattr(a, attr) == getattr(b, attr)
                        assert same != (j == e.index and attr == field[kind])
                if kind == "motion":
                    from carnator_lab.world.scene import OPPOSITE_MOTION
                    assert e.target.objects[e.index].motion == OPPOSITE_MOTION[sc.objects[e.index].motion]
                # same wording otherwise: only the edited words differ
                a, b = e.source_text.split(), e.target_text.split()
                assert len(a) != len(b) or sum(x != y for x, y in zip(a, b)) <= 3


def test_heldout_split_is_deterministic_and_disjoint():
    assert set(TRAIN_TEMPLATES).isdisjoint(HELDOUT_TEMPLATES)
    assert set(TRAIN_TEMPLATES) | set(HELDOUT_TEMPLATES) == set(TEMPLATES) and HELDOUT_TEMPLATES
    assert all(random_style(s, "heldout").template in HELDOUT_TEMPLATES for s in range(50))
    assert all(random_style(s, "train").template in TRAIN_TEMPLATES for s in range(50))
    scenes = _scenes(500, 5)
    assert [split_of(s) for s in scenes] == [split_of(s) for s in scenes]
    assert {"train", "heldout"} == {split_of(s) for s in scenes}
    # every attribute value still occurs in training; held-out combinations never do
    train = [s for s in sample_scenes(600, 6, split="train")]
    objs = [o for s in train for o in s.objects]
    assert {o.shape for o in objs} == set(SHAPES) and {o.color for o in objs} == set(COLORS)
    assert {o.motion for o in objs} == set(MOTIONS) and {s.background for s in train} == set(BACKGROUNDS)
    assert not any((o.shape, o.color) in HELDOUT_SHAPE_COLOR or (o.shape, o.motion) in HELDOUT_SHAPE_MOTION for o in objs)
    # held-out templates only recombine words that training captions use
    rng = np.random.default_rng(7)
    train_words = {w for s in sample_scenes(400, 8) for w in re.findall(r"[^\s,]+", caption(s, rng, split="train"))}
    held_words = {w for s in sample_scenes(200, 9) for w in re.findall(r"[^\s,]+", caption(s, rng, split="heldout"))}
    assert held_words <= train_words, held_words - train_words
    with pytest.raises(ValueError):
        edit(Scene("gray", (Obj("circle", "red", "big", "left"),)), "bogus", rng)
