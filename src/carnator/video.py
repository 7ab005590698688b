"""Writing videos with real encoders: H.264 .mp4 through PyAV (FFmpeg's libx264), animated .gif through Pillow."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import InvalidRequestError

#: frame rates the encoders honour: H.264 takes any; a GIF stores each frame's delay in 1/100 s and browsers
#: slow delays under 2/100 s down to 1/10 s, so a GIF plays at most 50 frames a second
MAX_FPS = {".mp4": 240, ".gif": 50}


def check_fps(fps, path: str | Path) -> int:
    """``fps`` if the encoder for ``path``'s extension plays it, else InvalidRequestError."""
    ext = Path(path).suffix.lower()
    most = MAX_FPS.get(ext, 240)
    if not isinstance(fps, (int, np.integer)) or isinstance(fps, bool) or not 1 <= fps <= most:
        raise InvalidRequestError(f"fps must be an integer from 1 to {most} for {ext or 'this'} output, got {fps!r}")
    return int(fps)


def write_video(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """Encode uint8 frames (T, H, W, 3) to ``path`` (.mp4 or .gif) at ``fps`` frames a second (:data:`MAX_FPS`),
    atomically (temp file + rename)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in (".mp4", ".gif"):
        raise InvalidRequestError(f"output must end in .mp4 or .gif, got {path.name!r}")
    fps = check_fps(fps, path)
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError("frames must be uint8 (T, H, W, 3)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    if ext == ".gif":
        from PIL import Image  # a diffusers dependency

        imgs = [Image.fromarray(f) for f in frames]
        imgs[0].save(tmp, format="GIF", save_all=True, append_images=imgs[1:], duration=round(1000 / fps), loop=0)
    else:
        import av

        # H.264 in yuv420p needs even sizes; pad by edge replication if needed.
        h, w = frames.shape[1:3]
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        with av.open(str(tmp), mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=fps)
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"}
            stream.height, stream.width = frames.shape[1:3]
            for f in frames:
                for pkt in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    out.mux(pkt)
            for pkt in stream.encode():
                out.mux(pkt)
    tmp.replace(path)
    return path


def read_video(path: str | Path) -> np.ndarray:
    """Decode a video file to uint8 frames (T, H, W, 3)."""
    import av

    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])
