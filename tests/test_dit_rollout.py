"""The DiT rollout against GLM-Image's own pipeline, and the exact first policy ratio of the trainer."""

from __future__ import annotations

import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.config import load_config
from glm_training.rollout.dit import (
    build_guidance_inputs,
    decode_latents,
    glm_image_schedule,
    sample_trajectory,
)
from glm_training.trainers.dit_trainer import DiTTrainer

PROMPT = "a sign that says 'OPEN' above a red door"
HEIGHT = WIDTH = 64


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    return GlmImagePipeline.from_pretrained(tiny_model_dir)


def _inputs(pipe, batch: int, seed: int = 0):
    prior, _, _ = pipe.generate_prior_tokens(
        prompt=[PROMPT], height=HEIGHT, width=WIDTH, generator=torch.Generator().manual_seed(seed)
    )
    shape = (batch, pipe.transformer.config.in_channels, HEIGHT // 8, WIDTH // 8)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    return prior.repeat(batch, 1), latents


def _pipeline_latents(pipe, prior, latents, num_steps: int, guidance: float) -> torch.Tensor:
    return pipe(
        prompt=[PROMPT] * latents.shape[0],
        prior_token_ids=prior,
        latents=latents.clone(),
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=num_steps,
        guidance_scale=guidance,
        output_type="latent",
    ).images


def _rollout(
    pipe, prior, latents, num_steps, guidance, *, noise_level, sde_type="flow_sde", window=None, seed=0
):
    timesteps, sigmas = glm_image_schedule(pipe, num_steps, HEIGHT, WIDTH)
    cond = build_guidance_inputs(
        pipe, [PROMPT] * latents.shape[0], prior, HEIGHT, WIDTH, guidance, torch.device("cpu"), torch.float32
    )
    return sample_trajectory(
        pipe.transformer,
        latents.clone(),
        cond,
        timesteps,
        sigmas,
        guidance_scale=guidance,
        noise_level=noise_level,
        sde_type=sde_type,
        sde_window=window or (0, num_steps),
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize("guidance", [1.5, 1.0])
@pytest.mark.parametrize("num_steps", [4, 7])
def test_noise_level_zero_reproduces_the_pipeline_exactly(pipe, guidance, num_steps):
    prior, latents = _inputs(pipe, batch=3)
    expected = _pipeline_latents(pipe, prior, latents, num_steps, guidance)
    traj = _rollout(pipe, prior, latents, num_steps, guidance, noise_level=0.0)
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=0)
    assert traj.step_indices == list(range(num_steps))
    assert torch.all(traj.log_probs_bs == 0)  # deterministic steps: log-prob defined as 0


def test_cps_with_noise_zero_matches_the_pipeline(pipe):
    prior, latents = _inputs(pipe, batch=2)
    expected = _pipeline_latents(pipe, prior, latents, 5, 1.5)
    traj = _rollout(pipe, prior, latents, 5, 1.5, noise_level=0.0, sde_type="cps")
    torch.testing.assert_close(traj.final_latents, expected, rtol=1e-5, atol=1e-5)


def test_sde_window_records_only_window_steps_and_differs_from_ode(pipe):
    prior, latents = _inputs(pipe, batch=2)
    ode = _rollout(pipe, prior, latents, 6, 1.5, noise_level=0.0)
    sde = _rollout(pipe, prior, latents, 6, 1.5, noise_level=0.7, window=(1, 3))
    assert sde.step_indices == [1, 2]
    assert sde.latents_bsc.shape == (2, 2, *latents.shape[1:])
    assert torch.isfinite(sde.log_probs_bs).all() and (sde.log_probs_bs != 0).all()
    assert not torch.allclose(sde.final_latents, ode.final_latents)
    # The recorded step j starts where step j-1 ended (contiguous window).
    torch.testing.assert_close(sde.latents_bsc[:, 1], sde.next_latents_bsc[:, 0], rtol=0, atol=0)


def test_decoded_images_match_the_pipeline(pipe):
    prior, latents = _inputs(pipe, batch=1)
    traj = _rollout(pipe, prior, latents, 3, 1.5, noise_level=0.0)
    ours = decode_latents(pipe, traj.final_latents)[0]
    theirs = pipe(
        prompt=[PROMPT],
        prior_token_ids=prior,
        latents=latents.clone(),
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=3,
        guidance_scale=1.5,
    ).images[0]
    assert ours.size == theirs.size == (WIDTH, HEIGHT)
    assert ours.tobytes() == theirs.tobytes()


def _trainer(tmp_path, *overrides: str) -> DiTTrainer:
    cfg = load_config(
        [
            f"trainer.output_dir={tmp_path}",
            "trainer.progress_bar=false",
            "sampling.num_steps=4",
            "sampling.micro_batch_size=3",
            "data.num_groups_per_step=2",
            "data.num_generations=3",
            *overrides,
        ],
        "t2i_training",
    )
    return DiTTrainer(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.lora.enabled=true", "algo.beta=0.04"),
        ("sampling.sde_type=cps", "sampling.sde_window_start=1", "sampling.sde_window_end=3"),
    ],
    ids=["full", "lora+kl", "cps-window"],
)
def test_first_ratio_after_a_rollout_is_exactly_one(tmp_path, overrides):
    trainer = _trainer(tmp_path, *overrides)
    batch = trainer._collect(0)
    for traj in batch.rollout.trajectories:
        for j in range(len(traj.step_indices)):
            new = trainer.policy_step(traj, j, batch.rollout)  # the training path, with gradients
            assert new.log_prob.requires_grad
            assert torch.equal(new.log_prob.detach(), traj.log_probs_bs[:, j])
    stats = trainer._update(batch, 0)
    assert stats["approx_kl"] == 0.0 and stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    assert stats["kl"] == 0.0  # policy == reference before the first optimizer step
    assert stats["grad_norm"] > 0


def test_update_moves_probability_towards_high_advantage_samples(tmp_path):
    trainer = _trainer(tmp_path)
    batch = trainer._collect(0)
    old = torch.cat([t.log_probs_bs for t in batch.rollout.trajectories]).mean(dim=1)
    trainer._update(batch, 0)
    with torch.no_grad():
        new = torch.cat(
            [
                torch.stack(
                    [trainer.policy_step(t, j, batch.rollout).log_prob for j in range(len(t.step_indices))], 1
                )
                for t in batch.rollout.trajectories
            ]
        ).mean(dim=1)
    assert (batch.advantages * (new - old)).sum() > 0
