"""The SDE rollout (Flow-GRPO's, shared by any decoder algorithm on sampled trajectories) and its
recomputation: the pipeline's denoising loop (`pipeline/dit.py`) with SDE steps inside the step's window
that record the latents before and after, the transition mean and the log-prob of the step taken
(`DiTTrajectory`), deterministic Euler steps elsewhere; `recompute_step` gives a recorded step's log-prob
with gradients under the current policy. With noise level 0 it reproduces the pipeline's latents exactly."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from glm_training.algorithms.decoder.sde import SDEStep, cps_step, flow_sde_step
from glm_training.pipeline.dit import VELOCITY_FNS, GuidanceInputs
from glm_training.pipeline.euler import ode_step

SDE_STEPS: dict[str, Callable[..., SDEStep]] = {"flow_sde": flow_sde_step, "cps": cps_step}


def sde_step_fn(sde_type: str, cps_log_prob: str = "flow_grpo") -> Callable[..., SDEStep]:
    """The step function of `sampling.sde_type`; CPS with its log-prob reduction (`sampling.cps_log_prob`)."""
    if sde_type == "cps":
        return functools.partial(cps_step, log_prob=cps_log_prob)
    return SDE_STEPS[sde_type]


@dataclass
class DiTTrajectory:
    """One micro-batch of sampled trajectories. Everything on CPU except while in use.

    Attributes:
        cond: the guidance inputs the DiT saw.
        latents_bsc: [B, K, C, h, w] latents *before* each of the K recorded SDE steps (float32).
        next_latents_bsc: [B, K, C, h, w] latents *after* each recorded step (the sample taken).
        log_probs_bs: [B, K] float32 log-probs of the steps taken (mean over latent elements).
        means_bsc: [B, K, C, h, w] float32 transition means of the steps taken (GRPO-Guard's ratio).
        step_indices: the K schedule indices that were SDE steps.
        final_latents: [B, C, h, w] the fully denoised latents.
    """

    cond: GuidanceInputs
    latents_bsc: torch.Tensor
    next_latents_bsc: torch.Tensor
    log_probs_bs: torch.Tensor
    means_bsc: torch.Tensor
    step_indices: list[int]
    final_latents: torch.Tensor


@torch.no_grad()
def sample_trajectory(
    transformer: nn.Module,
    latents: torch.Tensor,
    cond: GuidanceInputs,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str,
    sde_window: tuple[int, int],
    generator: torch.Generator | None,
    cps_log_prob: str = "flow_grpo",
    batched_cfg: bool = False,
) -> DiTTrajectory:
    """Denoise `latents` [B, C, h, w] through the schedule, SDE inside `sde_window` and ODE elsewhere."""
    step_fn = sde_step_fn(sde_type, cps_log_prob)
    velocity_fn = VELOCITY_FNS[batched_cfg]
    device = latents.device
    latents = latents.float()
    before, after, log_probs, means, indices = [], [], [], [], []
    for i, t in enumerate(timesteps):
        sigma, sigma_next = sigmas[i].to(device), sigmas[i + 1].to(device)
        velocity = velocity_fn(transformer, latents, t, cond, guidance_scale)
        if sde_window[0] <= i < sde_window[1]:
            step = step_fn(latents, velocity, sigma, sigma_next, noise_level, generator=generator)
            before.append(latents.cpu())
            latents = step.prev_sample.detach()
            after.append(latents.cpu())
            log_probs.append(step.log_prob.cpu())
            means.append(step.mean.cpu())
            indices.append(i)
        else:
            latents = ode_step(latents, velocity, sigma, sigma_next)
    return DiTTrajectory(
        cond=cond.to(torch.device("cpu")),
        latents_bsc=torch.stack(before, dim=1),
        next_latents_bsc=torch.stack(after, dim=1),
        log_probs_bs=torch.stack(log_probs, dim=1),
        means_bsc=torch.stack(means, dim=1),
        step_indices=indices,
        final_latents=latents.cpu(),
    )


def recompute_step(
    transformer: nn.Module,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    t: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    cond: GuidanceInputs,
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str,
    cps_log_prob: str = "flow_grpo",
    batched_cfg: bool = False,
) -> SDEStep:
    """Log-prob (with gradients) of a recorded step `latents -> next_latents` under the current policy."""
    velocity = VELOCITY_FNS[batched_cfg](transformer, latents, t, cond, guidance_scale)
    step_fn = sde_step_fn(sde_type, cps_log_prob)
    return step_fn(latents, velocity, sigma, sigma_next, noise_level, prev_sample=next_latents)
