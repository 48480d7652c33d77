"""`RunConfig`, the sections every run has, and `AlgoConfig`, what every algorithm's `algo` section has.

A run config is `RunConfig` with its algorithm's `sampling` and `algo` dataclasses
(`algorithms/<name>/config.py`); the engine reads only the fields `AlgoConfig` declares (advantages, the
update loop, the KL reference, EMA), so an algorithm's section adds its own fields and changes defaults, and
the shared checks run once, here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from glm_training.config.model import ModelConfig
from glm_training.config.options import (
    EMA_CALLS,
    RUN_NAME_HELP,
    SCALE_REWARDS,
    _check,
    _check_choice,
    option,
)
from glm_training.config.schema import (
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    RewardConfig,
    TrainerConfig,
)
from glm_training.config.spec import ALGORITHMS

# The error of a run config given to the other half's entry point.
_COMPONENT_ERRORS = {
    "dit": "train_dit.py trains the DiT; use train_ar.py for 'ar'.",
    "ar": "train_ar.py trains the AR model; use train_dit.py for 'dit'.",
}


@dataclass
class AlgoConfig:
    """The `algo` fields the engine reads; an algorithm's section redeclares a field to change its default."""

    name: str = option("", "the algorithm, as the algorithm table names it")
    beta: float = option(0.0, "KL coefficient to the reference model (0 = no reference pass)")
    scale_rewards: str = option(
        "group",
        "advantages: group = (r - group mean) / (group std + 1e-4); batch = the std of all rewards; none = "
        "centred only",
    )
    adv_clip_max: float = option(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]")
    num_inner_epochs: int = option(1, "passes over each rollout's samples")
    num_mini_batches: int = option(1, "optimizer steps per rollout (1 = fully on-policy)")
    ema: bool = option(
        False, "keep an exponential moving average of the trained weights (evaluated, exported)"
    )
    ema_decay: float = option(
        0.9, "the EMA's decay once warmed up (the references' min((1 + s) / (10 + s), ema_decay) at step s)"
    )
    ema_update_interval: int = option(
        1, "the EMA updates on the optimizer steps s with (s + 1) % ema_update_interval == 0 (Flow-GRPO: 8)"
    )
    ema_calls: str = option(
        "per_optimizer_step",
        "how often the EMA is called, as each reference calls it (engine/ema.py): per_train_batch = once per "
        "training batch of ema_train_batch_size of a rank's samples (Flow-GRPO's train_sd3.py) | "
        "per_optimizer_step = after every optimizer step (DiffusionNFT) | per_rollout = after a rollout's "
        "last optimizer step (AWM); never a function of sampling.micro_batch_size",
    )
    ema_train_batch_size: int = option(
        1,
        "per_train_batch: a rank's samples per EMA call, the reference's sample.train_batch_size (Flow-GRPO: "
        "9)",
    )

    def __post_init__(self) -> None:
        # The section's own algorithm: its `name` default. Another name needs its own schema.
        own = type(self).__dataclass_fields__["name"].default
        _check(self.name == own, "algo.name", self.other_schema_hint(own))
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check_choice(self.scale_rewards, SCALE_REWARDS, "algo.scale_rewards")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")
        _check(self.ema_update_interval >= 1, "algo.ema_update_interval", "must be >= 1.")
        _check_choice(self.ema_calls, EMA_CALLS, "algo.ema_calls")
        _check(self.ema_train_batch_size >= 1, "algo.ema_train_batch_size", "must be >= 1.")

    def uses_reference(self) -> bool:
        """Whether the update calls the base model (`Policy.reference_model`): a full fine-tune then keeps a
        frozen copy of it. The KL's by default; an algorithm whose loss reads the base model says so here."""
        return self.beta > 0

    def other_schema_hint(self, own: str) -> str:
        """The error when `algo.name` is not this section's algorithm: the config that trains the named one,
        or, for a name that is no algorithm, the closest name and all of them."""
        spec = ALGORITHMS.get(self.name)
        variant_of = [a for a in ALGORITHMS.values() if self.name.lower() in a.variants]
        if spec is None and variant_of:
            spec = variant_of[0]
            return (
                f"'{self.name}' is a setting of '{spec.name}' (docs/algorithms.md): algo.name={spec.name}, "
                f"as in configs/{spec.config}.yaml."
            )
        if spec is None:
            close = difflib.get_close_matches(self.name, list(ALGORITHMS), n=1)
            guess = f"did you mean '{close[0]}'? " if close else ""
            return f"'{self.name}' is not an algorithm; {guess}the algorithms: {', '.join(ALGORITHMS)}."
        script = "train_dit.py" if spec.component == "dit" else "train_ar.py"
        return (
            f"this config trains '{own}'; '{self.name}' has its own: {script} --config "
            f"configs/{spec.config}.yaml."
        )


@dataclass
class RunConfig:
    """The sections of every run config; a run config names its own `sampling` and `algo` dataclasses and the
    `component` (the half it trains) as its field's default."""

    run_name: str = option("run", RUN_NAME_HELP)
    component: str = option("", "the half of GLM-Image that trains: dit | ar")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: Any = None
    algo: Any = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        own = type(self).__dataclass_fields__["component"].default
        if own:
            _check(self.component == own, "component", _COMPONENT_ERRORS[own])
        self._check_precision()
        self._check_algorithm()
        _check(
            not self.model.compile_blocks or self.component == "dit",
            "model.compile_blocks",
            "compiles the DiT's blocks; the AR model compiles its decoding step instead: "
            "sampling.sampler=folded sampling.compile=true.",
        )

    def _check_precision(self) -> None:
        m = self.model
        if m.keeps_master_weights():
            # The weights' dtype is model.dtype: computing "without mixed precision" means computing in it.
            compute = {"bfloat16": "bf16", "float16": "fp16"}[m.dtype]
            if self.trainer.mixed_precision == "no":
                self.trainer.mixed_precision = compute
            _check(
                self.trainer.mixed_precision == compute,
                "trainer.mixed_precision",
                f"full fine-tuning of a {m.dtype} model keeps float32 master weights and computes in "
                f"{m.dtype}: set trainer.mixed_precision={compute} (or model.fp32_master_weights=false to "
                f"train the {m.dtype} weights themselves, or model.lora.enabled=true).",
            )

    def _check_algorithm(self) -> None:
        """The rules that tie the algorithm to the other sections (each run config may add its own)."""

    def rollout_latents_per_sample(self) -> tuple[int, str]:
        """(latent tensors a decoder rollout keeps per sample for the update, what they are): the memory
        plan's. The algorithms on the forward process keep the clean latents the update noises again."""
        return 1, "1 final latent"
