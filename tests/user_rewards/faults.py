"""Test-only user rewards that misbehave on purpose: slow, or NaN for some samples.

Named by file (`tests/user_rewards/faults.py:slow_brightness`), so runs from the repository root find them.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from glm_training.rewards.registry import Reward


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


class FailsOnCalls(Reward):
    """A retryable scorer (like a reward model on a GPU) that raises on the given calls (1-based).

    The default fails a run's step 2 (one call per step) and both of its retries with reward.max_retries=2.
    """

    retryable = True

    def __init__(self, fail_calls: tuple[int, ...] = (2, 3, 4)) -> None:
        self.fail_calls = set(fail_calls)
        self.num_calls = 0

    def __call__(self, images, prompts, metadata):
        self.num_calls += 1
        if self.num_calls in self.fail_calls:
            raise RuntimeError(f"scorer failed on call {self.num_calls} (test fault)")
        return torch.tensor(_brightness(images))


def fails_on_rank_1(images, prompts, metadata):
    """Mean brightness on rank 0; raises on rank 1 (a scorer that breaks on one machine only)."""
    if os.environ.get("RANK") == "1":
        raise KeyError("a bug in the reward that only rank 1 hits (test fault)")
    return _brightness(images)
