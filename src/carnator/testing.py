"""Offline tiny pipelines of every supported family, for tests (ours and users').

Nothing here touches a model hub: tokenizers are byte-level BPE models built with the
``tokenizers`` library (3 specials + 256 byte tokens, no merges) and every model is built from a
small config with seeded random weights. The outputs are noise, but the pipelines run their real
code paths, so ``Carnator(pipe)`` can be checked against ``pipe(...)`` exactly.

    from carnator.testing import tiny_pipeline
    pipe = tiny_pipeline("wan")
"""

from __future__ import annotations

import torch

FAMILIES = ("wan", "ltx", "hunyuan", "cogvideox")


def byte_tokenizer(model_max_length: int = 512, *, eos: bool = True, bos: bool = False):
    """A ``PreTrainedTokenizerFast`` over raw bytes: ids 0..2 are <pad>, </s>, <s>; byte b is 3 + b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2}
    # ByteLevel maps each byte to a printable unicode char (GPT-2's table); give each a fixed id in byte order.
    b2u = _bytes_to_unicode()
    for b in range(256):
        vocab[b2u[b]] = 3 + b
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    single = "$A"
    special = []
    if bos:
        single = "<s> " + single
        special.append(("<s>", 2))
    if eos:
        single = single + " </s>"
        special.append(("</s>", 1))
    tk.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(single=single, special_tokens=special)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        model_max_length=model_max_length,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ``pre_tokenizers.ByteLevel`` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


def _ready(pipe):
    """Every component in inference mode, as ``from_pretrained`` leaves them, and no progress bars.

    Models built from a config start in training mode, where the text encoders' dropout would make
    each encoding of a prompt different (and depend on the global RNG).
    """
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_wan(seed: int = 0, *, expand_timesteps: bool = False):
    """A tiny WanPipeline (Wan2.1 layout; ``expand_timesteps=True`` gives the Wan2.2-TI2V code path)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    _seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    _seed(seed)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    cfg = UMT5Config(vocab_size=259, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    text_encoder = UMT5EncoderModel(cfg)
    tokenizer = byte_tokenizer()
    _seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    pipe = WanPipeline(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer,
                       expand_timesteps=expand_timesteps)
    return _ready(pipe.to(torch.float32))


def tiny_ltx(seed: int = 0, *, timestep_conditioning: bool = False):
    """A tiny LTXPipeline (LTX-Video 0.9.0 layout; ``timestep_conditioning=True`` gives the 0.9.1+ VAE decode path)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    _seed(seed)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
        cross_attention_dim=32, num_layers=1, caption_channels=32,
    )
    _seed(seed)
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1), timestep_conditioning=timestep_conditioning, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    _seed(seed)
    text_encoder = _tiny_t5(d_model=32)
    # LTX-Video's own scheduler settings: the shift depends on the token count (the pipeline's ``mu``).
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096
    )
    pipe = LTXPipeline(transformer=transformer, vae=vae, scheduler=scheduler,
                       text_encoder=text_encoder, tokenizer=byte_tokenizer(128))
    return _ready(pipe)  # float32 already


def tiny_hunyuan(seed: int = 0):
    """A tiny HunyuanVideoPipeline (Llama + CLIP text encoders, guidance-distilled transformer).

    The pipeline's default prompt template is ~500 bytes, far more than the 95 + 256 tokens it keeps,
    so the byte-level Llama tokenizer truncates on the left: the kept window then ends with the
    prompt (and the template's closing ``<|eot_id|>``), as with the real tokenizer.
    """
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    _seed(seed)
    transformer = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    )
    _seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True,
    )
    _seed(seed)
    # Three layers: the pipeline reads hidden_states[-3], so fewer would skip every layer.
    llama = LlamaModel(LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=37, num_attention_heads=4,
                                   num_hidden_layers=3, pad_token_id=0, bos_token_id=2, eos_token_id=1))
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=259, hidden_size=8, intermediate_size=37, num_attention_heads=4,
                                        num_hidden_layers=2, pad_token_id=0, bos_token_id=2, eos_token_id=1,
                                        max_position_embeddings=77, projection_dim=32))
    tokenizer = byte_tokenizer(4096, bos=True, eos=False)
    tokenizer.truncation_side = "left"
    pipe = HunyuanVideoPipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=llama, tokenizer=tokenizer, text_encoder_2=clip, tokenizer_2=byte_tokenizer(77, bos=True),
    )
    return _ready(pipe)  # float32 already


def tiny_cogvideox(seed: int = 0, *, patch_size_t: int | None = None, scheduler: str = "ddim"):
    """A tiny CogVideoXPipeline: 1.0-5B layout (rotary embeddings) by default; ``patch_size_t=2`` gives the 1.5
    layout (temporal patching, padded latent frames); ``scheduler="dpm"`` the multistep CogVideoXDPMScheduler."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXDPMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    _seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=1, sample_width=4, sample_height=4, sample_frames=9, patch_size=2,
        patch_size_t=patch_size_t, temporal_compression_ratio=4, max_text_seq_length=226,
        use_rotary_positional_embeddings=True,
    )
    _seed(seed)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    )
    _seed(seed)
    text_encoder = _tiny_t5(d_model=32)
    sched = {"ddim": CogVideoXDDIMScheduler, "dpm": CogVideoXDPMScheduler}[scheduler]()
    pipe = CogVideoXPipeline(transformer=transformer, vae=vae, scheduler=sched, text_encoder=text_encoder,
                             tokenizer=byte_tokenizer(226))
    return _ready(pipe)  # float32 already


def _tiny_t5(d_model: int):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=259, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(cfg)


def tiny_pipeline(family: str, seed: int = 0):
    """A tiny offline pipeline of ``family`` (one of :data:`FAMILIES`)."""
    builders = {"wan": tiny_wan, "ltx": tiny_ltx, "hunyuan": tiny_hunyuan, "cogvideox": tiny_cogvideox}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    return builders[family](seed)


# Small settings each tiny pipeline runs fast at (frames, height, width, steps). Guidance enables CFG where the
# family has it; HunyuanVideo's guidance_scale is the distilled guidance embedding (its true CFG is off by default).
TINY_SETTINGS = {
    "wan": dict(num_frames=9, height=32, width=32, num_inference_steps=3, guidance_scale=5.0),
    "ltx": dict(num_frames=9, height=32, width=32, num_inference_steps=3, guidance_scale=3.0),
    "hunyuan": dict(num_frames=9, height=32, width=32, num_inference_steps=3, guidance_scale=6.0),
    "cogvideox": dict(num_frames=9, height=32, width=32, num_inference_steps=3, guidance_scale=6.0),
}


def hashed_embedder(dim: int = 32):
    """A deterministic recall embedder for tests: a hashed bag of words (no model to load).

    Recall order follows word overlap, so related prompts rank above unrelated ones.
    """
    import hashlib
    import re

    import numpy as np

    from .recall.embedder import TextEmbedder

    def encode(texts):
        out = np.zeros((len(texts), dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"\w+", t.lower()):
                out[i, int(hashlib.sha256(w.encode()).hexdigest(), 16) % dim] += 1.0
            out[i, -1] += 1e-3  # never all-zero
        return out

    return TextEmbedder(encode, dim, "hashed-bow")


def tiny_clip(path, seed: int = 0, *, image_size: int = 32, text_config: dict | None = None, vision_config: dict | None = None,
              projection_dim: int = 16):
    """Save a tiny random CLIP (model, byte-level ``CLIPTokenizer``, ``CLIPImageProcessor`` at ``image_size`` px) to the
    directory ``path`` and return it: what ``--judge clip=DIR`` loads through ``CLIPModel`` / ``CLIPProcessor``, with
    no hub. The tokenizer's vocabulary is the 256 byte symbols, the same with ``</w>``, and the two specials; its
    merges file holds only the version line. ``text_config`` / ``vision_config`` override the tiny sizes (e.g. ViT-B/32's
    for a judge that costs what a real one does)."""
    import json
    from pathlib import Path

    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"])}
    (path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=77)
    size = {"shortest_edge": image_size}
    image_processor = CLIPImageProcessor(size=size, crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(path))
    _seed(seed)
    cfg = CLIPConfig(
        text_config=dict(dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                              pad_token_id=vocab["<|endoftext|>"]), **(text_config or {})),
        vision_config=dict(dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                                patch_size=8), **(vision_config or {})),
        projection_dim=projection_dim,
    )
    CLIPModel(cfg).eval().save_pretrained(str(path))
    return path
