"""The evaluation EMA's update rule, as the references keep it (Flow-GRPO's `flow_grpo/ema.py`
`EMAModuleWrapper`, which the decoder references copy).

One update moves each shadow weight towards its parameter, `ema += (1 - d) (param - ema)`, with the warm-up
decay `d = min((1 + s) / (10 + s), ema_decay)` of the optimizer-step count `s`, and only on the counts where
`(s + 1) % ema_update_interval == 0`. Flow-GRPO's `train_sd3.py` calls it after every micro-batch with the
count of optimizer steps taken so far (`algo.ema_every_micro_batch`): of the micro-batches of one optimizer
step, all but the last call it before the step, towards the weights the step starts from, and the last after
it, with the new count. DiffusionNFT and AWM call it once per optimizer step, after it. The shadow weights are
diffusers' `EMAModel`'s (`Policy.ema`: checkpoints, evaluation and export read them there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def ema_decay_at(step: int, decay: float) -> float:
    """The references' warm-up decay at optimizer-step count `step`, capped at `decay`."""
    return min((1 + step) / (10 + step), decay)


@torch.no_grad()
def reference_ema_update_(
    shadows: Sequence[Tensor], params: Sequence[Tensor], step: int, decay: float, interval: int
) -> None:
    """One call of the references' `EMAModuleWrapper.step(params, step)`, in place on `shadows`."""
    if (step + 1) % interval:
        return
    one_minus_decay = 1.0 - ema_decay_at(step, decay)
    for shadow, param in zip(shadows, params, strict=True):
        shadow.add_(one_minus_decay * (param.detach() - shadow))


class EMASchedule:
    """When the references update their EMA around one optimizer step (see the module docstring)."""

    def __init__(self, decay: float, interval: int, every_micro_batch: bool):
        self.decay = decay
        self.interval = interval
        self.every_micro_batch = every_micro_batch

    def before_step(self, shadows, params, step: int, num_micro_batches: int) -> None:
        """The calls of the step's micro-batches but the last, towards the weights the step starts from;
        `step`: the optimizer steps taken so far."""
        if self.every_micro_batch:
            for _ in range(num_micro_batches - 1):
                reference_ema_update_(shadows, params, step, self.decay, self.interval)

    def after_step(self, shadows, params, step: int) -> None:
        """The call after the step; `step`: the optimizer steps taken, this one included."""
        reference_ema_update_(shadows, params, step, self.decay, self.interval)
