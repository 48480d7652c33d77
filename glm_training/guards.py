"""Non-finite guards: a NaN/inf from a reward model, a loss or an fp16 overflow never reaches the weights.

Three places are checked:
- the gradient norm before every optimizer step (`Policy.optimizer_step`): a non-finite loss gives
  non-finite gradients, so one check covers both; the step is skipped (no optimizer, scheduler or EMA
  update), like `torch.amp.GradScaler` skips an overflowing step. Under DDP the norm is computed from the
  all-reduced gradients, so every rank takes the same decision;
- each reward's scores (`rewards/combine.py`): `reward.on_nonfinite=error` names the reward and the
  samples; `drop` lets them through, and `nonfinite_groups` below gives their groups zero advantage;
- the streak: `trainer.max_consecutive_skips` skipped steps in a row stop the run (`TooManySkippedSteps`),
  and no checkpoint is written while a streak lasts, so the newest checkpoint predates the first bad step;
  a run none of whose steps updated the model ends in an error, not "done" (`NothingTrained`).

After each update the trained weights themselves are checked (`Policy.weights_finite`): an update with a
finite gradient that still made them NaN or inf (a learning rate far too high) stops the run
(`NonFiniteWeights`) before an evaluation, a metrics row or a checkpoint of that step.
"""

from __future__ import annotations

import math

import torch

from glm_training.errors import UserError


class TooManySkippedSteps(UserError, RuntimeError):
    """`trainer.max_consecutive_skips` steps in a row made no update; the message says why and what to try."""


class NothingTrained(UserError, RuntimeError):
    """Every step a run ran was skipped: it made no update, and says so instead of "done"."""


class NonFiniteWeights(UserError, RuntimeError):
    """An update left trained weights NaN or inf; the message names the step and the likely cause."""


def is_finite(value: float | torch.Tensor) -> bool:
    if torch.is_tensor(value):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def nonfinite_groups(rewards_gk: torch.Tensor) -> torch.Tensor:
    """[G, K] rewards -> [G] bool, True where any of the group's K rewards is NaN or inf."""
    return ~torch.isfinite(rewards_gk).all(dim=1)


class SkipCounter:
    """Counts skipped steps: in a row (reset by an update) and in total, by reason."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.in_a_row = 0
        self.reasons: list[str] = []

    def record(self, skipped: bool, reason: str = "") -> None:
        if not skipped:
            self.in_a_row, self.reasons = 0, []
            return
        self.in_a_row += 1
        self.reasons.append(reason)

    def check_trained(self, start_step: int, end_step: int) -> None:
        """Raises `NothingTrained` for steps `start_step + 1 .. end_step`, of which none updated the model
        (the caller counted the optimizer steps), when they were skipped for a failure."""
        if end_step > start_step and self.reasons:
            raise NothingTrained(
                f"no update in steps {start_step + 1}-{end_step}: skipped for "
                f"{' and '.join(sorted(set(self.reasons)))}; nothing was trained and no checkpoint holds a "
                "trained step. metrics.jsonl says which failed at each step (skipped_reward_failure, "
                "skipped_nonfinite), the warnings above why: fix that reward or loss and run again."
            )

    def check(self, step: int) -> None:
        if self.max_consecutive and self.in_a_row >= self.max_consecutive:
            raise TooManySkippedSteps(
                f"{self.in_a_row} steps in a row (through step {step}) made no update "
                f"({', '.join(sorted(set(self.reasons)))}); trainer.max_consecutive_skips="
                f"{self.max_consecutive}. The newest checkpoint predates the first of them. Look for the "
                "reward or loss that turns NaN/inf (metrics.jsonl: skipped_nonfinite, reward/...), lower "
                "optim.lr, use bf16 instead of fp16, or raise trainer.max_consecutive_skips."
            )
