"""Colour maths for the Early Signature: sRGB -> CIELAB (D65) and the CIEDE2000 colour difference.

Thin, typed wrappers over scikit-image (``skimage.color.rgb2lab`` and ``deltaE_ciede2000``), which
implement IEC 61966-2-1 sRGB, the CIE 1976 L*a*b* space with the D65 white point and the 2-degree
observer, and CIEDE2000 as specified by Sharma, Wu & Dalal (2005). The test suite checks the 34
reference pairs of that paper to 4 decimals.

Carnator uses them in two places (PAPER steps 4-5): the colour ``c_o`` of a noun is the mean CIELAB
of the decoded pixels inside its Evidence Region on the tail frame (:func:`mean_lab`), and the
colour discrepancies ``d_context`` / ``d_color`` are CIEDE2000 distances (:func:`ciede2000`).
"""

from __future__ import annotations

import numpy as np
from skimage.color import deltaE_ciede2000, rgb2lab

__all__ = ["ciede2000", "mean_lab", "srgb_to_lab"]


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """Convert sRGB to CIELAB (D65, 2-degree observer).

    Args:
        rgb: float array ``(..., 3)`` of gamma-encoded sRGB in ``[0, 1]``. Values slightly outside
            the range (a VAE decode overshoots) are clipped to ``[0, 1]`` first.

    Returns:
        float64 array ``(..., 3)`` of ``(L*, a*, b*)``; ``L*`` in ``[0, 100]``.
    """
    arr = np.asarray(rgb, dtype=np.float64)
    if arr.ndim == 0 or arr.shape[-1] != 3:
        raise ValueError(f"srgb_to_lab expects an array (..., 3), got shape {arr.shape}")
    flat = np.clip(arr.reshape(-1, 1, 3), 0.0, 1.0)
    lab = rgb2lab(flat, illuminant="D65", observer="2")
    return lab.reshape(arr.shape)


def mean_lab(rgb: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray | None:
    """Mean CIELAB colour of the pixels of ``rgb`` selected by ``mask``.

    Each pixel is converted to CIELAB first and the CIELAB values are averaged (the paper's "mean
    CIELAB colour of the pixels inside the region"), which is not the same as converting the mean
    RGB.

    Args:
        rgb: float sRGB image ``(H, W, 3)`` in ``[0, 1]``.
        mask: boolean ``(H, W)``; ``None`` means every pixel.

    Returns:
        ``(3,)`` float64 ``(L*, a*, b*)``, or ``None`` when the mask selects no pixel.
    """
    img = np.asarray(rgb, dtype=np.float64)
    if img.ndim != 3 or img.shape[-1] != 3:
        raise ValueError(f"mean_lab expects an image (H, W, 3), got shape {img.shape}")
    if mask is None:
        pixels = img.reshape(-1, 3)
    else:
        m = np.asarray(mask, dtype=bool)
        if m.shape != img.shape[:2]:
            raise ValueError(f"mask shape {m.shape} does not match image shape {img.shape[:2]}")
        pixels = img[m]
    if pixels.shape[0] == 0:
        return None
    return srgb_to_lab(pixels).mean(axis=0)


def ciede2000(
    lab1: np.ndarray | tuple[float, float, float],
    lab2: np.ndarray | tuple[float, float, float],
    *,
    kL: float = 1.0,
    kC: float = 1.0,
    kH: float = 1.0,
) -> float | np.ndarray:
    """CIEDE2000 colour difference between CIELAB colours (Sharma, Wu & Dalal 2005).

    Args:
        lab1, lab2: arrays ``(..., 3)`` broadcastable to each other.
        kL, kC, kH: the parametric weighting factors (1 under reference conditions, as in the paper).

    Returns:
        a Python ``float`` for single colours, else a float64 array of shape ``(...)``.
    """
    a = np.asarray(lab1, dtype=np.float64)
    b = np.asarray(lab2, dtype=np.float64)
    if a.shape[-1:] != (3,) or b.shape[-1:] != (3,):
        raise ValueError(f"ciede2000 expects arrays (..., 3), got {a.shape} and {b.shape}")
    a, b = np.broadcast_arrays(a, b)
    d = deltaE_ciede2000(a, b, kL=kL, kC=kC, kH=kH, channel_axis=-1)
    d = np.asarray(d, dtype=np.float64)
    return float(d) if d.ndim == 0 else d
