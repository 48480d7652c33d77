"""The Python API: `import glm_training` is cheap, a trainer takes reward functions and `Reward` objects."""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import DIT_SMALL, REPO

import glm_training as gt
from glm_training.metrics import read_metrics
from glm_training.rewards.callable_reward import reward_name
from glm_training.rewards.combine import rewards_from_python


def test_import_is_lazy_and_every_export_resolves():
    # A fresh interpreter: importing the package loads neither torch nor a trainer.
    code = "import sys, glm_training; print(sorted(m for m in sys.modules if m in ('torch', 'diffusers')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for name in gt.__all__:
        assert getattr(gt, name) is not None, name
    assert gt.DiTTrainer.__name__ == "DiTTrainer" and gt.export_pipeline.__module__ == "glm_training.export"
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        gt.Trainr  # noqa: B018


def brightness(images, prompts, metadata):
    return [float(np.asarray(image, dtype=np.float32).mean()) / 255.0 for image in images]


class Constant(gt.Reward):
    def __init__(self, value: float):
        self.value = value
        self.checked = 0

    def check_prompts(self, prompts, metadata):
        self.checked += len(prompts)

    def __call__(self, images, prompts, metadata):
        return torch.full((len(images),), self.value)


def test_rewards_given_in_python_are_named_weighted_and_recorded():
    cfg = gt.load_config()
    constant = Constant(2.0)
    reward_set, recorded = rewards_from_python(
        cfg.reward,
        [
            brightness,
            lambda i, p, m: [0.5] * len(i),
            lambda i, p, m: [1.0] * len(i),
            constant,
            "jpeg_compressibility",
        ],
        [1.0, 2.0, 3.0, 0.5, 0.0],
    )
    names = ["brightness", "lambda", "lambda_2", "Constant", "jpeg_compressibility"]
    assert reward_set.names == recorded.names == names
    assert recorded.weights == [1.0, 2.0, 3.0, 0.5, 0.0]
    reward_set.check_prompts(["a", "b"], [{}, {}])
    assert constant.checked == 2  # a Reward object's start-up check runs
    images = [gt_image(0), gt_image(255)]
    parts = reward_set(images, ["a", "b"], [{}, {}])
    np.testing.assert_allclose(parts["brightness"].numpy(), [0.0, 1.0])
    # total = 1 * brightness + 2 * 0.5 + 3 * 1.0 + 0.5 * 2.0 + 0 * jpeg = brightness + 5
    np.testing.assert_allclose(reward_set.combine(parts, 2).numpy(), [5.0, 6.0])

    by_key, recorded = rewards_from_python(cfg.reward, {"bright": brightness, "size": "jpeg_compressibility"})
    assert by_key.names == recorded.names == ["bright", "size"] and recorded.weights == [1.0, 1.0]
    assert reward_name(functools.partial(brightness)) == "brightness"
    assert reward_name(gt.build_reward("jpeg_compressibility")) == "jpeg_compressibility"

    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 rewards"):
        rewards_from_python(cfg.reward, [brightness, constant], [1.0])
    with pytest.raises(ValueError, match="empty"):
        rewards_from_python(cfg.reward, [])
    with pytest.raises(ValueError, match="Did you mean 'ocr'"):
        rewards_from_python(cfg.reward, [brightness, "ocrr"])


def gt_image(value: int):
    from PIL import Image

    return Image.new("RGB", (8, 8), (value, value, value))


@pytest.mark.slow
def test_a_trainer_trains_two_steps_with_a_lambda_reward(tmp_path):
    scored: list[float] = []

    def record(scores):
        scored.extend(scores)
        return scores

    cfg = gt.load_config(overrides=[*DIT_SMALL, "trainer.num_steps=2", f"hydra.run.dir={tmp_path}"])
    assert str(cfg.trainer.output_dir) == str(tmp_path)
    trainer = gt.DiTTrainer(
        cfg,
        reward_funcs=[
            lambda images, prompts, metadata: record([-abs(np.asarray(i, float).std()) for i in images])
        ],
    )
    assert trainer.train() == tmp_path
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # 2 groups x 3 generations per step, all scored by the lambda and nothing else.
    assert len(scored) == 12
    for step, row in enumerate(rows):
        mean = float(np.mean(scored[6 * step : 6 * step + 6]))
        assert row["reward/lambda"] == pytest.approx(mean, rel=1e-5)
        assert row["reward_mean"] == pytest.approx(mean, rel=1e-5)  # the only reward, weight 1
    assert "reward/jpeg_compressibility" not in rows[0]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["reward"]["names"] == ["lambda"] and saved["reward"]["weights"] == [1.0]


def test_trainers_of_different_precisions_in_one_session(tmp_path):
    # accelerate keeps one engine state per process; each trainer sets its own precision.
    plain = gt.DiTTrainer(gt.load_config(overrides=[*DIT_SMALL, f"hydra.run.dir={tmp_path / 'a'}"]))
    assert plain.accelerator.mixed_precision == "no"
    bf16 = [*DIT_SMALL, "trainer.mixed_precision=bf16", f"hydra.run.dir={tmp_path / 'b'}"]
    assert gt.DiTTrainer(gt.load_config(overrides=bf16)).accelerator.mixed_precision == "bf16"
