"""`AWM`: Advantage Weighted Matching (arXiv 2509.25050) on the GLM-Image diffusion decoder.

Follows the authors' reference (`scripts/train_sd3_awm.py`), in the
forward-process frame it shares with DiffusionNFT (`decoder/forward.py`):
- Rollout: the *policy* samples with the pipeline's ODE (`decoder/ode.py`; the reference uses an
  SA-Solver, and AWM's loss does not depend on the sampler); only the clean latents and the conditioning are
  kept. Prior tokens, rewards and advantages are the decoder's (`DecoderRollout`).
- Update: per micro-batch, `algo.train_timesteps` schedule indices (one per bin, `train_time_indices`,
  shared by the micro-batch) with fresh noise each; the CFG-free velocity is fitted to `eps - x_0` with the
  advantage-weighted, time-weighted matching loss (`losses.py`), averaged over samples and times,
  plus `algo.beta` times the velocity KL to the base model and `algo.ema_beta` times the one to an EMA
  anchor of the policy; `num_mini_batches` optimizer steps per rollout, the first on-policy (ratio 1) and the
  later ones ratio-weighted against the loss of the weights the update started from (`old_loss`, computed
  before the first step, as the reference's pre-pass). Noise and times come from a generator seeded by
  (seed, step, rank), so a resumed run draws the same ones.
- After the update the anchor moves towards the policy: `anchor <- d anchor + (1 - d) policy`, d =
  `min(kl_ema_decay, 0.001 k)` after k optimizer steps. It is NFT's old-model machinery (`OldPolicy`: a second
  copy of the LoRA weights swapped in, or a frozen copy of the module) and is saved in every checkpoint.

What runs of the reference's options (`docs/algorithms.md`): its configs' `loss_type=exp_first` and
`kl_weight=Uniform`; one deliberate difference: the reference adds the anchor's KL only when `beta > 0` (it
sits inside that branch); here `ema_beta` acts on its own. Every reference config has `beta > 0`, where the
two agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from glm_training.algorithms.awm.losses import (
    advantage_weights,
    anchor_decay,
    awm_policy_loss,
    matching_error,
    train_time_indices,
    weighted_matching_loss,
)
from glm_training.algorithms.base import Algorithm
from glm_training.algorithms.decoder.forward import ForwardRollout, forward_rollout, forward_update, ode_chunk
from glm_training.algorithms.decoder.forward_math import noised_latents, velocity_kl
from glm_training.algorithms.decoder.ode import NFTSamples
from glm_training.algorithms.decoder.old_policy import OldPolicy
from glm_training.algorithms.decoder.rollout import DecoderRollout, decoder_advantages
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts
from glm_training.pipeline.dit import predict_velocity

ANCHOR_FILE = "awm_ema_anchor.pt"
AWM_STATS = ("loss", "policy_loss", "matching_loss", "kl", "anchor_kl", "weight_mean")


class AWM(Algorithm):
    """AWM: the policy's ODE samples, the advantage-weighted matching loss, the EMA anchor after it."""

    def __init__(self, cfg: Any, parts: Parts):
        super().__init__(cfg, parts)
        self.decoder = DecoderRollout(cfg, parts)
        self.advantages = decoder_advantages(cfg)
        # The EMA anchor starts equal to the policy (the reference copies the adapter before training).
        self.anchor = None
        if cfg.algo.ema_beta > 0:
            p = self.policy
            self.anchor = OldPolicy(p.trainable, cfg.model.lora.enabled, ANCHOR_FILE, sharded=p.sharded)

    def rollout(self, group_prompts, group_ids, step, scoring) -> tuple[ForwardRollout, list]:
        return forward_rollout(self.decoder, group_prompts, group_ids, step, scoring, self.sample_chunk)

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator):
        """The policy's ODE sample of one micro-batch."""
        return ode_chunk(self.policy.trainable, latents, cond, timesteps, sigmas, self.cfg.sampling)

    def draw_times(self, num_samples: int, generator: torch.Generator) -> torch.Tensor:
        """`train_timesteps` indices, one per bin, shared by the micro-batch (the reference's)."""
        a = self.cfg.algo
        times = train_time_indices(
            self.cfg.sampling.num_steps, a.timestep_fraction, a.train_timesteps, a.time_type, generator
        )
        return times.expand(num_samples, -1)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        weights = advantage_weights(batch.advantages.float(), a.adv_clip_max, a.advantage_max)
        seed = self.collector.sample_seed(step)
        update = forward_update(
            self.updates,
            batch,
            seed,
            weights,
            AWM_STATS,
            self.draw_times,
            self.loss_and_backward,
            self.device,
            old_losses=self.old_loss if a.num_mini_batches > 1 else None,
        )
        out = dict(update.means)
        if self.anchor is not None:
            # The optimizer-step count is the scheduler's, restored by checkpoints: the decay resumes exactly.
            decay = anchor_decay(self.policy.lr_scheduler.last_epoch, a.kl_ema_decay, a.kl_ema_decay_type)
            self.anchor.update(decay)
            out["anchor_decay"] = decay
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        return self.collector.mean_over_ranks(out)

    def _inputs(self, chunk: NFTSamples, time_idx: torch.Tensor, noise: torch.Tensor, rollout):
        """(x_0, the noised x_t, its sigma t, the DiT's timestep, the conditioning, noise), on the device."""
        x0 = chunk.final_latents.to(self.device)
        t = rollout.sigmas[time_idx].to(self.device)
        timestep = rollout.timesteps[time_idx].to(self.device)
        noise = noise.to(self.device)
        return x0, noised_latents(x0, noise, t), t, timestep, chunk.cond.to(self.device), noise

    @torch.no_grad()
    def old_loss(
        self, chunk: NFTSamples, time_idx: torch.Tensor, noise: torch.Tensor, rollout
    ) -> torch.Tensor:
        """[B] the matching loss of the weights before the update (the reference's `old_log_probs` pre-pass,
        `-log_prob`, for the micro-batches of the optimizer steps after the first)."""
        a = self.cfg.algo
        x0, x_t, t, timestep, cond, noise = self._inputs(chunk, time_idx, noise, rollout)
        with self.policy.precision():
            v = predict_velocity(self.policy.model, x_t, timestep, cond, 1.0)
            return weighted_matching_loss(matching_error(v, noise, x0), t, a.weighting, a.ghuber_power)

    def loss_and_backward(
        self,
        chunk: NFTSamples,
        time_idx: torch.Tensor,
        noise: torch.Tensor,
        weights,
        rollout,
        denominator: int,
        old_loss: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """AWM loss of one micro-batch at one schedule index; backward of its share of the mean.

        time_idx [B] (one index for the micro-batch); noise [B, C, h, w]; weights [B] clipped, scaled
        advantages; old_loss [B] the pre-update loss (`old_loss`), None on the first optimizer step (ratio 1).
        The forward process takes the schedule's sigma, the DiT the schedule's timestep, as in sampling.
        """
        a = self.cfg.algo
        x0, x_t, t, timestep, cond, noise = self._inputs(chunk, time_idx, noise, rollout)
        with self.policy.precision():
            # CFG-free: the conditional velocity only (the reference's train.cfg=False).
            v = predict_velocity(self.policy.model, x_t, timestep, cond, 1.0)
            matching_b = weighted_matching_loss(matching_error(v, noise, x0), t, a.weighting, a.ghuber_power)
            policy_b = awm_policy_loss(matching_b, weights, a.clip_range, old_loss)
            kl_b = torch.zeros_like(policy_b)
            anchor_b = torch.zeros_like(policy_b)
            if a.beta > 0:
                with torch.no_grad(), self.policy.reference_model() as reference:
                    v_ref = predict_velocity(reference, x_t, timestep, cond, 1.0)
                kl_b = velocity_kl(v, v_ref).to(policy_b.dtype)
            if self.anchor is not None:
                with torch.no_grad(), self.anchor.module() as anchor:
                    v_anchor = predict_velocity(anchor, x_t, timestep, cond, 1.0)
                anchor_b = velocity_kl(v, v_anchor).to(policy_b.dtype)
            loss_b = policy_b + a.beta * kl_b + a.ema_beta * anchor_b
        self.policy.backward(loss_b.sum() / denominator)
        return {
            "loss": loss_b.detach().mean(),
            "policy_loss": policy_b.detach().mean(),
            "matching_loss": matching_b.detach().mean(),
            "kl": kl_b.detach().mean(),
            "anchor_kl": anchor_b.detach().mean(),
            "weight_mean": weights.mean(),
        }

    def state(self) -> dict[str, Any]:
        return {ANCHOR_FILE: self.anchor.state_dict()} if self.anchor is not None else {}

    def load_state(self, checkpoint: Path) -> None:
        if self.anchor is not None:
            self.anchor.load_from(checkpoint, "an AWM run with algo.ema_beta > 0")
