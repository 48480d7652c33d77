"""`DiffusionTrainer`: what every RL algorithm on the GLM-Image diffusion decoder shares.

The frozen AR model writes each prompt's prior tokens once (shared by its group, identical on every rank),
or they come from a prior cache (`data.prior_cache`); the DiT then samples `num_generations` images per
prompt in micro-batches of `sampling.micro_batch_size`: initial noise, the algorithm's own sampler, the
VAE decode, and the rewards (scored while the next micro-batch samples when `reward.overlap` is on).
Advantages are group-relative, with flat groups at exactly 0.

An algorithm on the decoder is a subclass that supplies:

- `sample_chunk(latents, cond, timesteps, sigmas, step, generator)`: sample one micro-batch, returning what
  its update keeps of it and the final latents to decode;
- `make_rollout(chunks, timesteps, sigmas, step)`: its rollout type, from those kept micro-batches;
- `_update(batch, step)`: its loss, through `RewardTrainer.run_update`.

`DiTTrainer` (Flow-GRPO: SDE trajectories and their log-probs) and `NFTTrainer` (DiffusionNFT: the old
model's ODE samples) are the two; `docs/architecture.md` says what else a new one needs.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from glm_training import distributed as dist
from glm_training.algorithms.advantages import zero_std_groups
from glm_training.algorithms.flow_grpo import nonzero_advantage_mask
from glm_training.data import Prompt
from glm_training.models.placement import parse_dtype
from glm_training.priors import open_for_dit_run
from glm_training.rewards.combine import ScoringQueue
from glm_training.rollout.dit import (
    build_guidance_inputs,
    decode_latents,
    generate_prior_tokens,
    glm_image_schedule,
)
from glm_training.trainers.reward_trainer import RewardTrainer


class DiffusionTrainer(RewardTrainer):
    """Reward training of the DiT: prior tokens, schedule, and per micro-batch sample -> decode -> score."""

    component = "dit"

    def _build_model(self):
        # data.prior_cache is checked (resolution, AR fingerprint, prompts, sha256s) before the DiT loads.
        self.prior_cache = open_for_dit_run(self.cfg, self.prompts, self.eval_prompts)
        return super()._build_model()

    def _components_not_loaded(self) -> tuple[tuple[str, ...], str]:
        if self.prior_cache is None:
            return (), ""
        return ("vision_language_encoder",), f"prior tokens from data.prior_cache={self.cfg.data.prior_cache}"

    def _eval_prior_tokens(self):
        return None if self.prior_cache is None else self.prior_cache.eval_tokens

    @abstractmethod
    def sample_chunk(
        self,
        latents: torch.Tensor,
        cond: Any,
        timesteps: torch.Tensor,
        sigmas: torch.Tensor,
        step: int,
        generator: torch.Generator,
    ) -> tuple[Any, torch.Tensor]:
        """Sample one micro-batch from its initial latents [B, C, h, w] (already in the model's dtype).

        Returns (what `_update` keeps of it, the final latents [B, C, h, w] to decode). Runs inside the
        policy's precision and `parallel.sampling`.
        """

    @abstractmethod
    def make_rollout(self, chunks: list, timesteps: torch.Tensor, sigmas: torch.Tensor, step: int) -> Any:
        """The rollout `_update` reads, from the kept micro-batches (in sample order) and the schedule."""

    def _rollout(
        self, group_prompts: list[Prompt], group_ids: list[int], step: int, scoring: ScoringQueue
    ) -> tuple[Any, list]:
        s = self.cfg.sampling
        pipe = self.wrapper.pipeline
        seed = self.sample_seed(step)
        sample_prompts = [group_prompts[g] for g in group_ids]
        prior = self._shared_prior_tokens(group_prompts, step)[torch.tensor(group_ids)]
        timesteps, sigmas = glm_image_schedule(pipe, s.num_steps, s.height, s.width)
        generator = torch.Generator(self.device).manual_seed(seed)
        dtype = parse_dtype(self.cfg.model.dtype)
        latent_shape = (
            self.trainable.config.in_channels,
            s.height // pipe.vae_scale_factor,
            s.width // pipe.vae_scale_factor,
        )
        chunks, images = [], []
        for start in range(0, len(sample_prompts), s.micro_batch_size):
            chunk = sample_prompts[start : start + s.micro_batch_size]
            cond = build_guidance_inputs(
                pipe,
                [p.text for p in chunk],
                prior[start : start + len(chunk)],
                s.height,
                s.width,
                s.guidance_scale,
                self.device,
                dtype,
            )
            latents = torch.randn((len(chunk), *latent_shape), generator=generator, device=self.device)
            with self.policy_precision(), self.parallel.sampling(self.trainable):
                kept, final_latents = self.sample_chunk(
                    latents.to(dtype), cond, timesteps, sigmas, step, generator
                )
            chunks.append(kept)
            chunk_images = decode_latents(pipe, final_latents)
            self.submit_chunk(scoring, chunk_images, chunk)
            images += chunk_images
        return self.make_rollout(chunks, timesteps, sigmas, step), images

    def global_advantages(
        self, all_rewards: torch.Tensor, all_parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The shared advantages, with flat groups at exactly 0 and the fraction of zero advantages logged.

        A group whose rewards are all equal has advantage 0 by definition; the rounding of its mean must not
        turn that into noise that Flow-GRPO's `drop_zero_advantage` would keep.
        """
        advantages, stats = super().global_advantages(all_rewards, all_parts)
        flat_n = zero_std_groups(all_rewards.view(-1, self.cfg.data.num_generations)).repeat_interleave(
            self.cfg.data.num_generations
        )
        advantages = torch.where(flat_n, torch.zeros_like(advantages), advantages)
        stats["frac_zero_advantage"] = 1.0 - nonzero_advantage_mask(advantages).float().mean().item()
        return advantages, stats

    def _shared_prior_tokens(self, group_prompts: list[Prompt], step: int) -> torch.Tensor:
        """[num_groups, L] prior tokens, one AR sample per group, identical on every rank.

        A group may straddle ranks, and all its members must decode the same prior tokens; so each group is
        generated by one owner rank (round-robin) and the tokens are shared with every rank. With
        `data.prior_cache` every rank reads the same cached rows instead (`PriorCache.step_tokens`).
        """
        if self.prior_cache is not None:
            return self.prior_cache.step_tokens([p.text for p in group_prompts], self.cfg.trainer.seed, step)
        s = self.cfg.sampling
        owned = list(range(self.rank, len(group_prompts), self.world_size))
        tokens = {}
        if owned:
            generated = generate_prior_tokens(
                self.wrapper.pipeline,
                [group_prompts[g].text for g in owned],
                s.height,
                s.width,
                seed=self.sample_seed(step),
            )
            tokens = dict(zip(owned, generated))
        merged = {g: t for part in dist.gather_objects(tokens) for g, t in part.items()}
        return torch.stack([merged[g] for g in range(len(group_prompts))])
