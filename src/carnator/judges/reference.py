"""Reference scores of a clip against the dense clip of the same request (the paper's comparison), and its flicker.

- ``ssim``: mean over frames of the structural similarity (scikit-image, RGB, data range 255; the window shrinks to
  the frame for frames under 7 px), 1 for identical clips, higher is better.
- ``psnr``: peak signal-to-noise ratio over the whole clip in dB (scikit-image), ``inf`` for identical clips, higher is
  better.
- ``flicker``: the clip's own temporal flicker, the mean absolute change between consecutive frames in [0, 1] (0: a
  still clip), lower is better; it needs no reference. (VBench's temporal_flickering is ``1 - flicker`` on static
  prompts.)

Without a reference, ``ssim`` and ``psnr`` are NaN.
"""

from __future__ import annotations

import math

import numpy as np

from . import HIGHER, LOWER

REFERENCE_DIRECTIONS = {"ssim": HIGHER, "psnr": HIGHER, "flicker": LOWER}


def _clip(frames) -> np.ndarray:
    a = np.asarray(frames)
    if a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"expected frames T x H x W x 3, got shape {a.shape}")
    return a


def ssim(frames, reference) -> float:
    """Mean per-frame SSIM of two uint8 clips (T x H x W x 3) of one shape."""
    from skimage.metrics import structural_similarity

    a, b = _clip(frames), _clip(reference)
    if a.shape != b.shape:
        raise ValueError(f"ssim: clips of shapes {a.shape} and {b.shape}")
    side = min(a.shape[1], a.shape[2])
    win = min(7, side if side % 2 else side - 1)
    return float(np.mean([structural_similarity(x, y, channel_axis=-1, data_range=255, win_size=win) for x, y in zip(a, b)]))


def psnr(frames, reference) -> float:
    """PSNR in dB of two uint8 clips of one shape over all their pixels; ``inf`` when identical."""
    from skimage.metrics import peak_signal_noise_ratio

    a, b = _clip(frames), _clip(reference)
    if a.shape != b.shape:
        raise ValueError(f"psnr: clips of shapes {a.shape} and {b.shape}")
    if np.array_equal(a, b):
        return math.inf
    return float(peak_signal_noise_ratio(b, a, data_range=255))


def flicker(frames) -> float:
    """Mean absolute change between consecutive frames of a uint8 clip, in [0, 1]; 0 for a single frame."""
    a = _clip(frames).astype(np.float32)
    if len(a) < 2:
        return 0.0
    return float(np.abs(np.diff(a, axis=0)).mean() / 255.0)


def reference_scores(frames, reference=None) -> dict[str, float]:
    """``ssim``, ``psnr`` (NaN without ``reference``) and ``flicker`` of ``frames``."""
    out = {"ssim": math.nan, "psnr": math.nan}
    if reference is not None:
        out = {"ssim": ssim(frames, reference), "psnr": psnr(frames, reference)}
    out["flicker"] = flicker(frames)
    return out


class ReferenceJudge:
    """Reference scores only (no model): ``--judge reference``. Default rule: SSIM against dense at least 0.5 (a floor;
    the paper has no reference metric, the value is ours) and flicker at most dense's + 0.02."""

    name = "reference"
    identity = "reference:v1"
    directions = dict(REFERENCE_DIRECTIONS)
    default_deltas = {"flicker": 0.02}
    default_floors = {"ssim": 0.5}

    def score(self, frames, prompt: str, reference=None) -> dict[str, float]:
        return reference_scores(frames, reference)


def reference_judge(arg: str | None = None, **_) -> ReferenceJudge:
    if arg:
        raise ValueError("the reference judge takes no argument")
    return ReferenceJudge()
