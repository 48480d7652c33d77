"""PickScore reward (Kirstain et al. 2023, "Pick-a-Pic", arXiv 2305.01569).

PickScore_v1 is CLIP-ViT-H/14 (LAION-2B) fine-tuned on Pick-a-Pic human preferences. The score of an
image for a prompt is the CLIP logit, as in PickScore's own inference code:

    score = exp(logit_scale) * cos(image_embedding, prompt_embedding) / scale

with the weights of `yuvalkirstain/PickScore_v1` and the processor (tokenizer, 224 px bicubic resize +
centre crop, OpenAI CLIP mean/std) of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`, which PickScore_v1
does not ship. exp(logit_scale) is ~100, so raw scores of real images land around 18-24.

`scale`: Flow-GRPO's PickScore reward divides by 26 ("norm to 0-1"). The default here is 1, the
paper's raw score; set `scale: 26` to reproduce Flow-GRPO's reward values. GRPO's per-group
advantage normalisation makes the choice irrelevant for a single reward; it matters for the weights
of a combination with other rewards and for logged values.

PickScore needs no code beyond `transformers.CLIPModel`, which is what its authors use too.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from glm_training.rewards.clip_base import ClipEmbedder, check_pairs, embed_prompts
from glm_training.rewards.registry import Reward, register_reward

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
FLOW_GRPO_PICKSCORE_SCALE = 26.0


@register_reward("pickscore")
class PickScoreReward(Reward):
    """PickScore_v1: exp(logit_scale) * cos(image, prompt) / scale per image/prompt pair.

    Args:
        model: hub id or local directory of the PickScore `CLIPModel`.
        processor: hub id or local directory of the `CLIPProcessor` to preprocess with.
        device: "auto" (this process's device), "cpu" or "cuda:N".
        dtype: weight dtype ("float32", "bfloat16", "float16").
        batch_size: images (or distinct prompts) per CLIP forward pass.
        scale: positive divisor of the score (Flow-GRPO: 26).
    """

    approx_params = 986_000_000  # CLIP ViT-H/14: the memory plan's figure
    retryable = True  # a transient failure (CUDA OOM, a busy device) is retried: reward.max_retries

    def __init__(
        self,
        model: str = PICKSCORE_MODEL,
        processor: str = PICKSCORE_PROCESSOR,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
        scale: float = 1.0,
    ) -> None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"pickscore scale must be a positive number (Flow-GRPO uses 26), got {scale!r}")
        self.scale = float(scale)
        self.embedder = ClipEmbedder(
            model, processor=processor, device=device, dtype=dtype, batch_size=batch_size
        )

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        check_pairs(images, prompts, self.name)
        images_nd = self.embedder.embed_images(images)
        prompts_nd = embed_prompts(self.embedder, prompts)
        cosine_n = (images_nd * prompts_nd).sum(dim=-1)
        return (math.exp(self.embedder.logit_scale) / self.scale * cosine_n).float()
