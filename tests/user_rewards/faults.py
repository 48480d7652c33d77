"""Test-only user rewards that misbehave on purpose: slow, or NaN for some samples.

Named by file (`tests/user_rewards/faults.py:slow_brightness`), so runs from the repository root find them.
"""

from __future__ import annotations

import time

import numpy as np


def _brightness(images) -> list[float]:
    return [float(np.asarray(img.convert("L"), dtype=np.float32).mean()) / 255.0 for img in images]


def slow_brightness(images, prompts, metadata, seconds: float = 1.0):
    """Mean brightness after `seconds` of sleep per call: a step long enough to signal in its middle."""
    time.sleep(seconds)
    return _brightness(images)


def nan_for_first(images, prompts, metadata):
    """Mean brightness, but NaN for the first image of every call (a reward model that overflowed)."""
    scores = _brightness(images)
    scores[0] = float("nan")
    return scores
