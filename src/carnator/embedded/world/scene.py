"""The shapes world's vocabularies, scene description and colour science: what reading a caption and a clip needs.

A :class:`Scene` is a background plus one or two :class:`Obj` (shape, colour, size, motion).
Everything is a short lower-case string id from the tuples below, so scenes are hashable,
comparable and trivially serialisable (``dataclasses.asdict``).

Geometry lives in units of the frame side (``size``): object radii are ``SIZE_RADIUS[size] * size``
pixels and each shape's extent is ``SHAPE_EXTENT[shape] * radius`` (half-width, half-height).
Colours are sRGB 0..255 triples, chosen far apart in CIELAB (CIEDE2000 >= 19 between object
colours; an object colour is only used on a background it differs from by >= 25, see
:func:`compatible`). The world's motions' geometry, held-out split and sampler are carnator-lab's
(``carnator_lab.world.scene``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------------------
# vocabularies (ids; the caption grammar maps them to words)
# --------------------------------------------------------------------------------------------

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "ring", "star", "diamond", "cross")

#: object colours, sRGB 0..255
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 35),
    "orange": (250, 140, 20),
    "yellow": (250, 225, 40),
    "green": (30, 165, 55),
    "cyan": (40, 215, 225),
    "blue": (35, 70, 225),
    "purple": (150, 40, 170),
    "pink": (250, 125, 195),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}

#: backgrounds: (top row colour, bottom row colour), a mild linear vertical gradient
BACKGROUNDS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "sky": ((75, 145, 230), (140, 190, 245)),
    "grass": ((95, 150, 65), (70, 125, 45)),
    "snow": ((228, 234, 242), (205, 213, 225)),
    "desert": ((230, 200, 140), (210, 175, 115)),
    "night": ((12, 16, 50), (35, 40, 85)),
    "gray": ((128, 128, 128), (128, 128, 128)),
    "teal": ((30, 110, 110), (30, 110, 110)),
    "maroon": ((110, 30, 50), (110, 30, 50)),
}

SIZES: tuple[str, ...] = ("small", "big")
#: object radius as a fraction of the frame side (7 px and 11 px at 64x64)
SIZE_RADIUS: dict[str, float] = {"small": 7 / 64, "big": 11 / 64}

MOTIONS: tuple[str, ...] = ("left", "right", "up", "down", "bouncing", "still", "growing", "shrinking")


#: shape half-extents (half-width, half-height) in units of the object radius; the bounding box
#: of every shape is centred on the object's position
SHAPE_EXTENT: dict[str, tuple[float, float]] = {
    "circle": (1.0, 1.0),
    "square": (0.9, 0.9),
    "triangle": (1.25, 1.25 * 3**0.5 / 2),
    "ring": (1.05, 1.05),
    "star": (1.35 * float(np.sin(np.radians(72))), 1.35 * (1 + float(np.cos(np.radians(36)))) / 2),
    "diamond": (1.25, 1.25),
    "cross": (1.1, 1.1),
}

BACKGROUNDS_LIST: tuple[str, ...] = tuple(BACKGROUNDS)
COLORS_LIST: tuple[str, ...] = tuple(COLORS)

#: minimum CIEDE2000 distance between an object colour and (both ends of) its background
MIN_CONTRAST = 25.0


@dataclass(frozen=True)
class Obj:
    """One object. ``None`` fields only occur in partial scenes returned by ``captions.parse``."""

    shape: str | None
    color: str | None
    size: str | None
    motion: str | None


@dataclass(frozen=True)
class Scene:
    """A background and 1-2 objects (drawn in order: the second is on top)."""

    background: str | None
    objects: tuple[Obj, ...] = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "objects", tuple(self.objects))

    def validate(self) -> "Scene":
        """Raise ValueError unless this is a complete scene the renderer and sampler accept."""
        if self.background not in BACKGROUNDS:
            raise ValueError(f"unknown background {self.background!r}")
        if not 1 <= len(self.objects) <= 2:
            raise ValueError("a scene has 1 or 2 objects")
        for o in self.objects:
            if o.shape not in SHAPES or o.color not in COLORS or o.size not in SIZES or o.motion not in MOTIONS:
                raise ValueError(f"incomplete or unknown object {o}")
            if not compatible(o.color, self.background):
                raise ValueError(f"{o.color} has too little contrast on {self.background}")
        return self

    def replace_object(self, i: int, **changes) -> "Scene":
        objs = list(self.objects)
        objs[i] = Obj(**{**objs[i].__dict__, **changes})
        return Scene(self.background, tuple(objs))


# --------------------------------------------------------------------------------------------
# colour science (numpy only, matches skimage's rgb2lab / deltaE_ciede2000; the judge uses these)
# --------------------------------------------------------------------------------------------

_RGB2XYZ = np.array([[0.412453, 0.357580, 0.180423],
                     [0.212671, 0.715160, 0.072169],
                     [0.019334, 0.119193, 0.950227]])
_WHITE = np.array([0.95047, 1.0, 1.08883])          # D65, 2° observer (as skimage)


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0,1] (..., 3) -> CIELAB (D65). Keeps float32 input float32, else float64."""
    rgb = np.asarray(rgb)
    dt = np.float32 if rgb.dtype == np.float32 else np.float64
    c: np.ndarray[Any, np.dtype[np.floating]] = rgb.astype(dt, copy=False)
    lin = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = lin @ (_RGB2XYZ / _WHITE[:, None]).T.astype(dt)
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def delta_e(lab1: np.ndarray, lab2: np.ndarray) -> np.ndarray:
    """CIEDE2000 colour difference, broadcasting over leading dims."""
    L1, a1, b1 = np.moveaxis(np.asarray(lab1, np.float64), -1, 0)
    L2, a2, b2 = np.moveaxis(np.asarray(lab2, np.float64), -1, 0)
    c7 = ((np.hypot(a1, b1) + np.hypot(a2, b2)) / 2) ** 7
    g = 0.5 * (1 - np.sqrt(c7 / (c7 + 25.0**7)))
    a1, a2 = a1 * (1 + g), a2 * (1 + g)
    C1, C2 = np.hypot(a1, b1), np.hypot(a2, b2)
    h1, h2 = np.arctan2(b1, a1) % (2 * np.pi), np.arctan2(b2, a2) % (2 * np.pi)
    zero = C1 * C2 == 0
    dh = h2 - h1
    dh = np.where(dh > np.pi, dh - 2 * np.pi, np.where(dh < -np.pi, dh + 2 * np.pi, dh))
    dh = np.where(zero, 0.0, dh)
    dL, dC, dH = L2 - L1, C2 - C1, 2 * np.sqrt(C1 * C2) * np.sin(dh / 2)
    Lm, Cm = (L1 + L2) / 2, (C1 + C2) / 2
    hm = (h1 + h2) / 2
    hm = np.where(np.abs(h1 - h2) > np.pi, np.where(h1 + h2 < 2 * np.pi, hm + np.pi, hm - np.pi), hm)
    hm = np.where(zero, h1 + h2, hm)
    t = (1 - 0.17 * np.cos(hm - np.radians(30)) + 0.24 * np.cos(2 * hm) + 0.32 * np.cos(3 * hm + np.radians(6))
         - 0.20 * np.cos(4 * hm - np.radians(63)))
    dtheta = np.radians(30) * np.exp(-(((np.degrees(hm) - 275) / 25) ** 2))
    cm7 = Cm**7
    rt = -np.sin(2 * dtheta) * 2 * np.sqrt(cm7 / (cm7 + 25.0**7))
    sl = 1 + 0.015 * (Lm - 50) ** 2 / np.sqrt(20 + (Lm - 50) ** 2)
    sc, sh = 1 + 0.045 * Cm, 1 + 0.015 * Cm * t
    return np.sqrt((dL / sl) ** 2 + (dC / sc) ** 2 + (dH / sh) ** 2 + rt * (dC / sc) * (dH / sh))


def _lab(c) -> np.ndarray:
    return srgb_to_lab(np.asarray(c, float) / 255.0)


def _contrast_table() -> dict[tuple[str, str], float]:
    out = {}
    for bg, (top, bot) in BACKGROUNDS.items():
        for c, rgb in COLORS.items():
            out[c, bg] = float(min(delta_e(_lab(rgb), _lab(top)), delta_e(_lab(rgb), _lab(bot))))
    return out


CONTRAST: dict[tuple[str, str], float] = _contrast_table()


def compatible(color: str, background: str) -> bool:
    """Whether ``color`` may be drawn on ``background`` (far enough from it; never 'equal')."""
    return CONTRAST[color, background] >= MIN_CONTRAST


def colors_for(background: str) -> list[str]:
    return [c for c in COLORS if compatible(c, background)]


def backgrounds_for(colors) -> list[str]:
    return [b for b in BACKGROUNDS if all(compatible(c, b) for c in colors)]
