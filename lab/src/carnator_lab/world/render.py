"""Vectorised torch renderer for the shapes world.

    from carnator_lab.world import render, sample_scenes
    video, masks = render(sample_scenes(256, rng=0), frames=16, size=64, device="cuda")
    # video (256, 3, 16, 64, 64) float in [0,1]; masks (256, 2, 16, 64, 64) bool

Each shape is a signed distance function (SDF, :func:`carnator.embedded.world.render.shape_sdf`) in units of the object radius, evaluated on the
pixel-centre grid of every frame at once; coverage ``alpha = clamp(0.5 - sdf_px, 0, 1)`` gives
one-pixel anti-aliasing and ``alpha >= 0.5`` the hard mask. The only Python loops are over
object slots (<= 2) and shape kinds (7).

Trajectories (``s = t / (frames - 1)`` in [0, 1]; all lengths scale with ``size``):
left/right/up/down travel ``TRAVEL * size`` (27 px at 64) in a straight line; bouncing starts
on its floor and bounces twice, ``BOUNCE * size`` (22 px) high; growing/shrinking scale
geometrically between ``GROW`` (0.75 -> 1.33: a 1.78x change of radius whose median is 1, so
"small"/"big" hold mid-clip); still stays put.

Start positions are random (from ``generator``) such that the whole trajectory stays inside the
frame (margin ``size / 32``). For two objects, the first of 64 random placements (16 uniform,
then 48 with the objects at opposite ends of a random axis) that keeps them apart on every frame
(disjoint bounding boxes or circumcircles) is kept, else the one that is apart at the start and
overlaps least. With 64x64 frames about 0.2 % of two-object scenes start overlapping (two big
objects, one of them shrinking: no room) and about 7 % overlap later (crossing paths, growth);
the second object is drawn on top.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from carnator.embedded.world.render import CIRCUM, shape_sdf

from .scene import (
    BACKGROUNDS, BOUNCE, COLORS, GROW, MOTIONS, SHAPE_EXTENT, SHAPES, SIZE_RADIUS, TRAVEL, Scene,
)

__all__ = ["render", "Rendered", "layout", "Layout", "shape_sdf", "to_uint8", "trajectories"]


class Rendered(NamedTuple):
    video: torch.Tensor   # (B, 3, T, H, W) float32 in [0, 1]
    masks: torch.Tensor   # (B, n_obj, T, H, W) bool: visible pixels (coverage >= 0.5) of each object


def _tables(device):
    f = dict(dtype=torch.float32, device=device)
    mx = torch.tensor([{"left": -1, "right": 1}.get(m, 0) for m in MOTIONS], **f)
    my = torch.tensor([{"up": -1, "down": 1}.get(m, 0) for m in MOTIONS], **f)
    mb = torch.tensor([m == "bouncing" for m in MOTIONS], **f)
    mg = torch.tensor([{"growing": 1, "shrinking": -1}.get(m, 0) for m in MOTIONS], **f)
    return mx, my, mb, mg


def _encode(scenes: Sequence[Scene], device):
    n = max(len(s.objects) for s in scenes)
    B = len(scenes)
    shape = torch.full((B, n), -1, dtype=torch.long)
    motion = torch.zeros((B, n), dtype=torch.long)
    radius = torch.ones((B, n))
    color = torch.zeros((B, n, 3))
    ext = torch.ones((B, n, 2))
    bg = torch.zeros((B, 2, 3))
    for b, sc in enumerate(scenes):
        sc.validate()
        bg[b] = torch.tensor(BACKGROUNDS[sc.background], dtype=torch.float32) / 255
        for j, o in enumerate(sc.objects):
            shape[b, j] = SHAPES.index(o.shape)
            motion[b, j] = MOTIONS.index(o.motion)
            radius[b, j] = SIZE_RADIUS[o.size]
            color[b, j] = torch.tensor(COLORS[o.color], dtype=torch.float32) / 255
            ext[b, j] = torch.tensor(SHAPE_EXTENT[o.shape])
    return [t.to(device) for t in (shape, motion, radius, color, ext, bg)]


def trajectories(motion: torch.Tensor, frames: int, size: int):
    """Offsets (dx, dy) in pixels and scale, each (..., frames), for motion ids (...)."""
    mx, my, mb, mg = _tables(motion.device)
    s = torch.linspace(0, 1, frames, device=motion.device)
    m = motion[..., None]
    dx = mx[m] * TRAVEL * size * s
    dy = my[m] * TRAVEL * size * s - mb[m] * BOUNCE * size * torch.sin(2 * math.pi * s).abs()
    scale = torch.exp(mg[m] * math.log(GROW[1]) * (2 * s - 1))
    return dx, dy, scale


def _place(present, ext_px, circum, r_px, dx, dy, size, generator, candidates=64):
    """Start centres (B, n, 2) keeping trajectories inside the frame (margin size/32) and apart."""
    B, n = present.shape
    margin = size / 32
    # ext_px: (B, n, T, 2) half extents over time
    lo_x = (margin + ext_px[..., 0] - dx).amax(-1)
    hi_x = (size - 1 - margin - ext_px[..., 0] - dx).amin(-1)
    lo_y = (margin + ext_px[..., 1] - dy).amax(-1)
    hi_y = (size - 1 - margin - ext_px[..., 1] - dy).amin(-1)
    lo = torch.stack([lo_x, lo_y], -1)
    hi = torch.stack([hi_x, hi_y], -1)
    mid = (lo + hi) / 2
    lo, hi = torch.minimum(lo, mid), torch.maximum(hi, mid)
    u = torch.rand((B, candidates, n, 2), generator=generator, device=present.device)
    if n == 2:
        # all but the first 16 candidates put the objects at opposite ends of a random axis
        side = torch.rand((B, candidates, 2), generator=generator, device=present.device)
        axis = (side[..., 0] < 0.5).long()                                  # 0: x, 1: y
        flip = side[..., 1] < 0.5
        near = u[..., 0, :].gather(-1, axis[..., None]).squeeze(-1) * 0.35
        far = 1 - u[..., 1, :].gather(-1, axis[..., None]).squeeze(-1) * 0.35
        a0, a1 = torch.where(flip, far, near), torch.where(flip, near, far)
        split = u.clone()
        split[..., 0, :].scatter_(-1, axis[..., None], a0[..., None])
        split[..., 1, :].scatter_(-1, axis[..., None], a1[..., None])
        u = torch.where((torch.arange(candidates, device=u.device) >= 16)[None, :, None, None], split, u)
    start = lo[:, None] + u * (hi - lo)[:, None]                      # (B, K, n, 2)
    if n == 1:
        return start[:, 0]
    cx = start[..., 0, None] + dx[:, None]                            # (B, K, n, T)
    cy = start[..., 1, None] + dy[:, None]
    ex, ey = ext_px[:, None, ..., 0], ext_px[:, None, ..., 1]
    gx, gy = (cx[:, :, 0] - cx[:, :, 1]).abs(), (cy[:, :, 0] - cy[:, :, 1]).abs()
    box_gap = torch.maximum(gx - ex[:, :, 0] - ex[:, :, 1], gy - ey[:, :, 0] - ey[:, :, 1])
    R = circum[:, None] * r_px[:, None]                                # (B, 1, n, T)
    disc_gap = torch.sqrt(gx * gx + gy * gy) - R[:, :, 0] - R[:, :, 1]
    gap = torch.maximum(box_gap, disc_gap)                            # (B, K, T) > 0: apart
    gap = torch.where(present.all(1)[:, None, None], gap, torch.full_like(gap, 1e6))
    min_gap, gap0 = gap.amin(-1), gap[..., 0]
    k = torch.arange(candidates, device=present.device, dtype=torch.float32)
    key = torch.where(min_gap >= 1.0, 1000.0 - k, torch.where(gap0 >= 1.0, 100.0 + min_gap, min_gap))
    best = key.argmax(1)
    return start[torch.arange(B, device=present.device), best]


class Layout(NamedTuple):
    """Where everything is: per object and frame, in pixels (absent objects: shape -1)."""

    shape: torch.Tensor    # (B, n) long index into SHAPES, -1 if absent
    color: torch.Tensor    # (B, n, 3) float [0,1]
    bg: torch.Tensor       # (B, 2, 3) float [0,1]: top and bottom row colours
    cx: torch.Tensor       # (B, n, T) centre x (bounding-box centre)
    cy: torch.Tensor       # (B, n, T) centre y
    r: torch.Tensor        # (B, n, T) radius
    ext: torch.Tensor      # (B, n, T, 2) half-width, half-height of the bounding box


@torch.no_grad()
def layout(scenes: Sequence[Scene], frames: int = 16, size: int = 64, device="cpu",
           generator: torch.Generator | None = None) -> Layout:
    """Sample start positions and compute every object's trajectory (what :func:`render` draws)."""
    device = torch.device(device)
    shape, motion, radius, color, ext, bg = _encode(scenes, device)
    present = shape >= 0
    dx, dy, scale = trajectories(motion, frames, size)               # (B, n, T)
    r_px = radius[..., None] * size * scale                          # (B, n, T)
    ext_px = ext[:, :, None, :] * r_px[..., None]                    # (B, n, T, 2)
    circum = torch.tensor([CIRCUM[s] for s in SHAPES], device=device)[shape.clamp(min=0)][..., None]
    start = _place(present, ext_px, circum, r_px, dx, dy, size, generator)   # (B, n, 2)
    return Layout(shape, color, bg, start[..., 0, None] + dx, start[..., 1, None] + dy, r_px, ext_px)


@torch.no_grad()
def render(scenes: Sequence[Scene], frames: int = 16, size: int = 64, device="cpu",
           generator: torch.Generator | None = None) -> Rendered:
    """Render complete scenes to ``Rendered(video (B,3,T,H,W) float [0,1], masks (B,n_obj,T,H,W) bool)``.

    ``n_obj`` is the largest object count in the batch (absent objects have empty masks). Masks
    are the visible parts (objects later in ``scene.objects`` are drawn on top). ``generator``
    (a ``torch.Generator`` on ``device``; None: torch's global RNG) jitters start positions.
    Works for any ``frames >= 2`` and ``size`` (geometry scales with ``size``).
    """
    device = torch.device(device)
    shape, color, bg, cx, cy, r_px, _ = layout(scenes, frames, size, device, generator)
    B, n = shape.shape

    grid = torch.arange(size, device=device, dtype=torch.float32)
    rows = grid / max(size - 1, 1)
    video = (bg[:, 0, :, None] * (1 - rows) + bg[:, 1, :, None] * rows)   # (B, 3, H)
    video = video[:, :, None, :, None].expand(B, 3, frames, size, size).contiguous()

    alphas = torch.zeros((B, n, frames, size, size), device=device)
    for j in range(n):
        for si, name in enumerate(SHAPES):
            sel = (shape[:, j] == si).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            r = r_px[sel, j][:, :, None, None]                         # (b, T, 1, 1)
            u = (grid[None, None, None, :] - cx[sel, j][:, :, None, None]) / r
            v = (grid[None, None, :, None] - cy[sel, j][:, :, None, None]) / r
            alphas[sel, j] = (0.5 - shape_sdf(name, u, v) * r).clamp(0, 1)
    for j in range(n):
        a = alphas[:, j, None]                                         # (B, 1, T, H, W)
        video = video * (1 - a) + color[:, j, :, None, None, None] * a
    masks = alphas >= 0.5
    for j in range(n - 1):                       # visible parts only: later objects are on top
        masks[:, j] &= ~masks[:, j + 1:].any(1)
    return Rendered(video.clamp(0, 1), masks)


def to_uint8(video: torch.Tensor):
    """(B, 3, T, H, W) or (3, T, H, W) float [0,1] -> numpy uint8 (B, T, H, W, 3) / (T, H, W, 3)."""
    v = (video.detach().float().clamp(0, 1) * 255 + 0.5).to(torch.uint8)
    v = v.movedim(-4, -1)
    return v.cpu().numpy()
