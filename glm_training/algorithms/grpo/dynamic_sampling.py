"""Dynamic sampling (DAPO, arXiv 2503.14476): groups whose rewards are all equal (or, with
`algo.min_group_std`, whose reward std is below that threshold, for continuous rewards) carry no signal and
are dropped; every rank keeps generating and scoring new batches *together* until the global pool holds
`num_groups_per_step` valid groups or `max_resample_rounds` is used up. Each decision is taken from globally
gathered data, so every rank makes the same number of `generate()` calls and collectives (no deadlock), and
each rank then takes an equal slice of the pool, moved to its own device on arrival: a tensor gathered from
another rank never meets this rank's tensors on the device it came from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from glm_training.algorithms.grpo.log_probs import ARRollout
from glm_training.distributed import collectives as dist
from glm_training.engine.advantages import flat_groups
from glm_training.engine.collect import Batch, Collector
from glm_training.errors import UserError

logger = logging.getLogger("glm_training")


def shareable_groups(num_groups: int, group_size: int, world_size: int) -> int:
    """The most of `num_groups` groups whose samples split equally over `world_size` ranks."""
    while num_groups and (num_groups * group_size) % world_size:
        num_groups -= 1
    return num_groups


class DynamicSamplingExhausted(UserError, RuntimeError):
    """Too few groups with reward spread after the resampling budget (`on_budget_exhausted=error`)."""


class DynamicSampling:
    """DAPO's collection: rounds of `rollout` (the GRPO algorithm's, whose data has per-sample `records`)
    until enough groups have reward spread; `decisions` lists every generated group and whether it was
    kept."""

    def __init__(self, cfg: Any, collector: Collector, rollout: Callable[..., tuple[Any, list]], advantages):
        self.cfg = cfg
        self.collector = collector
        self.rollout = rollout
        self.advantages = advantages
        self.decisions: list[dict] = []

    def collect(self, step: int) -> Batch:
        a, target = self.cfg.algo, self.cfg.data.num_groups_per_step
        pool: list[list[dict]] = []  # valid groups, identical on every rank
        self.decisions = []
        generated_rewards, generated_parts, num_groups_seen, rounds = [], [], 0, 0
        preview = None
        while True:
            groups, totals, parts, round_preview = self._round(step, rounds)
            preview = preview or round_preview
            flat = flat_groups(totals.view(len(groups), -1), a.min_group_std)
            pool += [grp for grp, is_flat in zip(groups, flat.tolist()) if not is_flat]
            self.decisions += [
                {
                    "round": rounds,
                    "prompt": grp[0]["prompt"].text,
                    "rewards": totals.view(len(groups), -1)[i].tolist(),
                    "kept": not f,
                }
                for i, (grp, f) in enumerate(zip(groups, flat.tolist()))
            ]
            generated_rewards.append(totals)
            generated_parts.append(parts)
            num_groups_seen += len(groups)
            rounds += 1
            if len(pool) >= target or rounds > a.max_resample_rounds:
                break
        num_valid = len(pool)
        if num_valid < target:
            pool = self._budget_exhausted(pool, num_valid, target, rounds)
        pool = pool[:target]
        all_rewards = torch.cat(generated_rewards)
        stats = {
            "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std(unbiased=False).item(),
            "frac_zero_std_groups": 1.0 - num_valid / num_groups_seen,
            "resample_rounds": rounds,
            "valid_groups": num_valid,
            "trained_groups": len(pool),
        }
        for name in generated_parts[0]:
            stats[f"reward/{name}"] = torch.cat([p[name] for p in generated_parts]).mean().item()
        return self.batch(pool, stats, preview)

    def _round(self, step: int, rounds: int) -> tuple[list[list[dict]], torch.Tensor, dict, tuple]:
        """One round on every rank: (every rank's samples by group, their totals, raw scores, this rank's
        preview)."""
        collector, k = self.collector, self.cfg.data.num_generations
        group_prompts, group_ids = collector.step_samples(step, round_index=rounds)
        scoring = collector.rewards.queue(overlap=self.cfg.reward.overlap)
        rollout, images = self.rollout(group_prompts, group_ids, step, scoring, rounds)
        parts = scoring.result()
        for record, prompt_index, i in zip(rollout.records, group_ids, range(len(group_ids))):
            record["prompt"] = group_prompts[prompt_index]
            record["parts"] = {name: values[i].reshape(()) for name, values in parts.items()}
        # Everyone sees every sample. Records are CPU tensors wherever they are (`split_samples`; the update
        # collates them with CPU padding and moves each micro-batch to the device itself), so they arrive on
        # the CPU: all on one device, never another rank's (seed 003), and not this rank's GPU either, where
        # the collation's CPU padding would meet them.
        everyone = dist.flatten(dist.gather_objects(rollout.records, device="cpu"))
        # Whole groups are gathered, so the totals combine every reward over complete groups.
        all_parts = {n: torch.stack([r["parts"][n] for r in everyone]).float().cpu() for n in parts}
        totals = collector.rewards.combine(all_parts, k)
        for record, total in zip(everyone, totals):
            record["reward"] = total.reshape(())
        start, _ = dist.shard_bounds(len(everyone), collector.rank, collector.world_size)
        mine = totals[start : start + len(images)].tolist()
        preview = (images, [group_prompts[g].text for g in group_ids], mine)
        groups = [everyone[g * k : (g + 1) * k] for g in range(len(everyone) // k)]
        return groups, totals.reshape(-1), all_parts, preview

    def batch(self, pool: list[list[dict]], stats: dict[str, float], preview: tuple) -> Batch:
        """This rank's equal slice of the pool (every rank's records of the kept groups, each with its
        "prompt" and total "reward"), with the pool's advantages."""
        if not pool:
            return Batch([], [], torch.zeros(0), {}, torch.zeros(0), ARRollout([]), stats, preview)
        pool_records = dist.flatten(pool)
        pool_rewards = torch.stack([r["reward"] for r in pool_records]).float().cpu()
        advantages, _ = self.advantages(pool_rewards, {})
        collector = self.collector
        start, end = dist.shard_bounds(len(pool_records), collector.rank, collector.world_size)
        mine = pool_records[start:end]
        return Batch(
            [r["prompt"] for r in mine],
            [],
            pool_rewards[start:end],
            {},
            advantages[start:end],
            ARRollout(mine),
            stats,
            preview,
        )

    def _budget_exhausted(self, pool: list, num_valid: int, target: int, rounds: int) -> list:
        a = self.cfg.algo
        spread = (
            f"reward std >= algo.min_group_std={a.min_group_std}"
            if a.min_group_std > 0
            else "non-zero reward spread"
        )
        message = (
            f"dynamic sampling found {num_valid} of {target} groups with {spread} after {rounds} round(s)"
        )
        if a.on_budget_exhausted == "error":
            raise DynamicSamplingExhausted(
                f"{message}. Raise algo.max_resample_rounds, use a reward with more spread (or a lower "
                "algo.min_group_std), or set algo.on_budget_exhausted=warn to train on what was found."
            )
        # Train on what was found, in a size every rank can share equally.
        k, w = self.cfg.data.num_generations, self.collector.world_size
        usable = shareable_groups(num_valid, k, w)
        logger.warning("%s; training on %d group(s) this step.", message, usable)
        return pool[:usable]
