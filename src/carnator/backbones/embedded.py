"""Adapter for the embedded shapes-world model (a Wan transformer with a pixel codec and word encoder)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..request import Request
from .base import Conditioning, GenerationDefaults
from .wan import WanAdapter

log = logging.getLogger("carnator")


class GraphedForward:
    """A function of CUDA tensors captured once as a CUDA graph and replayed: each call copies its inputs into the
    graph's own input buffers, replays, and returns a copy of the output (the next replay overwrites it)."""

    def __init__(self, fn, example_inputs) -> None:
        self.inputs = [x.detach().clone().contiguous() for x in example_inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture needs (cuBLAS/cuDNN workspaces)
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a write-behind store's copies on another thread may run while a new shape is captured
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.output = fn(*self.inputs)

    def __call__(self, *inputs) -> torch.Tensor:
        for buf, x in zip(self.inputs, inputs):
            buf.copy_(x)
        self.graph.replay()
        return self.output.clone()


class EmbeddedAdapter(WanAdapter):
    """The Wan adapter, with the embedded model's text encoder, latent layout and codec.

    CFG runs both branches in one batched forward (the same arithmetic as two forwards).
    """

    family = "embedded"
    pipeline_classes = ("EmbeddedPipeline",)

    def __init__(self, pipe):
        super().__init__(pipe)
        self._graph_lock = threading.Lock()

    @property
    def cfg(self):
        return self.pipe.cfg

    def model_identity(self) -> str:
        if self.pipe.weights_sha256:
            # The weights and the config they ship with (sampling shift, guidance, ...): either changes the trajectories.
            cfg = json.dumps(self.cfg.to_dict(), sort_keys=True)
            return f"embedded-{hashlib.sha256((self.pipe.weights_sha256 + cfg).encode()).hexdigest()[:16]}"
        return super().model_identity()

    def defaults(self) -> GenerationDefaults:
        c = self.cfg
        return GenerationDefaults(num_inference_steps=c.num_inference_steps, num_frames=c.frames, height=c.size, width=c.size, guidance_scale=c.guidance_scale)

    def limits(self):
        """Exactly what the embedded model makes: its frame count and size, and the first ``max_words`` words it
        knows (unknown words are dropped before the cut)."""
        from ..request import RequestLimits

        c, tok = self.cfg, self.pipe.tokenizer
        return RequestLimits(max_frames=c.frames, max_height=c.size, max_width=c.size, max_prompt_tokens=tok.max_words,
                             count_tokens=lambda text: sum(w in tok.ids for w in tok.words(text)))

    def check_geometry(self, req: Request) -> None:
        c = self.cfg
        if req.num_frames != c.frames or req.height != c.size or req.width != c.size:
            raise InvalidRequestError(f"the embedded model makes {c.frames} frames of {c.size}x{c.size} only, got {req.num_frames} frames of {req.height}x{req.width}")

    def token_grid(self, req: Request) -> tuple[int, int, int]:
        c = self.cfg
        pt, ph, pw = c.patch_size
        s = c.size // c.codec_factor
        return c.frames // pt, s // ph, s // pw

    def clean_prompt(self, prompt: str) -> str:
        return prompt

    def unknown_words(self, prompt: str) -> list[str]:
        return self.pipe.tokenizer.split(prompt)[1]

    def prompt_token_ids(self, prompt: str) -> list[int]:
        known, _ = self.pipe.tokenizer.split(prompt)
        return [self.pipe.tokenizer.ids[w] for w in known]

    def noun_extractor(self):
        """Exact nouns of the shapes world's captions, from the lexicon shipped with the model (``lexicon.json``);
        a prompt with words outside the model's vocabulary falls back to the real-prompt extractor."""
        from ..embedded import HERE
        from ..signature.nouns import LexiconNouns

        return LexiconNouns.from_file(HERE / "lexicon.json")

    def content_reader(self):
        """What a shapes-world caption asks for (objects with size, colour, noun and motion, and the place; synonyms
        equal), from the shipped lexicon."""
        from ..embedded import HERE
        from ..signature.content import LexiconContent

        return LexiconContent.from_file(HERE / "lexicon.json")

    def word_token_positions(self, prompt: str, word: str, modifiers: int = 0) -> list[int]:
        """One token per known word (unknown words are dropped, the sequence is cut at ``max_words``)."""
        from ..signature.nouns import noun_phrase_spans

        spans = noun_phrase_spans(prompt, word, modifiers)
        return [k for k, (a, b) in enumerate(self.pipe.tokenizer.token_spans(prompt)) if any(a < e and b > s for s, e in spans)]

    def encode(self, req: Request) -> Conditioning:
        unknown = self.unknown_words(req.prompt)
        if unknown:
            log.warning(
                "the embedded model ignores words it does not know: %s (it only knows the shapes world; real prompts need a real checkpoint: --model PATH)",
                ", ".join(dict.fromkeys(unknown)),
            )
        do_cfg = req.guidance_scale > 1.0
        texts = [req.prompt] + ([req.negative_prompt or ""] if do_cfg else [])
        with torch.no_grad():
            emb = self.pipe.encode_text(texts).to(self.transformer.dtype)
        return Conditioning(data={"cond": emb[:1], "uncond": emb[1:] if do_cfg else None, "both": emb}, do_cfg=do_cfg)

    def prepare_latents(self, req: Request, generator: torch.Generator) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        c = self.cfg
        s = c.size // c.codec_factor
        return randn_tensor((1, c.latent_channels, c.frames, s, s), generator=generator, device=self.device, dtype=torch.float32)

    supports_cuda_graphs = True

    def predict(self, latents, t, step, cond, req):
        x = latents.to(self.transformer.dtype)
        with torch.no_grad():
            if cond.do_cfg:
                xb = x.expand(2, *x.shape[1:])
                tb = t.expand(2)
                emb = cond.data["both"]  # (cond, uncond)
                flip = self._uncond_first()  # FasterCache reads a batch as (uncond, cond)
                if flip:
                    emb = emb.flip(0)
                self._branches((1, 0) if flip else (0, 1), step)
                out = self.pipe.velocity(xb, tb, self._forward("cond_uncond", step, t, req, True, xb, tb, emb))
                c, u = (out[1:], out[:1]) if flip else (out[:1], out[1:])
                return u + req.guidance_scale * (c - u)
            self._branches((0,), step)
            t1 = t.expand(1)
            return self.pipe.velocity(x, t1, self._forward("cond", step, t, req, False, x, t1, cond.data["cond"]))

    def _forward(self, name, step, t, req, do_cfg, x, tb, emb) -> torch.Tensor:
        """The transformer's output for one (possibly CFG-batched) forward: replayed from a CUDA graph when graphs
        are on and nothing is recorded or applied at this step (:attr:`AttentionPlan.idle`), else eager."""
        from ..attention.state import active

        st = active()
        if self._cuda_graphs and x.device.type == "cuda" and self._intra is None and (st is None or st.plan.idle):
            key = (tuple(x.shape), tuple(emb.shape), x.dtype, emb.dtype)
            with self._graph_lock:  # one graph, one set of input buffers: replays take turns
                graphs = self.__dict__.setdefault("_graphs", {})
                if key not in graphs:
                    graphs[key] = GraphedForward(self._plain_forward, (x, tb, emb))
                return graphs[key](x, tb, emb)
        with self.branch_context(name, step, t, req, do_cfg):
            return self._plain_forward(x, tb, emb)

    def _plain_forward(self, x, tb, emb) -> torch.Tensor:
        return self.transformer(hidden_states=x, timestep=tb, encoder_hidden_states=emb, return_dict=False)[0]

    def decode_tensor(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels (B, 3, T, H, W) in [0, 1] (clamped)."""
        return self.pipe.vae.decode(latents.float()).clamp(0, 1)

    def decode_tail(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        with torch.no_grad():
            return self.decode_tensor(latents[:, :, -1:])[0, :, 0].permute(1, 2, 0).cpu().numpy().astype(np.float32)

    def decode(self, latents: torch.Tensor, req: Request) -> np.ndarray:
        with torch.no_grad():
            v = self.decode_tensor(latents)[0]
        return v.permute(1, 2, 3, 0).cpu().numpy().astype(np.float32)
