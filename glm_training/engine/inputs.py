"""A run's inputs, read and checked before any model loads: prompts, rewards, held-out prompts and the
rewards watched on them, and the DiT's cached prior tokens. Everything that can be wrong with them fails
here, with the key and the fix."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from glm_training.checkpoint.resume import check_resume_target
from glm_training.config import ConfigError
from glm_training.data import load_prompts
from glm_training.evaluation import check_eval_prompts, load_eval_prompts, text_recogniser, watched_reward_set
from glm_training.models.wrapper import check_model_available
from glm_training.priors import open_for_dit_run
from glm_training.rewards import RewardSet
from glm_training.rewards.combine import RewardFuncs, rewards_from_python
from glm_training.rewards.retry import FailurePolicy

logger = logging.getLogger("glm_training")


class RunInputs:
    """`cfg`'s prompts and rewards. `reward_funcs` (Python API, as TRL's): functions, `Reward` objects or
    reward names that replace `reward.names`, weighted by `reward_weights` (default 1.0 each); `cfg` then
    becomes the config that records them (`rewards.combine.rewards_from_python`)."""

    def __init__(
        self, cfg: Any, reward_funcs: RewardFuncs | None = None, reward_weights: list[float] | None = None
    ):
        check_resume_target(cfg.trainer.resume)
        check_model_available(cfg.model.name)
        self.prompts = load_prompts(cfg.data.resolved_prompt_file())
        if reward_funcs is None:
            self.rewards = RewardSet(cfg.reward.weight_map(), cfg.reward.options, cfg.reward.combine)
        else:
            self.rewards, reward_cfg = rewards_from_python(cfg.reward, reward_funcs, reward_weights)
            cfg = dataclasses.replace(cfg, reward=reward_cfg)  # config.yaml records them
        self.cfg = cfg
        self.rewards.check_prompts([p.text for p in self.prompts], [p.metadata for p in self.prompts])
        self.eval_prompts = load_eval_prompts(cfg.eval) if cfg.eval.every_n_steps else []
        self.watched_rewards = watched_reward_set(cfg) if self.eval_prompts else None
        self.text_recogniser = None
        if self.eval_prompts:
            check_eval_prompts(self.eval_prompts, [self.rewards, self.watched_rewards], cfg.eval.text_metrics)
            if cfg.eval.text_metrics:
                self.text_recogniser = text_recogniser([self.rewards, self.watched_rewards])
        elif cfg.eval.watch_rewards or cfg.eval.text_metrics:
            logger.warning("eval.watch_rewards and eval.text_metrics are ignored: eval.every_n_steps=0")

    def set_failure_policy(self) -> None:
        """Retries and failure handling from `reward.*`, for the training rewards and the watched ones."""
        r = self.cfg.reward
        self.rewards.policy = FailurePolicy(r.max_retries, r.retry_backoff_s, r.on_failure, r.on_nonfinite)
        if self.watched_rewards is not None:
            self.watched_rewards.policy = self.rewards.policy  # retried as the training rewards are

    def stops_on_failure(self) -> bool:
        """Whether a reward that failed on any rank stops the run (`reward.on_failure=error`)."""
        return self.cfg.reward.on_failure == "error"

    def close(self) -> None:
        self.rewards.close()
        if self.watched_rewards is not None:
            self.watched_rewards.close()


def open_priors(cfg: Any, component: str, inputs: RunInputs) -> Any:
    """The DiT's prior-token cache (`data.prior_cache`, checked against the run before the DiT loads) or None
    (the run then never loads the AR model)."""
    if component != "dit":
        if cfg.data.prior_cache:
            raise ConfigError(
                "data.prior_cache", f"is for train_dit.py; the {component} trainer samples its own tokens."
            )
        return None
    return open_for_dit_run(cfg, inputs.prompts, inputs.eval_prompts)
