"""`JointTrainConfig`: `python train_joint.py`, both halves of GLM-Image trained from one rollout.

Per prompt the AR model samples `data.num_priors` token sequences (priors); the DiT renders each prior
`data.renderings_per_prior` times with Flow-GRPO's SDE; every image is scored by `ar_reward` and by
`dit_reward`. The AR half is GRPO/DAPO/GSPO (`ar.algo`, `ar.sampling`, `ar.optim`, `ar.lora`), the DiT half is
the Flow-GRPO family (`dit.*`). The engine trains each half as its own trainer would: `half("ar")` and
`half("dit")` are the `ARTrainConfig` and `DiTTrainConfig` of the two halves, and each half's checkpoints
hold its own, so `export` and `evaluate --checkpoint` read them as any run's.

Groups: the DiT's advantage compares the renderings of one prior (`grouping() == "per_prior"`), the AR's
compares each prior's mean AR reward over its renderings with the other priors of its prompt. With one
rendering per prior both compare the priors of a prompt (`"per_prompt"`), each prior's rendering starting
from the same noise as its prompt's other priors, as `train_ar.py` renders.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from glm_training.algorithms.flow_grpo.config import DiTSamplingConfig, DiTTrainConfig, FlowGRPOConfig
from glm_training.algorithms.grpo.config import ARSamplingConfig, ARTrainConfig, DAPOConfig
from glm_training.config.model import LoraConfig, ModelConfig
from glm_training.config.options import RUN_NAME_HELP, ConfigError, _check, option
from glm_training.config.schema import (
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    RewardConfig,
    TrainerConfig,
)

# The sections a joint config holds twice: (where, the key prefix the section's own checks name).
SECTIONS = tuple(
    (f"{half}.{name}", prefix)
    for half in ("ar", "dit")
    for name, prefix in (
        ("sampling", "sampling."),
        ("algo", "algo."),
        ("optim", "optim."),
        ("lora", "model.lora."),
    )
) + (("ar_reward", "reward."), ("dit_reward", "reward."))


@dataclass
class JointDataConfig:
    """Prompts and the two-level groups of a joint run."""

    prompt_file: str = option("", "as data.prompt_file of the other trainers (empty = the bundled prompts)")
    num_groups_per_step: int = option(2, "prompts per step over all ranks")
    num_priors: int = option(2, "AR samples (priors) per prompt: the AR's group; >= 2")
    renderings_per_prior: int = option(
        2,
        "DiT renderings of each prior: the DiT's group when >= 2 (per_prior grouping); 1 = both halves "
        "compare the priors of a prompt (per_prompt grouping)",
    )
    prior_cache: str = option(
        "", "refused in joint runs: the AR model trains, so its priors change every step and cannot be cached"
    )

    def __post_init__(self) -> None:
        _check(self.num_groups_per_step >= 1, "data.num_groups_per_step", "must be >= 1.")
        _check(
            self.num_priors >= 2,
            "data.num_priors",
            f"is {self.num_priors}; the AR's advantage compares the priors of a prompt: set >= 2.",
        )
        _check(
            self.renderings_per_prior >= 1,
            "data.renderings_per_prior",
            f"is {self.renderings_per_prior}; every prior needs a rendering: set >= 1 (1 = per_prompt "
            "groups, >= 2 = the DiT compares renderings of one prior).",
        )
        _check(
            not self.prior_cache,
            "data.prior_cache",
            "a joint run trains the AR model, so its priors change every step and cannot come from a cache; "
            "remove data.prior_cache (train_dit.py takes one).",
        )

    def grouping(self) -> str:
        return "per_prior" if self.renderings_per_prior > 1 else "per_prompt"

    def num_dit_samples(self) -> int:
        return self.num_groups_per_step * self.num_priors * self.renderings_per_prior


@dataclass
class ARHalfConfig:
    """The AR half: GRPO/DAPO/GSPO, as `train_ar.py`'s sections of the same names."""

    sampling: ARSamplingConfig = field(default_factory=ARSamplingConfig)
    algo: DAPOConfig = field(default_factory=lambda: DAPOConfig(dynamic_sampling=False))
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(
        default_factory=lambda: LoraConfig(
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_weights="default"
        )
    )


@dataclass
class DiTHalfConfig:
    """The DiT half: the Flow-GRPO family, as `train_dit.py`'s sections of the same names."""

    sampling: DiTSamplingConfig = field(default_factory=DiTSamplingConfig)
    algo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class JointTrainConfig:
    """`python train_joint.py`: the AR model and the DiT decoder trained together (module docstring)."""

    run_name: str = option("joint", RUN_NAME_HELP)
    component: str = option("joint", "both halves of GLM-Image train: joint")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: JointDataConfig = field(default_factory=JointDataConfig)
    ar_reward: RewardConfig = field(default_factory=RewardConfig)
    dit_reward: RewardConfig = field(default_factory=RewardConfig)
    ar: ARHalfConfig = field(default_factory=ARHalfConfig)
    dit: DiTHalfConfig = field(default_factory=DiTHalfConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(self.component == "joint", "component", "train_joint.py trains both halves: 'joint'.")
        for half in ("ar", "dit"):  # each half's reward set names at least one reward (`RewardConfig`)
            weights = getattr(self.model, f"{half}_weights")
            _check(
                not weights,
                f"model.{half}_weights",
                f"sets the frozen {half.upper()} half's weights, but a joint run trains that half; start "
                "from an exported pipeline instead (model.name=PATH, `python -m glm_training.export`).",
            )
        s_ar, s_dit = self.ar.sampling, self.dit.sampling
        _check(
            (s_ar.height, s_ar.width) == (s_dit.height, s_dit.width),
            "ar.sampling.height",
            f"{s_ar.height}x{s_ar.width} differs from dit.sampling's {s_dit.height}x{s_dit.width}; the DiT "
            "renders the AR's tokens, so both must be the same size.",
        )
        _check(
            not (self.ar.algo.dynamic_sampling and self.ar.algo.max_resample_rounds > 0),
            "ar.algo.max_resample_rounds",
            "must be 0 in a joint run with ar.algo.dynamic_sampling=true: each resampling round would "
            "also be "
            "rendered by the DiT that trains; flat AR groups are dropped from the AR update without "
            "resampling (set ar.algo.max_resample_rounds=0).",
        )
        _check(
            self.trainer.resume in (None, "latest"),
            "trainer.resume",
            "a joint run resumes both halves from its own folder: use trainer.resume=latest with its "
            "trainer.output_dir.",
        )
        _check(
            not self.eval.watch_rewards,
            "eval.watch_rewards",
            "a joint run evaluates both reward sets (ar_reward and dit_reward); put a reward to watch in "
            "neither and evaluate it with `python -m glm_training.evaluate --checkpoint`.",
        )
        self.half("ar")  # each half's own checks (sizes per rank, precision, its algorithm's rules)
        self.half("dit")

    def half(self, component: str) -> ARTrainConfig | DiTTrainConfig:
        """The run config of one half, as its own trainer reads it (saved in that half's checkpoints)."""
        d, s_dit = self.data, self.dit.sampling
        shared = {
            "trainer": self.trainer,
            "eval": self.eval,
            "logging": self.logging,
        }
        if component == "ar":
            sampling = dataclasses.replace(
                self.ar.sampling, dit_num_steps=s_dit.num_steps, dit_guidance_scale=s_dit.guidance_scale
            )
            return ARTrainConfig(
                run_name=f"{self.run_name}-ar",
                # model.compile_blocks compiles the DiT's blocks: the DiT half's
                model=dataclasses.replace(self.model, lora=self.ar.lora, compile_blocks=False),
                data=DataConfig(d.prompt_file, d.num_priors, d.num_groups_per_step),
                reward=self.ar_reward,
                sampling=sampling,
                algo=self.ar.algo,
                optim=self.ar.optim,
                **shared,
            )
        per_prior = d.grouping() == "per_prior"
        group_size = d.renderings_per_prior if per_prior else d.num_priors
        return DiTTrainConfig(
            run_name=f"{self.run_name}-dit",
            model=dataclasses.replace(self.model, lora=self.dit.lora),
            data=DataConfig(d.prompt_file, group_size, d.num_dit_samples() // group_size),
            reward=self.dit_reward,
            sampling=self.dit.sampling,
            algo=self.dit.algo,
            optim=self.dit.optim,
            **shared,
        )


def joint_key_error(cfg: Any, err: ConfigError) -> ConfigError:
    """`err`, raised by a section a joint config holds twice (whose checks name the key as a single-half
    config spells it: `algo.beta`), with the key as the joint config spells it (`ar.algo.beta`)."""
    for where, prefix in SECTIONS:
        if not err.key.startswith(prefix):
            continue
        try:
            OmegaConf.to_object(OmegaConf.select(cfg, where))
        except ConfigError as own:
            if str(own) == str(err):
                key = f"{where}.{err.key.removeprefix(prefix)}"
                message = str(err).partition(": ")[2]
                return ConfigError(key, message.replace(err.key, key))
    return err
