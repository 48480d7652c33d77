"""`ImageMonitor`: the reward-hacking monitors of a run.

Every step it measures the step's samples (`image_stats.py`: brightness, near-black and near-white
fractions, colour entropy, edge density, saturation, a group's diversity) over every rank, logged as
`image/<name>`; every evaluation's images are measured as `eval/image/<name>` (`evaluation.py`). Each
statistic is also logged as its change from step 0 (`<name>_change`): the first step's samples for training
(drawn by the untrained policy), the step-0 evaluation for evaluation. `eval.hacking_alarm` acts when a
statistic's change exceeds its bound in `eval.hacking_bounds` while the reward is above its step-0 value:
`warn` logs it once per statistic, `error` stops the run (`RewardHackingAlarm`) after that step's metrics row
is written. The step-0 values are saved in every checkpoint, so a resumed run measures change from the same
point.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from glm_training.distributed import collectives as dist
from glm_training.engine.collect import Batch
from glm_training.errors import UserError
from glm_training.image_stats import STATISTICS, group_runs, statistic_sums

logger = logging.getLogger("glm_training")

STATE_FILE = "image_monitor.pt"


class RewardHackingAlarm(UserError):
    """An image statistic drifted past its bound while the reward rose (`eval.hacking_alarm=error`)."""


class ImageMonitor:
    """`reward_key`: the step statistic of the reward the alarm watches (`eval/<reward_key>` when
    evaluating)."""

    def __init__(self, cfg: Any, reward_key: str = "reward_mean"):
        e = cfg.eval
        self.reward_key = reward_key
        # (baseline kind, scalar prefix, the reward that must have risen)
        self.watched = (("train", "image/", reward_key), ("eval", "eval/image/", f"eval/{reward_key}"))
        self.enabled = e.image_stats
        self.mode = e.hacking_alarm
        self.bounds = dict(e.hacking_bounds)
        # "train" / "eval" -> the step-0 value of each statistic and of the reward ("reward").
        self.baselines: dict[str, dict[str, float]] = {}
        self.warned: set[str] = set()

    def step_scalars(self, batch: Batch, reward_mean: float) -> dict[str, float]:
        """`image/<name>` of the step's samples over every rank (collective), and `image/<name>_change`.
        Every rank calls it, with or without images (a rank without any adds nothing to the sums)."""
        if not self.enabled:
            return {}
        # The preview holds this rank's images of the step with their prompts (the AR trainer's batch keeps
        # token records only; its preview is its last sampling round's renders).
        images, texts, _ = batch.preview or (batch.images, [p.text for p in batch.prompts], [])
        sums = statistic_sums(images, group_runs(list(texts)))
        flat = torch.tensor([float(x) for name in STATISTICS for x in sums[name]], dtype=torch.float64)
        totals = dist.all_reduce(flat).view(-1, 2)
        values = {
            name: (totals[i, 0] / totals[i, 1]).item()
            for i, name in enumerate(STATISTICS)
            if totals[i, 1] > 0
        }
        return self.with_changes("train", "image/", values, reward_mean)

    def eval_changes(self, scalars: dict[str, float]) -> dict[str, float]:
        """`eval/image/<name>_change` for an evaluation's scalars (the first evaluation is step 0's)."""
        prefix = "eval/image/"
        values = {k[len(prefix) :]: v for k, v in scalars.items() if k.startswith(prefix)}
        if not values:
            return {}
        changes = self.with_changes("eval", prefix, values, scalars[f"eval/{self.reward_key}"])
        return {k: v for k, v in changes.items() if k.endswith("_change")}

    def with_changes(
        self, kind: str, prefix: str, values: dict[str, float], reward: float
    ) -> dict[str, float]:
        base = self.baselines.setdefault(kind, {**values, "reward": reward})
        out = {}
        for name, value in values.items():
            out[prefix + name] = value
            if name in base:
                out[f"{prefix}{name}_change"] = value - base[name]
        return out

    def check(self, record: dict[str, Any]) -> None:
        """The alarm on a step's record (every rank holds the same values: it acts on all alike)."""
        if self.mode == "off":
            return
        for kind, prefix, reward_key in self.watched:
            base = self.baselines.get(kind)
            if base is None or reward_key not in record or not record[reward_key] > base["reward"]:
                continue
            for name, bound in self.bounds.items():
                change = record.get(f"{prefix}{name}_change")
                if change is None or not math.isfinite(change) or abs(change) <= bound:
                    continue
                message = (
                    f"step {record['step']}: {prefix}{name} moved {change:+.3g} from step 0 "
                    f"({base[name]:.3g} -> {record[prefix + name]:.3g}), past its bound {bound:g} "
                    f"(eval.hacking_bounds.{name}), while {reward_key} rose from {base['reward']:.4g} to "
                    f"{record[reward_key]:.4g}: the reward may be hacked; look at the samples (eval "
                    "grids, train/best_worst)."
                )
                if self.mode == "error":
                    raise RewardHackingAlarm(f"{message} Stopped by eval.hacking_alarm=error.")
                if prefix + name not in self.warned:
                    self.warned.add(prefix + name)
                    logger.warning("%s (eval.hacking_alarm=warn: said once)", message)

    def state(self) -> dict[str, Any]:
        return (
            {STATE_FILE: {"baselines": self.baselines, "warned": sorted(self.warned)}} if self.enabled else {}
        )

    def load_state(self, checkpoint: Path) -> None:
        file = checkpoint / STATE_FILE
        if not self.enabled:
            return
        if not file.is_file():
            logger.warning(
                "%s has no %s: image statistics change from this run's first step and evaluation",
                checkpoint,
                STATE_FILE,
            )
            return
        state = torch.load(file, map_location="cpu", weights_only=True)
        self.baselines = {k: dict(v) for k, v in state["baselines"].items()}
        self.warned = set(state["warned"])
