"""The types one request passes through: :class:`Request` in, :class:`Result` (frames + :class:`Stats`) out."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class Request:
    """A fully resolved generation request (every optional setting filled in from the model's defaults)."""

    prompt: str
    seed: int
    num_inference_steps: int
    num_frames: int
    height: int
    width: int
    guidance_scale: float
    negative_prompt: str | None = None
    tenant: str = "default"

    def settings(self) -> dict:
        """The generation settings that decide whether two requests' trajectories are comparable."""
        return {
            "num_inference_steps": self.num_inference_steps,
            "num_frames": self.num_frames,
            "height": self.height,
            "width": self.width,
            "guidance_scale": float(self.guidance_scale),
        }

    def exact_key(self, model_identity: str) -> str:
        """Key of the exact-hit tier: identical prompt, negative prompt, seed, settings, model and tenant."""
        payload = {
            "model": model_identity,
            "tenant": self.tenant,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": int(self.seed),
            **self.settings(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass
class Stats:
    """What happened to one request. Timings are seconds per stage."""

    policy: str = "dense"
    hit: bool = False
    exact_hit: bool = False
    source_id: str | None = None
    resume_step: int | None = None
    active_fraction: float | None = None
    mask_density: float | None = None
    entry_id: str | None = None
    dit_forwards: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Result:
    """Generated video and what it cost."""

    frames: np.ndarray  # uint8 (T, H, W, 3)
    stats: Stats
    request: Request
    video: np.ndarray | None = None  # float32 (T, H, W, 3) in [0, 1], as the diffusers pipeline returns with output_type="np"


def to_uint8(video: np.ndarray) -> np.ndarray:
    """Float video in [0, 1] to uint8, rounding like diffusers' ``numpy_to_pil``."""
    return (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)
