"""`JointTrainer`: `python train_joint.py`, the AR model and the DiT decoder trained from one rollout.

It is the engine's `Trainer` loop (collect, update, log, evaluate, checkpoint, resume, stop signals) over two
halves built as their own trainers build them: two `Policy` objects on one pipeline (the AR's loads it, the
DiT's shares it), each with its strategy, optimizer, LoRA or full fine-tuning and KL reference; the AR's
algorithm from the table (`GRPO`), the DiT's (`FlowGRPO`), each with its own run config
(`JointTrainConfig.half`), collector and update loop. `JointAlgorithm` (`collect.py`) runs the shared rollout
and both updates. The two collectors draw their sampling seeds from streams of their own (`SEED_STREAMS`).
Checkpoints: `<output_dir>/ar/checkpoints/` and `<output_dir>/dit/checkpoints/`, each an ordinary run's
(`export --checkpoint <output_dir>/dit --checkpoint <output_dir>/ar` writes one pipeline); a resume starts
from the newest step both halves saved (`BothCheckpoints`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from glm_training.checkpoint import checkpoint_dir, find_paired_resume, set_aside
from glm_training.config import ConfigError
from glm_training.config.algorithms import algorithm_of
from glm_training.distributed import collectives as dist
from glm_training.distributed.strategies import make_parallelism
from glm_training.engine.checkpointing import Checkpointer, agreed
from glm_training.engine.collect import Collector
from glm_training.engine.inputs import RunInputs
from glm_training.engine.monitor import ImageMonitor
from glm_training.engine.parts import Parts
from glm_training.engine.policy import Policy
from glm_training.engine.reporting import Evaluation
from glm_training.engine.trainer import Trainer
from glm_training.engine.update import UpdateLoop
from glm_training.joint.collect import JointAlgorithm, StepPriors
from glm_training.logs import setup_logging
from glm_training.plan import log_memory_plan
from glm_training.rewards.combine import RewardFuncs

logger = logging.getLogger("glm_training")

HALVES = ("ar", "dit")
# Each half's stream of sampling seeds (`Collector.sample_seed`): the AR decodes as train_ar.py does (stream
# 0, so a joint run's priors are the AR trainer's), the DiT draws its initial and SDE noise from its own, so a
# rendering's noise is independent of the AR decoding that wrote its prior (one seed would start both from
# one random sequence). `DiTTrainer(..., seed_stream=SEED_STREAMS["dit"])` samples as a joint run's DiT.
SEED_STREAMS = {"ar": 0, "dit": 1}
# Evaluation's scalar names -> a joint run's (dit_reward is evaluated as the rewards, ar_reward as watched).
RENAMED = (
    ("eval/reward_mean", "eval/dit_reward_mean"),
    ("eval/reward/", "eval/dit_reward/"),
    ("eval/watched/", "eval/ar_reward/"),
)


class JointInputs:
    """Both halves' inputs (`RunInputs`): the loop's reward handling covers both reward sets; evaluation
    scores `dit_reward` as its rewards and `ar_reward` as watched ones."""

    def __init__(self, ar: RunInputs, dit: RunInputs):
        self.ar, self.dit = ar, dit
        self.eval_prompts = dit.eval_prompts
        self.rewards = dit.rewards
        self.watched_rewards = ar.rewards
        self.text_recogniser = dit.text_recogniser

    def reward_sets(self) -> list[Any]:
        return [self.ar.rewards, self.dit.rewards]

    def set_failure_policy(self) -> None:
        self.ar.set_failure_policy()
        self.dit.set_failure_policy()

    def stops_on_failure(self) -> bool:
        return self.ar.stops_on_failure() or self.dit.stops_on_failure()

    def close(self) -> None:
        self.ar.close()
        self.dit.close()


class BothCheckpoints:
    """The two halves' `Checkpointer`s (built with `prunes=False`), saved one after the other and pruned
    together once both saved, so that a stop between the two saves always leaves a step both completed.

    `trainer.resume=latest` resumes both from the newest step both halves saved intact
    (`find_paired_resume`); the checkpoints past it are set aside (renamed, kept, logged): the newer half's of
    a stop between the saves as `step-N.unpaired`, damaged ones as `step-N.damaged`; the run writes those
    steps again. With no such step (a stop between the first two saves) it starts over from step 0.
    """

    def __init__(self, ar: Checkpointer, dit: Checkpointer):
        self.halves = (ar, dit)

    def save(self, step: int, at_once: bool = True) -> None:
        for half in self.halves:
            half.save(step, at_once)
        self._prune()

    def finish_pending(self) -> None:
        for half in self.halves:
            half.finish_pending()
        self._prune()

    def _prune(self) -> None:
        for half in self.halves:
            half.prune()

    def resume(self) -> int:
        if not self.halves[0].cfg.trainer.resume:
            return 0
        step = agreed(self._resume_step, self.halves[0].is_main)
        if step:
            for half in self.halves:
                half.load(checkpoint_dir(half.output_dir, step))
        return step

    def _resume_step(self) -> int:
        """Rank 0: the newest step both halves saved intact, the checkpoints past it set aside."""
        step, passed = find_paired_resume([half.output_dir for half in self.halves])
        for checkpoint, why in passed:
            set_aside(checkpoint, why)
        if step == 0:
            logger.warning("no step has a checkpoint of both halves: the run starts over from step 0")
        return step


class JointEvaluation:
    """The pipeline with both trained halves on the held-out prompts (`Evaluation`), its scalars named by
    half: `eval/dit_reward_mean`, `eval/dit_reward/<name>`, `eval/ar_reward_mean`, `eval/ar_reward/<name>`."""

    def __init__(self, evaluation: Evaluation, ar_weights: dict[str, float]):
        self.evaluation = evaluation
        self.ar_weights = ar_weights

    def maybe_run(self, step: int, rank: int, world_size: int, is_main: bool) -> dict[str, float]:
        scalars = self.evaluation.maybe_run(step, rank, world_size, is_main)
        if not scalars:
            return {}
        out = {}
        for key, value in scalars.items():
            for ours, joint in RENAMED:
                key = key.replace(ours, joint)
            out[key] = value
        out["eval/ar_reward_mean"] = sum(w * out[f"eval/ar_reward/{n}"] for n, w in self.ar_weights.items())
        return out


class JointTrainer(Trainer):
    """A joint run of `cfg` (a `JointTrainConfig`). Rewards from Python, as the other trainers take them,
    per half: `ar_reward_funcs` / `ar_reward_weights` and `dit_reward_funcs` / `dit_reward_weights`;
    `pipeline`: an already-built GlmImagePipeline to train instead of loading `model.name`."""

    component = "joint"
    reward_keys = ("ar_reward_mean", "dit_reward_mean")

    def __init__(
        self,
        cfg: Any,
        ar_reward_funcs: RewardFuncs | None = None,
        ar_reward_weights: list[float] | None = None,
        dit_reward_funcs: RewardFuncs | None = None,
        dit_reward_weights: list[float] | None = None,
        *,
        pipeline: Any = None,
    ):
        if cfg.component != "joint":
            raise ConfigError(
                "component",
                f"JointTrainer trains both halves; this config trains the {cfg.component} half (give it a "
                "joint config, e.g. load_config(config='joint_training'), or use DiTTrainer / ARTrainer).",
            )
        setup_logging(dist.rank_info().rank == 0)
        ar_in = RunInputs(cfg.half("ar"), ar_reward_funcs, ar_reward_weights)
        dit_in = RunInputs(cfg.half("dit"), dit_reward_funcs, dit_reward_weights)
        self.cfg = dataclasses.replace(cfg, ar_reward=ar_in.cfg.reward, dit_reward=dit_in.cfg.reward)
        self.inputs = JointInputs(ar_in, dit_in)
        self.halves = {"ar": ar_in.cfg, "dit": dit_in.cfg}
        for half in self.halves.values():
            half.data.per_rank_samples(dist.rank_info().world_size)  # refuses a split the ranks cannot share
        self._start_engine()
        self._open_outputs(HALVES)
        self.memory_plan = log_memory_plan(ar_in.cfg, self.accelerator, dit_in.cfg)
        self.priors = StepPriors()
        ar, dit = self._build_halves(pipeline)
        self.policies = {"ar_": ar.policy, "dit_": dit.policy}
        self.algorithm = JointAlgorithm(self.cfg, ar, dit, self.priors, (ar_in.rewards, dit_in.rewards))
        self.monitor = ImageMonitor(dit_in.cfg, "dit_reward_mean")
        checkpointer = functools.partial(Checkpointer, rank=self.rank, is_main=self.is_main, prunes=False)
        self.checkpoints = BothCheckpoints(
            checkpointer(ar_in.cfg, self.output_dir / "ar", ar.policy, [ar]),
            checkpointer(dit_in.cfg, self.output_dir / "dit", dit.policy, [dit, self.monitor]),
        )
        self._resume_and_track()
        evaluation = Evaluation(
            dit_in.cfg, self.inputs, dit.policy, self.tracker, self.output_dir, None, others=(ar.policy,)
        )
        self.evaluation = JointEvaluation(evaluation, ar_in.rewards.weights)

    def _build_halves(self, pipeline: Any) -> tuple[Any, Any]:
        """(the AR's algorithm, the DiT's), each on its own `Policy` over the one pipeline."""
        built = []
        for component, inputs in (("ar", self.inputs.ar), ("dit", self.inputs.dit)):
            cfg = inputs.cfg
            parallel = make_parallelism(cfg.trainer, self.accelerator, component)
            policy = Policy(
                cfg, component, self.accelerator, parallel, self.placement_context, pipeline=pipeline
            )
            pipeline = policy.wrapper  # the DiT's policy shares the pipeline the AR's loaded
            collector = Collector(
                cfg, inputs.prompts, inputs.rewards, self.rank, self.world_size, SEED_STREAMS[component]
            )
            updates = UpdateLoop(policy, cfg.algo.num_inner_epochs, cfg.algo.num_mini_batches)
            priors = self.priors if component == "dit" else None
            built.append(algorithm_of(cfg).algorithm_class()(cfg, Parts(policy, updates, collector, priors)))
        return built[0], built[1]
