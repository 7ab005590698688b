"""The shapes' geometry: each shape as a signed distance function, for torch tensors or numpy arrays.

The renderer (carnator-lab's ``carnator_lab.world.render``) draws with it; the judge fits it to what a clip shows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["shape_sdf", "CIRCUM"]

_STAR_R, _STAR_INNER = 1.35, 0.45
_RING_MID, _RING_HALF = 0.8, 0.25          # ring: outer 1.05, inner 0.55
_CROSS_ARM, _CROSS_HALF = 1.1, 0.38
_SQUARE, _DIAMOND = 0.9, 1.25
_TRI_W = 1.25                               # triangle half-width (equilateral, apex up)
#: farthest point of each shape from its bounding-box centre (radius 1), for placement
CIRCUM = {"circle": 1.0, "square": 0.9 * 2**0.5, "triangle": 1.65, "ring": 1.05, "star": 1.45, "diamond": 1.25,
          "cross": math.hypot(1.1, 0.38)}


class _Ops:
    """The few array functions the SDFs need, for torch tensors or numpy arrays."""

    def __init__(self, x):
        t = isinstance(x, torch.Tensor)
        self.sqrt, self.abs, self.maximum, self.minimum, self.where, self.remainder, self.cos, self.sin = (
            (torch.sqrt, torch.abs, torch.maximum, torch.minimum, torch.where, torch.remainder, torch.cos, torch.sin) if t
            else (np.sqrt, np.abs, np.maximum, np.minimum, np.where, np.remainder, np.cos, np.sin))
        self.atan2 = torch.atan2 if t else np.arctan2
        self.relu = (lambda a: a.clamp(min=0)) if t else (lambda a: np.maximum(a, 0))
        self.neg = (lambda a: a.clamp(max=0)) if t else (lambda a: np.minimum(a, 0))


def _box(o, u, v, bx, by):
    qx, qy = o.abs(u) - bx, o.abs(v) - by
    return o.sqrt(o.relu(qx) ** 2 + o.relu(qy) ** 2) + o.neg(o.maximum(qx, qy))


def shape_sdf(shape: str, u, v):
    """Signed distance (negative inside) to ``shape`` of radius 1, bounding box centred on (0, 0).

    ``u`` grows rightwards and ``v`` downwards (image coordinates); broadcasting; torch tensors
    or numpy arrays. Exact or a close approximation (unions and convex polygons: min / max of
    part distances), good enough for anti-aliasing.
    """
    o = _Ops(u)
    if shape == "circle":
        return o.sqrt(u * u + v * v) - 1.0
    if shape == "square":
        return _box(o, u, v, _SQUARE, _SQUARE)
    if shape == "diamond":
        return (o.abs(u) + o.abs(v) - _DIAMOND) * (0.5**0.5)
    if shape == "ring":
        return o.abs(o.sqrt(u * u + v * v) - _RING_MID) - _RING_HALF
    if shape == "cross":
        return o.minimum(_box(o, u, v, _CROSS_ARM, _CROSS_HALF), _box(o, u, v, _CROSS_HALF, _CROSS_ARM))
    if shape == "triangle":
        w = _TRI_W
        h = w * 3**0.5
        h2 = h / 2
        n = math.hypot(h, w)
        base = v - h2
        left = (-h * u - w * v - w * h2) / n
        right = (h * u - w * v - w * h2) / n
        return o.maximum(base, o.maximum(left, right))
    if shape == "star":
        R, Ri, an = _STAR_R, _STAR_R * _STAR_INNER, math.pi / 5
        x = o.abs(u)
        y = -v + R * (1 - math.cos(an)) / 2        # y up, star centre such that its bbox is centred
        theta = o.atan2(x, y)                       # angle from "up"; a point of the star is at 0
        bn = o.remainder(theta, 2 * an) - an
        rho = o.sqrt(x * x + y * y)
        qx, qy = rho * o.cos(bn), rho * o.abs(o.sin(bn))
        ax, ay = R * math.cos(an), R * math.sin(an)  # outer vertex in the reduced sector
        bx, by = Ri, 0.0                             # inner vertex
        ex, ey = bx - ax, by - ay
        t = ((qx - ax) * ex + (qy - ay) * ey) / (ex * ex + ey * ey)
        t = o.minimum(o.relu(t), 1.0) if isinstance(t, np.ndarray) else t.clamp(0, 1)
        d = o.sqrt((qx - ax - t * ex) ** 2 + (qy - ay - t * ey) ** 2)
        cross = ex * (qy - ay) - ey * (qx - ax)
        return o.where(cross < 0, -d, d)
    raise ValueError(f"unknown shape {shape!r}")
