"""The update loop every algorithm shares: inner epochs, mini-batches of one optimizer step each, backward
passes with one gradient all-reduce per optimizer step.

An algorithm hands `UpdateLoop.run` the number of its micro-batches and a function that yields, for the
micro-batch indices of one mini-batch, the backward passes of its optimizer step (`MicroStep`s), each
normalised so that their gradients sum to the gradient of the mini-batch's loss; and the number of this
rank's samples in the update, from which the evaluation EMA's calls per optimizer step are counted as the
reference counts them (`engine/ema.py`), whatever the micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

LOSS_STATS = ("loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean")

# One backward pass of an optimizer step: computes its loss, calls backward on its share of the mini-batch's
# loss and returns its statistics (floats or 0-d tensors).
MicroStep = Callable[[], dict[str, Any]]


def split_mini_batches(num_micro_batches: int, num_mini_batches: int) -> list[list[int]]:
    """Micro-batch indices of each mini-batch (one optimizer step each), interleaved, none empty."""
    everything = list(range(num_micro_batches))
    return [part for m in range(num_mini_batches) if (part := everything[m::num_mini_batches])]


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last one (one item of look-ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for upcoming in iterator:
        yield current, False
        current = upcoming
    yield current, True


class StatMeans:
    """Running means of the per-micro-batch loss statistics of one update."""

    def __init__(self, keys: tuple[str, ...] = LOSS_STATS):
        self.sums = dict.fromkeys(keys, 0.0)
        self.count = 0

    def add(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self.sums[key] += float(value.detach()) if torch.is_tensor(value) else float(value)
        self.count += 1

    def means(self) -> dict[str, float]:
        return {key: total / max(self.count, 1) for key, total in self.sums.items()}


@dataclass
class UpdateStats:
    """What one update (`UpdateLoop.run`) measured."""

    means: dict[str, float]  # each statistic's mean over every backward pass of the update
    mini_batches: list[dict[str, float]]  # the same per optimizer step, in order: the first is on-policy
    grad_norms: list[float]  # pre-clip gradient norm of each optimizer step

    @property
    def grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms)

    @property
    def num_optimizer_steps(self) -> int:
        return len(self.grad_norms)


class UpdateLoop:
    """`num_inner_epochs` passes over a rollout's micro-batches, each split into `num_mini_batches`
    interleaved mini-batches (`split_mini_batches`) of one optimizer step each. Every backward but the last of
    a mini-batch runs under the strategy's `no_sync` (DDP all-reduces once per optimizer step); then the
    policy's `optimizer_step` clips, steps, zeroes and calls the EMA as often as `policy.ema_calls` says for
    that step. `last` holds the latest update's statistics."""

    def __init__(self, policy: Any, num_inner_epochs: int, num_mini_batches: int):
        self.policy = policy
        self.num_inner_epochs = num_inner_epochs
        self.num_mini_batches = num_mini_batches
        self.last: UpdateStats | None = None

    def run(
        self,
        num_micro_batches: int,
        micro_steps: Callable[[list[int]], Iterable[MicroStep]],
        stat_keys: tuple[str, ...] = LOSS_STATS,
        *,
        num_samples: int | None = None,
    ) -> UpdateStats:
        """`num_samples`: this rank's samples in the update (the EMA's `per_train_batch` calls count them)."""
        policy = self.policy
        stats, mini_batches, grad_norms = StatMeans(stat_keys), [], []
        minis = split_mini_batches(num_micro_batches, self.num_mini_batches)
        ema_calls = iter(policy.ema_calls(num_samples, len(minis), self.num_inner_epochs))
        for _ in range(self.num_inner_epochs):
            for mini in minis:
                mini_stats = StatMeans(stat_keys)
                for backward, last in with_last(micro_steps(mini)):
                    with policy.parallel.no_sync(policy.model, last):
                        values = backward()
                    stats.add(values)
                    mini_stats.add(values)
                grad_norms.append(policy.optimizer_step(next(ema_calls)))
                mini_batches.append(mini_stats.means())
        self.last = UpdateStats(stats.means(), mini_batches, grad_norms)
        return self.last
