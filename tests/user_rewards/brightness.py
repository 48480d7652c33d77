"""User reward functions for the tests: the `module:function` contract, kept and broken."""

from __future__ import annotations

import numpy as np


def mean_brightness(images, prompts, metadata, scale: float = 1.0):
    """Mean pixel value in [0, 1] times `scale`, as a plain list (the contract accepts lists)."""
    return [scale * float(np.asarray(img.convert("L"), dtype=np.float32).mean()) / 255.0 for img in images]


def one_score_for_all(images, prompts, metadata):
    """Broken on purpose: one score for the whole batch instead of one per image."""
    return [0.5]


NOT_CALLABLE = 3
