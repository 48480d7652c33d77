"""JPEG compressibility / incompressibility rewards (DDPO, Black et al. 2023, arXiv 2305.13301).

Units: kilobytes with 1 kB = 1000 bytes, as in DDPO. An image's size is the length of its RGB
encoding by Pillow's JPEG encoder at quality 95 (DDPO's setting). `jpeg_compressibility` scores
`-size_kb` (smaller files score higher), `jpeg_incompressibility` scores `+size_kb`. Both need no
weights and are deterministic for a given Pillow / libjpeg build.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from glm_training.rewards.registry import Reward, register_reward

DDPO_JPEG_QUALITY = 95


def jpeg_size_kb(image: Image.Image, quality: int = DDPO_JPEG_QUALITY) -> float:
    """Size in kB (1000 bytes) of `image` encoded as an RGB JPEG at `quality`."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def _check_quality(quality: int) -> None:
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be an integer in [1, 100] (DDPO uses 95), got {quality!r}")


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """Score = -(JPEG size in kB): rewards images that compress well."""

    def __init__(self, quality: int = DDPO_JPEG_QUALITY) -> None:
        _check_quality(quality)
        self.quality = quality

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        sizes = [jpeg_size_kb(image, self.quality) for image in images]
        return -torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(Reward):
    """Score = +(JPEG size in kB): rewards detailed, hard-to-compress images."""

    def __init__(self, quality: int = DDPO_JPEG_QUALITY) -> None:
        _check_quality(quality)
        self.quality = quality

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        sizes = [jpeg_size_kb(image, self.quality) for image in images]
        return torch.tensor(sizes, dtype=torch.float32)
