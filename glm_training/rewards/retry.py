"""Reward failures: retries with exponential back-off, then skip the step or stop the run.

A reward that declares itself retryable (`Reward.retryable = True`: the remote client, model scorers whose
failures are transient, such as a CUDA error or a restarting server) is called again after
`backoff_s * 2**k` seconds before retry k+1, up to `reward.max_retries` retries.

While the trainer collects a step (`RewardSet.defer_errors`), a reward's error is recorded and the chunk
gets NaN scores instead of raising, so every rank still runs the same collectives; the loop then asks all
ranks once per step what failed (one all-reduce) and every rank acts on it together:
- a retryable reward out of retries: by `reward.on_failure`, the step's update is skipped on every rank
  (`skip`, counted as `skipped_reward_failure`) or every rank stops with `RewardFailed` (`error`);
- any other error (a non-retryable reward, whose failure is a bug; a wrong shape; a NaN score with
  `reward.on_nonfinite=error`): every rank stops, the one that saw it with the original error.
Without this, one rank raising would leave the others waiting in a collective until `dist_timeout_s`.
Outside training (evaluation, direct calls) errors raise at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from glm_training.errors import UserError

logger = logging.getLogger("glm_training")

T = TypeVar("T")


@dataclass(frozen=True)
class FailurePolicy:
    """`reward.max_retries`, `reward.retry_backoff_s`, `reward.on_failure`, `reward.on_nonfinite`."""

    max_retries: int = 0
    backoff_s: float = 1.0
    on_failure: str = "error"  # error | skip
    on_nonfinite: str = "error"  # error | drop


class RewardFailed(UserError, RuntimeError):
    """A retryable reward failed on every attempt (and `reward.on_failure=error`, or nothing to skip to)."""


def is_retryable(reward: object) -> bool:
    """`reward.retryable`, or that of the user's `Reward` subclass a `CallableReward` wraps (`fn`)."""
    return bool(
        getattr(reward, "retryable", False) or getattr(getattr(reward, "fn", None), "retryable", False)
    )


def call_with_retries(
    fn: Callable[[], T],
    *,
    name: str,
    retryable: bool,
    policy: FailurePolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, retried `policy.max_retries` times with back-off if `retryable`; `RewardFailed` at the end."""
    num_attempts = 1 + (policy.max_retries if retryable else 0)
    for attempt in range(num_attempts):
        try:
            return fn()
        except Exception as err:
            if not retryable:
                raise
            if attempt + 1 == num_attempts:
                raise RewardFailed(
                    f"reward {name!r} failed {num_attempts} time(s) (1 + reward.max_retries="
                    f"{policy.max_retries}); last error: {type(err).__name__}: {err}. Fix the scorer, raise "
                    "reward.max_retries, or set reward.on_failure=skip to train on through its outages."
                ) from err
            wait = policy.backoff_s * 2**attempt
            logger.warning(
                "reward %r failed (attempt %d/%d: %s: %s); retrying in %.2f s",
                name,
                attempt + 1,
                num_attempts,
                type(err).__name__,
                err,
                wait,
            )
            sleep(wait)
    raise AssertionError("unreachable")


def score_reward(
    reward_set: Any, name: str, reward: Any, images: list, prompts: list, metadata: list, validate
) -> torch.Tensor:
    """One reward's scores [N] for `RewardSet.__call__`: retried and validated; NaN, with the error recorded
    on `reward_set` (`failures` or `errors`), while it defers errors."""
    policy: FailurePolicy = reward_set.policy
    try:
        raw = call_with_retries(
            lambda: reward(images, prompts, metadata),
            name=name,
            retryable=is_retryable(reward),
            policy=policy,
        )
        return validate(name, raw, prompts, policy.on_nonfinite == "drop")
    except Exception as err:
        if not reward_set.defer_errors:
            raise
        if isinstance(err, RewardFailed):
            reward_set.failures.append(str(err))
        else:
            reward_set.errors.append(err)
    return torch.full((len(images),), float("nan"))
