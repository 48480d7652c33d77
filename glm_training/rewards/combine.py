"""Several rewards as one: scoring (optionally overlapped with the rollout) and combining into one total.

Two ways to combine the raw scores `r_k` of rewards k = 1..R into the total a group's advantages come from:

- `weighted_sum`: total_n = sum_k w_k * r_k_n (the multi-reward setting of Flow-GRPO / DDPO configs and TRL's
  `reward_weights`). Weights carry the units: a reward in kB and one in [0, 1] need very different weights.
- `normalized_sum`: each reward is first standardised within its prompt group,
  z_k_n = (r_k_n - mean_g(r_k)) / (std_g(r_k) + eps), then total_n = sum_k w_k * z_k_n. Rewards on
  different scales then count by their weights alone, and a reward that is flat within a group contributes 0
  there instead of drowning the others' signal.

Both operate on a whole step's scores gathered from every rank (group-major, K samples per group), because a
group may straddle ranks. Every reward's output is validated (shape [N], finite) on every batch, so a broken
reward, including a user's own function (`module:function`, see `callable_reward.py`), fails with its name.

Scoring can overlap with the rollout: the rollout hands each decoded micro-batch to a `ScoringQueue`, which
with `overlap=True` scores it in a worker thread while the next micro-batch samples (the approach of
Flow-GRPO's reward executor). Chunks are scored in submission order by the same calls either way, so the
scores do not depend on the setting.

From Python a trainer also takes the rewards themselves, TRL-style
(`DiTTrainer(cfg, reward_funcs=[fn, ...])`): functions, `Reward` objects and reward names mixed, named as
`callable_reward.reward_name` says (or by the keys of a dict) and reported as `reward/<name>`;
`rewards_from_python` builds the `RewardSet` and the reward config that records them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image

from glm_training.rewards.callable_reward import CallableReward, is_callable_target, reward_name
from glm_training.rewards.registry import Reward, build_reward, check_reward_options
from glm_training.rewards.retry import FailurePolicy, score_reward

logger = logging.getLogger(__name__)

Scores = dict[str, torch.Tensor]  # reward name -> raw scores [N], float32 on the CPU


def weighted_sum(parts: Scores, weights: dict[str, float], num_generations: int) -> torch.Tensor:
    """total_n = sum_k weights[k] * parts[k]_n, float32 [N]; `num_generations` is unused (same signature)."""
    del num_generations
    names = list(weights)
    total = torch.zeros_like(parts[names[0]], dtype=torch.float32)
    for name in names:
        total += weights[name] * parts[name].float()
    return total


def normalized_sum(
    parts: Scores, weights: dict[str, float], num_generations: int, eps: float = 1e-4
) -> torch.Tensor:
    """total_n = sum_k weights[k] * (r_k_n - group mean) / (group std + eps), float32 [G * K].

    `parts[k]` is [G * K], group-major with K = `num_generations` samples per group; std is the population std
    (unbiased=False), as in the group advantages; a group where a reward is constant contributes 0 for it.
    """
    total = None
    for name, weight in weights.items():
        r_gk = parts[name].float().view(-1, num_generations)
        std_g1 = r_gk.std(dim=1, keepdim=True, unbiased=False)
        # A flat group carries no preference: exactly 0, whatever eps is.
        z_gk = torch.where(std_g1 > 0, (r_gk - r_gk.mean(dim=1, keepdim=True)) / (std_g1 + eps), 0.0)
        term = weight * z_gk.reshape(-1)
        total = term if total is None else total + term
    return total


COMBINE_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "weighted_sum": weighted_sum,
    "normalized_sum": normalized_sum,
}


class RewardSet:
    """The rewards named in `weights`, built with `options[name]` as constructor keywords.

    A name is a registered reward (`available_rewards()`) or a user's callable as `module:function` (or
    `path/to/file.py:function`), or a name of `objects`: rewards given as Python objects (a function
    `fn(images, prompts, metadata)` or a `Reward` instance), reported under that name. Names, weights and
    options are all validated before any reward (and so any reward model) is built, so a typo fails at
    start-up with the available names and the closest match.
    """

    def __init__(
        self,
        weights: dict[str, float],
        options: dict[str, dict[str, Any]] | None = None,
        combine: str = "weighted_sum",
        objects: Mapping[str, Reward | Callable[..., Any]] | None = None,
    ) -> None:
        objects = dict(objects or {})
        options = dict(options or {})
        if not weights:
            raise ValueError(
                "no rewards configured: give at least one reward name with its weight, e.g. {'ocr': 1.0}"
            )
        if combine not in COMBINE_FNS:
            raise ValueError(f"unknown reward combination {combine!r}; choose one of {sorted(COMBINE_FNS)}")
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward {name!r} has weight {weight!r}; weights must be finite numbers")
        stray = sorted(set(options) - set(weights))
        if stray:
            raise ValueError(
                f"options given for reward(s) {stray} that have no weight; add them to the weights "
                f"(weight 0.0 to only log them) or remove their options. Weighted rewards: {list(weights)}"
            )
        given_options = sorted(set(options) & set(objects))
        if given_options:
            raise ValueError(
                f"options given for reward(s) {given_options} passed as Python objects; bind them in Python "
                "(functools.partial or a closure) instead"
            )
        for name in weights:
            if name not in objects and not is_callable_target(name):
                check_reward_options(name, options.get(name, {}))

        self.names: list[str] = list(weights)
        self.weights: dict[str, float] = {name: float(weight) for name, weight in weights.items()}
        self.combine_fn = COMBINE_FNS[combine]
        self.rewards: dict[str, Reward] = {
            name: _wrap(objects[name], name) if name in objects else _build(name, options.get(name, {}))
            for name in self.names
        }
        self._executor: ThreadPoolExecutor | None = None
        # Retries, failures and non-finite scores (see `rewards/retry.py`); the trainer sets the policy once
        # and collects each step inside `collecting()`.
        self.policy = FailurePolicy()
        self.defer_errors = False
        self.failures: list[str] = []  # retryable rewards out of retries
        self.errors: list[Exception] = []  # any other reward error

    @contextlib.contextmanager
    def collecting(self) -> Iterator[RewardSet]:
        """One step's scoring: starts with no recorded failure or error, and holds a reward's error (NaN
        scores, recorded in `errors`) until the block ends, so that every rank can act on it together."""
        self.failures.clear()
        self.errors.clear()
        self.defer_errors = True
        try:
            yield self
        finally:
            self.defer_errors = False

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        """Run every reward's prompt check (ValueError naming the prompt and the fix)."""
        for reward in self.rewards.values():
            reward.check_prompts(prompts, metadata)

    @torch.no_grad()  # also in the scoring thread, which does not inherit the caller's grad mode
    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> Scores:
        """Every reward's raw scores of the batch: {name: `scores_n` [N]}, float32 on the CPU, validated."""
        num_images = len(images)
        if not num_images == len(prompts) == len(metadata):
            raise ValueError(
                f"got {num_images} images, {len(prompts)} prompts and {len(metadata)} metadata entries"
            )
        return {
            name: score_reward(self, name, reward, images, prompts, metadata, _validated)
            for name, reward in self.rewards.items()
        }

    def combine(self, parts: Scores, num_generations: int) -> torch.Tensor:
        """The total [N] of a whole step's gathered scores (group-major, `num_generations` per group)."""
        return self.combine_fn(parts, self.weights, num_generations)

    def queue(self, overlap: bool = False) -> ScoringQueue:
        """A queue for one rollout's chunks; `overlap` scores them in a worker thread as they arrive."""
        if overlap and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        return ScoringQueue(self, self._executor if overlap else None)

    def close(self) -> None:
        if self._executor is not None:
            # After a failure, chunks still queued are dropped rather than scored for nothing.
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class ScoringQueue:
    """Collects the rollout's chunks in order and returns their scores concatenated."""

    def __init__(self, reward_set: RewardSet, executor: ThreadPoolExecutor | None) -> None:
        self.reward_set = reward_set
        self.executor = executor
        self._pending: list[Future | Scores] = []

    def submit(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> None:
        # Fail fast: a chunk that already failed stops the rollout here instead of after its last chunk.
        for pending in self._pending:
            if isinstance(pending, Future) and pending.done() and pending.exception() is not None:
                self.cancel()
                raise pending.exception()
        if self.executor is None:
            self._pending.append(self.reward_set(images, prompts, metadata))
        else:
            self._pending.append(self.executor.submit(self.reward_set, images, prompts, metadata))

    def cancel(self) -> None:
        """Drop the chunks not yet scored."""
        for pending in self._pending:
            if isinstance(pending, Future):
                pending.cancel()
        self._pending = []

    def result(self) -> Scores:
        """{name: [N]} over all submitted chunks, in submission order; re-raises a reward's error."""
        try:
            chunks = [p.result() if isinstance(p, Future) else p for p in self._pending]
        except BaseException:
            self.cancel()
            raise
        self._pending = []
        names = self.reward_set.names
        if not chunks:
            return {name: torch.zeros(0) for name in names}
        return {name: torch.cat([c[name] for c in chunks]) for name in names}


RewardFuncs = Sequence[Reward | Callable[..., Any] | str] | Mapping[str, Reward | Callable[..., Any] | str]


def rewards_from_python(
    reward_cfg: Any,
    reward_funcs: RewardFuncs | Reward | Callable[..., Any],
    weights: Sequence[float] | None = None,
) -> tuple[RewardSet, Any]:
    """The rewards a trainer was handed in Python, replacing `reward_cfg.names` (TRL's `reward_funcs`).

    `reward_funcs`: one reward or a list of them, each a function `fn(images, prompts, metadata) -> N floats`,
    a `Reward` object, or a name as in `reward.names` (registry name or `module:function`, built with its
    `reward.options`); or a dict {name: reward} choosing the names. `weights`: one per reward, default 1.0
    each (`reward.weights` of the config is replaced too). `reward.combine` and `reward.overlap` still apply.

    Returns the `RewardSet` and a copy of `reward_cfg` whose `names`/`weights` are what trains (the run's
    config.yaml records them; functions by their names).
    """
    if isinstance(reward_funcs, Mapping):
        entries = dict(reward_funcs)
        bad = [key for key in entries if not isinstance(key, str) or not key]
        if bad:
            raise ValueError(f"reward_funcs dict keys are the metric names and must be strings, got {bad}")
    else:
        if isinstance(reward_funcs, (str, Reward)) or callable(reward_funcs):
            reward_funcs = [reward_funcs]
        entries = {}
        for obj in reward_funcs:
            base = obj if isinstance(obj, str) else reward_name(obj)
            name, copy = base, 2
            while name in entries:  # two lambdas: "lambda", "lambda_2"
                name, copy = f"{base}_{copy}", copy + 1
            entries[name] = obj
    if not entries:
        raise ValueError("reward_funcs is empty; give at least one reward function, Reward or reward name")
    names = list(entries)
    if weights is None:
        weights = [1.0] * len(names)
    weights = list(weights)
    if len(weights) != len(names):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(names)} rewards {names}")
    # Names are built with their reward.options (under the name itself, whatever the dict key), after every
    # name and option has been checked, so a typo fails before any reward model loads.
    strings = {name: obj for name, obj in entries.items() if isinstance(obj, str)}
    options = {name: dict(reward_cfg.options.get(target, {})) for name, target in strings.items()}
    for name, target in strings.items():
        if not is_callable_target(target):
            check_reward_options(target, options[name])
    dropped = sorted(set(reward_cfg.options) - set(strings.values()))
    if dropped:
        logger.warning("reward.options for %s ignored: not among the trainer's reward_funcs", dropped)
    objects = {
        name: _build(obj, options[name]) if isinstance(obj, str) else obj for name, obj in entries.items()
    }
    reward_set = RewardSet(dict(zip(names, weights)), None, reward_cfg.combine, objects=objects)
    recorded = dataclasses.replace(
        reward_cfg,
        names=names,
        weights=[float(w) for w in weights],
        options={name: o for name, o in options.items() if o},
    )
    return reward_set, recorded


def _wrap(obj: Reward | Callable[..., Any], name: str) -> Reward:
    # A Reward object keeps its own contract (a tensor per batch); a function may return a list or an array.
    return obj if isinstance(obj, Reward) else CallableReward.from_object(obj, name)


def _build(name: str, options: dict[str, Any]) -> Reward:
    if is_callable_target(name):
        return CallableReward(name, **options)
    return build_reward(name, **options)


def _validated(name: str, scores_n: Any, prompts: list[str], allow_nonfinite: bool = False) -> torch.Tensor:
    num_images = len(prompts)
    if not isinstance(scores_n, torch.Tensor):
        raise TypeError(f"reward {name!r} returned {type(scores_n).__name__}, expected a torch.Tensor")
    if tuple(scores_n.shape) != (num_images,):
        raise ValueError(
            f"reward {name!r} returned shape {tuple(scores_n.shape)} for {num_images} images; "
            f"expected ({num_images},): one score per image"
        )
    scores_n = scores_n.detach().to(device="cpu", dtype=torch.float32)
    bad = ~torch.isfinite(scores_n)
    if bad.any() and not allow_nonfinite:
        indices = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"reward {name!r} returned non-finite scores at indices {indices} "
            f"(prompts {[prompts[i] for i in indices[:3]]}); fix the reward, or set "
            "reward.on_nonfinite=drop to give those samples' groups zero advantage"
        )
    return scores_n
