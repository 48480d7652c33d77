"""`Algorithm`: what the engine calls, with the defaults most algorithms keep.

An algorithm is built by the engine as `Algorithm(cfg, parts)` (`engine/parts.py`: the policy, the update
loop, the collector, the DiT's prior tokens) and creates all its own state in its constructor. The engine
calls:

- `collect(step) -> Batch`: rollout, rewards, advantages of this rank's samples. The default hands
  `rollout` and `advantages` to the collector; an algorithm with another scheme (DAPO's dynamic sampling)
  writes its own.
- `update(batch, step) -> dict`: its loss through `updates.run`, its statistics averaged over the ranks.
- `state() -> {file name: object}` saved in every checkpoint, and `load_state(folder)` on resume.

A subclass implements `rollout(group_prompts, group_ids, step, scoring) -> (rollout data, images)` and
`update`; `advantages` defaults to group-relative advantages as the config's `algo` section asks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from glm_training.data import Prompt
from glm_training.engine.advantages import GroupAdvantages
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts
from glm_training.rewards.combine import ScoringQueue


class Algorithm(ABC):
    def __init__(self, cfg: Any, parts: Parts):
        self.cfg = cfg
        self.policy = parts.policy
        self.updates = parts.updates
        self.collector = parts.collector
        self.device = parts.policy.device
        a = cfg.algo
        self.advantages = GroupAdvantages(cfg.data.num_generations, a.scale_rewards, a.adv_clip_max)

    def collect(self, step: int) -> Batch:
        return self.collector.collect(step, self.rollout, self.advantages)

    @abstractmethod
    def rollout(
        self, group_prompts: list[Prompt], group_ids: list[int], step: int, scoring: ScoringQueue
    ) -> tuple[Any, list]:
        """Sample this rank's samples: sample i belongs to group `group_ids[i]` (prompt `group_prompts[g]`).

        Hands each decoded chunk of images, in sample order, to `collector.submit_chunk(scoring, ...)` (so
        rewards can be computed while the next chunk samples). Returns (what `update` reads, one image per
        sample).
        """

    @abstractmethod
    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """Policy-gradient update(s) on the batch (through `updates.run`); return the step's statistics."""

    def state(self) -> dict[str, Any]:
        """The algorithm's own state for bit-exact resume: {file name in the checkpoint: object to save}."""
        return {}

    def load_state(self, checkpoint: Path) -> None:
        """Restore what `state` saved, from the checkpoint folder every rank resumes from."""
        return None
