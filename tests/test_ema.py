"""The evaluation EMA (`engine/ema.py`) against the references' own training loops, transcribed below on one
scalar parameter whose optimizer steps are replaced by known values: how often each calls
`EMAModuleWrapper.step(params, global_step)` and with which count. Flow-GRPO's `scripts/train_sd3.py`
(yifan123/flow_grpo at ac4c86e) and the DGPO authors' `scripts/train_sd3_dgpo.py` (Luo-Yihong/DGPO at
01ceb4b) call it after every training batch, DiffusionNFT's `scripts/train_nft_sd3.py` (NVlabs/DiffusionNFT at
24af555) after every optimizer step, AWM's `scripts/train_sd3_awm.py` (scxue/advantage_weighted_matching at
be51372) once per epoch. The reference configs' layouts set the sizes. The micro-batches an update is
computed in never enter: `test_the_calls_do_not_depend_on_the_micro_batches` runs the real update loops at
micro-batch sizes where one call per micro-batch would make other counts."""

from __future__ import annotations

import pytest
import torch
from conftest import DIT_SMALL

from glm_training.config import config_to_yaml, load_config, load_run_config
from glm_training.engine import ema as ema_module
from glm_training.engine.ema import (
    EMASchedule,
    ema_decay_at,
    per_optimizer_step,
    per_rollout,
    per_train_batch,
    reference_ema_update_,
)


def _values(num_steps: int) -> list[float]:
    """The parameter after each optimizer step (distinct, so every EMA call shows)."""
    return [float(k * k % 7 + k) for k in range(1, num_steps + 1)]


class ReferenceEMA:
    """`flow_grpo/ema.py` `EMAModuleWrapper` on one scalar, counting its calls."""

    def __init__(self, decay: float, interval: int):
        self.ema, self.decay, self.interval, self.num_calls = torch.tensor(0.0), decay, interval, 0

    def step(self, param: torch.Tensor, optimization_step: int) -> None:
        self.num_calls += 1
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.interval == 0:
            self.ema.add_(one_minus_decay * (param - self.ema))


def batch_loop(
    values, num_epochs, num_batches, accumulation, num_timesteps, num_inner_epochs, decay, interval
):
    """`train_sd3.py` (lines 826-955) and `train_sd3_dgpo.py` (lines 1045-1215): per epoch and inner epoch,
    the `num_batches_per_epoch` training batches, each `num_timesteps` backward passes under
    `accelerator.accumulate` (an optimizer step every `gradient_accumulation_steps * num_train_timesteps` of
    them, `global_step += 1`), then `ema.step(params, global_step)` after each batch."""
    param, ema, global_step, passes = torch.tensor(0.0), ReferenceEMA(decay, interval), 0, 0
    values = iter(values)
    for _epoch in range(num_epochs):
        for _inner_epoch in range(num_inner_epochs):
            for _i in range(num_batches):
                for _j in range(num_timesteps):
                    passes += 1
                    if passes % (accumulation * num_timesteps) == 0:  # accelerator.sync_gradients
                        param.fill_(next(values))
                        global_step += 1
                ema.step(param, global_step)
    return ema


def nft_loop(values, num_epochs, num_batches, accumulation, num_timesteps, decay, interval):
    """`train_nft_sd3.py` (lines 806-1029): an optimizer step every `gradient_accumulation_steps *
    num_train_timesteps` backward passes; after a batch that ended one, `ema.step(params, global_step)`."""
    param, ema, global_step, passes = torch.tensor(0.0), ReferenceEMA(decay, interval), 0, 0
    values = iter(values)
    for _epoch in range(num_epochs):
        for _i in range(num_batches):
            for _j in range(num_timesteps):
                passes += 1
                if passes % (accumulation * num_timesteps) == 0:
                    param.fill_(next(values))
                    global_step += 1
            if passes % (accumulation * num_timesteps) == 0:
                ema.step(param, global_step)
    return ema


def awm_loop(values, num_epochs, num_batches, accumulation, decay, interval):
    """`train_sd3_awm.py` (lines 1242-1392): one backward per batch, an optimizer step every
    `gradient_accumulation_steps` batches; `ema.step(params, global_step)` once, after the epoch's batches."""
    param, ema, global_step = torch.tensor(0.0), ReferenceEMA(decay, interval), 0
    values = iter(values)
    for _epoch in range(num_epochs):
        for i in range(num_batches):
            if (i + 1) % accumulation == 0:
                param.fill_(next(values))
                global_step += 1
        ema.step(param, global_step)
    return ema


def ours(values, num_epochs, schedule: EMASchedule, num_samples, num_steps, num_passes):
    """What `UpdateLoop.run` and `Policy.optimizer_step` do with the schedule: per rollout the calls of each
    optimizer step (`schedule.calls`), all but the last before the step, the last after it."""
    param, shadow, steps = [torch.tensor(0.0)], [torch.tensor(0.0)], 0
    values = iter(values)
    total = 0
    for _epoch in range(num_epochs):
        for calls in schedule.calls(num_samples, num_steps, num_passes):
            schedule.before_step(shadow, param, steps, calls)
            param[0].fill_(next(values))
            steps += 1
            schedule.after_step(shadow, param, steps, calls)
            total += calls
    return shadow[0], total


def _reference_layout(num_groups: int, group_size: int, num_gpus: int, train_batch_size: int) -> int:
    """The reference configs' `num_batches_per_epoch = int(num_groups / (gpu_number * train_batch_size /
    num_image_per_prompt))`."""
    return int(num_groups / (num_gpus * train_batch_size / group_size))


EPOCHS = 24


@pytest.mark.parametrize(
    "num_gpus, train_batch_size, group_size, num_groups",
    [
        (32, 9, 24, 48),  # config/grpo.py general_ocr_sd3, pickscore_sd3, geneval_sd3: 4 batches, 2 a step
        (4, 8, 16, 16),  # general_ocr_sd3_4gpu, pickscore_sd3_4gpu: 8 batches, 4 a step
        (8, 9, 24, 48),  # recipes/flow_grpo_* on 8 GPUs: 16 batches, 8 a step
    ],
)
@pytest.mark.parametrize("num_inner_epochs", [1, 2])
@pytest.mark.parametrize("interval", [8, 1])
def test_flow_grpo_calls_its_ema_once_per_training_batch(
    num_gpus, train_batch_size, group_size, num_groups, num_inner_epochs, interval
):
    num_batches = _reference_layout(num_groups, group_size, num_gpus, train_batch_size)
    accumulation = num_batches // 2  # config.train.gradient_accumulation_steps = num_batches_per_epoch // 2
    values = _values(EPOCHS * 2 * num_inner_epochs)
    expected = batch_loop(values, EPOCHS, num_batches, accumulation, 9, num_inner_epochs, 0.9, interval)
    # The defaults: FlowGRPOConfig's ema_calls and ema_train_batch_size, with the config's train batch size.
    schedule = EMASchedule(0.9, interval, "per_train_batch", train_batch_size)
    samples_per_rank = num_groups * group_size // num_gpus
    got, num_calls = ours(values, EPOCHS, schedule, samples_per_rank, 2, num_inner_epochs)
    assert num_calls == expected.num_calls == EPOCHS * num_inner_epochs * num_batches
    assert got == expected.ema  # the same float32 operations in the same order


@pytest.mark.parametrize(
    "num_gpus, train_batch_size, group_size, num_groups",
    [
        (4, 16, 16, 8),  # config/dgpo.py general_ocr_sd3_4gpu, geneval_sd3_4gpu: 2 batches, one step
        (4, 12, 24, 8),  # pickscore_sd3_4gpu: 4 batches
        (8, 16, 16, 8),  # recipes/dgpo_ocr on 8 GPUs: 1 batch
    ],
)
@pytest.mark.parametrize("interval", [8, 1])
def test_dgpo_calls_its_ema_once_per_training_batch(
    num_gpus, train_batch_size, group_size, num_groups, interval
):
    num_batches = _reference_layout(num_groups, group_size, num_gpus, train_batch_size)
    # gradient_accumulation_steps = num_batches_per_epoch ("Update once per epoch"); 4 training times.
    values = _values(EPOCHS)
    expected = batch_loop(values, EPOCHS, num_batches, num_batches, 4, 1, 0.9, interval)
    schedule = EMASchedule(0.9, interval, "per_train_batch", train_batch_size)
    got, num_calls = ours(values, EPOCHS, schedule, num_groups * group_size // num_gpus, 1, 1)
    assert num_calls == expected.num_calls == EPOCHS * num_batches
    assert got == expected.ema


@pytest.mark.parametrize("steps_per_epoch", [1, 2])  # config/nft.py: gradient_step_per_epoch (sd3_ocr: 2)
def test_nft_calls_its_ema_after_every_optimizer_step(steps_per_epoch):
    # _get_config(n_gpus=8): bsz 9, 48 groups of 24: 16 batches of 9 per rank.
    num_batches = 16
    values = _values(EPOCHS * steps_per_epoch)
    expected = nft_loop(values, EPOCHS, num_batches, num_batches // steps_per_epoch, 9, 0.9, 1)
    schedule = EMASchedule(0.9, 1, "per_optimizer_step")
    got, num_calls = ours(values, EPOCHS, schedule, num_batches * 9, steps_per_epoch, 1)
    assert num_calls == expected.num_calls == EPOCHS * steps_per_epoch
    assert got == expected.ema


@pytest.mark.parametrize("steps_per_epoch", [1, 2, 3])
def test_awm_calls_its_ema_once_per_epoch_whatever_its_optimizer_steps(steps_per_epoch):
    # config/dgx_awm.py ocr_sd3_no_cfg_1node: 72 training batches of 3 per rank, one step per epoch; more
    # steps per epoch are algo.num_mini_batches.
    num_batches = 72
    values = _values(EPOCHS * steps_per_epoch)
    expected = awm_loop(values, EPOCHS, num_batches, num_batches // steps_per_epoch, 0.99, 1)
    schedule = EMASchedule(0.99, 1, "per_rollout")
    got, num_calls = ours(values, EPOCHS, schedule, num_batches * 3, steps_per_epoch, 1)
    assert num_calls == expected.num_calls == EPOCHS
    assert got == expected.ema
    # A call after every step (per_optimizer_step) is the reference's only at one step per epoch.
    per_step, _ = ours(values, EPOCHS, EMASchedule(0.99, 1, "per_optimizer_step"), 216, steps_per_epoch, 1)
    assert (per_step == expected.ema) == (steps_per_epoch == 1)


def test_each_algorithm_calls_its_ema_as_its_reference():
    """The schemas' defaults: the decay, interval, calls and training batch the golden tests above use."""
    from glm_training.algorithms.dgpo.config import DGPOConfig
    from glm_training.config import AWMConfig, FlowGRPOConfig, NFTConfig

    def settings(a):
        return a.ema_decay, a.ema_update_interval, a.ema_calls, a.ema_train_batch_size

    assert settings(FlowGRPOConfig()) == (0.9, 8, "per_train_batch", 9)
    assert settings(DGPOConfig()) == (0.9, 8, "per_train_batch", 16)
    assert settings(NFTConfig())[:3] == (0.9, 1, "per_optimizer_step")
    assert settings(AWMConfig())[:3] == (0.99, 1, "per_rollout")


def test_the_calls_per_optimizer_step():
    # 144 samples in batches of 9 over 2 steps: 16 batches, 8 a step, every pass.
    assert per_train_batch(144, 9, 2, 2) == [8, 8, 8, 8]
    assert per_train_batch(36, 9, 2, 1) == [2, 2]  # Flow-GRPO on 32 GPUs
    assert per_train_batch(16, 16, 1, 1) == [1]
    assert per_train_batch(45, 9, 2, 1) == [3, 2]  # 5 batches, dealt as the micro-batches (interleaved)
    assert per_train_batch(6, 9, 2, 1) == [1, 1]  # fewer samples than a batch: each step is one
    assert per_train_batch(17, 9, 1, 1) == [1]  # the reference's int(): a partial batch joins the last
    assert per_optimizer_step(144, 9, 2, 2) == [1, 1, 1, 1]
    assert per_rollout(144, 9, 2, 2) == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="num_samples"):
        per_train_batch(None, 9, 2, 1)


def test_flow_grpo_updates_twice_every_eighth_step_at_two_calls_a_step():
    # 16 optimizer steps of the parameter 1.0 (it stays there), 2 calls a step (36 samples in batches of 9):
    # the EMA moves at steps 7 and 15 only, each time twice, towards 1: 1 - (d7 d7)(d15 d15) with the
    # warm-up decays d7 = 8/17 and d15 = 16/25.
    values = [1.0] * 16
    got, _ = ours(values, 8, EMASchedule(0.9, 8, "per_train_batch", 9), 36, 2, 1)
    d7, d15 = ema_decay_at(7, 0.9), ema_decay_at(15, 0.9)
    assert got.item() == pytest.approx(1 - (d7 * d7) * (d15 * d15), abs=1e-6)
    # Once per optimizer step instead (DiffusionNFT's calls): one update at each of those steps.
    got, _ = ours(values, 8, EMASchedule(0.9, 8, "per_optimizer_step"), 36, 2, 1)
    assert got.item() == pytest.approx(1 - d7 * d15, abs=1e-6)


def test_an_update_is_the_references_formula():
    shadows, params = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    reference_ema_update_(shadows, params, step=20, decay=0.9, interval=1)  # d = min(21/30, 0.9) = 0.7
    torch.testing.assert_close(shadows[0], torch.tensor([1.6, 3.2]))
    reference_ema_update_(shadows, params, step=20, decay=0.9, interval=8)  # (20 + 1) % 8 != 0: no update
    torch.testing.assert_close(shadows[0], torch.tensor([1.6, 3.2]))


def test_a_saved_config_with_the_retired_per_micro_batch_switch_still_loads(tmp_path):
    # Checkpoints written before algo.ema_calls hold algo.ema_every_micro_batch; evaluation reads them.
    saved = config_to_yaml(load_config([f"trainer.output_dir={tmp_path}"], "t2i_training"))
    path = tmp_path / "config.yaml"
    path.write_text(saved.replace("  ema_calls:", "  ema_every_micro_batch: true\n  ema_calls:"))
    assert "ema_every_micro_batch" in path.read_text()
    assert load_run_config(path).algo.ema_calls == "per_train_batch"


@pytest.mark.parametrize(
    "config, extra, micro_batch_sizes, expected",
    [
        # 6 samples in training batches of 2, 2 optimizer steps: 3 batches, [2, 1], at 3 or 2 micro-batches
        # (one call per micro-batch would make [2, 1] and [1, 1]).
        ("t2i_training", ["algo.num_mini_batches=2", "algo.ema_train_batch_size=2"], (2, 3), [2, 1]),
        # 6 samples, one training batch of DGPOConfig's 16 (fewer samples: one batch), at 3 micro-batches.
        ("dgpo_training", ["algo.trunc_steps=2", "algo.train_timesteps=1"], (2,), [1]),
        # AWM with 2 optimizer steps per rollout: one call, after the second.
        ("awm_training", ["algo.num_mini_batches=2", "algo.train_timesteps=1"], (3,), [0, 1]),
    ],
)
def test_the_calls_do_not_depend_on_the_micro_batches(
    tmp_path, monkeypatch, config, extra, micro_batch_sizes, expected
):
    """The real update loop: the EMA's calls at each optimizer step are its reference's (the counts
    `EMASchedule` updates the shadows with, with an update at every count), whatever the micro-batches."""
    from glm_training.engine.trainer import DiTTrainer

    made = []
    real_update = ema_module.reference_ema_update_

    def counted(shadows, params, step, decay, interval):
        made.append(step)
        real_update(shadows, params, step, decay, interval)

    monkeypatch.setattr(ema_module, "reference_ema_update_", counted)
    # Before a step its calls but the last see the count of the steps taken; the last, after it, the new one.
    counts = [c for k, n in enumerate(expected) for c in [k] * (n - 1) + [k + 1] * (n > 0)]
    for micro_batch_size in micro_batch_sizes:
        args = [*DIT_SMALL, *extra, f"sampling.micro_batch_size={micro_batch_size}", "algo.ema=true"]
        args += ["algo.ema_update_interval=1", f"trainer.output_dir={tmp_path / str(micro_batch_size)}"]
        trainer = DiTTrainer(load_config(["--config", f"configs/{config}.yaml", *args], "t2i_training"))
        batch = trainer.collect(0)
        made.clear()
        trainer.algorithm.update(batch, 0)
        assert made == counts, (micro_batch_size, made)
