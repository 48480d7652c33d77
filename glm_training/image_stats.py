"""Cheap statistics of generated images that move when a reward is being hacked.

An OCR reward that blanks backgrounds, a compressibility reward that blurs everything, an aesthetic reward
that saturates colours: the reward rises while the images drift somewhere a person would not want them.
These statistics make that drift visible per step (`engine/monitor.py`) and at every evaluation:

- `brightness`: the mean luma, luma = 0.299 R + 0.587 G + 0.114 B in [0, 1];
- `dark_fraction` / `bright_fraction`: the share of near-black (luma < 0.1) / near-white (luma > 0.9)
  pixels;
- `colour_entropy`: Shannon entropy in bits of the colours quantised to 8 levels per channel (0 for one
  flat colour, at most 9);
- `edge_density`: the share of pixels whose luma differs from its right or lower neighbour by more than 0.1
  in sum;
- `saturation`: mean HSV saturation, (max - min) / max per pixel;
- `diversity`: the mean absolute difference of two images' 32x32 thumbnails, averaged over the pairs of a
  group (one prompt's samples): it falls towards 0 when the policy collapses to one image.

Images larger than 256 pixels on a side are first reduced by box filtering, so the cost is bounded and the
statistics do not depend much on the resolution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

import numpy as np
from PIL import Image

PIXEL_STATISTICS = (
    "brightness",
    "dark_fraction",
    "bright_fraction",
    "colour_entropy",
    "edge_density",
    "saturation",
)
STATISTICS = (*PIXEL_STATISTICS, "diversity")
MAX_SIDE = 256
THUMBNAIL = 32
LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def pixels(image: Image.Image) -> np.ndarray:
    """[H, W, 3] float32 in [0, 1], reduced to at most `MAX_SIDE` pixels on a side."""
    image = image.convert("RGB")
    factor = math.ceil(max(image.size) / MAX_SIDE)
    if factor > 1:
        image = image.reduce(factor)
    return np.asarray(image, dtype=np.float32) / 255.0


def image_statistics(image: Image.Image) -> dict[str, float]:
    """The `PIXEL_STATISTICS` of one image."""
    x = pixels(image)
    luma = x @ LUMA
    levels = np.minimum((x * 8).astype(np.int64), 7)
    codes = (levels[..., 0] * 64 + levels[..., 1] * 8 + levels[..., 2]).reshape(-1)
    p = np.bincount(codes, minlength=512) / codes.size
    p = p[p > 0]
    step = np.abs(np.diff(luma, axis=1))[:-1, :] + np.abs(np.diff(luma, axis=0))[:, :-1]
    brightest, darkest = x.max(axis=-1), x.min(axis=-1)
    saturation = np.where(brightest > 0, (brightest - darkest) / np.maximum(brightest, 1e-12), 0.0)
    return {
        "brightness": float(luma.mean()),
        "dark_fraction": float((luma < 0.1).mean()),
        "bright_fraction": float((luma > 0.9).mean()),
        "colour_entropy": float(-(p * np.log2(p)).sum()),
        "edge_density": float((step > 0.1).mean()) if step.size else 0.0,
        "saturation": float(saturation.mean()),
    }


def thumbnail(image: Image.Image) -> np.ndarray:
    """[32, 32, 3] float32 in [0, 1]: what `diversity` compares."""
    small = image.convert("RGB").resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BILINEAR)
    return np.asarray(small, dtype=np.float32) / 255.0


def pairwise_distance_sum(thumbnails: Sequence[np.ndarray]) -> tuple[float, int]:
    """(sum over pairs of the mean absolute difference, number of pairs) of `thumbnails`."""
    pairs = list(combinations(thumbnails, 2))
    return float(sum(np.abs(a - b).mean() for a, b in pairs)), len(pairs)


def group_runs(keys: Sequence[str]) -> list[list[int]]:
    """Indices of each run of equal consecutive keys: a rank's samples of one group (its prompt's text)."""
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][-1]] == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def statistic_sums(images: Sequence[Image.Image], groups: list[list[int]]) -> dict[str, tuple[float, int]]:
    """Each statistic as (sum, count): over images for the pixel statistics, over a group's pairs for
    `diversity` (so sums from several ranks add up to the mean of all)."""
    sums = {name: [0.0, 0] for name in STATISTICS}
    for image in images:
        for name, value in image_statistics(image).items():
            sums[name][0] += value
            sums[name][1] += 1
    for group in groups:
        total, count = pairwise_distance_sum([thumbnail(images[i]) for i in group])
        sums["diversity"][0] += total
        sums["diversity"][1] += count
    return {name: (total, count) for name, (total, count) in sums.items()}


def image_record(image: Image.Image) -> tuple[dict[str, float], np.ndarray]:
    """What an evaluation keeps of one image for `summarise`: its statistics and its thumbnail."""
    return image_statistics(image), thumbnail(image)


def summarise(records: Sequence[tuple[dict[str, float], np.ndarray]]) -> dict[str, float]:
    """The mean of each pixel statistic over an evaluation's images, and `diversity` over every pair of
    them (one image per prompt: a policy that draws every prompt alike scores low)."""
    if not records:
        return {}
    means = {name: float(np.mean([stats[name] for stats, _ in records])) for name in PIXEL_STATISTICS}
    total, count = pairwise_distance_sum([thumb for _, thumb in records])
    return {**means, "diversity": total / count} if count else means
