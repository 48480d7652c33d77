"""The evaluation EMA as the references keep it: its update rule (Flow-GRPO's `flow_grpo/ema.py`
`EMAModuleWrapper`, which the decoder references copy) and how often their training loops call it.

One call `EMAModuleWrapper.step(params, s)` moves each shadow weight towards its parameter,
`ema += (1 - d) (param - ema)`, with the warm-up decay `d = min((1 + s) / (10 + s), ema_decay)` of the
optimizer-step count `s`, and only on the counts where `(s + 1) % ema_update_interval == 0`.

The calls per optimizer step are the reference's (`algo.ema_calls`, `EMA_CALL_FNS`), never a function of the
micro-batches an update is computed in (`sampling.micro_batch_size` is a memory setting):

- `per_train_batch`: Flow-GRPO's `train_sd3.py` (and the loops copied from it) calls it once per training
  batch, after the batch's backward passes (its loop over `samples_batched`). A rank's samples of a rollout
  are `num_batches_per_epoch` batches of `sample.train_batch_size` (`algo.ema_train_batch_size`), and an
  optimizer step takes `gradient_accumulation_steps` of them, so a step takes
  `samples // train_batch_size / steps` calls. Of one step's calls, all but the last come before the step,
  with the count of steps taken so far (towards the weights the step starts from), the last after it, with
  the new count.
- `per_optimizer_step`: DiffusionNFT's `train_nft_sd3.py` calls it once after every optimizer step.
- `per_rollout`: AWM's `train_sd3_awm.py` calls it once per epoch (rollout), after its last optimizer step.

The shadow weights are diffusers' `EMAModel`'s (`Policy.ema`: checkpoints, evaluation and export read them
there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def per_train_batch(
    num_samples: int | None, train_batch_size: int, num_steps: int, num_passes: int
) -> list[int]:
    """The calls at each of an update's `num_passes * num_steps` optimizer steps: one per training batch.

    A pass over a rank's `num_samples` samples holds `num_samples // train_batch_size` training batches (the
    reference's `num_batches_per_epoch`), dealt to the pass's `num_steps` optimizer steps as the update loop
    deals micro-batches (interleaved), and at least one per step, as every step of the reference takes one.
    E.g. 144 samples, batches of 9, 2 steps: 16 batches, [8, 8] per pass. Where the batches do not split
    evenly over the steps, or the samples into batches (layouts Flow-GRPO's config refuses: its
    `num_batches_per_epoch` must be even), the steps take them as evenly as they go (145 or 153 samples: [8,
    8] and [9, 8]) and a partial batch is not counted.
    """
    if num_samples is None:
        raise ValueError(
            "algo.ema_calls=per_train_batch counts a rank's samples of the update: the algorithm must pass "
            "num_samples to UpdateLoop.run (or set algo.ema_calls=per_optimizer_step)."
        )
    num_batches = max(num_steps, num_samples // train_batch_size)
    return [len(range(m, num_batches, num_steps)) for m in range(num_steps)] * num_passes


def per_optimizer_step(
    num_samples: int | None, train_batch_size: int, num_steps: int, num_passes: int
) -> list[int]:
    """One call after each of the update's optimizer steps."""
    return [1] * (num_steps * num_passes)


def per_rollout(num_samples: int | None, train_batch_size: int, num_steps: int, num_passes: int) -> list[int]:
    """One call after the update's last optimizer step, none at the others."""
    return [0] * (num_steps * num_passes - 1) + [1]


# `algo.ema_calls` -> (a rank's samples in the update, ema_train_batch_size, optimizer steps per pass,
# passes) -> the calls at each optimizer step of the update, in order.
EMA_CALL_FNS: dict[str, Callable[[int | None, int, int, int], list[int]]] = {
    "per_train_batch": per_train_batch,
    "per_optimizer_step": per_optimizer_step,
    "per_rollout": per_rollout,
}


class EMASchedule:
    """When the references update their EMA (see the module docstring): how many calls each optimizer step of
    an update takes (`calls`), and those calls around one step (`before_step`, `after_step`)."""

    def __init__(
        self, decay: float, interval: int, calls: str = "per_optimizer_step", train_batch_size: int = 1
    ):
        self.decay = decay
        self.interval = interval
        self.calls_fn = EMA_CALL_FNS[calls]
        self.train_batch_size = train_batch_size

    def calls(self, num_samples: int | None, num_steps: int, num_passes: int) -> list[int]:
        """The calls at each optimizer step of an update: `num_passes` passes of `num_steps` steps over a
        rank's `num_samples` samples."""
        return self.calls_fn(num_samples, self.train_batch_size, num_steps, num_passes)

    def before_step(self, shadows, params, step: int, num_calls: int) -> None:
        """The step's calls but the last, towards the weights the step starts from; `step`: the optimizer
        steps taken so far."""
        for _ in range(num_calls - 1):
            reference_ema_update_(shadows, params, step, self.decay, self.interval)

    def after_step(self, shadows, params, step: int, num_calls: int) -> None:
        """The step's last call, if it has any; `step`: the optimizer steps taken, this one included."""
        if num_calls > 0:
            reference_ema_update_(shadows, params, step, self.decay, self.interval)
