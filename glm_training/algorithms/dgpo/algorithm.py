"""`DGPO`: Direct Group Preference Optimization (Luo et al.) on the GLM-Image diffusion decoder.

Follows the authors' `scripts/train_sd3_dgpo.py` (`Luo-Yihong/DGPO` at 01ceb4b):
- Rollout: an ODE sample (`decoder/ode.py`) by the policy, or by the EMA reference once more than
  `algo.switch_ema_ref` optimizer steps are done; only the clean latents and the conditioning are kept. Prior
  tokens, rewards and group-relative advantages are the decoder's (`DecoderRollout`); the sign of a sample's
  advantage puts it in its group's positive or negative set.
- Update, one optimizer step per rollout: `algo.train_timesteps` schedule indices drawn without replacement
  from {0, ..., trunc_steps}, shared by every sample and rank; at each, every clean latent is noised again,
  `x_t = (1 - t) x_0 + t eps`, with one noise per group (`algo.shared_noise`). Per time, a no-grad pass over
  this rank's samples computes each one's flow-matching error under the policy, the base model and the EMA
  reference, and the group sums `S_g` (`losses.group_sums`), all-reduced so that every group sums over all
  its members whichever rank or micro-batch holds them; then one backward per micro-batch of DGPO's loss
  (`losses.dgpo_loss`, weight `sigmoid(S_g)`, the error detached where the PPO-style clip against the EMA
  reference acts) plus `algo.beta` times the velocity KL to the base model, averaged over samples and times.
  The policy's velocity is CFG-free; the base model's is guided with `algo.kl_cfg` when it is above 1.
- After the update's optimizer step the EMA reference moves towards the policy, decay
  `min(ref_decay, 0.001 k)` after k earlier optimizer steps (`OldPolicy`, saved in every checkpoint); a step
  skipped as non-finite is not counted and does not move it.

The reference forms each group sum inside one training micro-batch across its ranks, which its configs fill
with whole groups; the no-grad pass gives that sum for any layout of groups over micro-batches and ranks, at
the cost of one more forward of the policy per sample and time. Noise and times are functions of (seed,
step) and the group or sample index, not of the rank, so they are the same for any number of ranks and
after a resume.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from glm_training.algorithms.base import Algorithm
from glm_training.algorithms.decoder.forward import forward_rollout, ode_chunk
from glm_training.algorithms.decoder.forward_math import noised_latents, velocity_kl
from glm_training.algorithms.decoder.ode import NFTSamples
from glm_training.algorithms.decoder.old_policy import OldPolicy
from glm_training.algorithms.decoder.rollout import DecoderRollout, decoder_advantages
from glm_training.algorithms.dgpo.losses import (
    clip_mask,
    dgpo_loss,
    group_sums,
    matching_loss,
    ref_decay,
    train_time_indices,
)
from glm_training.distributed import collectives as dist
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts
from glm_training.models.placement import parse_dtype
from glm_training.pipeline.dit import VELOCITY_FNS, encode_glyphs, predict_velocity

EMA_REF_FILE = "dgpo_ema_ref.pt"
DGPO_STATS = ("loss", "policy_loss", "matching_loss", "kl", "clip_frac", "group_weight")
# Offset of the update's seeds from the rollout's, so the streams never coincide.
UPDATE_SEED_OFFSET = 2_000_000_011
SEED_MODULUS = 2**63


@dataclass
class DGPORollout:
    samples: list[NFTSamples]  # one per micro-batch, in sample order: clean latents and conditioning
    timesteps: torch.Tensor  # [T]: the schedule the training times index
    sigmas: torch.Tensor  # [T + 1]
    group_ids: torch.Tensor  # [N] the step's group of each of this rank's samples
    sample_ids: torch.Tensor  # [N] each sample's index among the step's samples of every rank
    num_groups: int
    from_ema_ref: bool  # whether the EMA reference sampled it


@dataclass
class TimePass:
    """What the no-grad pass at one training time keeps for its backward passes, per micro-batch."""

    sums: torch.Tensor  # [num_groups] every rank's group sums S_g
    noise: list[torch.Tensor]
    old_loss: list[torch.Tensor | None]  # the EMA reference's errors, where the clip needs them
    v_base: list[torch.Tensor | None]  # the base model's velocity, where the KL needs it


class DGPO(Algorithm):
    """DGPO: ODE rollouts, the group-level DPO update, the EMA reference after it."""

    def __init__(self, cfg: Any, parts: Parts):
        super().__init__(cfg, parts)
        self.decoder = DecoderRollout(cfg, parts)
        self.advantages = decoder_advantages(cfg)
        # Starts equal to the policy (the reference's EMAModuleWrapper copies the adapter before training).
        p = self.policy
        self.ema_ref = OldPolicy(p.trainable, cfg.model.lora.enabled, EMA_REF_FILE, sharded=p.sharded)
        self._empty_prompt_embeds: torch.Tensor | None = None  # [1, S0, D], encoded at first use

    def optimizer_steps(self) -> int:
        """Optimizer steps done (the scheduler's count, restored by checkpoints)."""
        return self.policy.lr_scheduler.last_epoch

    def samples_from_ema_ref(self) -> bool:
        switch = self.cfg.algo.switch_ema_ref
        return switch >= 0 and self.optimizer_steps() > switch

    def rollout(self, group_prompts, group_ids, step, scoring) -> tuple[DGPORollout, list]:
        from_ema_ref = self.samples_from_ema_ref()
        sampled, images = forward_rollout(
            self.decoder, group_prompts, group_ids, step, scoring, self.sample_chunk
        )
        c = self.collector
        start, _ = dist.shard_bounds(len(group_prompts) * self.cfg.data.num_generations, c.rank, c.world_size)
        ids = torch.arange(start, start + len(group_ids))
        rollout = DGPORollout(
            sampled.samples,
            sampled.timesteps,
            sampled.sigmas,
            torch.tensor(group_ids),
            ids,
            len(group_prompts),
            from_ema_ref,
        )
        return rollout, images

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator):
        """The ODE sample of one micro-batch by the policy, or by the EMA reference after the switch."""
        if self.samples_from_ema_ref():
            with self.ema_ref.module() as module:
                return ode_chunk(module, latents, cond, timesteps, sigmas, self.cfg.sampling)
        return ode_chunk(self.policy.trainable, latents, cond, timesteps, sigmas, self.cfg.sampling)

    def step_seed(self, step: int) -> int:
        """The update's seed at `step`: (seed, step) only, the same on every rank."""
        return ((self.cfg.trainer.seed * 1_000_003 + step) * 7919 + UPDATE_SEED_OFFSET) % SEED_MODULUS

    def noise(self, step: int, time: int, ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[B, *shape] the noise of each id (group or sample) at training time `time`, whichever rank asks."""
        base = (self.step_seed(step) * 1_000_033 + time) * 1_000_003
        return torch.stack(
            [
                torch.randn(shape, generator=torch.Generator().manual_seed((base + i) % SEED_MODULUS))
                for i in ids.tolist()
            ]
        )

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        a, rollout = self.cfg.algo, batch.rollout
        generator = torch.Generator().manual_seed(self.step_seed(step))
        times = train_time_indices(a.trunc_steps, a.train_timesteps, generator).tolist()
        advantages = batch.advantages.float()

        def micro_steps(mini: list[int]):
            denominator = advantages.numel() * len(times)
            for time in times:
                held: dict[str, TimePass] = {}
                for m in mini:
                    yield functools.partial(
                        self.loss_and_backward, held, rollout, advantages, step, time, m, denominator
                    )

        steps_before = self.optimizer_steps()
        update = self.updates.run(
            len(rollout.samples), micro_steps, DGPO_STATS, num_samples=advantages.numel()
        )
        # The reference moves after its optimizer step, at the count of the steps before it; a step skipped
        # as non-finite (`Policy.optimizer_step`) is not counted and moves nothing (a decay of 1).
        decay = 1.0
        if self.optimizer_steps() > steps_before:
            decay = ref_decay(steps_before, a.ref_decay)
            self.ema_ref.update(decay)
        out = dict(update.means)
        out["ref_decay"] = decay
        out["sampled_by_ema_ref"] = float(rollout.from_ema_ref)
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        return self.collector.mean_over_ranks(out)

    def _rows(self, rollout: DGPORollout, m: int) -> slice:
        start = sum(c.final_latents.shape[0] for c in rollout.samples[:m])
        return slice(start, start + rollout.samples[m].final_latents.shape[0])

    def _inputs(self, chunk: NFTSamples, time: int, noise: torch.Tensor, rollout: DGPORollout):
        """(the noised x_t, the DiT's timestep, the conditioning, the target eps - x_0), on the device."""
        x0 = chunk.final_latents.to(self.device)
        index = torch.full((x0.shape[0],), time)
        noise = noise.to(self.device)
        t = rollout.sigmas[index].to(self.device)
        timestep = rollout.timesteps[index].to(self.device)
        return noised_latents(x0, noise, t), timestep, chunk.cond.to(self.device), noise - x0.float()

    @torch.no_grad()
    def time_pass(self, rollout: DGPORollout, advantages: torch.Tensor, step: int, time: int) -> TimePass:
        """The no-grad pass at one training time: every micro-batch's noise, the errors the clip and the KL
        need, and the group sums over every rank (the reference's all-reduced `global_group_sums`)."""
        a, policy = self.cfg.algo, self.policy
        use_old = a.clip_loss or a.clip_kl or a.dpo_reference == "ema_ref"
        local = torch.zeros(rollout.num_groups, dtype=torch.float32, device=self.device)
        held = TimePass(local, [], [], [])
        for m, chunk in enumerate(rollout.samples):
            rows = self._rows(rollout, m)
            ids = rollout.group_ids[rows] if a.shared_noise else rollout.sample_ids[rows]
            noise = self.noise(step, time, ids, chunk.final_latents.shape[1:])
            x_t, timestep, cond, target = self._inputs(chunk, time, noise, rollout)
            with policy.precision():
                loss = matching_loss(predict_velocity(policy.model, x_t, timestep, cond, 1.0).float(), target)
                v_base = old_loss = None
                if a.beta > 0 or a.dpo_reference == "base":
                    with policy.reference_model() as base:
                        v_base = self.base_velocity(base, x_t, timestep, cond)
                if use_old:
                    with self.ema_ref.module() as old:
                        old_loss = matching_loss(
                            predict_velocity(old, x_t, timestep, cond, 1.0).float(), target
                        )
            ref_loss = matching_loss(v_base, target) if a.dpo_reference == "base" else old_loss
            adv = advantages[rows].to(self.device)
            gids = rollout.group_ids[rows].to(self.device)
            group_size = self.cfg.data.num_generations
            local += group_sums(loss, ref_loss, adv, gids, rollout.num_groups, a.beta_dpo, group_size)
            held.noise.append(noise)
            held.old_loss.append(old_loss)
            held.v_base.append(v_base if a.beta > 0 else None)
        held.sums = dist.all_reduce(local)
        return held

    def base_velocity(self, base, x_t, timestep, cond) -> torch.Tensor:
        """The base model's velocity that the KL and the group sums (`dpo_reference=base`) compare with:
        CFG-free, or guided with scale `algo.kl_cfg` > 1 (the reference's `predict_v(..., cfg=True,
        cfg_scale=kl_cfg)`), its unconditional pass on the empty prompt with the prior tokens dropped, as the
        pipeline's."""
        a = self.cfg.algo
        if a.kl_cfg <= 1:
            return predict_velocity(base, x_t, timestep, cond, 1.0).float()
        if self._empty_prompt_embeds is None:  # the pipeline's negative prompt "", the same for every sample
            dtype = parse_dtype(self.cfg.model.dtype)
            pipe = self.policy.wrapper.pipeline
            self._empty_prompt_embeds, _ = encode_glyphs(pipe, [""], 1.0, self.device, dtype)
        negative = self._empty_prompt_embeds.expand(x_t.shape[0], -1, -1)
        guided = replace(cond, negative_embeds=negative)
        return VELOCITY_FNS[self.cfg.sampling.batched_cfg](base, x_t, timestep, guided, a.kl_cfg).float()

    def loss_and_backward(
        self,
        held: dict[str, TimePass],
        rollout: DGPORollout,
        advantages: torch.Tensor,
        step: int,
        time: int,
        m: int,
        denominator: int,
    ) -> dict[str, Any]:
        """DGPO's loss of micro-batch `m` at one training time; backward of its share of the mean over this
        rank's samples and times. The first micro-batch of a time runs the time's no-grad pass."""
        a = self.cfg.algo
        if "pass" not in held:
            held["pass"] = self.time_pass(rollout, advantages, step, time)
        done = held["pass"]
        chunk, rows = rollout.samples[m], self._rows(rollout, m)
        x_t, timestep, cond, target = self._inputs(chunk, time, done.noise[m], rollout)
        adv = advantages[rows].to(self.device)
        gids = rollout.group_ids[rows].to(self.device)
        old_loss, v_base = done.old_loss[m], done.v_base[m]
        with self.policy.precision():
            # CFG-free: the conditional velocity only (the reference's predict_v(cfg=False)).
            v = predict_velocity(self.policy.model, x_t, timestep, cond, 1.0).float()
            loss = matching_loss(v, target)
            clipped = torch.zeros_like(loss, dtype=torch.bool)
            if old_loss is not None and (a.clip_loss or a.clip_kl):
                clipped = clip_mask(loss, old_loss, adv, a.clip_range)
            trained = torch.where(clipped, loss.detach(), loss) if a.clip_loss else loss
            policy_loss = dgpo_loss(trained, adv, done.sums, gids)
            kl_b = torch.zeros_like(loss)
            if v_base is not None:
                kl_b = velocity_kl(v, v_base)
                kl_b = torch.where(clipped, kl_b.detach(), kl_b) if a.clip_kl else kl_b
            total = policy_loss + a.beta * kl_b.mean()
        self.policy.backward(total * loss.shape[0] / denominator)
        return {
            "loss": total.detach(),
            "policy_loss": policy_loss.detach(),
            "matching_loss": loss.detach().mean(),
            "kl": kl_b.detach().mean(),
            "clip_frac": clipped.float().mean(),
            "group_weight": torch.sigmoid(done.sums)[gids].mean(),
        }

    def state(self) -> dict[str, Any]:
        return {EMA_REF_FILE: self.ema_ref.state_dict()}

    def load_state(self, checkpoint: Path) -> None:
        self.ema_ref.load_from(checkpoint, "a DGPO run")
