"""Flow-GRPO parity defaults and the fast decoder recipes: SDE windows, batched CFG, training without CFG."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.cli import run
from glm_training.config import ConfigError, DiTSamplingConfig, FlowGRPOConfig, load_config
from glm_training.engine.trainer import DiTTrainer
from glm_training.evaluation import eval_sampling
from glm_training.pipeline.dit import (
    build_guidance_inputs,
    glm_image_schedule,
    predict_velocity,
    predict_velocity_batched_cfg,
)

HEIGHT = WIDTH = 64


def test_the_defaults_are_flow_grpos(tmp_path):
    """What a Flow-GRPO user expects (yifan123/flow_grpo: train_sd3.py, config/grpo.py), read back."""
    algo, sampling = FlowGRPOConfig(), DiTSamplingConfig()
    assert algo.kl_type == "flow_grpo"  # mean(dmu^2) / (2 std_dev_t^2): its betas 0.04 / 0.01 carry over
    assert algo.scale_rewards == "batch"  # sample.global_std=True in every shipped SD3 config
    assert algo.num_mini_batches == 2  # gradient_accumulation_steps = num_batches_per_epoch // 2
    assert algo.drop_zero_advantage  # samples with zero advantage are filtered out
    assert algo.clip_range == 1e-4 and algo.adv_clip_max == 5.0 and algo.ratio_norm == "none"
    assert sampling.noise_level == 0.7 and sampling.sde_type == "flow_sde"
    assert sampling.cps_log_prob == "flow_grpo" and not sampling.batched_cfg
    # Window (0, num_steps - 1): the last step is deterministic, and every SDE step trains.
    assert (sampling.sde_window_start, sampling.window_end()) == (0, sampling.num_steps - 1)
    assert int(sampling.num_steps * algo.timestep_fraction) >= sampling.window_end()
    # The shipped tiny config keeps them but one: it takes 1 optimizer step per rollout (see its comment),
    # while having enough micro-batches for Flow-GRPO's 2 with algo.num_mini_batches=2.
    cfg = load_config([f"trainer.output_dir={tmp_path}"], "t2i_training")
    assert (cfg.algo.kl_type, cfg.algo.scale_rewards, cfg.algo.drop_zero_advantage) == (
        "flow_grpo",
        "batch",
        True,
    )
    assert cfg.algo.num_mini_batches == 1
    assert cfg.data.num_groups_per_step * cfg.data.num_generations >= 2 * cfg.sampling.micro_batch_size


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["sampling.sde_window_size=4", "sampling.sde_window_range=[0,3]"], "sampling.sde_window_range"),
        (["sampling.sde_window_schedule=sliding"], "sampling.sde_window_schedule"),
        (["algo.kl_type=k3"], "algo.kl_type"),
        (["algo.ratio_norm=guard"], "algo.ratio_norm"),
        (["sampling.cps_log_prob=full"], "sampling.cps_log_prob"),
        (["algo.ratio_norm=grpo_guard", "sampling.sde_type=cps"], "algo.ratio_norm"),
    ],
)
def test_bad_recipe_keys_are_named(tmp_path, args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([*args, f"trainer.output_dir={tmp_path}"], "t2i_training")


def _trainer(tmp_path, *overrides: str) -> DiTTrainer:
    cfg = load_config(
        [
            f"trainer.output_dir={tmp_path}",
            "trainer.progress_bar=false",
            "sampling.height=32",
            "sampling.width=32",
            "sampling.num_steps=6",
            "sampling.micro_batch_size=2",
            "data.num_groups_per_step=2",
            "data.num_generations=2",
            "eval.every_n_steps=0",
            *overrides,
        ],
        "t2i_training",
    )
    return DiTTrainer(cfg)


def test_random_window_is_sde_inside_ode_outside_and_trains_each_window_step(tmp_path):
    trainer = _trainer(tmp_path, "sampling.sde_window_size=2", "sampling.sde_window_range=[0,4]")
    windows = [trainer.algorithm.sde_window(step) for step in range(30)]
    assert {w[0] for w in windows} == {0, 1, 2} and all(w[1] == w[0] + 2 for w in windows)
    batch = trainer.collect(3)
    start = windows[3][0]
    for traj in batch.rollout.trajectories:
        assert traj.step_indices == [start, start + 1]
        assert (traj.log_probs_bs != 0).all()
    stats = trainer.update(batch, 3)
    assert stats["sde_window_start"] == start and stats["num_train_steps"] == 2
    # Progressive (MixGRPO): slides one step every 2 training steps.
    sliding = _trainer(
        tmp_path / "p",
        "sampling.sde_window_size=2",
        "sampling.sde_window_range=[0,4]",
        "sampling.sde_window_schedule=progressive",
        "sampling.sde_window_every=2",
    )
    assert [sliding.algorithm.sde_window(step)[0] for step in range(8)] == [0, 0, 1, 1, 2, 2, 0, 0]


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    return GlmImagePipeline.from_pretrained(tiny_model_dir)


def _cond(pipe, prompts, guidance=1.5):
    prior, _, _ = pipe.generate_prior_tokens(
        prompt=prompts, height=HEIGHT, width=WIDTH, generator=torch.Generator().manual_seed(0)
    )
    cond = build_guidance_inputs(
        pipe, prompts, prior, HEIGHT, WIDTH, guidance, torch.device("cpu"), torch.float32
    )
    latents = torch.randn(
        len(prompts), pipe.transformer.config.in_channels, 8, 8, generator=torch.Generator().manual_seed(1)
    )
    return cond, latents


@torch.no_grad()
def test_batched_cfg_equals_sequential_when_the_glyph_lengths_match(pipe):
    # Prompts without quoted text have glyph embeddings as long as the empty prompt's: nothing is padded,
    # and one forward of 2B samples equals two of B up to float rounding.
    cond, latents = _cond(pipe, ["a cat", "a dog"])
    assert cond.prompt_embeds.shape[1] == cond.negative_embeds.shape[1]
    timesteps, _ = glm_image_schedule(pipe, 4, HEIGHT, WIDTH)
    for t in timesteps:
        sequential = predict_velocity(pipe.transformer, latents, t, cond, 1.5)
        batched = predict_velocity_batched_cfg(pipe.transformer, latents, t, cond, 1.5)
        torch.testing.assert_close(batched, sequential, atol=5e-5, rtol=1e-5)


@torch.no_grad()
def test_batched_cfg_with_padded_glyphs_differs_measurably_and_no_cfg_is_untouched(pipe):
    # GLM-Image's DiT takes no text mask: the empty prompt's glyph embeddings padded to a quoted prompt's
    # length change the unconditional prediction (why batched_cfg is an option, off by default).
    cond, latents = _cond(pipe, ["a sign that says 'OPEN' above a red door", "a cat"])
    assert cond.prompt_embeds.shape[1] > cond.negative_embeds.shape[1]
    timesteps, _ = glm_image_schedule(pipe, 4, HEIGHT, WIDTH)
    sequential = predict_velocity(pipe.transformer, latents, timesteps[1], cond, 1.5)
    batched = predict_velocity_batched_cfg(pipe.transformer, latents, timesteps[1], cond, 1.5)
    rel = ((batched - sequential).abs().max() / sequential.abs().mean()).item()
    assert 1e-4 < rel < 0.5, rel  # measured ~0.05 on the tiny model
    # Without CFG there is nothing to batch: the same single pass, bit for bit.
    assert torch.equal(
        predict_velocity_batched_cfg(pipe.transformer, latents, timesteps[1], cond, 1.0),
        predict_velocity(pipe.transformer, latents, timesteps[1], cond, 1.0),
    )


@torch.no_grad()
def test_batched_cfg_rollout_recomputes_its_own_log_probs_exactly(tmp_path):
    trainer = _trainer(tmp_path, "sampling.batched_cfg=true")
    batch = trainer.collect(0)
    for traj in batch.rollout.trajectories:
        for j in range(len(traj.step_indices)):
            assert torch.equal(
                trainer.algorithm.policy_step(traj, j, batch.rollout).log_prob, traj.log_probs_bs[:, j]
            )


def test_train_without_cfg_and_evaluate_with_it(tmp_path):
    """Flow-GRPO's "nocfg" recipe: rollouts and training at guidance 1 (one DiT pass), evaluation with CFG."""
    args = [
        "trainer.progress_bar=false",
        "sampling.height=32",
        "sampling.width=32",
        "sampling.num_steps=3",
        "data.num_groups_per_step=2",
        "data.num_generations=2",
        "sampling.guidance_scale=1",
        "eval.guidance_scale=1.5",
        "eval.every_n_steps=1",
        "eval.num_prompts=2",
        "trainer.num_steps=1",
        f"trainer.output_dir={tmp_path}",
    ]
    cfg = load_config(args, "t2i_training")
    assert cfg.sampling.guidance_scale == 1 and eval_sampling(cfg).guidance_scale == 1.5
    trainer = DiTTrainer(cfg)
    batch = trainer.collect(0)
    assert all(t.cond.negative_embeds is None for t in batch.rollout.trajectories)  # no CFG pass at all
    assert run(DiTTrainer, "t2i_training", [*args[:-1], f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    evaluated = json.loads((tmp_path / "run" / "eval" / "000001.json").read_text())
    assert evaluated["sampling"]["guidance_scale"] == 1.5 and len(evaluated["total_per_prompt"]) == 2
