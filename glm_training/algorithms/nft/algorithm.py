"""`NFT`: DiffusionNFT (arXiv 2509.16117) on the GLM-Image diffusion decoder.

Follows NVlabs' reference (`scripts/train_nft_sd3.py`) step for step, in the forward-process frame it shares
with AWM (`decoder/forward.py`):
- Rollout: the *old* model samples with the pipeline's ODE (`decoder/ode.py`); only the final latents and the
  conditioning are kept. Prior tokens, rewards and advantages are the decoder's (`DecoderRollout`,
  shared with Flow-GRPO).
- Update: each sample is noised again at `int(num_steps * timestep_fraction)` distinct times of the sampling
  schedule (drawn per sample, fresh noise each), the current and old velocities are predicted without CFG,
  and the implicit positive/negative policy loss (`losses.py`) is averaged over samples and times;
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

from glm_training.algorithms.base import Algorithm
from glm_training.algorithms.decoder.forward import ForwardRollout, forward_rollout, forward_update, ode_chunk
from glm_training.algorithms.decoder.forward_math import noised_latents, velocity_kl
from glm_training.algorithms.decoder.ode import NFTSamples
from glm_training.algorithms.decoder.old_policy import OldPolicy
from glm_training.algorithms.decoder.rollout import DecoderRollout, decoder_advantages
from glm_training.algorithms.nft.losses import (
    nft_loss,
    old_model_decay,
    optimality_probability,
    train_time_indices,
)
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts
from glm_training.pipeline.dit import predict_velocity

OLD_POLICY_FILE = "nft_old_policy.pt"
NFT_STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "old_deviation", "r_mean")


class NFT(Algorithm):
    """DiffusionNFT: the old model's ODE samples, the NFT update, the old model's EMA after it."""

    def __init__(self, cfg: Any, parts: Parts):
        super().__init__(cfg, parts)
        self.decoder = DecoderRollout(cfg, parts)
        self.advantages = decoder_advantages(cfg)
        # Starts equal to the policy (the reference copies the adapter before the first rollout).
        p = self.policy
        self.old_policy = OldPolicy(p.trainable, cfg.model.lora.enabled, OLD_POLICY_FILE, sharded=p.sharded)

    def rollout(self, group_prompts, group_ids, step, scoring) -> tuple[ForwardRollout, list]:
        return forward_rollout(self.decoder, group_prompts, group_ids, step, scoring, self.sample_chunk)

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator):
        """The old model's ODE sample of one micro-batch (the old model samples)."""
        with self.old_policy.module() as module:
            return ode_chunk(module, latents, cond, timesteps, sigmas, self.cfg.sampling)

    def draw_times(self, num_samples: int, generator: torch.Generator) -> torch.Tensor:
        """`int(num_steps * timestep_fraction)` distinct schedule indices per sample (the reference's)."""
        s = self.cfg.sampling
        return train_time_indices(
            num_samples, s.num_steps, self.cfg.algo.num_train_times(s.num_steps), generator
        )

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        r_n = optimality_probability(batch.advantages.float(), a.adv_clip_max)
        seed = self.collector.sample_seed(step)
        update = forward_update(
            self.updates, batch, seed, r_n, NFT_STATS, self.draw_times, self.loss_and_backward, self.device
        )
        # The optimizer-step count is the scheduler's, which checkpoints restore: the decay resumes exactly.
        decay = old_model_decay(self.policy.lr_scheduler.last_epoch, a.decay_type)
        self.old_policy.update(decay)
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        out["num_train_times"] = float(a.num_train_times(self.cfg.sampling.num_steps))
        out["old_decay"] = decay
        return self.collector.mean_over_ranks(out)

    def loss_and_backward(
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
        with self.policy.precision():
            # CFG-free: the conditional velocity only (guidance_scale 1).
            with torch.no_grad(), self.old_policy.module() as old:
                v_old = predict_velocity(old, x_t, timestep, cond, 1.0)
            v = predict_velocity(self.policy.model, x_t, timestep, cond, 1.0)
            policy_b, terms = nft_loss(v, v_old, x_t, x0, t, r, a.nft_beta, a.adv_clip_max)
            kl_b = torch.zeros_like(policy_b)
            if a.beta > 0:
                with torch.no_grad(), self.policy.reference_model() as reference:
                    v_ref = predict_velocity(reference, x_t, timestep, cond, 1.0)
                kl_b = velocity_kl(v, v_ref)
            loss_b = policy_b + a.beta * kl_b
        self.policy.backward(loss_b.sum() / denominator)
        return {
            "loss": loss_b.detach().mean(),
            "policy_loss": policy_b.detach().mean(),
            "kl": kl_b.detach().mean(),
            "positive_loss": terms["positive_loss"].mean(),
            "negative_loss": terms["negative_loss"].mean(),
            "old_deviation": ((v.detach() - v_old) ** 2).mean(),
            "r_mean": r.mean(),
        }

    def state(self) -> dict[str, Any]:
        return {OLD_POLICY_FILE: self.old_policy.state_dict()}

    def load_state(self, checkpoint: Path) -> None:
        self.old_policy.load_from(checkpoint, "a DiffusionNFT run (configs/nft_training.yaml)")
