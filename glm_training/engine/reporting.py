"""What a run reports: evaluation on held-out prompts, the progress bar or log line, tracker scalars and
sample grids. `metrics.jsonl` is written by the loop (`MetricsWriter`), one row per step."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from glm_training.evaluation import (
    eval_sampling,
    eval_scalars,
    evaluate_prompts,
    grid_samples,
    write_evaluation,
)
from glm_training.image_grid import caption

logger = logging.getLogger("glm_training")


class Evaluation:
    """Evaluates the policy (its EMA weights when EMA is on) on the held-out prompts at step 0, every
    `eval.every_n_steps` and at the end; nothing without `eval.every_n_steps`.

    `inputs` (`RunInputs`): the held-out prompts, the rewards and the watched ones. In a joint run, `others`:
    the other half's policies; `watched`: the reward set scored as watched instead (the other half's);
    `rename`: what turns the scalars into the run's names."""

    def __init__(
        self,
        cfg: Any,
        inputs: Any,
        policy: Any,
        tracker: Any,
        output_dir: Path,
        priors: Any,
        others: tuple[Any, ...] = (),
        watched: Any = None,
        rename: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ):
        self.cfg = cfg
        self.inputs = inputs
        self.policy = policy
        self.others = others  # policies of the pipeline's other half, when it trains too (EMA, gathering)
        self.watched = inputs.watched_rewards if watched is None else watched
        self.rename = rename
        self.tracker = tracker
        self.output_dir = output_dir
        self.prior_tokens = None if priors is None else priors.eval_tokens

    def maybe_run(self, step: int, rank: int, world_size: int, is_main: bool) -> dict[str, float]:
        every = self.cfg.eval.every_n_steps
        if not every or not (step % every == 0 or step == self.cfg.trainer.num_steps):
            return {}
        policy, inputs = self.policy, self.inputs
        # The pipeline's AR stage reseeds the global RNG; training's random streams must not notice.
        with (
            contextlib.ExitStack() as others,
            policy.eval_weights(),
            policy.parallel.sampling(policy.trainable),
            # Float32 masters in a bf16 pipeline compute under the policy's autocast, as in training.
            policy.precision()
            if policy.master_names
            else policy.parallel.evaluation_precision(policy.precision),
            torch.random.fork_rng(devices=self._rng_devices()),
        ):
            for other in self.others:
                others.enter_context(other.eval_weights())
                others.enter_context(other.parallel.sampling(other.trainable))
            result, images = evaluate_prompts(
                policy.wrapper.pipeline,
                inputs.eval_prompts,
                inputs.rewards,
                eval_sampling(self.cfg),
                device=policy.device,
                rank=rank,
                world_size=world_size,
                num_grid_images=self.cfg.eval.num_grid_images,
                prior_tokens=self.prior_tokens,
                equal_calls=any(p.parallel.equal_calls for p in (policy, *self.others)),
                watched=self.watched,
                recogniser=inputs.text_recogniser,
                image_stats=self.cfg.eval.image_stats,
            )
        scalars = eval_scalars(result)
        if is_main:
            grid_images, captions = grid_samples(result, images, self.cfg.eval.num_grid_images)
            write_evaluation(self.output_dir / "eval", step, result, grid_images, captions)
            self.tracker.log_images(step, "eval/samples", grid_images, captions)
            logger.info("eval at step %d: reward %.4g", step, scalars["eval/reward_mean"])
        return scalars if self.rename is None else self.rename(scalars)

    def _rng_devices(self) -> list[int]:
        device = self.policy.device
        return [device.index or 0] if device.type == "cuda" else []


def best_and_worst(rewards: list[float], num_images: int) -> list[int]:
    """Indices of the highest-reward half of `num_images` samples, best first, then the lowest-reward half,
    worst last: the grid that shows what the reward pays for (each sample once)."""
    order = sorted(range(len(rewards)), key=lambda i: rewards[i], reverse=True)
    half = min(max(num_images // 2, 1), len(order) // 2)
    return order[:half] + order[len(order) - half :] if half else order[:num_images]


def progress_label(cfg: Any) -> str:
    """What the progress bar names the run: the half and its algorithm (`dit flow_grpo`, `ar grpo`), or both
    halves' algorithms in a joint run."""
    if cfg.component == "joint":
        return f"joint {cfg.ar.algo.name} + {cfg.dit.algo.name}"
    return f"{cfg.component} {cfg.algo.name}"


class Progress:
    """The progress bar (or a log line per step on rank 0 without one), tracker scalars, and every
    `logging.images_every_n_steps` steps a grid of the step's samples and one of its highest-reward samples
    beside its lowest (`train/best_worst`, this rank's)."""

    def __init__(
        self,
        cfg: Any,
        tracker: Any,
        is_main: bool,
        start_step: int,
        reward_keys: tuple[str, ...] = ("reward_mean",),
    ):
        self.cfg = cfg
        self.reward_keys = reward_keys  # the rewards the bar and the log line show
        self.tracker = tracker
        self.is_main = is_main
        self.bar = None
        if is_main and cfg.trainer.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=cfg.trainer.num_steps,
                initial=start_step,
                desc=progress_label(cfg),
                unit="step",
            )

    def log(self, record: dict[str, Any], preview: tuple[list, list[str], list[float]] | None) -> None:
        step = record["step"]
        if self.bar is not None:
            rewards = {k.removesuffix("_mean"): f"{record[k]:.4g}" for k in self.reward_keys}
            # Each reward's loss beside it: loss, or ar_loss / dit_loss.
            losses = {
                k.replace(
                    "reward_mean", "loss"
                ): f"{record.get(k.replace('reward_mean', 'loss'), math.nan):.3g}"
                for k in self.reward_keys
            }
            self.bar.set_postfix(**rewards, **losses, step_s=f"{record['step_time_s']:.2f}")
            self.bar.update(1)
        elif self.is_main:
            rewards = " ".join(f"{k.removesuffix('_mean')} {record[k]:.4g}" for k in self.reward_keys)
            logger.info(
                "step %d/%d %s (%.2f s/step)",
                step,
                self.cfg.trainer.num_steps,
                rewards,
                record["step_time_s"],
            )
        self.tracker.log_scalars(step, record)
        every = self.cfg.logging.images_every_n_steps
        if self.is_main and every and preview and (step % every == 0 or step == 1):
            images, texts, rewards = (x[: self.cfg.logging.num_images] for x in preview)
            self.tracker.log_images(
                step, "train/samples", list(images), [caption(t, r) for t, r in zip(texts, rewards)]
            )
            shown = best_and_worst(preview[2], self.cfg.logging.num_images)
            self.tracker.log_images(
                step,
                "train/best_worst",
                [preview[0][i] for i in shown],
                [caption(preview[1][i], preview[2][i]) for i in shown],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
