"""The evaluation EMA (`engine/ema.py`) against the references' own loop: Flow-GRPO's `train_sd3.py` calls
`EMAModuleWrapper.step(params, global_step)` after every micro-batch; DiffusionNFT and AWM once per optimizer
step. Transcribed here on scalars, with the optimizer's updates replaced by known values."""

from __future__ import annotations

import pytest
import torch

from glm_training.engine.ema import EMASchedule, ema_decay_at, reference_ema_update_


def reference_loop(
    updates: list[float], micro_batches: int, decay: float, interval: int, per_micro_batch: bool
):
    """The references' loop: `updates[k]` is the parameter after optimizer step k + 1."""
    param, ema, global_step = torch.tensor(0.0), torch.tensor(0.0), 0

    def step(s):  # EMAModuleWrapper.step(parameters, optimization_step)
        one_minus_decay = 1 - min((1 + s) / (10 + s), decay)
        if (s + 1) % interval == 0:
            ema.add_(one_minus_decay * (param - ema))

    for value in updates:
        for i in range(micro_batches):
            if i == micro_batches - 1:  # the last micro-batch of the step: sync_gradients
                param.fill_(value)
                global_step += 1
            if per_micro_batch:
                step(global_step)
        if not per_micro_batch:
            step(global_step)
    return ema.item()


def ours(updates: list[float], micro_batches: int, decay: float, interval: int, per_micro_batch: bool):
    """`Policy.optimizer_step`'s calls: before the step with the steps taken, after it with the new count."""
    schedule = EMASchedule(decay, interval, per_micro_batch)
    param, ema = [torch.tensor(0.0)], [torch.tensor(0.0)]
    for steps, value in enumerate(updates):
        schedule.before_step(ema, param, steps, micro_batches)
        param[0].fill_(value)
        schedule.after_step(ema, param, steps + 1)
    return ema[0].item()


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
@pytest.mark.parametrize("interval, per_micro_batch", [(8, True), (1, False), (1, True), (3, False)])
def test_the_schedule_equals_the_references_loop(micro_batches, interval, per_micro_batch):
    updates = [float(k * k % 7 + k) for k in range(1, 41)]
    expected = reference_loop(updates, micro_batches, 0.9, interval, per_micro_batch)
    assert ours(updates, micro_batches, 0.9, interval, per_micro_batch) == expected


def test_flow_grpo_updates_twice_every_eighth_step_at_two_micro_batches():
    # 16 optimizer steps of the parameter 1.0 (it stays there): the EMA moves at steps 7 and 15 only, each
    # time twice, towards 1: 1 - (d7 d7)(d15 d15) with the warm-up decays d7 = 8/17 and d15 = 16/25.
    updates = [1.0] * 16
    got = ours(updates, 2, 0.9, 8, True)
    d7, d15 = ema_decay_at(7, 0.9), ema_decay_at(15, 0.9)
    assert got == pytest.approx(1 - (d7 * d7) * (d15 * d15), abs=1e-6)
    # Once per optimizer step instead (DiffusionNFT's and AWM's calls): one update at each of those steps.
    assert ours(updates, 2, 0.9, 8, False) == pytest.approx(1 - d7 * d15, abs=1e-6)


def test_an_update_is_the_references_formula():
    shadows, params = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    reference_ema_update_(shadows, params, step=20, decay=0.9, interval=1)  # d = min(21/30, 0.9) = 0.7
    torch.testing.assert_close(shadows[0], torch.tensor([1.6, 3.2]))
    reference_ema_update_(shadows, params, step=20, decay=0.9, interval=8)  # (20 + 1) % 8 != 0: no update
    torch.testing.assert_close(shadows[0], torch.tensor([1.6, 3.2]))
