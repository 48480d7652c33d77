"""`FlowGRPO`: Flow-GRPO (arXiv 2505.05470) on the GLM-Image diffusion decoder, with GRPO-Guard, CPS,
Flow-GRPO-Fast and MixGRPO as its options.

Rollout (the frame is `DecoderRollout`'s): the frozen AR model writes each prompt's prior tokens once (shared
by its group), then the DiT samples `num_generations` images per prompt with an SDE inside this step's window
(fixed, or drawn per rollout as in Flow-GRPO-Fast / MixGRPO), ODE elsewhere, recording every SDE step's
latents, mean and log-prob.
Update: for the SDE steps that train (Flow-GRPO's `timestep_fraction` rule), the log-prob of the recorded
step is recomputed under the current policy (same guidance, same micro-batches as the rollout, so the first
ratio is exactly 1), and the clipped objective plus `beta` times the KL to the reference is accumulated over
steps and micro-batches; `num_mini_batches` optimizer steps per rollout (Flow-GRPO: 2), the later ones
off-policy. Samples with zero advantage leave the loss (`drop_zero_advantage`).

The math is chosen by name in `losses.py` (`KL_FNS`, `LOG_RATIOS`) and `rollout.py`. Log-probs are means over
latent elements (Flow-GRPO's reduction), which is why `algo.clip_range` is ~1e-4.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from glm_training.algorithms.base import Algorithm
from glm_training.algorithms.decoder.rollout import DecoderRollout, decoder_advantages
from glm_training.algorithms.decoder.trajectory import DiTTrajectory, recompute_step, sample_trajectory
from glm_training.algorithms.flow_grpo.losses import (
    KL_FNS,
    LOG_RATIOS,
    nonzero_advantage_mask,
    num_train_steps,
    progressive_window_start,
    random_window_start,
)
from glm_training.algorithms.losses import clipped_policy_loss, ratio_stats
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts

# `sampling.sde_window_schedule` -> the window start of a step, from (sampling config, seed, step, lo, hi).
WINDOW_STARTS = {
    "random": lambda s, seed, step, lo, hi: random_window_start(seed, step, s.sde_window_size, lo, hi),
    "progressive": lambda s, seed, step, lo, hi: progressive_window_start(
        step, s.sde_window_size, lo, hi, s.sde_window_stride, s.sde_window_every
    ),
}


@dataclass
class DiTRollout:
    trajectories: list[DiTTrajectory]  # one per micro-batch, in sample order
    timesteps: torch.Tensor  # [T]
    sigmas: torch.Tensor  # [T + 1]
    sde_window: tuple[int, int] = (0, 0)  # the schedule steps [start, end) that sampled with noise


class FlowGRPO(Algorithm):
    """SDE sampling inside a window with recorded log-probs; the clipped ratio objective."""

    def __init__(self, cfg: Any, parts: Parts):
        super().__init__(cfg, parts)
        self.decoder = DecoderRollout(cfg, parts)
        self.advantages = decoder_advantages(cfg)

    def rollout(self, group_prompts, group_ids, step, scoring) -> tuple[DiTRollout, list]:
        chunks, timesteps, sigmas, images = self.decoder.sample(
            group_prompts, group_ids, step, scoring, self.sample_chunk
        )
        return DiTRollout(chunks, timesteps, sigmas, self.sde_window(step)), images

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator) -> tuple[Any, torch.Tensor]:
        """One micro-batch's SDE trajectory inside this step's window; its final latents to decode."""
        s = self.cfg.sampling
        trajectory = sample_trajectory(
            self.policy.trainable,
            latents,
            cond,
            timesteps,
            sigmas,
            guidance_scale=s.guidance_scale,
            noise_level=s.noise_level,
            sde_type=s.sde_type,
            sde_window=self.sde_window(step),
            generator=generator,
            cps_log_prob=s.cps_log_prob,
            batched_cfg=s.batched_cfg,
        )
        return trajectory, trajectory.final_latents

    def sde_window(self, step: int) -> tuple[int, int]:
        """The schedule steps [start, end) that sample with noise at `step`.

        A function of (config, seed, step) only, so identical on every rank and after a resume.
        """
        s = self.cfg.sampling
        if not s.sde_window_size:
            return s.sde_window_start, s.window_end()
        lo, hi = s.window_range()
        start = WINDOW_STARTS[s.sde_window_schedule](s, self.cfg.trainer.seed, step, lo, hi)
        return start, start + s.sde_window_size

    def policy_step(self, traj: DiTTrajectory, j: int, rollout: DiTRollout, module=None):
        """Recorded step `j` of a micro-batch, recomputed with gradients by `module` (default: the policy)."""
        s, device = self.cfg.sampling, self.device
        i = traj.step_indices[j]
        return recompute_step(
            self.policy.model if module is None else module,
            traj.latents_bsc[:, j].to(device),
            traj.next_latents_bsc[:, j].to(device),
            rollout.timesteps[i],
            rollout.sigmas[i].to(device),
            rollout.sigmas[i + 1].to(device),
            traj.cond.to(device),
            guidance_scale=s.guidance_scale,
            noise_level=s.noise_level,
            sde_type=s.sde_type,
            cps_log_prob=s.cps_log_prob,
            batched_cfg=s.batched_cfg,
        )

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        rollout: DiTRollout = batch.rollout
        num_sde = len(rollout.trajectories[0].step_indices)
        train_steps = list(range(num_train_steps(num_sde, self.cfg.sampling.num_steps, a.timestep_fraction)))
        sizes = [t.latents_bsc.shape[0] for t in rollout.trajectories]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        keep_n = self.trained_samples(batch.advantages)

        def micro_steps(mini: list[int]):
            # Normalised by the samples that train (Flow-GRPO averages over the samples it kept).
            num_kept = sum(int(keep_n[offsets[m] : offsets[m] + sizes[m]].sum()) for m in mini)
            for m in mini:
                traj = rollout.trajectories[m]
                adv = batch.advantages[offsets[m] : offsets[m] + sizes[m]].to(self.device)
                keep = keep_n[offsets[m] : offsets[m] + sizes[m]].to(self.device)
                for j in train_steps:
                    yield functools.partial(
                        self.loss_and_backward,
                        traj,
                        j,
                        rollout,
                        adv,
                        keep,
                        max(num_kept, 1),
                        len(train_steps),
                    )

        update = self.updates.run(len(sizes), micro_steps, num_samples=sum(sizes))
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        out["num_train_steps"] = float(len(train_steps))
        out["sde_window_start"] = float(rollout.sde_window[0])
        return self.collector.mean_over_ranks(out)

    def trained_samples(self, advantages: torch.Tensor) -> torch.Tensor:
        """[N] bool: the samples whose loss counts (all, or those with a non-zero advantage)."""
        if self.cfg.algo.drop_zero_advantage:
            return nonzero_advantage_mask(advantages)
        return torch.ones_like(advantages, dtype=torch.bool)

    def loss_and_backward(
        self, traj, j, rollout, adv, keep, num_samples: int, num_steps: int
    ) -> dict[str, float]:
        """Loss of recorded step `j` of one micro-batch; backward of its share of the mini-batch's mean.

        `keep` [B] marks the samples that count; `num_samples` is how many count in the whole mini-batch.
        """
        a = self.cfg.algo
        old_log_prob = traj.log_probs_bs[:, j].to(self.device)
        with self.policy.precision():
            new = self.policy_step(traj, j, rollout)
            log_ratio = LOG_RATIOS[a.ratio_norm](
                new.log_prob, old_log_prob, new.mean, traj.means_bsc[:, j].to(self.device), new.std
            )
            zeros = torch.zeros_like(log_ratio)
            policy_b = clipped_policy_loss(log_ratio, zeros, adv, a.clip_range, a.clip_range)
            kl_b = torch.zeros_like(policy_b)
            if a.beta > 0:
                with torch.no_grad(), self.policy.reference_model() as reference:
                    ref = self.policy_step(traj, j, rollout, module=reference)
                kl_b = KL_FNS[a.kl_type](new, ref)
            loss_b = policy_b + a.beta * kl_b
        weight_b = keep.float()
        # Each kept sample weighs 1 / (kept samples in the mini-batch x trained steps): an exact mean.
        self.policy.backward((loss_b * weight_b).sum() / num_samples / num_steps)
        num_kept = weight_b.sum().clamp(min=1.0)
        diag = ratio_stats(log_ratio.detach(), zeros, a.clip_range, a.clip_range, mask=keep)
        return {
            "loss": ((loss_b.detach() * weight_b).sum() / num_kept).item(),
            "policy_loss": ((policy_b.detach() * weight_b).sum() / num_kept).item(),
            "kl": ((kl_b.detach() * weight_b).sum() / num_kept).item(),
            "clip_frac": diag["clip_frac"].item(),
            "approx_kl": diag["approx_kl"].item(),
            "ratio_mean": diag["ratio_mean"].item(),
        }
