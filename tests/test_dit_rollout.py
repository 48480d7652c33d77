"""The DiT rollout against GLM-Image's own pipeline, and the exact first policy ratio of the trainer."""

from __future__ import annotations

import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.algorithms.decoder.trajectory import sample_trajectory
from glm_training.config import load_config
from glm_training.engine.trainer import DiTTrainer
from glm_training.pipeline.dit import build_guidance_inputs, decode_latents, glm_image_schedule

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
        (
            "algo.ratio_norm=grpo_guard",
            "algo.beta=0.04",
            "algo.kl_type=velocity",
            "sampling.batched_cfg=true",
        ),
    ],
    ids=["full", "lora+kl", "cps-window", "guard+velocity-kl+batched-cfg"],
)
def test_first_ratio_after_a_rollout_is_exactly_one(tmp_path, overrides):
    trainer = _trainer(tmp_path, "algo.num_mini_batches=2", *overrides)
    batch = trainer.collect(0)
    for traj in batch.rollout.trajectories:
        for j in range(len(traj.step_indices)):
            new = trainer.algorithm.policy_step(traj, j, batch.rollout)  # the training path, with gradients
            assert new.log_prob.requires_grad
            assert torch.equal(new.log_prob.detach(), traj.log_probs_bs[:, j])
    stats = trainer.update(batch, 0)
    assert stats["num_optimizer_steps"] == 2  # Flow-GRPO's default: two optimizer steps per rollout
    first = trainer.updates.last.mini_batches[0]  # before any optimizer step: on-policy
    assert first["approx_kl"] == 0.0 and first["ratio_mean"] == 1.0 and first["clip_frac"] == 0.0
    assert first["kl"] == 0.0  # policy == reference before the first optimizer step
    assert stats["grad_norm"] > 0


def test_the_second_optimizer_step_is_off_policy_and_the_clip_acts(tmp_path):
    trainer = _trainer(tmp_path, "algo.num_mini_batches=2")  # Flow-GRPO's (the tiny YAML takes 1)
    batch = trainer.collect(0)
    stats = trainer.update(batch, 0)
    first, second = trainer.updates.last.mini_batches
    assert first["clip_frac"] == 0.0 and first["ratio_mean"] == 1.0
    # After one step at lr 1e-2 the recorded steps' ratios move by far more than clip_range 1e-4.
    assert second["clip_frac"] > 0 and second["approx_kl"] > 0
    assert stats["clip_frac"] == pytest.approx((first["clip_frac"] + second["clip_frac"]) / 2)


def test_one_mini_batch_stays_on_policy(tmp_path):
    trainer = _trainer(tmp_path, "algo.num_mini_batches=1")
    stats = trainer.update(trainer.collect(0), 0)
    assert stats["num_optimizer_steps"] == 1 and stats["clip_frac"] == 0.0 and stats["ratio_mean"] == 1.0


def test_every_sde_step_trains_and_the_last_step_is_deterministic(tmp_path):
    # 4 steps: SDE on [0, 3) (the last step is an ODE step, as in Flow-GRPO), and all 3 train.
    trainer = _trainer(tmp_path)
    batch = trainer.collect(0)
    assert all(t.step_indices == [0, 1, 2] for t in batch.rollout.trajectories)
    stats = trainer.update(batch, 0)
    assert stats["num_train_steps"] == 3 and stats["sde_window_start"] == 0


def test_zero_advantage_samples_leave_the_loss_and_kl(tmp_path):
    """A sample with advantage 0 adds nothing, KL included: the gradient equals that of the others alone."""
    trainer = _trainer(tmp_path, "algo.beta=0.5", "algo.num_mini_batches=1")
    batch = trainer.collect(0)
    traj, rollout = batch.rollout.trajectories[0], batch.rollout
    params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    with torch.no_grad():  # move the policy away from the reference so the KL has a gradient
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    adv = torch.tensor([1.0, 0.0, -1.0])

    def grads(keep, num):
        for p in params:
            p.grad = None
        values = trainer.algorithm.loss_and_backward(traj, 0, rollout, adv, keep, num, 1)
        return torch.cat([p.grad.flatten() for p in params]), values

    dropped, dropped_values = grads(torch.tensor([True, False, True]), 2)
    kept, kept_values = grads(torch.ones(3, dtype=torch.bool), 3)
    assert kept_values["kl"] > 0 and dropped_values["kl"] > 0
    assert not torch.allclose(dropped, kept * 1.5)  # the zero-advantage sample's KL gradient is gone
    # Independent: the same loss written out over samples 0 and 2 only.
    for p in params:
        p.grad = None
    new = trainer.algorithm.policy_step(traj, 0, rollout)
    with torch.no_grad(), trainer.policy.reference_model() as reference:
        ref = trainer.algorithm.policy_step(traj, 0, rollout, module=reference)
    ratio = torch.exp(new.log_prob - traj.log_probs_bs[:, 0])
    kl = ((new.mean - ref.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * new.std_dev_t.flatten() ** 2)
    loss_b = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-4, 1 + 1e-4)) + 0.5 * kl
    ((loss_b[0] + loss_b[2]) / 2).backward()
    expected = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(dropped, expected, atol=1e-6, rtol=1e-4)


def test_flat_groups_get_exactly_zero_advantage_and_the_fraction_is_logged(tmp_path):
    trainer = _trainer(tmp_path)
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.1, 0.1, 0.1])  # group 1 is flat; its float32 mean is not 0.1
    advantages, stats = trainer.algorithm.advantages(rewards, {"r": rewards})
    assert advantages[3:].tolist() == [0.0, 0.0, 0.0]
    assert stats["frac_zero_advantage"] == pytest.approx(4 / 6)  # the middle of group 0 is 0 too
    # Flow-GRPO's global std (numpy, population std of all rewards, + 1e-4) is the default scale.
    r = rewards.double().numpy()
    expected = (r[:3] - r[:3].mean()) / (r.std() + 1e-4)
    torch.testing.assert_close(advantages[:3].double(), torch.from_numpy(expected), atol=1e-5, rtol=1e-5)


def test_update_moves_probability_towards_high_advantage_samples(tmp_path):
    trainer = _trainer(tmp_path)
    batch = trainer.collect(0)
    old = torch.cat([t.log_probs_bs for t in batch.rollout.trajectories]).mean(dim=1)
    trainer.update(batch, 0)
    with torch.no_grad():
        new = torch.cat(
            [
                torch.stack(
                    [
                        trainer.algorithm.policy_step(t, j, batch.rollout).log_prob
                        for j in range(len(t.step_indices))
                    ],
                    1,
                )
                for t in batch.rollout.trajectories
            ]
        ).mean(dim=1)
    assert (batch.advantages * (new - old)).sum() > 0
