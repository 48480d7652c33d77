"""Flow-GRPO's config: its SDE sampling (`DiTSamplingConfig`), its `algo` section and its run config
(`DiTTrainConfig`, what `python train_dit.py` trains by default)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.algorithms.decoder.config import DiffusionSamplingConfig
from glm_training.config.options import RUN_NAME_HELP, _check, _check_choice, option
from glm_training.config.run import AlgoConfig, RunConfig

SDE_TYPES = ("flow_sde", "cps")  # rollout.py SDE_STEPS
CPS_LOG_PROBS = ("flow_grpo", "gaussian")  # sde.py LOG_PROBS
SDE_WINDOW_SCHEDULES = ("random", "progressive")  # algorithm.py WINDOW_STARTS
DIT_KL_TYPES = ("flow_grpo", "exact", "velocity")  # losses.py KL_FNS
RATIO_NORMS = ("none", "grpo_guard")  # losses.py LOG_RATIOS


@dataclass
class DiTSamplingConfig(DiffusionSamplingConfig):
    """The DiT rollout (Flow-GRPO SDE sampling). Defaults follow Flow-GRPO (`yifan123/flow_grpo`)."""

    noise_level: float = option(0.7, "SDE noise level (Flow-GRPO's a; 0 = the deterministic ODE sampler)")
    sde_type: str = option("flow_sde", "flow_sde | cps")
    cps_log_prob: str = option(
        "flow_grpo",
        (
            'CPS log-prob: "flow_grpo" = Flow-GRPO\'s -mean((x - m)^2) (pair with clip_range '
            '~1e-5, as its Fast configs do); "gaussian" = the full Gaussian log-density. The flow'
            " SDE always uses the Gaussian one."
        ),
    )
    sde_window_start: int = option(
        0,
        (
            "Fixed window: steps [sde_window_start, sde_window_end) sample with the SDE and "
            "train; the rest are deterministic ODE steps. End -1 = num_steps - 1: the last step "
            "is deterministic, as in Flow-GRPO (its window is (0, num_steps - 1)); set it to "
            "num_steps to make the last step stochastic too."
        ),
    )
    sde_window_end: int = option(-1, "end of the SDE window (exclusive); -1 = through the last step")
    sde_window_size: int = option(
        0,
        (
            "Flow-GRPO-Fast / MixGRPO: sde_window_size > 0 draws a window of that many SDE steps "
            "for every rollout inside sde_window_range = [lo, hi) (hi -1 = num_steps - 1), "
            'replacing start/end above. "random": a start uniform on [lo, hi - size], a function '
            'of (trainer.seed, step); "progressive": MixGRPO\'s sliding window, moving '
            "sde_window_stride steps later every sde_window_every training steps."
        ),
    )
    sde_window_range: list[int] = option(
        factory=lambda: [0, -1],
        help="[lo, hi]: where a random or progressive SDE window lies (hi -1 = num_steps - 1)",
    )
    sde_window_schedule: str = option("random", "random | progressive")
    sde_window_stride: int = option(1, "progressive windows: steps the window moves each time it moves")
    sde_window_every: int = option(25, "progressive windows: training steps between two moves of the window")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.noise_level >= 0, "sampling.noise_level", "must be >= 0.")
        _check_choice(self.sde_type, SDE_TYPES, "sampling.sde_type")
        _check_choice(self.cps_log_prob, CPS_LOG_PROBS, "sampling.cps_log_prob")
        _check_choice(self.sde_window_schedule, SDE_WINDOW_SCHEDULES, "sampling.sde_window_schedule")
        _check(self.sde_window_size >= 0, "sampling.sde_window_size", "must be >= 0 (0 = fixed window).")
        _check(self.sde_window_stride >= 1, "sampling.sde_window_stride", "must be >= 1.")
        _check(self.sde_window_every >= 1, "sampling.sde_window_every", "must be >= 1.")
        if self.sde_window_size:
            _check(
                len(self.sde_window_range) == 2,
                "sampling.sde_window_range",
                f"must be [lo, hi]; got {list(self.sde_window_range)}.",
            )
            lo, hi = self.window_range()
            _check(
                0 <= lo and lo + self.sde_window_size <= hi <= self.num_steps,
                "sampling.sde_window_range",
                f"a window of {self.sde_window_size} steps must fit in [lo, hi) = [{lo}, {hi}) inside "
                f"[0, {self.num_steps}); widen the range or shrink sampling.sde_window_size.",
            )
        else:
            end = self.window_end()
            _check(
                0 <= self.sde_window_start < end <= self.num_steps,
                "sampling.sde_window_start",
                f"the SDE window [{self.sde_window_start}, {end}) must lie inside [0, {self.num_steps}).",
            )

    def window_end(self) -> int:
        return self.num_steps - 1 if self.sde_window_end < 0 else self.sde_window_end

    def window_range(self) -> tuple[int, int]:
        lo, hi = (int(x) for x in self.sde_window_range)
        return lo, self.num_steps - 1 if hi < 0 else hi


@dataclass
class FlowGRPOConfig(AlgoConfig):
    """Flow-GRPO loss settings; the defaults are Flow-GRPO's (`scripts/train_sd3.py`, `config/grpo.py`).

    Log-probs are means over latent elements, hence the tiny clip range.
    """

    name: str = option(
        "flow_grpo",
        (
            "The DiT's RL algorithm; DiffusionNFT has its own schema (`nft_schema`, "
            "configs/nft_training.yaml)."
        ),
    )
    beta: float = option(
        0.0,
        (
            "KL coefficient. With kl_type=flow_grpo Flow-GRPO's values mean the same here: 0.04 "
            "(GenEval / OCR), 0.01 (PickScore), 0 (its Fast recipes)."
        ),
    )
    kl_type: str = option(
        "flow_grpo",
        (
            "flow_grpo: mean(dmu^2) / (2 std_dev_t^2), Flow-GRPO's (no -dt); exact: the "
            "transitions' Gaussian KL (= flow_grpo / -dt for the flow SDE, 4-30x stronger on a "
            "10-step schedule); velocity: mean(dv^2)."
        ),
    )
    clip_range: float = option(
        1e-4, "PPO clip range of the ratio; tiny because log-probs are means over latent elements"
    )
    scale_rewards: str = option(
        "batch",
        (
            "batch: (r - group mean) / (std of all rewards + 1e-4), Flow-GRPO's shipped "
            "`sample.global_std=True`; group: per-group std; none: centred only."
        ),
    )
    drop_zero_advantage: bool = option(
        True,
        (
            "Samples with advantage exactly 0 (flat groups) leave the loss, KL included, as Flow-"
            "GRPO filters them; the fraction is logged as frac_zero_advantage."
        ),
    )
    timestep_fraction: float = option(
        1.0,
        (
            "The first int(sampling.num_steps * timestep_fraction) SDE steps train (Flow-GRPO's "
            "rule); 1.0 and Flow-GRPO's 0.99 both train every SDE step when the last step is "
            "deterministic."
        ),
    )
    num_mini_batches: int = option(
        2,
        (
            "Optimizer steps per rollout. Flow-GRPO takes 2 (gradient_accumulation_steps = "
            "num_batches_per_epoch // 2): the first is on-policy (ratio exactly 1), the second "
            "off-policy, where the clip can act. Needs at least that many rollout micro-batches "
            "(sampling.micro_batch_size); fewer give fewer steps."
        ),
    )
    ratio_norm: str = option(
        "none",
        (
            "none: exp(log_prob - old); grpo_guard: GRPO-Guard's centred, std-reweighted ratio "
            "(arXiv 2510.22319)."
        ),
    )
    ema_update_interval: int = option(
        8, "the EMA updates every 8th optimizer step: train_sd3.py's EMAModuleWrapper(update_step_interval=8)"
    )
    ema_calls: str = option(
        "per_train_batch",
        "train_sd3.py calls the EMA once per training batch (its loop over samples_batched), so an update "
        "acts once per training batch of its step",
    )
    ema_train_batch_size: int = option(
        9,
        "a rank's samples per EMA call: Flow-GRPO's sample.train_batch_size (9 in its SD3.5-M configs, 8 in "
        "the *_4gpu ones), whatever sampling.micro_batch_size (its 32-GPU configs: 2 calls a step)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice(self.kl_type, DIT_KL_TYPES, "algo.kl_type")
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check_choice(self.ratio_norm, RATIO_NORMS, "algo.ratio_norm")


@dataclass
class DiTTrainConfig(RunConfig):
    """`python train_dit.py`: Flow-GRPO on the GLM-Image DiT decoder.

    Another decoder algorithm's run config is a `RunConfig` with component "dit" and its own `sampling` and
    `algo` sections (`NFTTrainConfig`).
    """

    run_name: str = option("dit", RUN_NAME_HELP)
    component: str = option("dit", "the half of GLM-Image that trains: dit here (train_ar.py trains ar)")
    sampling: DiTSamplingConfig = field(default_factory=DiTSamplingConfig)
    algo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)

    def _check_algorithm(self) -> None:
        # GRPO-Guard's re-centring assumes Gaussian log-probs; Flow-GRPO's CPS log-prob has no 1 / (2 std^2).
        _check(
            self.algo.ratio_norm != "grpo_guard"
            or self.sampling.sde_type == "flow_sde"
            or self.sampling.cps_log_prob == "gaussian",
            "algo.ratio_norm",
            "grpo_guard needs Gaussian log-probs; with sde_type=cps set sampling.cps_log_prob=gaussian.",
        )

    def rollout_latents_per_sample(self) -> tuple[int, str]:
        """(latent tensors a rollout keeps per sample for the update, what they are): the memory plan's.

        Flow-GRPO: the latents before and after every trained SDE step (of the window a rollout draws, with
        Flow-GRPO-Fast's `sde_window_size`).
        """
        s = self.sampling
        window = s.sde_window_size or s.window_end() - s.sde_window_start
        steps = max(1, round(window * self.algo.timestep_fraction))
        return 2 * steps, f"{steps} steps x 2 latents"
