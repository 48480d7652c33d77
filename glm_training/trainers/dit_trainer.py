"""`DiTTrainer`: Flow-GRPO (arXiv 2505.05470) on the GLM-Image diffusion decoder.

Rollout: the frozen AR model writes each prompt's prior tokens once (shared by its group), then the DiT
samples `num_generations` images per prompt with an SDE, recording every SDE step's latents and log-prob.
Update: for the first `timestep_fraction` of the SDE steps, the log-prob of the recorded step is recomputed
under the current policy (same guidance, same micro-batches as the rollout, so the first ratio is exactly
1), and the clipped objective plus `beta` times the KL to the reference is accumulated over steps and
micro-batches before each optimizer step.

Log-probs are means over latent elements (Flow-GRPO's reduction), which is why `algo.clip_range` is ~1e-4.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from glm_training.algorithms.losses import clipped_policy_loss, gaussian_mean_kl, ratio_stats
from glm_training.data import Prompt
from glm_training.models.placement import parse_dtype
from glm_training.rollout.dit import (
    DiTTrajectory,
    build_guidance_inputs,
    decode_latents,
    generate_prior_tokens,
    glm_image_schedule,
    recompute_step,
    sample_trajectory,
)
from glm_training.trainers.reward_trainer import Batch, RewardTrainer


@dataclass
class DiTRollout:
    trajectories: list[DiTTrajectory]  # one per micro-batch, in sample order
    timesteps: torch.Tensor  # [T]
    sigmas: torch.Tensor  # [T + 1]


class DiTTrainer(RewardTrainer):
    component = "dit"

    def _rollout(self, prompts: list[Prompt], step: int) -> tuple[DiTRollout, list, list[Prompt]]:
        s = self.cfg.sampling
        k = self.cfg.data.num_generations
        pipe = self.wrapper.pipeline
        seed = self.sample_seed(step)
        prior = generate_prior_tokens(pipe, [p.text for p in prompts], s.height, s.width, seed)
        sample_prompts = [p for p in prompts for _ in range(k)]
        prior = prior.repeat_interleave(k, dim=0)
        timesteps, sigmas = glm_image_schedule(pipe, s.num_steps, s.height, s.width)
        generator = torch.Generator(self.device).manual_seed(seed)
        dtype = parse_dtype(self.cfg.model.dtype)
        latent_shape = (
            self.trainable.config.in_channels,
            s.height // pipe.vae_scale_factor,
            s.width // pipe.vae_scale_factor,
        )
        trajectories = []
        for start in range(0, len(sample_prompts), s.micro_batch_size):
            chunk = sample_prompts[start : start + s.micro_batch_size]
            cond = build_guidance_inputs(
                pipe, [p.text for p in chunk], prior[start : start + len(chunk)],
                s.height, s.width, s.guidance_scale, self.device, dtype,
            )
            latents = torch.randn((len(chunk), *latent_shape), generator=generator, device=self.device)
            with self.accelerator.autocast():
                trajectories.append(
                    sample_trajectory(
                        self.trainable, latents.to(dtype), cond, timesteps, sigmas,
                        guidance_scale=s.guidance_scale, noise_level=s.noise_level, sde_type=s.sde_type,
                        sde_window=(s.sde_window_start, s.window_end()), generator=generator,
                    )
                )
        images = decode_latents(pipe, torch.cat([t.final_latents for t in trajectories]))
        return DiTRollout(trajectories, timesteps, sigmas), images, sample_prompts

    def policy_step(self, traj: DiTTrajectory, j: int, rollout: DiTRollout, module=None):
        """The recorded step `j` of a micro-batch, recomputed (with gradients) by `module` (default: policy)."""
        s = self.cfg.sampling
        i = traj.step_indices[j]
        return recompute_step(
            self.model if module is None else module,
            traj.latents_bsc[:, j].to(self.device),
            traj.next_latents_bsc[:, j].to(self.device),
            rollout.timesteps[i],
            rollout.sigmas[i].to(self.device),
            rollout.sigmas[i + 1].to(self.device),
            traj.cond.to(self.device),
            guidance_scale=s.guidance_scale,
            noise_level=s.noise_level,
            sde_type=s.sde_type,
        )

    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        rollout: DiTRollout = batch.rollout
        num_sde = len(rollout.trajectories[0].step_indices)
        train_steps = list(range(max(1, int(num_sde * a.timestep_fraction))))
        sizes = [t.latents_bsc.shape[0] for t in rollout.trajectories]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        mini_batches = [list(range(len(sizes)))[m :: a.num_mini_batches] for m in range(a.num_mini_batches)]
        mini_batches = [mb for mb in mini_batches if mb]
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
        count, grad_norms = 0, []
        for _ in range(a.num_inner_epochs):
            for mini in mini_batches:
                num_samples = sum(sizes[m] for m in mini)
                for pos, m in enumerate(mini):
                    traj = rollout.trajectories[m]
                    adv = batch.advantages[offsets[m] : offsets[m] + sizes[m]].to(self.device)
                    for j in train_steps:
                        last = pos == len(mini) - 1 and j == train_steps[-1]
                        sync = contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)
                        with sync:
                            stats = self._loss_and_backward(traj, j, rollout, adv, num_samples, len(train_steps))
                        for key, value in stats.items():
                            totals[key] += value
                        count += 1
                grad_norms.append(self.optimizer_step())
        out = {key: value / count for key, value in totals.items()}
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return self.mean_over_ranks(out)

    def _loss_and_backward(self, traj, j, rollout, adv, num_samples: int, num_steps: int) -> dict[str, float]:
        a = self.cfg.algo
        old_log_prob = traj.log_probs_bs[:, j].to(self.device)
        with self.accelerator.autocast():
            new = self.policy_step(traj, j, rollout)
            policy_loss = clipped_policy_loss(new.log_prob, old_log_prob, adv, a.clip_range, a.clip_range).mean()
            kl = torch.zeros((), device=self.device)
            if a.beta > 0:
                with torch.no_grad(), self.reference_model() as reference:
                    ref = self.policy_step(traj, j, rollout, module=reference)
                kl = gaussian_mean_kl(new.mean, ref.mean, new.std).mean()
            loss = policy_loss + a.beta * kl
        # Each micro-batch weighs by its share of the mini-batch's samples: an exact mean over samples x steps.
        self.accelerator.backward(loss * (adv.shape[0] / num_samples) / num_steps)
        diag = ratio_stats(new.log_prob.detach(), old_log_prob, a.clip_range, a.clip_range)
        return {
            "loss": loss.item(),
            "policy_loss": policy_loss.item(),
            "kl": kl.item(),
            "clip_frac": diag["clip_frac"].item(),
            "approx_kl": diag["approx_kl"].item(),
            "ratio_mean": diag["ratio_mean"].item(),
        }
