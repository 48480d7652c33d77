"""bf16 by construction: policy, old log-probs and reference run in one precision in both trainers.

Under `trainer.mixed_precision=bf16` accelerate runs the prepared policy's forward under autocast; the
rollout, the old log-probs and the frozen reference copy of full fine-tuning are other modules or calls, so
only `Policy.precision()` makes them compute in the same precision. If any of them ran in
fp32 instead, the first ratio or the first KL would be off by bf16 rounding (~1e-2), not exactly 1 / 0.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DIT_SMALL
from test_ar_training import SMALL as AR_TRAINING_SMALL

from glm_training.config import load_config
from glm_training.engine.trainer import ARTrainer, DiTTrainer

BF16_FULL_FT_KL = ["trainer.mixed_precision=bf16", "model.lora.enabled=false", "algo.beta=0.05"]

AR_SMALL = [*AR_TRAINING_SMALL, "algo.dynamic_sampling=false"]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide mixed-precision setting and refuses another; the other tests of the
    session run without mixed precision, so the state is reset before and after each bf16 trainer."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


def _first_update(trainer):
    assert trainer.policy.reference is not None  # full fine-tuning with beta > 0: the frozen fp32-weight copy
    batch = trainer.collect(0)
    return trainer.update(batch, 0)


def test_ar_first_step_is_exact_under_bf16(tmp_path):
    cfg = load_config([*AR_SMALL, *BF16_FULL_FT_KL, f"trainer.output_dir={tmp_path}"], "ar_training")
    stats = _first_update(ARTrainer(cfg))
    assert stats["ratio_mean"] == 1.0 and stats["approx_kl"] == 0.0 and stats["clip_frac"] == 0.0
    assert stats["kl"] == 0.0
    # The sampling pass is in the same precision too: the recorded log-probs match the teacher-forced ones
    # up to the bf16 rounding of two differently shaped computations (fp32 vs bf16 would be ~1e-1 here).
    assert stats["sampling_logp_max_diff"] < 0.1
    assert stats["grad_norm"] > 0


def test_dit_first_step_is_exact_under_bf16(tmp_path):
    cfg = load_config(
        [*DIT_SMALL, *BF16_FULL_FT_KL, f"trainer.output_dir={tmp_path}", "sampling.num_steps=2"],
        "t2i_training",
    )
    stats = _first_update(DiTTrainer(cfg))
    assert stats["ratio_mean"] == 1.0 and stats["approx_kl"] == 0.0 and stats["clip_frac"] == 0.0
    assert stats["kl"] == 0.0
    assert stats["grad_norm"] > 0


@pytest.mark.parametrize("trainer_cls", [ARTrainer, DiTTrainer])
def test_policy_precision_is_bf16_autocast(tmp_path, trainer_cls):
    name = "ar_training" if trainer_cls is ARTrainer else "t2i_training"
    small = AR_SMALL if trainer_cls is ARTrainer else DIT_SMALL
    cfg = load_config([*small, *BF16_FULL_FT_KL, f"trainer.output_dir={tmp_path}"], name)
    trainer = trainer_cls(cfg)
    layer = torch.nn.Linear(4, 4)
    with trainer.policy.precision():
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16  # the unprepared module computes in bf16 too


def test_policy_precision_skips_peft_s_input_casts_under_bf16(tmp_path):
    """LoRA with float32 adapters under bf16 autocast: the adapted layers leave their inputs in bf16
    (`models.lora.adapter_inputs_uncast`, bit-identical) inside `precision()` only."""
    from glm_training.models.lora import tuner_layers

    cfg = load_config(
        [
            *DIT_SMALL,
            "model.lora.enabled=true",
            "trainer.mixed_precision=bf16",
            f"trainer.output_dir={tmp_path}",
        ],
        "t2i_training",
    )
    trainer = DiTTrainer(cfg)
    layers = [layer for _, layer in tuner_layers(trainer.policy.trainable)]
    assert layers and all(layer.cast_input_dtype_enabled for layer in layers)
    with trainer.policy.precision():
        assert not any(layer.cast_input_dtype_enabled for layer in layers)
    assert all(layer.cast_input_dtype_enabled for layer in layers)
