"""`JointTrainer`: `python train_joint.py`, the AR model and the DiT decoder trained from one rollout.

It is the engine's `Trainer` loop (collect, update, log, evaluate, checkpoint, resume, stop signals) over two
halves built as their own trainers build them: two `Policy` objects on one pipeline (the AR's loads it, the
DiT's shares it), each with its strategy, optimizer, LoRA or full fine-tuning and KL reference; the AR's
algorithm from the table (`GRPO`), the DiT's (`FlowGRPO`), each with its own run config
(`JointTrainConfig.half`), collector and update loop. `JointAlgorithm` (`collect.py`) runs the shared rollout
and both updates. Checkpoints: `<output_dir>/ar/checkpoints/` and `<output_dir>/dit/checkpoints/`, each an
ordinary run's (`export --checkpoint <output_dir>/dit --checkpoint <output_dir>/ar` writes one pipeline).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from glm_training.checkpoint import CheckpointError
from glm_training.config import ConfigError
from glm_training.config.algorithms import algorithm_of
from glm_training.distributed import collectives as dist
from glm_training.distributed.strategies import make_parallelism
from glm_training.engine.checkpointing import Checkpointer
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

HALVES = ("ar", "dit")
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
    """The two halves' `Checkpointer`s, saved and resumed together; a resume whose halves stopped at
    different steps is refused, naming both."""

    def __init__(self, ar: Checkpointer, dit: Checkpointer):
        self.halves = (ar, dit)

    def save(self, step: int, at_once: bool = True) -> None:
        for half in self.halves:
            half.save(step, at_once)

    def finish_pending(self) -> None:
        for half in self.halves:
            half.finish_pending()

    def resume(self) -> int:
        steps = [half.resume() for half in self.halves]
        if steps[0] != steps[1]:
            ar, dit = (half.output_dir / "checkpoints" for half in self.halves)
            raise CheckpointError(
                f"the AR half's newest checkpoint is of step {steps[0]} ({ar}), the DiT half's of step "
                f"{steps[1]} ({dit}): the run stopped between the two saves. Move the newer one out of its "
                "checkpoints/ folder and resume again (trainer.resume=latest)."
            )
        return steps[0]


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
        self.checkpoints = BothCheckpoints(
            Checkpointer(ar_in.cfg, self.output_dir / "ar", ar.policy, [ar], self.rank, self.is_main),
            Checkpointer(
                dit_in.cfg, self.output_dir / "dit", dit.policy, [dit, self.monitor], self.rank, self.is_main
            ),
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
            collector = Collector(cfg, inputs.prompts, inputs.rewards, self.rank, self.world_size)
            updates = UpdateLoop(policy, cfg.algo.num_inner_epochs, cfg.algo.num_mini_batches)
            priors = self.priors if component == "dit" else None
            built.append(algorithm_of(cfg).algorithm_class()(cfg, Parts(policy, updates, collector, priors)))
        return built[0], built[1]
