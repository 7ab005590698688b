"""`carnator calibrate` on Wan2.1-T2V-1.3B's configuration with random weights: what a user's run costs per pair,
and where the seconds go (docs/CALIBRATION.md). Random weights certify nothing; the point is the cost.

Builds, in --work: the 1.3B pipeline (Wan2.1-T2V-1.3B's transformer and VAE configurations, UniPC with flow shift 3 as
for 480p, bf16) with random weights, and a random CLIP ViT-B/32 judge (the size of openai/clip-vit-base-patch32), both
saved as directories; then runs `carnator calibrate --model DIR --judge clip=DIR ...` through the CLI.

Stand-ins (no hub on the device): the text encoder is UMT5 with the real width (4096) but 2 layers instead of 24
(UMT5-XXL encodes two short prompts in milliseconds next to 50 steps of the transformer); tokenizers are byte-level; the
recall embedder is carnator.testing.hashed_embedder instead of MiniLM (--real-embedder keeps MiniLM).

    PYTHONPATH=src python scripts/calibrate_wan13b.py --out OUT [--frames 17 --steps 50 --pairs 4]
    PYTHONPATH=src python scripts/calibrate_wan13b.py --tiny --device cpu --out /tmp/x --frames 5 --height 16 --width 16 --steps 6 --resume-step 5  # the same path, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

WARM = ["a red ball on green grass", "a blue cube on yellow sand", "a white cat under a tree", "a black dog in the snow",
        "a small boat on a calm lake", "an old car on a dusty road"]
STREAM = ["a yellow ball on green grass", "a blue cube on white sand", "a grey cat under a tree", "a brown dog in the snow",
          "a small boat on a stormy lake", "an old truck on a dusty road", "a red ball on brown grass", "a white cat under a bush"]


def build_wan(path: Path, device: str, tiny: bool) -> None:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from carnator.testing import byte_tokenizer, tiny_pipeline

    if tiny:
        tiny_pipeline("wan").save_pretrained(path)
        return
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(  # Wan2.1-T2V-1.3B's transformer/config.json
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
            freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=1024).to(torch.bfloat16)
        vae = AutoencoderKLWan()  # its defaults are Wan2.1's VAE (kept in float32, as the model card loads it)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=259, d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64,
                                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                                   decoder_start_token_id=0)).to(torch.bfloat16)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)
    pipe = WanPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder, tokenizer=byte_tokenizer())
    pipe.save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/carnator-wan13b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny Wan and tiny CLIP instead (checks the path on a CPU)")
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--resume-step", type=int, default=None, help="(default: the policy's, 30 of 50)")
    ap.add_argument("--real-embedder", action="store_true")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    import carnator.recall.embedder
    from carnator.cli import main as carnator_main
    from carnator.testing import hashed_embedder, tiny_clip

    if not a.real_embedder:
        carnator.recall.embedder.default_embedder = lambda: hashed_embedder(64)
    t0 = time.perf_counter()
    model, clip = work / "wan", work / "clip"
    if not (model / "model_index.json").exists():
        build_wan(model, a.device, a.tiny)
    if not (clip / "config.json").exists():
        if a.tiny:
            tiny_clip(clip)
        else:  # ViT-B/32's sizes (CLIPConfig's defaults), byte-level vocabulary
            tiny_clip(clip, image_size=224, projection_dim=512,
                      text_config=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
                      vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                         patch_size=32))
    build_s = time.perf_counter() - t0
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(WARM + STREAM) + "\n")
    argv = ["calibrate", "--model", str(model), "--prompts", str(prompts), "--judge", f"clip={clip}", "--pairs", str(a.pairs),
            "--warm", str(len(WARM)), "--device", a.device, "--frames", str(a.frames), "--height", str(a.height),
            "--width", str(a.width), "--steps", str(a.steps), "--guidance", "5", "--out", str(out / "cal"),
            "--cache-dir", str(work / "cache")] + (["--dtype", "bfloat16"] if not a.tiny else []) + (["--resume-step", str(a.resume_step)] if a.resume_step else [])
    print("carnator " + " ".join(argv), flush=True)
    t1 = time.perf_counter()
    code = carnator_main(argv)
    wall = time.perf_counter() - t1
    summary = json.loads((out / "cal" / "calibration.json").read_text()) if code == 0 else {}
    rep = {"code": code, "build_seconds": round(build_s, 1), "calibrate_wall_seconds": round(wall, 1), "argv": argv,
           "seconds_per_pair": summary.get("seconds_per_pair"), "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "torch": torch.__version__, "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if a.device == "cuda" else None,
           "result": summary.get("result")}
    (out / "measure.json").write_text(json.dumps(rep, indent=1, default=str))
    print(json.dumps(rep, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
