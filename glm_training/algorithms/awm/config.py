"""AWM's config: its `algo` section and its run config (`configs/awm_training.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.algorithms.decoder.config import DiffusionSamplingConfig
from glm_training.config.options import RUN_NAME_HELP, _check, _check_choice, option
from glm_training.config.run import AlgoConfig, RunConfig

AWM_WEIGHTINGS = ("ghuber", "huber", "t", "t_squared", "uniform")  # losses.py WEIGHTINGS
AWM_TIME_TYPES = ("discrete_wo_init", "discrete")  # losses.py TIME_TYPES
AWM_ANCHOR_DECAY_TYPES = ("linear", "constant")  # losses.py ANCHOR_DECAY_TYPES


@dataclass
class AWMConfig(AlgoConfig):
    """Advantage Weighted Matching (arXiv 2509.25050); defaults are the authors' reference for SD3.5-M OCR.

    The reference is `scxue/advantage_weighted_matching` (`config/dgx_awm.py` `ocr_sd3_no_cfg_1node`,
    `scripts/train_sd3_awm.py`). The rollout is the policy's own ODE sample (the reference's SA-Solver is a
    sampler choice the loss never sees; `sampling` has no SDE keys). The update noises each clean latent
    again at `train_timesteps` times of the schedule and fits the CFG-free velocity to `eps - x_0`, each
    sample's loss weighted by its advantage. It is on-policy with one optimizer step per rollout.
    """

    name: str = option("awm", "the DiT algorithm: awm here (configs/t2i_training.yaml trains flow_grpo)")
    weighting: str = option(
        "ghuber",
        (
            "How the matching error l becomes the loss: ghuber = t ((l + 1e-10)^p - 1e-10^p) / p (the "
            "reference's default) | huber = t (sqrt(l) - 1e-5) | t = t l | t_squared = t^2 l | uniform = l."
        ),
    )
    ghuber_power: float = option(0.25, "p of the ghuber weighting (the reference's `ghuber_power`)")
    train_timesteps: int = option(6, "training times per sample and rollout, one per bin of the schedule")
    timestep_fraction: float = option(
        0.9, "the bins split the first int(sampling.num_steps * this) steps of the schedule"
    )
    time_type: str = option(
        "discrete_wo_init",
        (
            "discrete_wo_init: the bins start at step 1, so the pure-noise step never trains (the "
            "reference's OCR and GenEval configs) | discrete: they start at step 0 (PickScore)."
        ),
    )
    beta: float = option(
        0.003,
        (
            "KL to the base model, beta * mean((v_theta - v_ref)^2); the reference: 0.003 OCR, 0.001 "
            "GenEval, 1e-4 PickScore."
        ),
    )
    ema_beta: float = option(
        1.0, "KL to an EMA anchor of the policy, ema_beta * mean((v_theta - v_anchor)^2) (0 = no anchor)"
    )
    kl_ema_decay: float = option(0.3, "the anchor's EMA decay (its cap with kl_ema_decay_type=linear)")
    kl_ema_decay_type: str = option(
        "linear", "linear: decay min(kl_ema_decay, 0.001 k) after k optimizer steps | constant"
    )
    adv_clip_max: float = option(5.0, "advantages are clipped to +-this, then divided by it")
    advantage_max: float = option(1.0, "... and multiplied by this: a sample's weight is in +-advantage_max")
    clip_range: float = option(
        1.0, "PPO clip of the ratio exp(old loss - loss); on-policy the ratio is exactly 1 (the reference: 1)"
    )
    scale_rewards: str = option(
        "batch", "the reference's per-prompt mean with the global std (global_std=True)"
    )
    num_mini_batches: int = option(
        1,
        "optimizer steps per rollout (the reference's configs: 1); the later ones are ratio-weighted against "
        "the loss of the pre-update weights, as the reference",
    )
    ema: bool = option(True, "EMA of the policy for evaluation (the reference's train.ema, decay 0.99)")
    ema_decay: float = option(0.99, "decay of the evaluation EMA (algo.ema); not the KL anchor")
    ema_calls: str = option(
        "per_rollout",
        "train_sd3_awm.py calls its evaluation EMA once per epoch (rollout), after its last optimizer step",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self.weighting, AWM_WEIGHTINGS, "algo.weighting")
        _check(self.ghuber_power > 0, "algo.ghuber_power", "must be > 0 (the reference: 0.25).")
        _check(self.train_timesteps >= 1, "algo.train_timesteps", "must be >= 1.")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check_choice(self.time_type, AWM_TIME_TYPES, "algo.time_type")
        _check(self.ema_beta >= 0, "algo.ema_beta", "must be >= 0 (0 = no EMA anchor).")
        _check(0 <= self.kl_ema_decay < 1, "algo.kl_ema_decay", "must be in [0, 1).")
        _check_choice(self.kl_ema_decay_type, AWM_ANCHOR_DECAY_TYPES, "algo.kl_ema_decay_type")
        _check(self.advantage_max > 0, "algo.advantage_max", "must be > 0.")
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check(
            self.num_inner_epochs == 1,
            "algo.num_inner_epochs",
            "must be 1: the reference (train_sd3_awm.py) makes one pass over a rollout; more optimizer steps "
            "per rollout are algo.num_mini_batches.",
        )


@dataclass
class AWMTrainConfig(RunConfig):
    """`python train_dit.py --config configs/awm_training.yaml`: AWM on the GLM-Image DiT decoder (the policy
    samples with the ODE)."""

    run_name: str = option("awm", RUN_NAME_HELP)
    component: str = option("dit", "the half of GLM-Image that trains: dit here (train_ar.py trains ar)")
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    algo: AWMConfig = field(default_factory=AWMConfig)
