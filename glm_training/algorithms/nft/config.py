"""DiffusionNFT's config: its `algo` section and its run config (`configs/nft_training.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.algorithms.decoder.config import DiffusionSamplingConfig
from glm_training.config.options import RUN_NAME_HELP, _check, _check_choice, option
from glm_training.config.run import AlgoConfig, RunConfig

NFT_DECAY_TYPES = (0, 1, 2)  # losses.py DECAY_SCHEDULES


@dataclass
class NFTConfig(AlgoConfig):
    """DiffusionNFT (arXiv 2509.16117); defaults are NVlabs' reference (`config/nft.py`, `train_nft_sd3.py`).

    The rollout samples with the old model and the pipeline's own Euler ODE (the reference samples SD3 with
    a deterministic 2nd-order DPM solver; `sampling.noise_level` and the SDE window keys are unused); the
    update noises the clean latents again at `int(sampling.num_steps * timestep_fraction)` of the
    schedule's times per sample and trains without CFG.
    """

    name: str = option("nft", "the DiT algorithm: nft here (configs/t2i_training.yaml trains flow_grpo)")
    nft_beta: float = option(
        1.0,
        (
            "beta of the implicit policies v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) "
            "v_old - beta v_theta (the reference's `config.beta`: 1.0; 0.1 for OCR and multi-"
            "reward)."
        ),
    )
    decay_type: int = option(
        1,
        (
            "The old (sampling) model's EMA schedule, the reference's `decay_type`: 0 = the "
            "current model after every rollout; 1 = decay min(0.001 k, 0.5) after k optimizer "
            "steps (default); 2 = 0 for 75 steps, then min(0.0075 (k - 75), 0.999) (OCR)."
        ),
    )
    beta: float = option(
        1e-4,
        (
            "KL coefficient to the base model, beta * mean((v_theta - v_ref)^2) (the reference's "
            "`train.beta`)."
        ),
    )
    adv_clip_max: float = option(5.0, "also the scale of r: r = clip(A) / adv_clip_max / 2 + 1/2")
    scale_rewards: str = option(
        "batch", "the reference's per-prompt mean with the global std (global_std=True)"
    )
    timestep_fraction: float = option(
        0.99, "the update noises each clean latent at int(sampling.num_steps * this) times"
    )
    num_mini_batches: int = option(1, "optimizer steps per rollout (the reference: 1; OCR: 2)")
    ema: bool = option(
        True,
        "EMA of the policy for evaluation (the reference's `train.ema`, decay 0.9); not the old model.",
    )
    ema_decay: float = option(0.9, "decay of the evaluation EMA (algo.ema)")
    ema_calls: str = option(
        "per_optimizer_step", "train_nft_sd3.py calls its evaluation EMA after every optimizer step"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(
            self.nft_beta > 0,
            "algo.nft_beta",
            f"must be > 0 (the reference uses 1.0 or 0.1), got {self.nft_beta}.",
        )
        _check_choice(self.decay_type, NFT_DECAY_TYPES, "algo.decay_type")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")

    def num_train_times(self, num_steps: int) -> int:
        """Training times per sample: the reference's int(num_steps * timestep_fraction), at least 1."""
        return max(1, int(num_steps * self.timestep_fraction))


@dataclass
class NFTTrainConfig(RunConfig):
    """`python train_dit.py --config configs/nft_training.yaml`: DiffusionNFT on the GLM-Image DiT decoder
    (the old model samples with the ODE)."""

    run_name: str = option("nft", RUN_NAME_HELP)
    component: str = option("dit", "the half of GLM-Image that trains: dit here (train_ar.py trains ar)")
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    algo: NFTConfig = field(default_factory=NFTConfig)
