"""Test-only user rewards that misbehave on purpose: held at a gate, NaN for some samples, or raising.

Named by file (`tests/user_rewards/faults.py:gated_brightness`), so runs from the repository root find them.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from glm_training.rewards.registry import Reward


def _brightness(images) -> list[float]:
    return [float(np.asarray(img.convert("L"), dtype=np.float32).mean()) / 255.0 for img in images]


GATE = "GLM_TEST_GATE"


def gated_brightness(images, prompts, metadata):
    """Mean brightness, once the file that $GLM_TEST_GATE names exists: a step that cannot end before the
    test lets it (the test signals the run in the middle of the step, then creates the file).

    A call that finds the gate closed first writes "[rank R] reward waiting at the gate" to stderr: the run
    is inside a step, its stop-signal handlers installed. Without $GLM_TEST_GATE it is plain brightness.
    """
    gate = os.environ.get(GATE)
    if gate and not os.path.exists(gate):
        sys.stderr.write(f"[rank {os.environ.get('RANK', '0')}] reward waiting at the gate\n")
        sys.stderr.flush()
        deadline = time.monotonic() + 600  # a guard against a hang, never reached when the test is right
        while not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test never opened the gate {gate}")
            time.sleep(0.02)
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


class AlwaysFails(Reward):
    """A retryable scorer that never answers (a reward server down for the whole run)."""

    retryable = True

    def __call__(self, images, prompts, metadata):
        raise ConnectionError("the scorer is down (test fault)")
