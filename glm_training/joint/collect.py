"""One step of a joint run: the rollout, the two batches it becomes, and both updates (`JointAlgorithm`).

    AR tokens of this rank's priors (GRPO's sampler, log-probs recorded)
    -> every rank gets every prior (`StepPriors`: the DiT's `Parts.priors` for this step)
    -> the DiT renders each prior `renderings_per_prior` times (Flow-GRPO's rollout, log-probs recorded)
    -> every image is scored by `dit_reward` and by `ar_reward` (`BothQueues`)
    -> the DiT's batch: advantages over the renderings of a prior (per_prompt grouping: a prompt's priors)
    -> the AR's batch: each prior's mean AR score over its renderings, advantages over the priors of a prompt

Global sample order is prompt-major: prior (g, p) is AR sample g*P + p, its rendering r DiT sample
(g*P + p)*R + r; each rank takes an equal contiguous slice of each list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glm_training.algorithms.grpo.dynamic_sampling import shareable_groups
from glm_training.algorithms.grpo.log_probs import ARRollout, split_samples
from glm_training.data import Prompt
from glm_training.distributed import collectives as dist
from glm_training.engine.advantages import flat_groups
from glm_training.engine.collect import Batch
from glm_training.pipeline.dit import seeded_latents


class StepPriors:
    """The DiT's prior tokens in a joint run: the AR model's samples of the current step, every rank's
    (`Parts.priors`); in per_prompt grouping also the initial noise of this rank's DiT samples
    (`JointAlgorithm._shared_noise`)."""

    eval_tokens = None  # evaluation samples its own tokens with the AR model that trains

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None  # [G * P, L]
        self.latents: torch.Tensor | None = None  # [this rank's DiT samples, C, h, w] or None

    def step_tokens(self, texts: list[str], seed: int, step: int) -> torch.Tensor:
        return self.tokens

    def initial_latents(self) -> torch.Tensor | None:
        return self.latents


class BothQueues:
    """The scoring queues of both reward sets, fed the same images (`ScoringQueue`'s `submit`)."""

    def __init__(self, dit_queue: Any, ar_queue: Any):
        self.dit, self.ar = dit_queue, ar_queue

    def submit(self, images: list, prompts: list[str], metadata: list[dict]) -> None:
        self.dit.submit(images, prompts, metadata)
        self.ar.submit(images, prompts, metadata)


@dataclass
class JointBatch:
    ar: Batch
    dit: Batch
    stats: dict[str, float]  # both halves' reward statistics, as ar_* and dit_*
    preview: tuple[list, list[str], list[float]]  # this rank's images, prompts and DiT rewards


class JointAlgorithm:
    """The step's rollout on this rank, `ar` (a `GRPO`) sampling priors and `dit` (a `FlowGRPO`) rendering
    them; then each half's update on its batch (the algorithm contract of `algorithms/base.py`)."""

    def __init__(self, cfg: Any, ar: Any, dit: Any, priors: StepPriors, rewards: tuple[Any, Any]):
        self.cfg = cfg
        self.ar, self.dit = ar, dit
        self.priors = priors
        self.ar_rewards, self.dit_rewards = rewards
        self.rank, self.world_size = ar.collector.rank, ar.collector.world_size

    def collect(self, step: int) -> JointBatch:
        d = self.cfg.data
        num_priors, renderings = d.num_priors, d.renderings_per_prior
        ar_prompts, ar_ids = self.ar.collector.step_samples(step)
        samples = self.ar.sample_tokens(ar_prompts, ar_ids, step)
        self.priors.tokens = torch.cat(dist.gather_objects(samples.prior_token_ids.cpu()))
        dit_prompts = [p for p in ar_prompts for _ in range(num_priors)]  # one DiT group per prior
        start, end = dist.shard_bounds(len(dit_prompts) * renderings, self.rank, self.world_size)
        dit_ids = [i // renderings for i in range(start, end)]
        self.priors.latents = self._shared_noise(ar_prompts, range(start, end), step)
        overlap = self.cfg.dit_reward.overlap or self.cfg.ar_reward.overlap
        queues = BothQueues(self.dit_rewards.queue(overlap=overlap), self.ar_rewards.queue(overlap=overlap))
        rollout, images = self.dit.rollout(dit_prompts, dit_ids, step, queues)
        dit_parts, ar_parts = queues.dit.result(), queues.ar.result()
        dit_batch = self._dit_batch(dit_prompts, dit_ids, images, dit_parts, rollout)
        ar_batch = self._ar_batch(ar_prompts, ar_ids, samples, ar_parts)
        stats = {f"ar_{k}": v for k, v in ar_batch.stats.items()}
        stats.update({f"dit_{k}": v for k, v in dit_batch.stats.items()})
        return JointBatch(ar_batch, dit_batch, stats, dit_batch.preview)

    def update(self, batch: JointBatch, step: int) -> dict[str, float]:
        """The AR's update, then the DiT's; their statistics as ar_* and dit_*."""
        out = {f"ar_{k}": v for k, v in self.ar.update(batch.ar, step).items()}
        out.update({f"dit_{k}": v for k, v in self.dit.update(batch.dit, step).items()})
        return out

    def state(self) -> dict[str, Any]:
        return {}  # each half's algorithm is checkpointed with its half

    def load_state(self, checkpoint: Any) -> None:
        return None

    def _shared_noise(self, ar_prompts: list[Prompt], samples: range, step: int) -> torch.Tensor | None:
        """per_prompt grouping: the initial noise of each of this rank's DiT samples, one seed per prompt
        (`GRPO.noise_seeds`, as train_ar.py renders), so the priors of a prompt differ by their tokens only.
        None in per_prior grouping: the DiT's rollout draws its noise as train_dit.py does, from the DiT's
        seed stream (`trainer.SEED_STREAMS`). (Sharing rendering r's noise over a prompt's priors there too
        was measured worse: priors with equal tokens then score within a few JPEG bytes, the AR advantage's
        sign turns on rounding, and the DiT sees 1/P of the noises.)"""
        if self.cfg.data.grouping() == "per_prior":
            return None
        groups = [i // self.cfg.data.num_priors for i in samples]
        seeds = self.ar.noise_seeds([ar_prompts[g].text for g in groups], groups, step, 0)
        s = self.cfg.dit.sampling
        return seeded_latents(self.dit.policy.wrapper.pipeline, seeds, s.height, s.width)

    def _dit_batch(self, dit_prompts, dit_ids, images, parts, rollout) -> Batch:
        collector = self.dit.collector
        rewards, advantages, stats = collector.advantages(parts, self.dit.advantages)
        prompts = [dit_prompts[g] for g in dit_ids]
        preview = (images, [p.text for p in prompts], rewards.tolist())
        return Batch(prompts, images, rewards, parts, advantages, rollout, stats, preview)

    def _ar_batch(self, ar_prompts, ar_ids, samples, parts) -> Batch:
        """Each prior's AR reward: its renderings' mean of each raw score, then combined (so a
        `normalized_sum` standardises over the priors of a prompt); advantages over those priors."""
        d = self.cfg.data
        every = {n: dist.all_gather_cat(v.float()) for n, v in parts.items()}
        per_prior = {n: v.view(-1, d.renderings_per_prior).mean(dim=1) for n, v in every.items()}
        totals = self.ar_rewards.combine(per_prior, d.num_priors)
        records = split_samples(samples)
        if self.ar.dynamic is not None:
            return self._without_flat_groups(ar_prompts, ar_ids, records, totals, per_prior)
        advantages, stats = self.ar.advantages(totals, per_prior)
        start, end = dist.shard_bounds(totals.numel(), self.rank, self.world_size)
        mine = {n: v[start:end] for n, v in per_prior.items()}
        prompts = [ar_prompts[g] for g in ar_ids]
        return Batch(prompts, [], totals[start:end], mine, advantages[start:end], ARRollout(records), stats)

    def _without_flat_groups(self, ar_prompts, ar_ids, records, totals, per_prior) -> Batch:
        """DAPO's dynamic sampling without resampling: the AR updates on the groups with reward spread,
        shared equally by the ranks (`DynamicSampling.batch`); the DiT trained on every image."""
        a, num_priors = self.cfg.ar.algo, self.cfg.data.num_priors
        for record, g in zip(records, ar_ids):
            record["prompt"] = ar_prompts[g]
        everyone = dist.flatten(dist.gather_objects(records, device="cpu"))
        for record, total in zip(everyone, totals):
            record["reward"] = total.reshape(())
        flat = flat_groups(totals.view(-1, num_priors), a.min_group_std).tolist()
        pool = [
            everyone[g * num_priors : (g + 1) * num_priors] for g, is_flat in enumerate(flat) if not is_flat
        ]
        pool = pool[: shareable_groups(len(pool), num_priors, self.world_size)]
        stats = {
            "reward_mean": totals.mean().item(),
            "reward_std": totals.std(unbiased=False).item(),
            "frac_zero_std_groups": sum(flat) / len(flat),
            "trained_groups": len(pool),
        }
        stats.update({f"reward/{n}": v.mean().item() for n, v in per_prior.items()})
        return self.ar.dynamic.batch(pool, stats, None)
