"""`RewardTrainer`: what every GLM-Image reward trainer shares; `DiTTrainer` and `ARTrainer` override steps.

The loop is `train()`: collect a batch (rollout, rewards, group advantages), update, log, checkpoint. The
shared steps are here: config checks that run before any model is loaded, the distributed engine,
`_build_model` (placement by construction, see `models/placement.py`), LoRA or full fine-tuning, the
optimizer, rewards, group-relative advantages with statistics gathered over all ranks, checkpoints and
metrics. Subclasses implement `_rollout` and `_update`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from glm_training import distributed as dist
from glm_training.algorithms.advantages import (
    batch_std_advantages,
    centered_advantages,
    clip_advantages,
    group_normalized_advantages,
    zero_std_groups,
)
from glm_training.checkpoint import (
    CheckpointError,
    find_resume,
    later_checkpoints,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_state,
    save_checkpoint,
    set_aside,
)
from glm_training.config import ConfigError, config_to_yaml
from glm_training.data import Prompt, load_prompts, prompts_for_step
from glm_training.environment import log_environment
from glm_training.evaluate import (
    check_eval_prompts,
    eval_sampling,
    eval_scalars,
    evaluate_prompts,
    grid_samples,
    load_eval_prompts,
    text_recogniser,
    watched_reward_set,
    write_evaluation,
)
from glm_training.guards import SkipCounter, nonfinite_groups
from glm_training.image_grid import caption
from glm_training.logs import setup_logging
from glm_training.metrics import MetricsWriter
from glm_training.models.frozen_weights import apply_weights_source, frozen_weight_sources
from glm_training.models.halves import ModelHalf, model_half
from glm_training.models.lora import adapters_disabled, add_lora_adapters
from glm_training.models.master_weights import computing_like_masters, master_names, upcast_trained_
from glm_training.models.placement import describe_module, run_stage
from glm_training.models.sharded_loading import local_pipeline_folder, standin_weights
from glm_training.models.wrapper import (
    GLMImageWrapper,
    enable_gradient_checkpointing,
    load_for_training,
    resolve_model_path,
)
from glm_training.parallel import make_parallelism
from glm_training.plan import log_memory_plan
from glm_training.preemption import StopSignals
from glm_training.rewards import RewardSet
from glm_training.rewards.combine import RewardFuncs, ScoringQueue, rewards_from_python
from glm_training.rewards.retry import FailurePolicy, RewardFailed
from glm_training.tracking import build_tracker

logger = logging.getLogger("glm_training")

ADVANTAGE_FNS = {
    "group": group_normalized_advantages,
    "batch": batch_std_advantages,
    "none": lambda rewards_gk, eps=0.0: centered_advantages(rewards_gk),
}


@dataclass
class Batch:
    """One step's samples on this rank, in group-major order (group g holds samples g*K .. g*K+K-1)."""

    prompts: list[Prompt]  # one per sample
    images: list  # PIL images, one per sample
    rewards: torch.Tensor  # [N] combined total, this rank's samples
    reward_parts: dict[str, torch.Tensor]  # raw score of each reward, [N]
    advantages: torch.Tensor  # [N]
    rollout: Any  # what the subclass's `_update` needs (trajectories, token ids, ...)
    stats: dict[str, float] = field(default_factory=dict)  # global reward statistics for the log
    # Samples to show in the logged image grid: (images, prompt texts, total rewards) of this rank.
    preview: tuple[list, list[str], list[float]] | None = None


LOSS_STATS = ("loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean")


def split_mini_batches(num_micro_batches: int, num_mini_batches: int) -> list[list[int]]:
    """Micro-batch indices of each mini-batch (one optimizer step each), interleaved, none empty."""
    everything = list(range(num_micro_batches))
    return [part for m in range(num_mini_batches) if (part := everything[m::num_mini_batches])]


class StatMeans:
    """Running means of the per-micro-batch loss statistics of one update."""

    def __init__(self, keys: tuple[str, ...] = LOSS_STATS):
        self.sums = dict.fromkeys(keys, 0.0)
        self.count = 0

    def add(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self.sums[key] += float(value.detach()) if torch.is_tensor(value) else float(value)
        self.count += 1

    def means(self) -> dict[str, float]:
        return {key: total / max(self.count, 1) for key, total in self.sums.items()}


# One backward pass of an optimizer step: computes its loss, calls backward on its share of the mini-batch's
# loss and returns its statistics (floats or 0-d tensors).
MicroStep = Callable[[], dict[str, Any]]


@dataclass
class UpdateStats:
    """What one update (`RewardTrainer.run_update`) measured."""

    means: dict[str, float]  # each statistic's mean over every backward pass of the update
    mini_batches: list[dict[str, float]]  # the same per optimizer step, in order: the first is on-policy
    grad_norms: list[float]  # pre-clip gradient norm of each optimizer step

    @property
    def grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms)

    @property
    def num_optimizer_steps(self) -> int:
        return len(self.grad_norms)


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last one (one item of look-ahead)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for upcoming in iterator:
        yield current, False
        current = upcoming
    yield current, True


class RewardTrainer(ABC):
    """Base trainer. `component` ("dit" or "ar") names the half of GLM-Image that trains."""

    component: str = ""

    @property
    def half(self) -> ModelHalf:
        """What the project knows about the half that trains (`models/halves.py`)."""
        return model_half(self.component)

    def __init__(
        self, cfg: Any, reward_funcs: RewardFuncs | None = None, reward_weights: list[float] | None = None
    ):
        """`cfg`: a `DiTTrainConfig` / `ARTrainConfig`. `reward_funcs` (Python API, as TRL's): functions,
        `Reward` objects or reward names that replace `reward.names`, weighted by `reward_weights` (default
        1.0 each); `rewards.combine.rewards_from_python` says how they are named in the metrics."""
        self.cfg = cfg
        info = dist.rank_info()
        setup_logging(info.rank == 0)
        # Everything that can be wrong with the inputs fails here, before any model is loaded.
        self.prompts = load_prompts(cfg.data.resolved_prompt_file())
        if reward_funcs is None:
            self.rewards = RewardSet(cfg.reward.weight_map(), cfg.reward.options, cfg.reward.combine)
        else:
            self.rewards, reward_cfg = rewards_from_python(cfg.reward, reward_funcs, reward_weights)
            self.cfg = cfg = dataclasses.replace(cfg, reward=reward_cfg)  # config.yaml records them
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
        self.samples_per_rank = cfg.data.per_rank_samples(info.world_size)

        self.is_distributed, self.distributed_reason = dist.detect_distributed(strategy=cfg.trainer.strategy)
        self.accelerator = dist.make_accelerator(
            mixed_precision=cfg.trainer.mixed_precision,
            # Loading (rank 0 may download while the others wait) has its own bound; `train()` then
            # tightens every collective to trainer.dist_timeout_s.
            timeout_s=max(cfg.trainer.dist_timeout_s, cfg.model.stage_timeout_s),
            seed_everything=cfg.trainer.seed,
        )
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        self.parallel = make_parallelism(cfg.trainer, self.accelerator, self.component)
        self.is_main = self.accelerator.is_main_process
        log_environment(cfg, self.accelerator.device)  # bf16 on a CPU without it; packages off the lock
        self.output_dir = self._resolve_output_dir()
        self.metrics = MetricsWriter(self.output_dir, self.is_main)
        if self.is_main:
            (self.output_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")

        self.memory_plan = log_memory_plan(cfg, self.accelerator)  # on GPUs: stops here if it cannot fit
        self.wrapper = self._build_model()
        self.trainable = self._setup_trainable(self.wrapper.trainable)
        # In place, after LoRA and gradient checkpointing are set up and before the optimizer is built over
        # the shards (FSDP); nothing under DDP. A component built empty is read into its shards here.
        weights = self.wrapper.trained_folder
        run_stage(
            "shard the trained component" + (f" and read its shards from {weights}" if weights else ""),
            lambda: self.parallel.shard(self.trainable, self.reference, weights),
            self.cfg.model.stage_timeout_s,
        )
        logger.info(
            "[load] %s", describe_module(f"{self.wrapper.trainable_name} (trainable)", self.trainable)
        )
        self.wrapper.trainable = self.trainable
        self.ema = self._build_ema()
        self.optimizer, self.lr_scheduler = self._build_optimizer()  # over the shards, when sharded
        # `trainable` is the module (rollouts, evaluation, the KL reference call it); `model` is what the
        # strategy wrapped (the training forward passes call it): DDP's wrapper, or the sharded module itself.
        self.model, self.optimizer = self.parallel.wrap(self.trainable, self.optimizer)
        self.start_step = self._maybe_resume()
        self._pending_checkpoint = None  # a checkpoint being written in the background (trainer.async_save)
        self._background_group = None
        self.wrapper.pipeline.set_progress_bar_config(disable=True)
        self.tracker = build_tracker(
            is_main=self.is_main,
            output_dir=self.output_dir,
            run_name=cfg.run_name,
            config=OmegaConf.to_container(OmegaConf.structured(cfg)),
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            wandb_entity=cfg.logging.wandb_entity,
            wandb_mode=cfg.logging.wandb_mode,
            start_step=self.start_step,
        )

    # ---------------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> Path:
        """Run steps `start_step .. num_steps`; stop early, with a checkpoint, on SIGTERM / SIGUSR1.

        Once per step every rank reaches two agreement points (one all-reduce each): after the rollout,
        whether any rank's reward failed (skip the update, or stop; `reward.on_failure`), and after the
        update, whether any rank was asked to stop. A collective that fails because another rank died or
        stalled is re-raised as `distributed.CollectiveFailure`, naming this rank, the step and the phase.
        """
        cfg = self.cfg.trainer
        r = self.cfg.reward
        self.rewards.policy = FailurePolicy(r.max_retries, r.retry_backoff_s, r.on_failure, r.on_nonfinite)
        if self.watched_rewards is not None:
            self.watched_rewards.policy = self.rewards.policy  # retried as the training rewards are
        dist.set_collective_timeout(cfg.dist_timeout_s)
        signals = StopSignals()
        signals.install()
        skips = SkipCounter(cfg.max_consecutive_skips)
        bar = self._progress_bar()
        failed = True
        try:
            if self.start_step == 0:
                dist.set_phase("evaluation", 0)
                self.tracker.log_scalars(0, self._maybe_evaluate(0))  # the base model's numbers
            for step in range(self.start_step, cfg.num_steps):
                if self._train_step(step, bar, skips, signals):
                    break
            self._finish_pending_checkpoint()
            failed = False
        except Exception as err:
            if not dist.is_collective_failure(err):
                raise
            message = dist.describe_failure(err, cfg.dist_timeout_s)
            logger.error(message)
            raise dist.CollectiveFailure(message) from err
        finally:
            signals.restore()
            if bar is not None:
                bar.close()
            self.tracker.close(failed=failed)
            self.rewards.close()
            if self.watched_rewards is not None:
                self.watched_rewards.close()
        dist.set_phase("shutdown")
        dist.barrier()
        return self.output_dir

    def _train_step(self, step: int, bar, skips: SkipCounter, signals: StopSignals) -> bool:
        """One step: collect, update (unless a reward failed), log, checkpoint. True = stop here."""
        cfg = self.cfg.trainer
        start = time.perf_counter()
        dist.set_phase("rollout", step + 1)
        # A reward's error is held (NaN scores) until every rank has collected: then all act on it together.
        with self.rewards.collecting():
            batch = self._collect(step)
        dist.set_phase("reward gather", step + 1)
        seen = torch.tensor([float(bool(self.rewards.failures)), float(bool(self.rewards.errors))])
        reward_failed, reward_error = (bool(x) for x in dist.all_reduce(seen, op="max"))
        if reward_error:
            if self.rewards.errors:
                raise self.rewards.errors[0]
            raise RewardFailed(
                f"step {step + 1}: a reward failed on another rank (its log says how); stopping"
            )
        if reward_failed and self.cfg.reward.on_failure == "error":
            raise RewardFailed(self._failure_message(step))
        self.num_skipped_nonfinite = 0
        dist.set_phase("update", step + 1)
        if reward_failed:
            logger.warning("%s; no update (reward.on_failure=skip)", self._failure_message(step))
            update_stats: dict[str, float] = {}
        else:
            update_stats = self._update(batch, step)
        nonfinite = self.num_skipped_nonfinite > 0 or not math.isfinite(update_stats.get("loss", 0.0))
        skips.record(reward_failed or nonfinite, "reward failure" if reward_failed else "non-finite loss")
        record = {"step": step + 1, **batch.stats, **update_stats}
        record["skipped_nonfinite"] = self.num_skipped_nonfinite
        record["skipped_reward_failure"] = int(reward_failed)
        record["lr"] = self.lr_scheduler.get_last_lr()[0]
        record["step_time_s"] = time.perf_counter() - start
        dist.set_phase("evaluation", step + 1)
        record.update(self._maybe_evaluate(step + 1))
        self.metrics.write(record)
        self._log(bar, record, batch)
        skips.check(step + 1)
        dist.set_phase("checkpoint", step + 1)
        stop = signals.agreed()  # every rank, every step: all stop at the same step
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.num_steps or stop:
            if skips.in_a_row:
                # Weights are unchanged by skipped steps, but the newest checkpoint must predate the streak.
                logger.warning(
                    "step %d: no checkpoint during %d skipped step(s) in a row", step + 1, skips.in_a_row
                )
            else:
                # The run's last checkpoint is written at once; others may write in the background.
                self._save(step + 1, at_once=step + 1 == cfg.num_steps or stop)
        if stop:
            logger.warning(
                "stopped at step %d on a stop signal (%s); continue with trainer.resume=latest",
                step + 1,
                "received here" if signals.requested else "received by another rank",
            )
        return stop

    def _failure_message(self, step: int) -> str:
        here = "; ".join(self.rewards.failures) or "a reward failed on another rank"
        return f"step {step + 1}: {here}"

    def _collect(self, step: int) -> Batch:
        """Rollout, rewards and advantages for this rank's samples of `step`."""
        group_prompts, group_ids = self._step_samples(step)
        sample_prompts = [group_prompts[g] for g in group_ids]
        scoring = self.rewards.queue(overlap=self.cfg.reward.overlap)
        rollout, images = self._rollout(group_prompts, group_ids, step, scoring)
        parts = scoring.result()
        dist.set_phase("reward gather")
        rewards, advantages, stats = self._advantages(parts)
        preview = (images, [p.text for p in sample_prompts], rewards.tolist())
        return Batch(sample_prompts, images, rewards, parts, advantages, rollout, stats, preview)

    @abstractmethod
    def _rollout(
        self, group_prompts: list[Prompt], group_ids: list[int], step: int, scoring: ScoringQueue
    ) -> tuple[Any, list]:
        """Sample this rank's samples: sample i belongs to group `group_ids[i]` (prompt `group_prompts[g]`).

        Hands each decoded chunk of images, in sample order, to `scoring.submit` (so rewards can be computed
        while the next chunk samples). Returns (rollout data for `_update`, one image per sample).
        """

    @abstractmethod
    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        """Policy-gradient update(s) on the batch (through `run_update`); return the step's statistics."""

    last_update: UpdateStats | None = None  # the latest `run_update`'s statistics, per optimizer step too

    def run_update(
        self,
        num_micro_batches: int,
        micro_steps: Callable[[list[int]], Iterable[MicroStep]],
        stat_keys: tuple[str, ...] = LOSS_STATS,
    ) -> UpdateStats:
        """The update loop every trainer shares.

        `algo.num_inner_epochs` passes over the rollout's micro-batches, each split into
        `algo.num_mini_batches` interleaved mini-batches (`split_mini_batches`) of one optimizer step each.
        `micro_steps(mini)` yields, for the micro-batch indices of one mini-batch, the backward passes of its
        optimizer step in order, each normalised by the trainer so that their gradients sum to the gradient of
        the mini-batch's loss. Every backward but the last runs under `no_sync` (DDP all-reduces once per
        optimizer step); then `optimizer_step` clips, steps and zeroes.
        """
        a = self.cfg.algo
        stats, mini_batches, grad_norms = StatMeans(stat_keys), [], []
        for _ in range(a.num_inner_epochs):
            for mini in split_mini_batches(num_micro_batches, a.num_mini_batches):
                mini_stats = StatMeans(stat_keys)
                for backward, last in with_last(micro_steps(mini)):
                    with self.parallel.no_sync(self.model, last):
                        values = backward()
                    stats.add(values)
                    mini_stats.add(values)
                grad_norms.append(self.optimizer_step())
                mini_batches.append(mini_stats.means())
        self.last_update = UpdateStats(stats.means(), mini_batches, grad_norms)
        return self.last_update

    # ---------------------------------------------------------------------------------------------------
    # Shared steps

    def _step_samples(self, step: int, round_index: int = 0) -> tuple[list[Prompt], list[int]]:
        """The step's group prompts (identical on every rank) and the group id of each of this rank's samples.

        The step's `num_groups_per_step x num_generations` samples are laid out group-major and each rank
        takes an equal contiguous slice, so a group may straddle ranks; its statistics are gathered in
        `_advantages`.
        """
        seed = self.cfg.trainer.seed * 1000 + round_index
        group_prompts = prompts_for_step(self.prompts, self.cfg.data.num_groups_per_step, seed, step)
        k = self.cfg.data.num_generations
        start, end = dist.shard_bounds(len(group_prompts) * k, self.rank, self.world_size)
        return group_prompts, [i // k for i in range(start, end)]

    def sample_seed(self, step: int, round_index: int = 0) -> int:
        """Seed of this rank's sampling noise at `step`: a function of (seed, step, round, rank) only."""
        return ((self.cfg.trainer.seed * 1_000_003 + step) * 101 + round_index) * 1009 + self.rank

    @staticmethod
    def submit_chunk(scoring: ScoringQueue, images: list, prompts: list[Prompt]) -> None:
        scoring.submit(images, [p.text for p in prompts], [p.metadata for p in prompts])

    def _advantages(
        self, parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This rank's raw scores -> (its total rewards [N], its advantages [N], global reward statistics).

        Every rank gathers every rank's raw scores (a group may straddle ranks), combines them into totals and
        computes the same global advantages, then keeps its slice.
        """
        all_parts = {name: dist.all_gather_cat(values.float()) for name, values in parts.items()}
        all_rewards = self.rewards.combine(all_parts, self.cfg.data.num_generations)  # [W * N]
        advantages, stats = self.global_advantages(all_rewards, all_parts)
        start, end = dist.shard_bounds(all_rewards.numel(), self.rank, self.world_size)
        return all_rewards[start:end], advantages[start:end], stats

    def global_advantages(
        self, all_rewards: torch.Tensor, all_parts: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """[G * K] total rewards of every rank, group-major -> ([G * K] advantages, reward statistics)."""
        rewards_gk = all_rewards.view(-1, self.cfg.data.num_generations)
        adv_fn = ADVANTAGE_FNS[self.cfg.algo.scale_rewards]
        # Groups with a NaN/inf reward (reward.on_nonfinite=drop, or a failed reward) get zero advantage and
        # stay out of every statistic, so nothing non-finite reaches the loss.
        bad_g = nonfinite_groups(rewards_gk)
        good_gk = rewards_gk[~bad_g]
        advantages_gk = torch.zeros_like(rewards_gk)
        if len(good_gk):
            advantages_gk[~bad_g] = clip_advantages(adv_fn(good_gk), self.cfg.algo.adv_clip_max)
        advantages = advantages_gk.reshape(-1)
        good = good_gk.reshape(-1)
        stats = {
            "reward_mean": good.mean().item() if len(good) else math.nan,
            "reward_std": good.std(unbiased=False).item() if len(good) else math.nan,
            "frac_zero_std_groups": self.flat_groups(good_gk).float().mean().item() if len(good) else 1.0,
        }
        if bad_g.any():
            stats["dropped_nonfinite_groups"] = int(bad_g.sum())
            logger.warning("%d group(s) with non-finite rewards get zero advantage", int(bad_g.sum()))
        keep = (~bad_g).repeat_interleave(self.cfg.data.num_generations)
        stats.update({f"reward/{name}": values[keep].mean().item() for name, values in all_parts.items()})
        return advantages, stats

    def flat_groups(self, rewards_gk: torch.Tensor) -> torch.Tensor:
        """[G] bool: groups without reward spread (counted in `frac_zero_std_groups`); default: exact ties."""
        return zero_std_groups(rewards_gk)

    def policy_precision(self):
        """The numeric precision of every pass of the policy: sampling, old log-probs, update, reference.

        All of them run inside this one context (accelerate's autocast for `trainer.mixed_precision`), so
        they compute in the same precision by construction: an unprepared module (the frozen reference copy
        of full fine-tuning, the policy called outside `self.model`) would otherwise run in its parameters'
        dtype while the prepared policy runs under autocast, and the first ratio / KL would not be exact.
        """
        return self.accelerator.autocast()

    def _build_model(self) -> GLMImageWrapper:
        """Load GLM-Image and place it on this process's device(s), following the plan (never by luck)."""
        m = self.cfg.model
        skip, skip_reason = self._components_not_loaded()
        # model.ar_weights / model.dit_weights (chaining the stages) are checked before anything loads.
        sources = frozen_weight_sources(m, self.component, skip)
        # Rank 0 first: it builds the tiny model (transformers writes weights only on rank 0) or fetches
        # the checkpoint; the other ranks then find it complete. Bounded by the stage timeout.
        # An error must not skip the block's barrier (the other ranks would wait there until the process-group
        # timeout): it is raised after the block, where every rank is released.
        path, error = None, None
        with self.accelerator.main_process_first():
            try:
                path = run_stage(
                    f"resolve model '{m.name}'",
                    lambda: resolve_model_path(m.name, m.tiny_seed, m.shape_layers()),
                    m.stage_timeout_s,
                )
                if self.parallel.loads_into_shards:
                    # The trained component's files are read shard by shard, not by from_pretrained (which
                    # would not fetch a component it is told to leave out): a hub id's whole snapshot, fetched
                    # once, on rank 0; every rank then loads from the local folder.
                    path = str(
                        run_stage(
                            f"fetch '{path}' into the local cache",
                            lambda: local_pipeline_folder(path),
                            m.stage_timeout_s,
                        )
                    )
            except Exception as err:  # noqa: BLE001  (re-raised below, outside the barrier)
                error = err
        if error is not None:
            raise error
        wrapper, self.placement = load_for_training(
            m,
            self.component,
            distributed=self.is_distributed,
            reason=self.distributed_reason,
            device=dist.choose_device(self.accelerator.local_process_index),
            model_path=path,
            skip_components=skip,
            skip_reason=skip_reason,
            trained_on_meta=self.parallel.loads_into_shards,
        )
        for source in sources:
            apply_weights_source(wrapper.pipeline, source)
        if wrapper.trained_folder is not None:  # on the meta device until it is sharded
            self.device = self.parallel.device
        else:
            self.device = next(wrapper.trainable.parameters()).device
        return wrapper

    def _components_not_loaded(self) -> tuple[tuple[str, ...], str]:
        """Frozen pipeline components this run never uses, so never loads, and why (for the load log)."""
        if self.cfg.data.prior_cache:
            raise ConfigError(
                "data.prior_cache",
                f"is for train_dit.py; the {self.component} trainer samples its own tokens.",
            )
        return (), ""

    def _eval_prior_tokens(self):
        """None (the AR model samples the held-out prompts' tokens), or a function texts -> [B, L] tokens."""
        return None

    def _setup_trainable(self, module: nn.Module) -> nn.Module:
        """LoRA adapters (peft, injected in place so the pipeline keeps its classes) or full fine-tuning."""
        lora = self.cfg.model.lora
        self.reference: nn.Module | None = None
        if lora.enabled:
            # On an empty component (loaded into shards later) peft's adapters need real base weights.
            with standin_weights(module):
                add_lora_adapters(module, lora)
        else:
            for sub in self.half.trained_parts(module):
                sub.requires_grad_(True)
            if self.cfg.algo.beta > 0:
                # Full fine-tuning: the KL reference is a frozen copy of the base weights.
                self.reference = copy.deepcopy(module).requires_grad_(False).eval()
        # Parameters outside the submodules the forward pass uses (e.g. LoRA adapters a target name put into
        # the AR model's vision tower) stay frozen: they would get no gradient, which DDP refuses.
        used = {id(p) for sub in self.half.trained_parts(module) for p in sub.parameters()}
        for p in module.parameters():
            if id(p) not in used:
                p.requires_grad_(False)
        # Float32 masters of a bf16 / fp16 full fine-tune (`models/master_weights.py`); after the reference
        # copy, which stays in the model's dtype.
        self.master_names: set[str] = set()
        if self.cfg.model.keeps_master_weights():
            upcast = upcast_trained_(module)
            self.master_names = master_names(module)
            logger.info(
                "[load] %s: %s trained parameters in float32 (master weights), computed in %s "
                "(trainer.mixed_precision); the rest stays %s",
                self.half.attribute,
                f"{upcast:,}",
                self.cfg.model.dtype,
                self.cfg.model.dtype,
            )
        module.eval()  # no dropout: the recomputed log-probs must equal the rollout's
        if self.cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(module)  # works in eval mode too
        num = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if num == 0:
            raise ValueError(
                f"no trainable parameters in the {self.component} model: model.lora.target_modules="
                f"{list(lora.target_modules)} matched nothing; name modules that exist in it."
            )
        return module

    @property
    def sharded(self) -> bool:
        """Whether the trained component is sharded over the ranks (FSDP on 2 or more ranks)."""
        return self.parallel.sharded

    @contextlib.contextmanager
    def reference_model(self):
        """The KL reference: the same module with LoRA adapters disabled, or the frozen copy."""
        if self.reference is None:
            with adapters_disabled(self.trainable) as module:
                yield module
            return
        # Beside float32 masters it computes with their values, as the policy does (FSDP casts both).
        like_masters = self.master_names and not self.parallel.sharded
        with (
            computing_like_masters(self.reference, self.master_names)
            if like_masters
            else contextlib.nullcontext()
        ):
            yield self.reference

    def _build_ema(self):
        if not getattr(self.cfg.algo, "ema", False):
            return None
        from diffusers.training_utils import EMAModel

        params = [p for p in self.trainable.parameters() if p.requires_grad]
        return EMAModel(params, decay=self.cfg.algo.ema_decay)

    def _build_optimizer(self):
        o = self.cfg.optim
        params = [p for p in self.trainable.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        warmup = o.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0
        )
        return optimizer, scheduler

    num_skipped_nonfinite = 0  # optimizer steps skipped in the current training step

    def optimizer_step(self) -> float:
        """Clip, step, schedule, zero; returns the pre-clip gradient norm.

        A non-finite norm (a NaN/inf loss or an overflow) makes no update: no optimizer, LR schedule or EMA
        step (see `guards.py`). Under DDP the norm comes from all-reduced gradients: every rank agrees.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(self.parallel.clip_grad_norm_(params, self.cfg.optim.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.num_skipped_nonfinite += 1
            if self.accelerator.scaler is not None:
                self.optimizer.step()  # fp16: the grad scaler skips the update itself and lowers its scale
            self.optimizer.zero_grad(set_to_none=True)
            logger.warning("gradient norm is %s: optimizer step skipped (no update)", grad_norm)
            return grad_norm
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step([p for p in self.trainable.parameters() if p.requires_grad])
        return grad_norm

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        totals = dist.all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
        return {k: (totals[i] / self.world_size).item() for i, k in enumerate(keys)}

    # ---------------------------------------------------------------------------------------------------
    # Outputs

    def _resolve_output_dir(self) -> Path:
        name = self.cfg.trainer.output_dir
        if not name:
            # Chosen once by rank 0 so every rank writes to the same folder.
            name = dist.broadcast_object(f"outputs/{self.cfg.run_name}-{datetime.now():%Y%m%d-%H%M%S}")
        path = Path(name).expanduser()
        if self.cfg.trainer.resume is None and list_checkpoints(path):
            raise FileExistsError(
                f"'{path}' already holds checkpoints of another run; continue it with trainer.resume=latest, "
                "or choose a new trainer.output_dir (checkpoints are never overwritten)."
            )
        if self.is_main:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        logger.info("outputs go to %s", path)
        return path

    def _save(self, step: int, at_once: bool = True) -> None:
        """Write the checkpoint of `step` (every rank). With `trainer.async_save`, unless `at_once`, its
        sharded weights and optimizer state are written in the background and it becomes final at the next
        `_save` (or the run's end); the one before is made final first, so at most one is in flight."""
        self._finish_pending_checkpoint()
        background = None
        if self.cfg.trainer.async_save and not at_once:
            if self._background_group is None:
                # Collective: every rank, at the same step.
                self._background_group = dist.background_group(self.cfg.trainer.dist_timeout_s)
            background = self._background_group
            logger.info("checkpoint of step %d: writing in the background", step)
        self._pending_checkpoint = save_checkpoint(
            self.output_dir,
            step,
            module=self.trainable,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            ema_state=self.parallel.ema_state(self.ema) if self.ema is not None else None,
            config_yaml=config_to_yaml(self.cfg),
            component=self.component,
            rank=self.rank,
            is_main=self.is_main,
            barrier=dist.barrier,
            parallel=self.parallel,
            extra_files=self.checkpoint_extras(),
            background_group=background,
        )
        if self._pending_checkpoint.done:
            self._after_checkpoint()

    def _finish_pending_checkpoint(self) -> None:
        """Collective: wait for the checkpoint being written in the background, if any, and make it final."""
        pending = self._pending_checkpoint
        if pending is not None and not pending.done:
            pending.finish()
            self._after_checkpoint()

    def _after_checkpoint(self) -> None:
        if self.is_main:
            prune_checkpoints(self.output_dir, self.cfg.trainer.keep_last)
        dist.barrier()

    def checkpoint_extras(self) -> dict[str, Any]:
        """A subclass's own state for bit-exact resume: {file name in the checkpoint: object to save}."""
        return {}

    def _maybe_resume(self) -> int:
        resume = self.cfg.trainer.resume
        if not resume:
            return 0
        # Rank 0 checks the hashes (every file read once, not once per rank) and tells the others which
        # checkpoint to load, or the error, so that no rank waits in a collective for one that failed.
        choice: tuple[str, str] = ("", "")
        if self.is_main:
            try:
                choice = (str(self._resume_point(resume)), "")
            except CheckpointError as err:
                choice = ("", str(err))
        path_str, error = dist.broadcast_object(choice)
        if error:
            raise CheckpointError(error)
        path = Path(path_str)
        step, ema_state = load_checkpoint(
            path,
            module=self.trainable,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            rank=self.rank,
            parallel=self.parallel,
        )
        if self.ema is not None and ema_state is not None:
            self.parallel.load_ema_state(self.ema, ema_state)
        self.load_checkpoint_extras(path)
        self.metrics.truncate_after(step)
        logger.info("resumed from %s at step %d", path, step)
        return step

    def _resume_point(self, resume: str) -> Path:
        """Rank 0: the checkpoint to resume from. The damaged ones `latest` passed over are set aside (so the
        run writes their steps again); later intact ones in this run's folder, which the run would have to
        overwrite, are refused before the first step."""
        path, damaged = find_resume(resume, self.output_dir)
        for checkpoint in damaged:
            set_aside(checkpoint)
        later = later_checkpoints(self.output_dir, read_checkpoint_state(path)["step"])
        if later:
            raise CheckpointError(
                f"trainer.resume='{resume}' is {path.name}, but '{self.output_dir}' already holds the later "
                f"checkpoints {[p.name for p in later]}, which this run would write again (checkpoints are "
                "never overwritten); resume with trainer.resume=latest, or write this run to a new "
                "trainer.output_dir."
            )
        return path

    def load_checkpoint_extras(self, path: Path) -> None:
        """Restore what `checkpoint_extras` saved, from the checkpoint folder every rank resumes from."""
        return None  # an optional hook: the base trainer saves no extras

    def _progress_bar(self):
        if not (self.is_main and self.cfg.trainer.progress_bar):
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.cfg.trainer.num_steps,
            initial=self.start_step,
            desc=f"{self.component} GRPO",
            unit="step",
        )

    def _log(self, bar, record: dict[str, Any], batch: Batch) -> None:
        """Progress bar (or a log line), tracker scalars, and every `images_every_n_steps` a sample grid."""
        step = record["step"]
        if bar is not None:
            bar.set_postfix(
                reward=f"{record['reward_mean']:.4g}",
                loss=f"{record.get('loss', math.nan):.3g}",
                step_s=f"{record['step_time_s']:.2f}",
            )
            bar.update(1)
        elif self.is_main:
            logger.info(
                "step %d/%d reward %.4g (%.2f s/step)",
                step,
                self.cfg.trainer.num_steps,
                record["reward_mean"],
                record["step_time_s"],
            )
        self.tracker.log_scalars(step, record)
        every = self.cfg.logging.images_every_n_steps
        if self.is_main and every and batch.preview and (step % every == 0 or step == 1):
            images, texts, rewards = (x[: self.cfg.logging.num_images] for x in batch.preview)
            self.tracker.log_images(
                step, "train/samples", list(images), [caption(t, r) for t, r in zip(texts, rewards)]
            )

    # ---------------------------------------------------------------------------------------------------
    # Evaluation

    def _maybe_evaluate(self, step: int) -> dict[str, float]:
        """Evaluate on the held-out prompts at step 0, every `eval.every_n_steps` and at the end."""
        every = self.cfg.eval.every_n_steps
        if not every or not (step % every == 0 or step == self.cfg.trainer.num_steps):
            return {}
        # The pipeline's AR stage reseeds the global RNG; training's random streams must not notice.
        with (
            self._eval_weights(),
            self.parallel.sampling(self.trainable),
            # Float32 masters in a bf16 pipeline compute under the policy's autocast, as in training.
            self.policy_precision()
            if self.master_names
            else self.parallel.evaluation_precision(self.policy_precision),
            torch.random.fork_rng(devices=self._rng_devices()),
        ):
            result, images = evaluate_prompts(
                self.wrapper.pipeline,
                self.eval_prompts,
                self.rewards,
                eval_sampling(self.cfg),
                device=self.device,
                rank=self.rank,
                world_size=self.world_size,
                num_grid_images=self.cfg.eval.num_grid_images,
                prior_tokens=self._eval_prior_tokens(),
                equal_calls=self.parallel.equal_calls,
                watched=self.watched_rewards,
                recogniser=self.text_recogniser,
            )
        scalars = eval_scalars(result)
        if self.is_main:
            grid_images, captions = grid_samples(result, images, self.cfg.eval.num_grid_images)
            write_evaluation(self.output_dir / "eval", step, result, grid_images, captions)
            self.tracker.log_images(step, "eval/samples", grid_images, captions)
            logger.info("eval at step %d: reward %.4g", step, scalars["eval/reward_mean"])
        return scalars

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    @contextlib.contextmanager
    def _eval_weights(self):
        """Evaluate the EMA weights when EMA is on (as Flow-GRPO does), the live weights otherwise."""
        if self.ema is None:
            yield
            return
        params = [p for p in self.trainable.parameters() if p.requires_grad]
        # diffusers' store() keeps a CPU copy; a sharded parameter (DTensor) stays where its shard is, so it
        # is copied in place, on its device (1/world of the weights).
        sharded = self.parallel.sharded
        stored = [p.detach().clone() for p in params] if sharded else self.ema.store(params)
        self.ema.copy_to(params)
        try:
            yield
        finally:
            if sharded:
                with torch.no_grad():
                    for param, value in zip(params, stored):
                        param.copy_(value)
            else:
                self.ema.restore(params)
