"""CLIPScore reward (Hessel et al. 2021, "CLIPScore", arXiv 2104.08718).

    score = w * max(cos(image_embedding, prefix + prompt_embedding), 0),  w = 2.5 (the paper's)

on OpenAI CLIP ViT-L/14 (`openai/clip-vit-large-patch14`, the CLIP Flow-GRPO's CLIPScore uses; the
paper used ViT-B/32). Preprocessing is the model's `CLIPProcessor`: 224 px bicubic resize of the
short side, centre crop, OpenAI CLIP mean/std; prompts are truncated to 77 tokens.

`prefix`: the paper prepends "A photo depicts " to candidate captions; for text-to-image prompts
(and in Flow-GRPO) nothing is prepended, the default here. Flow-GRPO's `clip_score` reward is instead
the raw logit 100 * cos / 30 without the clamp; use `w=100/30` to match it on positive cosines.

The official `clipscore` package was not used: it needs OpenAI's `clip` package and torchvision.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from glm_training.rewards.clip_base import ClipEmbedder, check_pairs, embed_prompts
from glm_training.rewards.registry import Reward, register_reward

CLIPSCORE_MODEL = "openai/clip-vit-large-patch14"
CLIPSCORE_W = 2.5


@register_reward("clip_score")
class ClipScoreReward(Reward):
    """CLIPScore: w * max(cos(image, prefix + prompt), 0) per image/prompt pair, in [0, w].

    Args:
        model: hub id or local directory of a `CLIPModel` (with its `CLIPProcessor`).
        processor: hub id or local directory of the processor; None uses `model`.
        device: "auto" (this process's device), "cpu" or "cuda:N".
        dtype: weight dtype ("float32", "bfloat16", "float16").
        batch_size: images (or distinct prompts) per CLIP forward pass.
        w: positive rescaling weight (the paper's 2.5 stretches typical cosines towards [0, 1]).
        prefix: text prepended to every prompt ("A photo depicts " in the paper's captioning setup).
    """

    approx_params = 151_000_000  # CLIP ViT-B/32: the memory plan's figure
    retryable = True  # a transient failure (CUDA OOM, a busy device) is retried: reward.max_retries

    def __init__(
        self,
        model: str = CLIPSCORE_MODEL,
        processor: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
        w: float = CLIPSCORE_W,
        prefix: str = "",
    ) -> None:
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0):
            raise ValueError(f"clip_score w must be a positive number (the paper uses 2.5), got {w!r}")
        self.w = float(w)
        self.prefix = prefix
        self.embedder = ClipEmbedder(
            model, processor=processor, device=device, dtype=dtype, batch_size=batch_size
        )

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        check_pairs(images, prompts, self.name)
        images_nd = self.embedder.embed_images(images)
        prompts_nd = embed_prompts(self.embedder, [self.prefix + prompt for prompt in prompts])
        cosine_n = (images_nd * prompts_nd).sum(dim=-1)
        return (self.w * cosine_n.clamp(min=0.0)).float()
