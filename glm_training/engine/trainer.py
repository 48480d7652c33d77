"""`RewardTrainer`: the loop of every GLM-Image reward run, composed of parts, each made by one builder.

    __init__:  _build_inputs (prompts, rewards: checked before loading) -> _build_priors -> _build_model
               (the trained half, placed, sharded, wrapped) -> _build_algorithm (`algo.name` in the algorithm
               table) -> _build_monitor -> _build_checkpoints (resume) -> _build_evaluation
    train():   per step: collect (rollout -> rewards -> advantages) -> update -> log -> evaluate -> checkpoint

`DiTTrainer` and `ARTrainer` train one half; `joint.trainer.JointTrainer` both, over the same loop, by
overriding builders. A run's parts are kept by the prefix of their statistics: "" in a run of one half,
"ar_" and "dit_" in a joint run (`inputs`, `policies`).

The algorithm is any object with `collect(step) -> Batch`, `update(batch, step) -> stats`, `state()` and
`load_state(folder)` (`algorithms/base.py`); the engine never asks which algorithm runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from glm_training.config import ConfigError, config_to_yaml
from glm_training.config.algorithms import algorithm_of
from glm_training.distributed import collectives as dist
from glm_training.distributed.strategies import check_ranks, make_parallelism
from glm_training.engine.checkpointing import Checkpointer, resolve_output_dir
from glm_training.engine.collect import Batch, Collector
from glm_training.engine.inputs import RunInputs, open_priors
from glm_training.engine.monitor import ImageMonitor
from glm_training.engine.parts import Parts
from glm_training.engine.policy import Policy
from glm_training.engine.reporting import Evaluation, Progress
from glm_training.engine.update import UpdateLoop
from glm_training.environment import log_environment
from glm_training.evaluation import FrozenPriors, eval_sampling
from glm_training.guards import NonFiniteWeights, SkipCounter
from glm_training.logs import setup_logging
from glm_training.metrics import MetricsWriter
from glm_training.plan import log_memory_plan
from glm_training.preemption import StopSignals
from glm_training.priors.read import PriorCache
from glm_training.priors.source import PriorSource
from glm_training.rewards.retry import RewardFailed
from glm_training.tracking import build_tracker

logger = logging.getLogger("glm_training")


class RewardTrainer:
    """A reward run of `cfg` (a `DiTTrainConfig`, `ARTrainConfig`, ... from `load_config`).

    `reward_funcs` / `reward_weights`: rewards from Python (`engine/inputs.py`). `pipeline`: an already-built
    GlmImagePipeline to train instead of loading `model.name`. `priors`: where the DiT's prior tokens come
    from instead of its AR model or `data.prior_cache` (`Parts.priors`). `algorithm`: the algorithm class,
    instead of the table's entry for `algo.name`. `seed_stream`: the stream of sampling seeds it draws from
    (`Collector.sample_seed`); 0 by default, `joint.trainer.SEED_STREAMS["dit"]` to sample as a joint run's
    DiT does.

    The constructor calls the builders in order; a subclass changes a part by overriding its builder (each
    returns the part and reads only the parts built before it).
    """

    component: str = ""  # the half a subclass trains ("dit", "ar", "joint"); "" = the one its config names
    reward_keys: tuple[str, ...] = ("reward_mean",)  # the step statistics the progress bar shows

    def __init__(
        self,
        cfg: Any,
        reward_funcs: Any = None,
        reward_weights: Any = None,
        *,
        pipeline: Any = None,
        priors: PriorSource | None = None,
        algorithm: type | None = None,
        seed_stream: int = 0,
    ):
        self._check_component(cfg)
        setup_logging(dist.rank_info().rank == 0)
        self.inputs = self._build_inputs(cfg, reward_funcs, reward_weights)
        self.cfg = self._run_config(cfg)
        for inputs in self.inputs.values():  # refused before anything is written
            check_ranks(inputs.cfg, dist.rank_info().world_size)
        self._start_engine()
        with self._outputs_until_accepted():  # config.yaml once the run is built and its resume checked
            self.memory_plan = self._plan_memory()  # on GPUs: stops here if it cannot fit
            self.priors = self._build_priors(priors)
            self.policies = self._build_model(pipeline)
            self.algorithm = self._build_algorithm(algorithm, seed_stream)
            self.monitor = self._build_monitor()
            self.checkpoints = self._build_checkpoints()
            self.start_step = self._resume()
        self.tracker = self._build_tracker()
        self.evaluation = self._build_evaluation()

    # -------------------------------------------------------------------------------------------------
    # The builders, in the constructor's order

    def _build_inputs(self, cfg: Any, reward_funcs: Any, reward_weights: Any) -> dict[str, RunInputs]:
        """Each trained half's prompts and rewards, read and checked before any model loads."""
        return {"": RunInputs(cfg, reward_funcs, reward_weights)}

    def _run_config(self, cfg: Any) -> Any:
        """The config the run records (config.yaml): `cfg` with the rewards given from Python."""
        return self.inputs[""].cfg

    def _build_priors(self, priors: PriorSource | None) -> PriorSource | None:
        """Where the DiT's prior tokens come from besides its AR model: `priors`, else `data.prior_cache`."""
        if priors is not None:
            return priors
        return open_priors(self.cfg, self.cfg.component, self.inputs[""])

    def _build_model(self, pipeline: Any) -> dict[str, Policy]:
        """Each trained half of GLM-Image, loaded, placed, sharded and wrapped (`Policy`), by prefix; a second
        half trains the pipeline the first loaded. The one place placement is decided (`models/placement.py`):
          - under DDP/FSDP every rank loads on "cpu" and moves explicitly to its own device;
          - one process with several GPUs may spread the model with a balanced device map;
          - nothing calls `.to()` on meta tensors."""
        policies = {}
        for prefix, inputs in self.inputs.items():
            cfg, component = inputs.cfg, inputs.cfg.component
            parallel = make_parallelism(cfg.trainer, self.accelerator, component)
            policy = Policy(
                cfg, component, self.accelerator, parallel, self.placement_context, self._unused(), pipeline
            )
            policy.wrapper.pipeline.set_progress_bar_config(disable=True)
            pipeline = policy.wrapper  # the next half shares the pipeline this one loaded
            policies[prefix] = policy
        return policies

    def _build_algorithm(self, algorithm: type | None, seed_stream: int) -> Any:
        """The algorithm `algo.name` names (or `algorithm`), built over the engine's parts."""
        algorithm_cls = algorithm or algorithm_of(self.cfg).algorithm_class()
        return algorithm_cls(self.cfg, self._parts("", seed_stream, self.priors))

    def _build_monitor(self) -> ImageMonitor:
        """The image statistics of every step and evaluation, and the reward-hacking alarm."""
        return ImageMonitor(self.cfg)

    def _build_checkpoints(self) -> Checkpointer:
        """Saving and resuming the policy and the state of the algorithm and the monitor."""
        parts = [self.algorithm, self.monitor]
        return Checkpointer(self.cfg, self.output_dir, self.policy, parts, self.rank, self.is_main)

    def _build_tracker(self) -> Any:
        """TensorBoard / W&B, from the step the run starts at."""
        cfg = self.cfg
        return build_tracker(
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

    def _build_evaluation(self) -> Evaluation:
        """The held-out evaluation of the trained half."""
        return Evaluation(
            self.cfg, self.inputs[""], self.policy, self.tracker, self.output_dir, self._held_out_priors()
        )

    # -------------------------------------------------------------------------------------------------
    # What the builders share

    def _check_component(self, cfg: Any) -> None:
        """Refuses a config of another half than this trainer's (a bare `RewardTrainer` takes either half)."""
        if cfg.component == self.component or (not self.component and cfg.component != "joint"):
            return
        hint = " (use JointTrainer)" if cfg.component == "joint" else ""
        if self.component == "joint":
            hint = (
                " (give it a joint config, e.g. load_config(config='joint_training'), or use DiTTrainer / "
                "ARTrainer)"
            )
        what = _trained(self.component) if self.component else "one half"
        raise ConfigError(
            "component",
            f"{type(self).__name__} trains {what}; this config trains {_trained(cfg.component)}{hint}.",
        )

    def _start_engine(self) -> None:
        """The distributed engine (accelerate) and this process's rank."""
        cfg = self.cfg
        self.placement_context = dist.detect_distributed(strategy=cfg.trainer.strategy)
        self.accelerator = dist.make_accelerator(
            mixed_precision=cfg.trainer.mixed_precision,
            # Loading (rank 0 may download while the others wait) has its own bound; `train()` then
            # tightens every collective to trainer.dist_timeout_s.
            timeout_s=max(cfg.trainer.dist_timeout_s, cfg.model.stage_timeout_s),
            seed_everything=cfg.trainer.seed,
        )
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        log_environment(cfg, self.accelerator.device)  # bf16 on a CPU without it; packages off the lock

    @contextlib.contextmanager
    def _outputs_until_accepted(self) -> Iterator[None]:
        """The run's folder (each half's checkpoints in its sub-folder: none for a run of one half) and its
        metrics.jsonl while the run is built; then config.yaml. A run refused while it is built leaves the
        folder as it was: config.yaml untouched, a folder it made removed (still empty)."""
        folders = tuple(prefix.rstrip("_") for prefix in self.inputs)  # "ar_" -> "ar"; "" -> the run's own
        self.output_dir, made = resolve_output_dir(self.cfg, self.is_main, folders)
        self.metrics = MetricsWriter(self.output_dir, self.is_main)
        try:
            yield
        except BaseException:
            if made:
                with contextlib.suppress(OSError):  # not empty: something else wrote there; kept
                    self.output_dir.rmdir()
            raise
        if self.is_main:
            (self.output_dir / "config.yaml").write_text(config_to_yaml(self.cfg), encoding="utf-8")

    def _plan_memory(self) -> Any:
        """The per-rank memory plan of the trained halves, logged; on GPUs it refuses what cannot fit."""
        halves = [inputs.cfg for inputs in self.inputs.values()]
        return log_memory_plan(halves[0], self.accelerator, *halves[1:])

    def _unused(self) -> tuple[tuple[str, ...], str]:
        """The frozen components a run never loads, and why: the AR model when a prior cache gives the DiT its
        tokens."""
        if not isinstance(self.priors, PriorCache):
            return (), ""
        return ("vision_language_encoder",), f"prior tokens from data.prior_cache={self.cfg.data.prior_cache}"

    def _parts(self, prefix: str, seed_stream: int, priors: PriorSource | None) -> Parts:
        """What the engine hands the algorithm of half `prefix`: its policy, update loop and collector."""
        inputs, policy = self.inputs[prefix], self.policies[prefix]
        cfg = inputs.cfg
        updates = UpdateLoop(policy, cfg.algo.num_inner_epochs, cfg.algo.num_mini_batches)
        collector = Collector(cfg, inputs.prompts, inputs.rewards, self.rank, self.world_size, seed_stream)
        return Parts(policy, updates, collector, priors)

    def _resume(self) -> int:
        """Resume from `trainer.resume` (its later metrics rows dropped); the step the run starts at."""
        start_step = self.checkpoints.resume()
        if self.cfg.trainer.resume:
            # Rows of steps the run will write again (all of them when a joint run's resume starts over).
            self.metrics.truncate_after(start_step)
        return start_step

    def _held_out_priors(self) -> PriorSource | FrozenPriors | None:
        """Where the evaluation's prior tokens come from: the run's prior source, or None (the AR model)."""
        return self.priors

    @property
    def policy(self) -> Policy:
        """The trained half's `Policy` (a joint run has two: `policies["ar_"]`, `policies["dit_"]`)."""
        return self._only(self.policies, "policies")

    @property
    def rewards(self) -> Any:
        """The training rewards (`RewardSet`) of the trained half."""
        return self._only(self.inputs, "inputs").rewards

    @property
    def updates(self) -> UpdateLoop:
        """The algorithm's update loop (`UpdateLoop.last`: the last update's mini-batches)."""
        return self.algorithm.updates

    @property
    def collector(self) -> Collector:
        """The algorithm's collector (the step's samples and seeds, scoring, advantages)."""
        return self.algorithm.collector

    def _only(self, parts: dict[str, Any], name: str) -> Any:
        if "" not in parts:
            raise AttributeError(f"{type(self).__name__} trains two halves; read its {name} by prefix")
        return parts[""]

    # -------------------------------------------------------------------------------------------------
    # The loop

    def train(self) -> Path:
        """Run steps `start_step .. num_steps`; stop early, with a checkpoint, on SIGTERM / SIGUSR1.

        Once per step every rank reaches two agreement points (one all-reduce each): after the rollout,
        whether any rank's reward failed (skip the update, or stop; `reward.on_failure`), and after the
        update, whether any rank was asked to stop. A collective that fails because another rank died or
        stalled is re-raised as `distributed.collectives.CollectiveFailure`, naming this rank, the step and
        the phase.
        """
        cfg = self.cfg.trainer
        for inputs in self.inputs.values():
            inputs.set_failure_policy()
        dist.set_collective_timeout(cfg.dist_timeout_s)
        signals = StopSignals()
        signals.install()
        skips = SkipCounter(cfg.max_consecutive_skips)
        progress = Progress(self.cfg, self.tracker, self.is_main, self.start_step, self.reward_keys)
        failed = True
        updates_before = self._optimizer_steps()
        try:
            if self.start_step == 0:
                dist.set_phase("evaluation", 0)
                self.tracker.log_scalars(0, self.evaluate(0))  # the base model's numbers
            ran = self.start_step  # the last step run
            for step in range(self.start_step, cfg.num_steps):
                ran = step + 1
                if self.train_step(step, progress, skips, signals):
                    break
            self.checkpoints.finish_pending()
            if self._optimizer_steps() == updates_before:  # a run that made no update never says done
                skips.check_trained(self.start_step, ran)
            failed = False
        except Exception as err:
            if not dist.is_collective_failure(err):
                raise
            message = dist.describe_failure(err, cfg.dist_timeout_s)
            logger.error(message)
            raise dist.CollectiveFailure(message) from err
        finally:
            signals.restore()
            progress.close()
            self.tracker.close(failed=failed)
            for inputs in self.inputs.values():
                inputs.close()
        dist.set_phase("shutdown")
        dist.barrier()
        return self.output_dir

    def train_step(self, step: int, progress: Progress, skips: SkipCounter, signals: StopSignals) -> bool:
        """One step: collect, update (unless a reward failed), log, evaluate, checkpoint. True = stop here."""
        start = time.perf_counter()
        dist.set_phase("rollout", step + 1)
        # A reward's error is held (NaN scores) until every rank has collected: then all act on it together.
        with contextlib.ExitStack() as collecting:
            for rewards in self._reward_sets():
                collecting.enter_context(rewards.collecting())
            batch = self.collect(step)
        reward_failed = self._reward_failed(step)
        for policy in self.policies.values():
            policy.num_skipped_nonfinite = 0
        dist.set_phase("update", step + 1)
        if reward_failed:
            logger.warning("%s; no update (reward.on_failure=skip)", self._failure_message(step))
            update_stats: dict[str, float] = {}
        else:
            update_stats = self.update(batch, step)
            self._check_weights(step)
        skipped = sum(policy.num_skipped_nonfinite for policy in self.policies.values())
        losses = [v for k, v in update_stats.items() if k == "loss" or k.endswith("_loss")]
        nonfinite = skipped > 0 or not all(math.isfinite(v) for v in losses)
        skips.record(reward_failed or nonfinite, "reward failure" if reward_failed else "non-finite loss")
        record = {"step": step + 1, **batch.stats, **update_stats}
        record.update(self.monitor.step_scalars(batch, batch.stats.get(self.monitor.reward_key, math.nan)))
        record["skipped_nonfinite"] = skipped
        record["skipped_reward_failure"] = int(reward_failed)
        for prefix, policy in self.policies.items():
            record[f"{prefix}lr"] = policy.lr_scheduler.get_last_lr()[0]
        record["step_time_s"] = time.perf_counter() - start
        dist.set_phase("evaluation", step + 1)
        record.update(self.evaluate(step + 1))
        self.metrics.write(record)
        progress.log(record, batch.preview)
        skips.check(step + 1)
        self.monitor.check(record)
        dist.set_phase("checkpoint", step + 1)
        stop = signals.agreed()  # every rank, every step: all stop at the same step
        self._maybe_save(step + 1, skips, stop)
        if stop:
            logger.warning(
                "stopped at step %d on a stop signal (%s); continue with trainer.resume=latest",
                step + 1,
                "received here" if signals.requested else "received by another rank",
            )
        return stop

    def collect(self, step: int) -> Batch:
        """The algorithm's rollout, rewards and advantages for this rank's samples of `step`."""
        return self.algorithm.collect(step)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """The algorithm's update on `batch`: its statistics, averaged over the ranks."""
        return self.algorithm.update(batch, step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluation scalars at `step` (empty when no evaluation is due), with the image statistics' change
        from step 0's."""
        scalars = self.evaluation.maybe_run(step, self.rank, self.world_size, self.is_main)
        return {**scalars, **self.monitor.eval_changes(scalars)}

    def save(self, step: int, at_once: bool = True) -> None:
        """The checkpoint of `step` (collective); with `trainer.async_save`, unless `at_once`, in the
        background."""
        self.checkpoints.save(step, at_once)

    def _reward_failed(self, step: int) -> bool:
        """Whether any rank's reward failed this step (one all-reduce); an error or on_failure=error stops."""
        dist.set_phase("reward gather", step + 1)
        failures = [f for rewards in self._reward_sets() for f in rewards.failures]
        errors = [e for rewards in self._reward_sets() for e in rewards.errors]
        seen = torch.tensor([float(bool(failures)), float(bool(errors))])
        reward_failed, reward_error = (bool(x) for x in dist.all_reduce(seen, op="max"))
        if reward_error:
            if errors:
                raise errors[0]
            raise RewardFailed(
                f"step {step + 1}: a reward failed on another rank (its log says how); stopping"
            )
        if reward_failed and any(inputs.stops_on_failure() for inputs in self.inputs.values()):
            raise RewardFailed(self._failure_message(step))
        return reward_failed

    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far, by every trained half (a skipped one is not counted)."""
        return sum(policy.lr_scheduler.last_epoch for policy in self.policies.values())

    def _check_weights(self, step: int) -> None:
        """Stops the run (every rank) when an update left a trained weight NaN or inf, before any evaluation,
        metrics row or checkpoint of the step can use it."""
        broken = [prefix for prefix, policy in self.policies.items() if not policy.weights_finite()]
        if not dist.any_rank(bool(broken)):
            return
        lrs = ", ".join(f"{prefix}optim.lr={p.cfg.optim.lr}" for prefix, p in self.policies.items())
        raise NonFiniteWeights(
            f"step {step + 1}: an update with a finite gradient norm left trained weights NaN or inf; the "
            f"run stops before a checkpoint holds them. The likely cause is a learning rate far too high "
            f"({lrs}): lower it, then continue from the newest checkpoint with trainer.resume=latest."
        )

    def _reward_sets(self) -> list[Any]:
        """The reward sets scored during training, every half's (the failure handling covers each)."""
        return [inputs.rewards for inputs in self.inputs.values()]

    def _failure_message(self, step: int) -> str:
        failures = [f for rewards in self._reward_sets() for f in rewards.failures]
        here = "; ".join(failures) or "a reward failed on another rank"
        return f"step {step + 1}: {here}"

    def _maybe_save(self, step: int, skips: SkipCounter, stop: bool) -> None:
        cfg = self.cfg.trainer
        if not ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.num_steps or stop):
            return
        if skips.in_a_row:
            # Weights are unchanged by skipped steps, but the newest checkpoint must predate the streak.
            logger.warning("step %d: no checkpoint during %d skipped step(s) in a row", step, skips.in_a_row)
            return
        # The run's last checkpoint is written at once; others may write in the background.
        self.save(step, at_once=step == cfg.num_steps or stop)


def _trained(component: str) -> str:
    return "both halves" if component == "joint" else f"the {component} half"


Trainer = RewardTrainer  # the name scripts written before the hierarchy use


class DiTTrainer(RewardTrainer):
    """A run that trains the DiT decoder with the DiT algorithm its config's `algo.name` names. Its AR model
    never trains, so the evaluation samples each held-out prompt's prior tokens once (`FrozenPriors`)."""

    component = "dit"

    def _held_out_priors(self) -> PriorSource | FrozenPriors | None:
        if self.priors is not None:
            return self.priors
        return FrozenPriors(self.policy.wrapper.pipeline, eval_sampling(self.cfg))


class ARTrainer(RewardTrainer):
    """A run that trains the AR model (GRPO, DAPO, GSPO); its samples are rendered by the frozen DiT with
    `sampling.dit_num_steps` steps. Its evaluation samples new prior tokens each time: the AR model trains."""

    component = "ar"
