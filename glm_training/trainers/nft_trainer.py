"""`NFTTrainer`: DiffusionNFT (arXiv 2509.16117) on the GLM-Image diffusion decoder.

Follows NVlabs' reference (`scripts/train_nft_sd3.py`) step for step, in the forward-process frame it shares
with AWM (`ForwardProcessTrainer`):
- Rollout: the *old* model samples with the pipeline's ODE (`rollout/nft.py`); only the final latents and the
  conditioning are kept. Prior tokens, rewards and advantages are the diffusion base's (`DiffusionTrainer`,
  shared with Flow-GRPO's `DiTTrainer`).
- Update: each sample is noised again at `int(num_steps * timestep_fraction)` distinct times of the sampling
  schedule (drawn per sample, fresh noise each), the current and old velocities are predicted without CFG,
  and the implicit positive/negative policy loss (`algorithms/nft.py`) is averaged over samples and times;
  `num_mini_batches` optimizer steps per rollout. Noise and times come from a generator seeded by
  (seed, step, rank), so a resumed run draws the same ones.
- After the update the old model moves towards the policy: `old <- d old + (1 - d) policy`, d from the
  reference's `decay_type` schedule of the optimizer-step count.

The old model: with LoRA a second copy of the adapter weights, swapped into the module for its forward
passes (the reference keeps a second peft adapter; this costs no extra base weights); with full fine-tuning
a frozen copy of the module; under FSDP shards like the parameters' (`OldPolicy`). It is saved in every
checkpoint (`nft_old_policy.pt`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.algorithms.nft import (
    nft_loss,
    noised_latents,
    old_model_decay,
    optimality_probability,
    train_time_indices,
    velocity_kl,
)
from glm_training.rollout.dit import predict_velocity
from glm_training.rollout.nft import NFTSamples
from glm_training.trainers.forward_trainer import ForwardProcessTrainer, OldPolicy
from glm_training.trainers.reward_trainer import Batch

OLD_POLICY_FILE = "nft_old_policy.pt"
NFT_STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "old_deviation", "r_mean")


class NFTTrainer(ForwardProcessTrainer):
    """DiffusionNFT: the forward-process frame, the old model's ODE samples, the NFT update."""

    def _setup_trainable(self, module: nn.Module) -> nn.Module:
        module = super()._setup_trainable(module)
        # Starts equal to the policy (the reference copies the adapter before the first rollout).
        self.old_policy = OldPolicy(
            module, self.cfg.model.lora.enabled, OLD_POLICY_FILE, sharded=self.parallel.sharded
        )
        return module

    def sampler(self):
        return self.old_policy.module()  # the old model samples

    def draw_times(self, num_samples: int, generator: torch.Generator) -> torch.Tensor:
        """`int(num_steps * timestep_fraction)` distinct schedule indices per sample (the reference's)."""
        s = self.cfg.sampling
        return train_time_indices(
            num_samples, s.num_steps, self.cfg.algo.num_train_times(s.num_steps), generator
        )

    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        r_n = optimality_probability(batch.advantages.float(), a.adv_clip_max)
        update = self.run_forward_update(batch, step, r_n, NFT_STATS)
        # The optimizer-step count is the scheduler's, which checkpoints restore: the decay resumes exactly.
        decay = old_model_decay(self.lr_scheduler.last_epoch, a.decay_type)
        self.old_policy.update(decay)
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        out["num_train_times"] = float(a.num_train_times(self.cfg.sampling.num_steps))
        out["old_decay"] = decay
        return self.mean_over_ranks(out)

    def _loss_and_backward(
        self, chunk: NFTSamples, time_idx: torch.Tensor, noise: torch.Tensor, r, rollout, denominator: int
    ) -> dict[str, float]:
        """NFT loss of one micro-batch at one training time per sample; backward of its share of the mean.

        time_idx [B]: schedule indices (sigma for the forward process, the schedule's timestep for the DiT,
        as in sampling); noise [B, C, h, w]; r [B] optimality probabilities.
        """
        a = self.cfg.algo
        x0 = chunk.final_latents.to(self.device)
        t = rollout.sigmas[time_idx].to(self.device)
        timestep = rollout.timesteps[time_idx].to(self.device)
        x_t = noised_latents(x0, noise.to(self.device), t)
        cond = chunk.cond.to(self.device)
        with self.policy_precision():
            # CFG-free: the conditional velocity only (guidance_scale 1).
            with torch.no_grad(), self.old_policy.module() as old:
                v_old = predict_velocity(old, x_t, timestep, cond, 1.0)
            v = predict_velocity(self.model, x_t, timestep, cond, 1.0)
            policy_b, terms = nft_loss(v, v_old, x_t, x0, t, r, a.nft_beta, a.adv_clip_max)
            kl_b = torch.zeros_like(policy_b)
            if a.beta > 0:
                with torch.no_grad(), self.reference_model() as reference:
                    v_ref = predict_velocity(reference, x_t, timestep, cond, 1.0)
                kl_b = velocity_kl(v, v_ref)
            loss_b = policy_b + a.beta * kl_b
        self.accelerator.backward(loss_b.sum() / denominator)
        return {
            "loss": loss_b.detach().mean(),
            "policy_loss": policy_b.detach().mean(),
            "kl": kl_b.detach().mean(),
            "positive_loss": terms["positive_loss"].mean(),
            "negative_loss": terms["negative_loss"].mean(),
            "old_deviation": ((v.detach() - v_old) ** 2).mean(),
            "r_mean": r.mean(),
        }

    def checkpoint_extras(self) -> dict[str, Any]:
        return {OLD_POLICY_FILE: self.old_policy.state_dict()}

    def load_checkpoint_extras(self, path: Path) -> None:
        self.old_policy.load_from(path, "a DiffusionNFT run (configs/nft_training.yaml)")
