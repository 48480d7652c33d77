"""`JointTrainer`: `python train_joint.py`, the AR model and the DiT decoder trained from one rollout.

It is `RewardTrainer` (collect, update, log, evaluate, checkpoint, resume, stop signals) over two halves,
with the builders that differ overridden: the inputs of both halves (`JointTrainConfig.half`), each with its
own reward set; `_build_model`, unchanged, then loads two `Policy` objects on one pipeline (the AR's loads
it, the DiT's shares it), each with its strategy, optimizer, LoRA or full fine-tuning and KL reference. The
algorithm is `JointAlgorithm` (`collect.py`) over the AR's algorithm from the table (`GRPO`) and the DiT's
(`FlowGRPO`), each with its own collector and update loop; the two collectors draw their sampling seeds from
streams of their own (`SEED_STREAMS`). Checkpoints: `<output_dir>/ar/checkpoints/` and
`<output_dir>/dit/checkpoints/`, each an ordinary run's (`export --checkpoint <output_dir>/dit --checkpoint
<output_dir>/ar` writes one pipeline); a resume starts from the newest step both halves saved
(`PairedCheckpoints`). One evaluation renders with both trained halves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from glm_training.config.algorithms import algorithm_of
from glm_training.engine.checkpointing import Checkpointer, PairedCheckpoints
from glm_training.engine.inputs import RunInputs
from glm_training.engine.monitor import ImageMonitor
from glm_training.engine.reporting import Evaluation
from glm_training.engine.trainer import RewardTrainer
from glm_training.joint.collect import JointAlgorithm, StepPriors
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


def joint_eval_names(scalars: dict[str, float], ar_weights: dict[str, float]) -> dict[str, float]:
    """An evaluation's scalars named by half: `eval/dit_reward_mean`, `eval/dit_reward/<name>` (the DiT's
    rewards, evaluated as the rewards), `eval/ar_reward/<name>` (watched) and their weighted
    `eval/ar_reward_mean`."""
    out = {}
    for key, value in scalars.items():
        for ours, joint in RENAMED:
            key = key.replace(ours, joint)
        out[key] = value
    out["eval/ar_reward_mean"] = sum(w * out[f"eval/ar_reward/{n}"] for n, w in ar_weights.items())
    return out


class JointTrainer(RewardTrainer):
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
        funcs = {"ar": ar_reward_funcs, "dit": dit_reward_funcs}
        weights = {"ar": ar_reward_weights, "dit": dit_reward_weights}
        super().__init__(cfg, funcs, weights, pipeline=pipeline)

    def _build_inputs(self, cfg: Any, reward_funcs: Any, reward_weights: Any) -> dict[str, RunInputs]:
        """Each half's inputs from its run config; `reward_funcs` / `reward_weights`: by half."""
        return {
            f"{half}_": RunInputs(cfg.half(half), reward_funcs[half], reward_weights[half]) for half in HALVES
        }

    def _run_config(self, cfg: Any) -> Any:
        ar, dit = self.inputs["ar_"].cfg, self.inputs["dit_"].cfg
        return dataclasses.replace(cfg, ar_reward=ar.reward, dit_reward=dit.reward)

    def _build_priors(self, priors: Any) -> StepPriors:
        """The DiT's prior tokens: the AR model's samples of the current step."""
        return StepPriors()

    def _build_algorithm(self, algorithm: type | None, seed_stream: int) -> JointAlgorithm:
        """Each half's algorithm from the table, on its own parts and seed stream, run together by
        `JointAlgorithm` (the DiT's prior tokens: the AR's samples)."""
        ar, dit = (self._half_algorithm(half) for half in HALVES)
        rewards = (self.inputs["ar_"].rewards, self.inputs["dit_"].rewards)
        return JointAlgorithm(self.cfg, ar, dit, self.priors, rewards)

    def _half_algorithm(self, half: str) -> Any:
        cfg = self.inputs[f"{half}_"].cfg
        priors = self.priors if half == "dit" else None
        return algorithm_of(cfg).algorithm_class()(cfg, self._parts(f"{half}_", SEED_STREAMS[half], priors))

    def _build_monitor(self) -> ImageMonitor:
        return ImageMonitor(self.inputs["dit_"].cfg, "dit_reward_mean")

    def _build_checkpoints(self) -> PairedCheckpoints:
        """One `Checkpointer` per half in its sub-folder, pruned together once both saved."""
        checkpointer = functools.partial(Checkpointer, rank=self.rank, is_main=self.is_main, prunes=False)
        ar, dit = self.inputs["ar_"].cfg, self.inputs["dit_"].cfg
        return PairedCheckpoints(
            checkpointer(ar, self.output_dir / "ar", self.policies["ar_"], [self.algorithm.ar]),
            checkpointer(
                dit, self.output_dir / "dit", self.policies["dit_"], [self.algorithm.dit, self.monitor]
            ),
        )

    def _build_evaluation(self) -> Evaluation:
        """The pipeline with both trained halves on the held-out prompts: the DiT's rewards scored as the
        rewards, the AR's as watched ones, the scalars named by half (`joint_eval_names`)."""
        ar, dit = self.inputs["ar_"], self.inputs["dit_"]
        return Evaluation(
            dit.cfg,
            dit,
            self.policies["dit_"],
            self.tracker,
            self.output_dir,
            None,
            others=(self.policies["ar_"],),
            watched=ar.rewards,
            rename=functools.partial(joint_eval_names, ar_weights=ar.rewards.weights),
        )
