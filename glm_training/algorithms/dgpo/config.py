"""DGPO's config: its `algo` section and its run config (`configs/dgpo_training.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.algorithms.decoder.config import DiffusionSamplingConfig
from glm_training.config.options import RUN_NAME_HELP, _check, _check_choice, option
from glm_training.config.run import AlgoConfig, RunConfig

DPO_REFERENCES = ("base", "ema_ref")


@dataclass
class DGPOConfig(AlgoConfig):
    """DGPO (Luo et al., "Reinforcing Diffusion Models by Direct Group Preference Optimization"); defaults are
    the authors' OCR run on SD3.5-M (`Luo-Yihong/DGPO` `config/dgpo.py` `general_ocr_sd3_4gpu`,
    `scripts/train_sd3_dgpo.py`).

    The rollout is an ODE sample (no stochastic policy, no log-probs). Each group's samples are split by the
    sign of their advantage into a positive and a negative set; the update noises every clean latent again at
    `train_timesteps` schedule indices drawn from {0, ..., trunc_steps} (shared by every sample and rank),
    with one noise per group, and minimises DGPO's group-level DPO loss on the flow-matching errors against
    the reference model's (`losses.py`), plus `beta` times the velocity KL to the base model. One optimizer
    step per rollout.
    """

    name: str = option("dgpo", "the DiT algorithm: dgpo here (configs/t2i_training.yaml trains flow_grpo)")
    beta_dpo: float = option(
        100.0, "the DPO temperature of the group sums S_g (the reference: 100 OCR and GenEval, 10 PickScore)"
    )
    beta: float = option(
        0.02,
        "KL to the base model, beta * mean((v_theta - v_base)^2) (the reference: 0.02 OCR and GenEval, 0.001 "
        "PickScore)",
    )
    train_timesteps: int = option(
        4, "schedule indices each sample is noised again at per rollout (the reference's num_train_timesteps)"
    )
    trunc_steps: int = option(
        6,
        "the indices are drawn without replacement from {0, ..., trunc_steps} of the sampling schedule: the "
        "noisier part (the reference: 6 of 10 steps, t >= shift(0.3); 4 for GenEval)",
    )
    shared_noise: bool = option(
        True, "one noise per group and training time, so a group's errors differ only by its samples"
    )
    clip_range: float = option(
        1e-2,
        "PPO-style clip of r = exp(l_old - l) against the EMA reference (the reference: 1e-2 OCR and "
        "GenEval, 5e-2 PickScore)",
    )
    clip_loss: bool = option(
        True, "detach a sample's flow-matching loss where the clip acts (the reference's clip_dsm)"
    )
    clip_kl: bool = option(False, "detach its KL there as well (the reference's clip_kl)")
    ref_decay: float = option(
        0.3,
        "the EMA reference's decay after k optimizer steps is min(ref_decay, 0.001 k) (the reference: 0.3)",
    )
    switch_ema_ref: int = option(
        200,
        "after this many optimizer steps the EMA reference samples the rollouts instead of the policy (the "
        "reference: 200 OCR and PickScore, 500 GenEval; -1 = never)",
    )
    dpo_reference: str = option(
        "base",
        "the model whose errors the group sums subtract: base (the reference's default) | ema_ref (its "
        "use_ema_ref, the dynamic reference of TDM-R1)",
    )
    kl_cfg: float = option(
        1.0,
        "CFG scale of the base model's velocity in the KL and the group sums (the reference's kl_cfg; 1 = "
        "CFG-free, config/dgpo.py; 4.5 in config/dgpo_wocfg.py, its fully CFG-free mode with a guided "
        "reference, sampling.guidance_scale=1); the policy's velocity is always CFG-free",
    )
    scale_rewards: str = option("batch", "the reference's per-prompt mean with the global std (global_std)")
    ema: bool = option(True, "EMA of the policy for evaluation (the reference's train.ema)")
    ema_decay: float = option(0.9, "the reference's EMAModuleWrapper(decay=0.9, update_step_interval=8)")
    ema_update_interval: int = option(
        8, "the evaluation EMA updates every 8th optimizer step (the reference)"
    )
    ema_calls: str = option(
        "per_train_batch",
        "the reference calls its evaluation EMA once per training batch (train_sd3_dgpo.py's loop over "
        "samples_batched, as Flow-GRPO's)",
    )
    ema_train_batch_size: int = option(
        16,
        "a rank's samples per evaluation-EMA call: the reference's sample.train_batch_size (8 * 2 for OCR "
        "and GenEval, 12 for PickScore), whatever sampling.micro_batch_size",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.beta_dpo > 0, "algo.beta_dpo", "must be > 0 (the reference: 100 OCR, 10 PickScore).")
        _check(self.train_timesteps >= 1, "algo.train_timesteps", "must be >= 1.")
        _check(self.trunc_steps >= 0, "algo.trunc_steps", "must be >= 0.")
        _check(
            self.train_timesteps <= self.trunc_steps + 1,
            "algo.train_timesteps",
            f"{self.train_timesteps} distinct indices cannot be drawn from the {self.trunc_steps + 1} of "
            f"{{0, ..., algo.trunc_steps}}: lower it or raise algo.trunc_steps.",
        )
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check(0 <= self.ref_decay < 1, "algo.ref_decay", "must be in [0, 1).")
        _check(self.kl_cfg >= 1, "algo.kl_cfg", "must be >= 1 (1 = a CFG-free base velocity).")
        _check(self.switch_ema_ref >= -1, "algo.switch_ema_ref", "must be >= 0, or -1 for never.")
        _check_choice(self.dpo_reference, DPO_REFERENCES, "algo.dpo_reference")
        for key in ("num_inner_epochs", "num_mini_batches"):
            _check(
                getattr(self, key) == 1,
                f"algo.{key}",
                "must be 1: DGPO takes one optimizer step per rollout (every reference config updates once "
                "per epoch), so every group sum sees the weights its gradient is taken at.",
            )

    def uses_reference(self) -> bool:
        """The group sums read the base model's errors (dpo_reference=base), besides the KL's."""
        return self.beta > 0 or self.dpo_reference == "base"


@dataclass
class DGPOTrainConfig(RunConfig):
    """`python train_dit.py --config configs/dgpo_training.yaml`: DGPO on the GLM-Image DiT decoder (ODE
    rollouts)."""

    run_name: str = option("dgpo", RUN_NAME_HELP)
    component: str = option("dit", "the half of GLM-Image that trains: dit here (train_ar.py trains ar)")
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    algo: DGPOConfig = field(default_factory=DGPOConfig)

    def _check_algorithm(self) -> None:
        _check(
            self.algo.trunc_steps < self.sampling.num_steps,
            "algo.trunc_steps",
            f"{self.algo.trunc_steps} is past the last index {self.sampling.num_steps - 1} of the "
            f"sampling.num_steps={self.sampling.num_steps} schedule: lower it.",
        )
        _check(
            self.data.num_generations >= 2,
            "data.num_generations",
            "DGPO compares the samples of a group: it needs at least 2 per prompt.",
        )
