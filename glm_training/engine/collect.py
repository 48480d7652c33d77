"""What one step samples on this rank, and the batch it becomes: rollout -> rewards -> advantages.

The step's `num_groups_per_step x num_generations` samples are laid out group-major and each rank takes an
equal contiguous slice, so a group may straddle ranks: every rank gathers every rank's raw scores, combines
them into totals and computes the same global advantages, then keeps its slice. Prompts and sampling seeds
are functions of (seed, step, round, rank) only, so identical after a resume; a run with two collectors
(`train_joint.py`'s halves) gives each its own stream of sampling seeds (`Collector.seed_stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from glm_training.data import Prompt, prompts_for_step
from glm_training.distributed import collectives as dist
from glm_training.rewards import RewardSet
from glm_training.rewards.combine import ScoringQueue

# (group prompts, group id of each of this rank's samples, step, scoring queue) -> (rollout, images): an
# algorithm's rollout, handing each decoded chunk of images to `Collector.submit_chunk` as it goes.
Rollout = Callable[[list[Prompt], list[int], int, ScoringQueue], tuple[Any, list]]
# (every rank's totals [G * K], every rank's raw scores by name) -> (advantages [G * K], statistics).
Advantages = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
# How far apart two seed streams' sampling seeds are. The CPU generator seeds from a seed's low 32 bits only:
# 2^31 - 1 keeps one stream's seeds half that range from another's, so at a step no seed of one stream is any
# rank's seed of the other (the nearest meet ~21000 steps apart, ~10^9 on one rank).
SEED_STREAM_OFFSET = 2**31 - 1


@dataclass
class Batch:
    """One step's samples on this rank, in group-major order (group g holds samples g*K .. g*K+K-1)."""

    prompts: list[Prompt]  # one per sample
    images: list  # PIL images, one per sample
    rewards: torch.Tensor  # [N] combined total, this rank's samples
    reward_parts: dict[str, torch.Tensor]  # raw score of each reward, [N]
    advantages: torch.Tensor  # [N]
    rollout: Any  # what the algorithm's update needs (trajectories, token ids, ...)
    stats: dict[str, float] = field(default_factory=dict)  # global reward statistics for the log
    # Samples to show in the logged image grid: (images, prompt texts, total rewards) of this rank.
    preview: tuple[list, list[str], list[float]] | None = None


class Collector:
    """This rank's samples of each step, their scoring, and the batch with its advantages. `seed_stream`:
    which stream of sampling seeds it draws from (`sample_seed`); 0, every single-half run's."""

    def __init__(
        self,
        cfg: Any,
        prompts: list[Prompt],
        rewards: RewardSet,
        rank: int,
        world_size: int,
        seed_stream: int = 0,
    ):
        self.cfg = cfg
        self.prompts = prompts
        self.rewards = rewards
        self.rank = rank
        self.world_size = world_size
        self.seed_stream = seed_stream

    def step_samples(self, step: int, round_index: int = 0) -> tuple[list[Prompt], list[int]]:
        """The step's group prompts (identical on every rank) and the group of each of this rank's samples."""
        seed = self.cfg.trainer.seed * 1000 + round_index
        group_prompts = prompts_for_step(self.prompts, self.cfg.data.num_groups_per_step, seed, step)
        k = self.cfg.data.num_generations
        start, end = dist.shard_bounds(len(group_prompts) * k, self.rank, self.world_size)
        return group_prompts, [i // k for i in range(start, end)]

    def sample_seed(self, step: int, round_index: int = 0) -> int:
        """Seed of this rank's sampling noise at `step`: a function of (seed, step, round, rank, stream)."""
        seed = ((self.cfg.trainer.seed * 1_000_003 + step) * 101 + round_index) * 1009 + self.rank
        return seed + self.seed_stream * SEED_STREAM_OFFSET

    @staticmethod
    def submit_chunk(scoring: ScoringQueue, images: list, prompts: list[Prompt]) -> None:
        scoring.submit(images, [p.text for p in prompts], [p.metadata for p in prompts])

    def collect(self, step: int, rollout: Rollout, advantages: Advantages) -> Batch:
        """Rollout, rewards and advantages for this rank's samples of `step`."""
        group_prompts, group_ids = self.step_samples(step)
        sample_prompts = [group_prompts[g] for g in group_ids]
        scoring = self.rewards.queue(overlap=self.cfg.reward.overlap)
        data, images = rollout(group_prompts, group_ids, step, scoring)
        parts = scoring.result()
        dist.set_phase("reward gather")
        rewards, adv, stats = self.advantages(parts, advantages)
        preview = (images, [p.text for p in sample_prompts], rewards.tolist())
        return Batch(sample_prompts, images, rewards, parts, adv, data, stats, preview)

    def advantages(
        self, parts: dict[str, torch.Tensor], advantages: Advantages
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This rank's raw scores -> (its total rewards [N], its advantages [N], global reward statistics)."""
        all_parts = {name: dist.all_gather_cat(values.float()) for name, values in parts.items()}
        all_rewards = self.rewards.combine(all_parts, self.cfg.data.num_generations)  # [W * N]
        adv, stats = advantages(all_rewards, all_parts)
        start, end = dist.shard_bounds(all_rewards.numel(), self.rank, self.world_size)
        return all_rewards[start:end], adv[start:end], stats

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's mean over the ranks (every rank gets the same), in float64."""
        if not values:
            return {}
        keys = sorted(values)
        totals = dist.all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
        return {k: (totals[i] / self.world_size).item() for i, k in enumerate(keys)}
