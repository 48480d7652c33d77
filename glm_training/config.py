"""Structured configuration: dataclasses in Hydra's ConfigStore, extended by the YAML files in `configs/`.

Every setting a run reads lives here, typed and validated at start-up (``__post_init__``), so a misspelt key,
a wrong type, a bad resolution or a missing value stops the run before any model is loaded, with a message
that names the key and the fix. Sizes that depend on the world size (per-rank batch, groups per rank) are
derived in code (`per_rank_samples`), never written in YAML.

Two command-line spellings are accepted by `load_config`:

    python train_dit.py --config configs/t2i_training.yaml algo.beta=0.04
    python train_dit.py --config-name t2i_training algo.beta=0.04  # Hydra's (-cn, --config-path)

and Hydra's own flags for one run: `--cfg job|all|hydra` prints the resolved config and exits, `--help` lists
the groups and every key with its doc (`config_help.py`), `hydra.run.dir=DIR` sets `trainer.output_dir`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from glm_training.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
BUNDLED_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts_tiny.txt"
BUNDLED_EVAL_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts_eval.txt"


class ConfigError(UserError, ValueError):
    """A user-facing configuration error; the message names the key and the fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _check_choice(value: str, choices: tuple[str, ...], key: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(key, f"'{value}' is not one of {list(choices)}.{hint}")


DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "cpu", "cuda")


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the trainable component; `enabled=False` means full fine-tuning."""

    enabled: bool = True
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    # Attention projections of the GLM-Image DiT; the AR trainer's YAML names the GLM ones.
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])

    def __post_init__(self) -> None:
        _check(self.rank > 0, "model.lora.rank", f"must be > 0, got {self.rank}.")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}.")
        _check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}.")
        _check(len(self.target_modules) > 0, "model.lora.target_modules", "name at least one module.")


@dataclass
class ModelConfig:
    """Which GLM-Image to load and how to place it (see `glm_training.models.placement`)."""

    # Required (the `model/` config group sets it). "tiny" builds (once, cached) a random-weight GLM-Image
    # offline; anything else is a hub id or a local folder loaded through the very same `from_pretrained`
    # path, e.g. "zai-org/GLM-Image".
    name: str = MISSING
    tiny_seed: int = 0
    dtype: str = "float32"
    # Single process only: "auto" (-> diffusers' "balanced"), "balanced", "cuda", or "cpu" (load on CPU, then
    # move to the training device). Distributed runs always load on CPU and move to the rank's device.
    device_map: str = "auto"
    max_memory_fraction: float = 0.9
    # A loading stage (download/read, placement, wrapping) that runs longer than this fails with an error
    # naming the stage instead of hanging silently.
    stage_timeout_s: float = 1800.0
    gradient_checkpointing: bool = False
    # model.name=glm_image_shape only (the real-width random fixture, `models/shape.py`): how many AR decoder
    # layers and DiT blocks it has (the real model: 40 and 30).
    shape_num_ar_layers: int = 1
    shape_num_dit_layers: int = 1
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Chaining the decoupled stages (README "Decoupled recipe"): the AR model the DiT trainer and
    # `python -m glm_training.priors` sample prior tokens with, as an AR run folder, a checkpoint step folder
    # (LoRA or full) or an export folder. Empty = the base model's own AR weights.
    ar_weights: str = ""
    # The DiT the AR trainer renders with, as a DiT run folder, a checkpoint step folder (LoRA or full) or an
    # export folder. Empty = the base model's own DiT weights.
    dit_weights: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.name), "model.name", "give 'tiny', a hub id or a local folder.")
        _check_choice(self.dtype, DTYPES, "model.dtype")
        _check_choice(self.device_map, DEVICE_MAPS, "model.device_map")
        _check(
            0.1 <= self.max_memory_fraction <= 1.0,
            "model.max_memory_fraction",
            f"must be in [0.1, 1.0], got {self.max_memory_fraction}.",
        )
        _check(self.stage_timeout_s > 0, "model.stage_timeout_s", "must be > 0 seconds.")
        for key in ("shape_num_ar_layers", "shape_num_dit_layers"):
            _check(getattr(self, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(self, key)}.")

    def shape_layers(self) -> tuple[int, int]:
        """(AR layers, DiT blocks) of the `glm_image_shape` fixture."""
        return self.shape_num_ar_layers, self.shape_num_dit_layers

    def base_model_id(self) -> tuple:
        """What identifies the base weights: the name, plus what picks a built fixture's random weights.

        Runs can be combined (export, model.ar_weights / dit_weights) only when these are equal.
        """
        if self.name == "tiny":
            return self.name, self.tiny_seed
        if self.name == "glm_image_shape":
            return self.name, self.tiny_seed, self.shape_layers()
        return (self.name,)


@dataclass
class DataConfig:
    """Prompts and grouping. A group is `num_generations` samples of one prompt."""

    # One prompt per line (.txt) or one JSON object per line with a "prompt" key (.jsonl; other keys,
    # e.g. "text" for the OCR reward, are passed to the rewards as metadata). Empty = the bundled prompts.
    prompt_file: str = ""
    num_generations: int = 4
    # Groups (prompts) per step over all ranks. The groups x generations samples are split evenly over the
    # ranks, so a group may straddle ranks (its statistics are gathered).
    num_groups_per_step: int = 4
    # DiT trainer only: a folder written by `python -m glm_training.priors`. Each group's prior tokens then
    # come from the cache (chosen from (trainer.seed, step, group, prompt)) and the AR model is never
    # loaded. Empty = the AR model samples them live at every step.
    prior_cache: str = ""

    def __post_init__(self) -> None:
        _check(self.num_generations >= 2, "data.num_generations", "group-relative advantages need >= 2.")
        _check(self.num_groups_per_step >= 1, "data.num_groups_per_step", "must be >= 1.")

    def resolved_prompt_file(self) -> Path:
        return Path(self.prompt_file).expanduser() if self.prompt_file else BUNDLED_PROMPTS

    def per_rank_samples(self, world_size: int) -> int:
        """Samples per rank per step: all `num_groups_per_step * num_generations` samples split evenly."""
        total = self.num_groups_per_step * self.num_generations
        if total % world_size:
            raise ConfigError(
                "data.num_groups_per_step",
                f"{self.num_groups_per_step} groups x {self.num_generations} generations = {total} samples "
                f"cannot be split evenly over {world_size} ranks; make it a multiple of {world_size}.",
            )
        return total // world_size


@dataclass
class RewardConfig:
    """Rewards from the registry, combined as a weighted sum (TRL's `reward_funcs` / `reward_weights`)."""

    names: list[str] = field(default_factory=lambda: ["jpeg_compressibility"])
    weights: list[float] = field(default_factory=list)  # empty = 1.0 each
    options: dict[str, Any] = field(default_factory=dict)  # per reward name: constructor keyword arguments
    # weighted_sum: sum_k w_k r_k. normalized_sum: each reward standardised within its group first, so rewards
    # on different scales count by their weights alone (see `rewards/combine.py`).
    combine: str = "weighted_sum"
    # Score each decoded micro-batch in a worker thread while the rollout samples the next one. The scores
    # are the same either way; it saves time when a reward model and the rollout can run side by side.
    overlap: bool = False
    # A NaN/inf score: `error` stops the run naming the reward and samples; `drop` gives the sample's group
    # zero advantage (it teaches nothing this step) and counts it as `dropped_nonfinite_groups`.
    on_nonfinite: str = "error"
    # Rewards that declare themselves retryable (remote, model scorers) are retried this many times, waiting
    # retry_backoff_s * 2**k before retry k+1. Then `on_failure`: `error` stops every rank with the reward's
    # name; `skip` makes the step's update a no-op on every rank (counted as `skipped_reward_failure`).
    max_retries: int = 3
    retry_backoff_s: float = 1.0
    on_failure: str = "error"

    def __post_init__(self) -> None:
        _check(len(self.names) > 0, "reward.names", "name at least one reward.")
        _check_choice(self.on_nonfinite, ("error", "drop"), "reward.on_nonfinite")
        _check_choice(self.on_failure, ("error", "skip"), "reward.on_failure")
        _check(self.max_retries >= 0, "reward.max_retries", "must be >= 0 (0 = no retry).")
        _check(
            math.isfinite(self.retry_backoff_s) and self.retry_backoff_s >= 0,
            "reward.retry_backoff_s",
            "must be a finite number of seconds >= 0.",
        )
        _check_choice(self.combine, ("weighted_sum", "normalized_sum"), "reward.combine")
        _check(
            not self.weights or len(self.weights) == len(self.names),
            "reward.weights",
            f"has {len(self.weights)} entries for {len(self.names)} rewards; give one per name or none.",
        )
        _check(all(math.isfinite(w) for w in self.weights), "reward.weights", "must be finite numbers.")
        unknown = set(self.options) - set(self.names)
        _check(
            not unknown,
            "reward.options",
            f"options given for rewards not in reward.names: {sorted(unknown)}.",
        )

    def weight_map(self) -> dict[str, float]:
        weights = self.weights or [1.0] * len(self.names)
        return dict(zip(self.names, (float(w) for w in weights)))


@dataclass
class EvalConfig:
    """Held-out evaluation: deterministic sampling (ODE, no SDE noise, one fixed seed per prompt).

    Runs before the first step and every `every_n_steps` during training (0 = off), and standalone with
    `python -m glm_training.evaluate`. Writes `<output_dir>/eval/<step>.json` and an image grid each time.
    Zeros and nulls below mean "as the training sampling".
    """

    every_n_steps: int = 0
    prompt_file: str = ""  # .txt or .jsonl like data.prompt_file; empty = the bundled held-out prompts
    num_prompts: int = 0  # 0 = every prompt in the file
    seed: int = 0  # each prompt's seed is derived from this and the prompt text
    num_inference_steps: int = 0
    guidance_scale: float | None = None
    height: int = 0
    width: int = 0
    batch_size: int = 4
    num_grid_images: int = 16

    def __post_init__(self) -> None:
        _check(self.every_n_steps >= 0, "eval.every_n_steps", "must be >= 0 (0 = no evaluation).")
        _check(self.num_prompts >= 0, "eval.num_prompts", "must be >= 0 (0 = all prompts).")
        _check(self.num_inference_steps >= 0, "eval.num_inference_steps", "must be >= 0.")
        _check(self.batch_size >= 1, "eval.batch_size", "must be >= 1.")
        _check(self.num_grid_images >= 0, "eval.num_grid_images", "must be >= 0.")
        for key in ("height", "width"):
            value = getattr(self, key)
            _check(
                value >= 0 and value % 32 == 0,
                f"eval.{key}",
                f"must be a multiple of 32 (or 0 = as training), got {value}.",
            )

    def resolved_prompt_file(self) -> Path:
        return Path(self.prompt_file).expanduser() if self.prompt_file else BUNDLED_EVAL_PROMPTS


@dataclass
class LoggingConfig:
    """Where scalars and image grids go besides metrics.jsonl; only rank 0 logs."""

    tensorboard: bool = True  # <output_dir>/tensorboard
    wandb: bool = False
    wandb_project: str = "glm-training"
    wandb_entity: str | None = None
    wandb_mode: str = "online"  # online | offline (no network; `wandb sync` later) | disabled
    images_every_n_steps: int = 10  # a captioned grid of training samples (0 = never)
    num_images: int = 8

    def __post_init__(self) -> None:
        _check_choice(self.wandb_mode, ("online", "offline", "disabled"), "logging.wandb_mode")
        _check(self.images_every_n_steps >= 0, "logging.images_every_n_steps", "must be >= 0 (0 = never).")
        _check(self.num_images >= 1, "logging.num_images", "must be >= 1.")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}.")
        _check(len(self.betas) == 2, "optim.betas", "give two numbers, e.g. [0.9, 0.999].")
        _check(self.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0.")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0.")


@dataclass
class TrainerConfig:
    """The loop: how long, where outputs go, checkpoints, distribution."""

    num_steps: int = 20
    seed: int = 0
    # Empty = outputs/<run name>-<timestamp>, chosen by rank 0 and shared with every rank.
    output_dir: str = ""
    save_every: int = 10  # optimizer steps between checkpoints; a final one is always written
    keep_last: int = 0  # 0 keeps every checkpoint
    resume: str | None = None  # a checkpoint folder, or "latest" (newest in output_dir)
    mixed_precision: str = "no"  # accelerate: no | bf16 | fp16
    # ddp (replicated weights, accelerate's DDP) | fsdp (FSDP2 `fully_shard`: the trainable component, its
    # gradients and optimizer state split over the ranks; see glm_training/sharding.py)
    strategy: str = "ddp"
    # fsdp: gather the whole trained component once for each rollout and evaluation instead of one unit per
    # forward (per denoising step / generated token); one full copy per rank while sampling (TRL's
    # ds3_gather_for_generation). false = least memory, many more all-gathers.
    fsdp_gather_for_rollout: bool = True
    # fsdp + full fine-tuning with algo.beta > 0: keep the frozen KL reference's shards in host memory and
    # copy them to the device for each forward (FSDP2's CPUOffloadPolicy), instead of on the device.
    fsdp_reference_offload: bool = False
    # Bound on every collective once training runs: a rank that dies or stalls makes the others fail within
    # it, naming the step and phase. Loading is bounded by model.stage_timeout_s instead. It must cover the
    # longest wait of one rank for another, e.g. rank 0 writing a full fine-tune's checkpoint.
    dist_timeout_s: float = 600.0
    # Steps in a row that make no update (non-finite loss/gradients, a reward failure with on_failure=skip)
    # before the run stops with TooManySkippedSteps; 0 = never stop.
    max_consecutive_skips: int = 5
    progress_bar: bool = True

    def __post_init__(self) -> None:
        _check(self.num_steps >= 1, "trainer.num_steps", "must be >= 1.")
        _check(
            math.isfinite(self.dist_timeout_s) and self.dist_timeout_s > 0,
            "trainer.dist_timeout_s",
            "must be a finite number of seconds > 0.",
        )
        _check(self.max_consecutive_skips >= 0, "trainer.max_consecutive_skips", "must be >= 0 (0 = never).")
        _check(self.save_every >= 0, "trainer.save_every", "must be >= 0 (0 = only at the end).")
        _check(self.keep_last >= 0, "trainer.keep_last", "must be >= 0 (0 = keep all).")
        _check_choice(self.mixed_precision, ("no", "bf16", "fp16"), "trainer.mixed_precision")
        _check(
            self.strategy != "deepspeed",
            "trainer.strategy",
            "deepspeed is not supported: no DeepSpeed run passes this project's tests. Use "
            "trainer.strategy=fsdp (FSDP2) to shard parameters, gradients and optimizer state.",
        )
        _check_choice(self.strategy, ("ddp", "fsdp"), "trainer.strategy")
        _check(
            self.strategy != "fsdp" or self.mixed_precision != "fp16",
            "trainer.mixed_precision",
            "fp16 is not supported with trainer.strategy=fsdp (it would need a sharded gradient scaler); "
            "use bf16, whose FSDP2 policy computes in bf16 and reduces gradients in fp32.",
        )


@dataclass
class DiTSamplingConfig:
    """The DiT rollout (Flow-GRPO SDE sampling). Defaults follow Flow-GRPO (`yifan123/flow_grpo`)."""

    height: int = 64
    width: int = 64
    num_steps: int = 10
    guidance_scale: float = 1.5
    noise_level: float = 0.7
    sde_type: str = "flow_sde"  # flow_sde | cps
    # CPS log-prob: "flow_grpo" = Flow-GRPO's -mean((x - m)^2) (pair with clip_range ~1e-5, as its Fast
    # configs do); "gaussian" = the full Gaussian log-density. The flow SDE always uses the Gaussian one.
    cps_log_prob: str = "flow_grpo"
    # Fixed window: steps [sde_window_start, sde_window_end) sample with the SDE and train; the rest are
    # deterministic ODE steps. End -1 = num_steps - 1: the last step is deterministic, as in Flow-GRPO
    # (its window is (0, num_steps - 1)); set it to num_steps to make the last step stochastic too.
    sde_window_start: int = 0
    sde_window_end: int = -1
    # Flow-GRPO-Fast / MixGRPO: sde_window_size > 0 draws a window of that many SDE steps for every rollout
    # inside sde_window_range = [lo, hi) (hi -1 = num_steps - 1), replacing start/end above. "random": a
    # start uniform on [lo, hi - size], a function of (trainer.seed, step); "progressive": MixGRPO's sliding
    # window, moving sde_window_stride steps later every sde_window_every training steps.
    sde_window_size: int = 0
    sde_window_range: list[int] = field(default_factory=lambda: [0, -1])
    sde_window_schedule: str = "random"  # random | progressive
    sde_window_stride: int = 1
    sde_window_every: int = 25
    # Conditional and unconditional CFG passes in one DiT forward of 2B samples (rollout and training). Off
    # by default: GLM-Image's DiT takes no text mask, so padding the empty prompt's glyph embeddings to the
    # prompt's length changes the unconditional prediction slightly (docs/benchmarks.md).
    batched_cfg: bool = False
    micro_batch_size: int = 4  # images per DiT forward pass during the rollout

    def __post_init__(self) -> None:
        for key in ("height", "width"):
            value = getattr(self, key)
            _check(
                value > 0 and value % 32 == 0,
                f"sampling.{key}",
                f"GLM-Image needs a multiple of 32, got {value}; try {max(32, round(value / 32) * 32)}.",
            )
        _check(self.num_steps >= 2, "sampling.num_steps", "must be >= 2 (the last step is deterministic).")
        _check(self.guidance_scale >= 0, "sampling.guidance_scale", "must be >= 0 (<= 1 disables CFG).")
        _check(self.noise_level >= 0, "sampling.noise_level", "must be >= 0.")
        _check_choice(self.sde_type, ("flow_sde", "cps"), "sampling.sde_type")
        _check_choice(self.cps_log_prob, ("flow_grpo", "gaussian"), "sampling.cps_log_prob")
        _check_choice(self.sde_window_schedule, ("random", "progressive"), "sampling.sde_window_schedule")
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
        _check(self.micro_batch_size >= 1, "sampling.micro_batch_size", "must be >= 1.")

    def window_end(self) -> int:
        return self.num_steps - 1 if self.sde_window_end < 0 else self.sde_window_end

    def window_range(self) -> tuple[int, int]:
        lo, hi = (int(x) for x in self.sde_window_range)
        return lo, self.num_steps - 1 if hi < 0 else hi


@dataclass
class FlowGRPOConfig:
    """Flow-GRPO loss settings; the defaults are Flow-GRPO's (`scripts/train_sd3.py`, `config/grpo.py`).

    Log-probs are means over latent elements, hence the tiny clip range.
    """

    # The DiT's RL algorithm; DiffusionNFT has its own schema (`nft_schema`, configs/nft_training.yaml).
    name: str = "flow_grpo"
    # KL coefficient. With kl_type=flow_grpo Flow-GRPO's values mean the same here: 0.04 (GenEval / OCR),
    # 0.01 (PickScore), 0 (its Fast recipes).
    beta: float = 0.0
    # flow_grpo: mean(dmu^2) / (2 std_dev_t^2), Flow-GRPO's (no -dt); exact: the transitions' Gaussian KL
    # (= flow_grpo / -dt for the flow SDE, 4-30x stronger on a 10-step schedule); velocity: mean(dv^2).
    kl_type: str = "flow_grpo"
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    # batch: (r - group mean) / (std of all rewards + 1e-4), Flow-GRPO's shipped `sample.global_std=True`;
    # group: per-group std; none: centred only.
    scale_rewards: str = "batch"
    # Samples with advantage exactly 0 (flat groups) leave the loss, KL included, as Flow-GRPO filters
    # them; the fraction is logged as frac_zero_advantage.
    drop_zero_advantage: bool = True
    # The first int(sampling.num_steps * timestep_fraction) SDE steps train (Flow-GRPO's rule); 1.0 and
    # Flow-GRPO's 0.99 both train every SDE step when the last step is deterministic.
    timestep_fraction: float = 1.0
    num_inner_epochs: int = 1
    # Optimizer steps per rollout. Flow-GRPO takes 2 (gradient_accumulation_steps = num_batches_per_epoch
    # // 2): the first is on-policy (ratio exactly 1), the second off-policy, where the clip can act. Needs
    # at least that many rollout micro-batches (sampling.micro_batch_size); fewer give fewer steps.
    num_mini_batches: int = 2
    # none: exp(log_prob - old); grpo_guard: GRPO-Guard's centred, std-reweighted ratio (arXiv 2510.22319).
    ratio_norm: str = "none"
    ema: bool = False
    ema_decay: float = 0.9

    def __post_init__(self) -> None:
        _check(
            self.name == "flow_grpo",
            "algo.name",
            f"'{self.name}' needs its own schema: for DiffusionNFT use --config configs/nft_training.yaml.",
        )
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check_choice(self.kl_type, ("flow_grpo", "exact", "velocity"), "algo.kl_type")
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check_choice(self.scale_rewards, ("group", "batch", "none"), "algo.scale_rewards")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check_choice(self.ratio_norm, ("none", "grpo_guard"), "algo.ratio_norm")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")


@dataclass
class NFTConfig:
    """DiffusionNFT (arXiv 2509.16117); defaults are NVlabs' reference (`config/nft.py`, `train_nft_sd3.py`).

    The rollout samples with the old model and the pipeline's own Euler ODE (the reference samples SD3 with
    a deterministic 2nd-order DPM solver; `sampling.noise_level` and the SDE window keys are unused); the
    update noises the clean latents again at `int(sampling.num_steps * timestep_fraction)` of the
    schedule's times per sample and trains without CFG.
    """

    name: str = "nft"
    # beta of the implicit policies v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) v_old - beta v_theta
    # (the reference's `config.beta`: 1.0; 0.1 for OCR and multi-reward).
    nft_beta: float = 1.0
    # The old (sampling) model's EMA schedule, the reference's `decay_type`: 0 = the current model after
    # every rollout; 1 = decay min(0.001 k, 0.5) after k optimizer steps (default); 2 = 0 for 75 steps,
    # then min(0.0075 (k - 75), 0.999) (OCR).
    decay_type: int = 1
    # KL coefficient to the base model, beta * mean((v_theta - v_ref)^2) (the reference's `train.beta`).
    beta: float = 1e-4
    adv_clip_max: float = 5.0  # also the scale of r: r = clip(A) / adv_clip_max / 2 + 1/2
    scale_rewards: str = "batch"  # the reference's per-prompt mean with the global std (global_std=True)
    timestep_fraction: float = 0.99
    num_inner_epochs: int = 1
    num_mini_batches: int = 1  # optimizer steps per rollout (the reference: 1; OCR: 2)
    # EMA of the policy for evaluation (the reference's `train.ema`, decay 0.9); not the old model.
    ema: bool = True
    ema_decay: float = 0.9

    def __post_init__(self) -> None:
        _check(
            self.name == "nft",
            "algo.name",
            f"the nft schema trains DiffusionNFT; for '{self.name}' use configs/t2i_training.yaml.",
        )
        _check(
            self.nft_beta > 0,
            "algo.nft_beta",
            f"must be > 0 (the reference uses 1.0 or 0.1), got {self.nft_beta}.",
        )
        _check_choice(str(self.decay_type), ("0", "1", "2"), "algo.decay_type")
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check_choice(self.scale_rewards, ("group", "batch", "none"), "algo.scale_rewards")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")

    def num_train_times(self, num_steps: int) -> int:
        """Training times per sample: the reference's int(num_steps * timestep_fraction), at least 1."""
        return max(1, int(num_steps * self.timestep_fraction))


@dataclass
class ARSamplingConfig:
    """The AR rollout: image-token sampling, and the frozen DiT that renders each sample for the reward."""

    height: int = 64
    width: int = 64
    # The policy trained is the distribution the tokens are sampled from, so temperature / top_p / top_k
    # unset (null) = what GlmImagePipeline itself samples with: the AR checkpoint's generation_config, and
    # transformers' defaults where it is silent (real checkpoint and tiny model: 0.9 / 0.75 / 50). The
    # resolved values are logged at start ("AR sampling: ..."); a value set here overrides.
    temperature: float | None = None
    top_p: float | None = None  # nucleus sampling threshold (1 = off; null = the pipeline's)
    top_k: int | None = None  # top-k filter (0 = off; null = the pipeline's, transformers' 50 when unset)
    # A static KV cache (transformers' cache_implementation="static"): faster generation, the same tokens for
    # the same seed, log-probs equal up to fp32 rounding (tests/test_ar_logprobs.py).
    static_cache: bool = False
    compile: bool = False  # torch.compile of the decoding step (needs static_cache; compiles on first use)
    dit_num_steps: int = 4
    dit_guidance_scale: float = 1.5
    # The DiT noise that renders a group is fixed per group (rewards inside a group differ only through the AR
    # tokens). "step": drawn anew for every group of every step; "prompt": the same for a prompt at every
    # step, which makes the reward a deterministic function of (prompt, tokens): less variance, at the cost
    # of learning tokens for one noise draw per prompt.
    dit_noise_seed: str = "step"

    def __post_init__(self) -> None:
        for key in ("height", "width"):
            value = getattr(self, key)
            _check(
                value > 0 and value % 32 == 0,
                f"sampling.{key}",
                f"GLM-Image needs a multiple of 32, got {value}; try {max(32, round(value / 32) * 32)}.",
            )
        unset = "leave it unset (null) for the pipeline's own value."
        _check(
            self.temperature is None or self.temperature > 0, "sampling.temperature", f"must be > 0; {unset}"
        )
        _check(self.top_p is None or 0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1]; {unset}")
        _check(self.top_k is None or self.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 = off); {unset}")
        _check(
            self.static_cache or not self.compile,
            "sampling.compile",
            "transformers compiles the decoding step only with a static KV cache; set "
            "sampling.static_cache=true.",
        )
        _check(self.dit_num_steps >= 1, "sampling.dit_num_steps", "must be >= 1.")
        _check_choice(self.dit_noise_seed, ("step", "prompt"), "sampling.dit_noise_seed")


@dataclass
class DAPOConfig:
    """GRPO/DAPO token-level loss and dynamic sampling."""

    # The ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]. DAPO's clip-higher (0.2 / 0.28) is for
    # token-level ratios; GSPO's sequence-level ratios need far smaller ranges: the paper uses 3e-4 / 4e-4
    # (TRL's GSPO recipe: epsilon=3e-4, epsilon_high=4e-4).
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28  # upper clip: 1 + epsilon_high (DAPO's clip-higher 0.28; GSPO: 4e-4)
    # token: one ratio per token (GRPO / DAPO). sequence: GSPO (arXiv 2507.18071; TRL's
    # importance_sampling_level="sequence"), one ratio per sample, the geometric mean of its token ratios.
    importance_sampling_level: str = "token"
    loss_aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    beta: float = 0.0  # KL (k3) coefficient
    scale_rewards: str = "group"
    adv_clip_max: float = 5.0
    num_inner_epochs: int = 1
    num_mini_batches: int = 1
    micro_batch_size: int = 4
    dynamic_sampling: bool = True  # DAPO's dynamic sampling: drop flat groups (min_group_std) and resample
    # A group whose reward std (population) is below this counts as flat: dynamic sampling drops it and
    # frac_zero_std_groups counts it. 0 = only exact ties. Continuous rewards (PickScore, HPS, aesthetic)
    # almost never tie, so set it to the reward's noise level there, or nothing is ever dropped and groups of
    # pure noise get unit advantages.
    min_group_std: float = 0.0
    max_resample_rounds: int = 3
    on_budget_exhausted: str = "warn"  # warn (train on what was found) | error

    def __post_init__(self) -> None:
        _check(0 < self.epsilon_low < 1, "algo.epsilon_low", "must be in (0, 1).")
        _check(self.epsilon_high > 0, "algo.epsilon_high", "must be > 0.")
        _check_choice(self.importance_sampling_level, ("token", "sequence"), "algo.importance_sampling_level")
        _check(self.min_group_std >= 0, "algo.min_group_std", "must be >= 0 (0 = only exact ties are flat).")
        _check_choice(
            self.loss_aggregation,
            ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
            "algo.loss_aggregation",
        )
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check_choice(self.scale_rewards, ("group", "batch", "none"), "algo.scale_rewards")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(self.micro_batch_size >= 1, "algo.micro_batch_size", "must be >= 1.")
        _check(self.max_resample_rounds >= 0, "algo.max_resample_rounds", "must be >= 0.")
        _check_choice(self.on_budget_exhausted, ("warn", "error"), "algo.on_budget_exhausted")


@dataclass
class DiTTrainConfig:
    """`python train_dit.py`: Flow-GRPO on the GLM-Image DiT decoder."""

    run_name: str = "dit"
    component: str = "dit"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: DiTSamplingConfig = field(default_factory=DiTSamplingConfig)
    algo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(self.component == "dit", "component", "train_dit.py trains the DiT; use train_ar.py for 'ar'.")
        self._check_algo_with_sampling()
        _check(
            not (self.algo.ema and self.trainer.strategy == "fsdp"),
            "algo.ema",
            "EMA is not supported with trainer.strategy=fsdp yet (its shadow weights would be sharded); "
            "set algo.ema=false or trainer.strategy=ddp.",
        )

    def _check_algo_with_sampling(self) -> None:
        # GRPO-Guard's re-centring assumes Gaussian log-probs; Flow-GRPO's CPS log-prob has no 1 / (2 std^2).
        _check(
            self.algo.ratio_norm != "grpo_guard"
            or self.sampling.sde_type == "flow_sde"
            or self.sampling.cps_log_prob == "gaussian",
            "algo.ratio_norm",
            "grpo_guard needs Gaussian log-probs; with sde_type=cps set sampling.cps_log_prob=gaussian.",
        )


@dataclass
class NFTTrainConfig(DiTTrainConfig):
    """`python train_dit.py --config configs/nft_training.yaml`: DiffusionNFT on the GLM-Image DiT decoder."""

    run_name: str = "nft"
    algo: NFTConfig = field(default_factory=NFTConfig)  # type: ignore[assignment]

    def _check_algo_with_sampling(self) -> None:
        pass  # NFT samples with the ODE: no log-probs, so no GRPO-Guard

    def __post_init__(self) -> None:
        # The old model is a copy of the unsharded trainable weights (or swapped into them): FSDP shards
        # those, so only DDP keeps the old model's forward passes correct.
        _check(
            self.trainer.strategy == "ddp",
            "trainer.strategy",
            f"DiffusionNFT runs under ddp only, got '{self.trainer.strategy}'; set trainer.strategy=ddp.",
        )
        super().__post_init__()


@dataclass
class ARTrainConfig:
    """`python train_ar.py`: GRPO/DAPO on the GLM-Image autoregressive token model."""

    run_name: str = "ar"
    component: str = "ar"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: ARSamplingConfig = field(default_factory=ARSamplingConfig)
    algo: DAPOConfig = field(default_factory=DAPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(
            self.component == "ar",
            "component",
            "train_ar.py trains the AR model; use train_dit.py for 'dit'.",
        )
        _check(
            not (self.sampling.compile and self.trainer.strategy == "fsdp"),
            "sampling.compile",
            "is not supported with trainer.strategy=fsdp (sharded weights are gathered into new buffers, "
            "which compiled CUDA graphs do not follow); set sampling.compile=false.",
        )


SCHEMAS: dict[str, type] = {
    "dit_schema": DiTTrainConfig,
    "nft_schema": NFTTrainConfig,
    "ar_schema": ARTrainConfig,
}
# `algo.name` of a saved DiT config -> its schema (configs saved before `algo.name` existed are Flow-GRPO).
DIT_SCHEMAS: dict[str, type] = {"flow_grpo": DiTTrainConfig, "nft": NFTTrainConfig}


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore; YAML files name them in their defaults list."""
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
    cs.store(group="model", name="model_schema", node=ModelConfig)


# ---------------------------------------------------------------------------------------------------------
# Command line -> typed config


@dataclass
class CommandLine:
    config_dir: Path
    config_name: str
    overrides: list[str]
    print_config: str | None = None  # --cfg job|all|hydra: print the resolved config and exit
    help: bool = False  # --help: list the flags, config groups and every key with its doc, and exit


# Hydra's flags: the ones a single training run uses work; the others are refused with the reason.
CFG_CHOICES = ("job", "all", "hydra")
_VALUE_FLAGS = ("--config", "-c", "--config-name", "-cn", "--config-path", "-cp", "--cfg")
_REFUSED = {
    ("--multirun", "-m"): "sweeps are not supported; start one run per setting (each its own output_dir)",
    ("--info", "-i"): "use --cfg job to see the resolved config, --help for the groups and keys",
    ("--package", "-p"): "--cfg prints the whole config; read one key in it",
    ("--run", "-r"): "a plain run is the default, drop the flag",
    ("--shell-completion", "-sc"): "shell completion is not installed by this project",
    ("--experimental-rerun",): "continue a run with trainer.resume=latest instead",
}
_REFUSED_FLAGS = {flag: why for flags, why in _REFUSED.items() for flag in flags}
# hydra.<key> overrides that mean something here, as the config key they set.
HYDRA_KEYS = {"hydra.run.dir": "trainer.output_dir"}


def parse_command_line(argv: list[str], default_config: str) -> CommandLine:
    """Split argv into the config file, Hydra's flags and overrides; `--config FILE` and `--config-name` work.

    Hydra's own flags: `--cfg job|all|hydra` (with or without `--resolve`) and `--help`/`-h` (and
    `--hydra-help`) are recorded for the entry point to act on; `hydra.run.dir=DIR` becomes
    `trainer.output_dir=DIR`. `-c` stays this project's short form of `--config` (Hydra's `--cfg`).
    """
    config_file: str | None = None
    config_dir: str | None = None
    config_name: str | None = None
    print_config: str | None = None
    want_help = False
    overrides: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, inline = arg.partition("=")
        if flag in _VALUE_FLAGS:
            value = inline if eq else next(it, None)
            if value is None or (not eq and value.startswith("-")):
                example = "--cfg job" if flag == "--cfg" else "--config configs/t2i_training.yaml"
                raise ConfigError(flag, f"expects a value, e.g. {example}")
            if flag in ("--config", "-c"):
                config_file = value
            elif flag in ("--config-name", "-cn"):
                config_name = value
            elif flag == "--cfg":
                _check_choice(value, CFG_CHOICES, "--cfg")
                print_config = value
            else:
                config_dir = value
        elif arg in ("--help", "-h", "--hydra-help"):
            want_help = True
        elif arg == "--resolve":
            pass  # what --cfg prints is always resolved: it is the typed config the run would use
        elif arg.startswith("-"):
            refused = _REFUSED_FLAGS.get(flag)
            if refused:
                raise ConfigError(flag, f"Hydra's flag is not supported here: {refused}.")
            raise ConfigError(
                arg,
                "unknown flag; use --config FILE or --config-name NAME, then key=value overrides "
                "(--cfg job prints the config, --help lists the keys).",
            )
        else:
            overrides.append(arg)
    overrides = _map_hydra_overrides(overrides)

    if config_file is not None:
        path = Path(config_file).expanduser()
        if path.suffix not in (".yaml", ".yml"):
            path = path.with_suffix(".yaml")
        if not path.is_file():
            raise ConfigError("--config", f"no such file '{config_file}'; available: {available_configs()}.")
        return CommandLine(path.resolve().parent, path.stem, overrides, print_config, want_help)
    name = config_name or default_config
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    directory = Path(config_dir).expanduser().resolve() if config_dir else CONFIG_DIR
    if not (directory / f"{name}.yaml").is_file():
        raise ConfigError(
            "--config-name", f"no '{name}.yaml' in {directory}; available: {available_configs()}."
        )
    return CommandLine(directory, name, overrides, print_config, want_help)


def _map_hydra_overrides(overrides: list[str]) -> list[str]:
    """`hydra.run.dir=DIR` -> `trainer.output_dir=DIR`; any other `hydra.` key is refused, never ignored.

    The config is composed with Hydra's compose API, not run under `@hydra.main`: no change of working
    directory, no `.hydra/` folder and no sweep, so the rest of Hydra's own settings would have no effect.
    """
    mapped: list[str] = []
    keys = {o.lstrip("+~").partition("=")[0] for o in overrides}
    for override in overrides:
        key, eq, value = override.lstrip("+").partition("=")
        if not key.startswith("hydra."):
            mapped.append(override)
            continue
        if key not in HYDRA_KEYS or not eq:
            raise ConfigError(
                key,
                "this Hydra setting has no effect here (the config is composed, not run under @hydra.main); "
                f"supported: {', '.join(f'{h}=... (sets {k})' for h, k in HYDRA_KEYS.items())}.",
            )
        target = HYDRA_KEYS[key]
        if target in keys:
            raise ConfigError(key, f"sets {target}, which is also given; keep one of the two.")
        mapped.append(f"{target}={value}")
    return mapped


def available_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIG_DIR.parent)) for p in CONFIG_DIR.glob("*.yaml"))


def compose_config(command: CommandLine) -> Any:
    """Compose the YAML with Hydra (defaults list, config groups, overrides) and convert it to dataclasses."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_configs()
    overrides = list(command.overrides)
    if command.config_dir != CONFIG_DIR:
        # A config file elsewhere still resolves the project's groups (model/tiny, model/glm_image).
        overrides.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(command.config_dir), version_base=None):
            cfg = compose(config_name=command.config_name, overrides=overrides)
        cfg = _with_schema(cfg, command)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            key = missing[0]
            hint = " (pick a model: model=tiny or model=glm_image)" if key == "model.name" else ""
            raise ConfigError(
                key, f"is required; set it in the YAML or on the command line ({key}=...){hint}."
            )
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise _unknown_key_error(err) from None
    except MissingMandatoryValue as err:
        key = _full_key(err)
        raise ConfigError(
            key, f"is required; set it in the YAML or on the command line ({key}=...)."
        ) from None
    except ValidationError as err:
        key = _full_key(err)
        raise ConfigError(key, f"wrong type or value: {err.msg.splitlines()[0]}") from None
    except HydraException as err:
        cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            raise _unknown_key_error(cause) from None
        if isinstance(cause, ValidationError):
            key = _full_key(cause)
            raise ConfigError(key, f"wrong type or value: {cause.msg.splitlines()[0]}") from None
        raise ConfigError("overrides", f"{str(err).splitlines()[0]}") from None
    finally:
        GlobalHydra.instance().clear()


def _with_schema(cfg: Any, command: CommandLine) -> Any:
    """A YAML without a schema in its defaults list (e.g. what `--cfg job` printed, or a run's config.yaml)
    is typed by its `component` key, so it validates like any config instead of passing as a plain dict."""
    if is_dataclass(OmegaConf.get_type(cfg)):
        return cfg
    component = cfg.get("component")
    schema = {"dit": DiTTrainConfig, "ar": ARTrainConfig}.get(component)
    if schema is None:
        raise ConfigError(
            "defaults",
            f"{command.config_dir / command.config_name}.yaml names no schema; start it with "
            "`defaults: [dit_schema, {model: tiny}, _self_]` (ar_schema for the AR trainer) or set "
            "`component: dit` / `component: ar`.",
        )
    return OmegaConf.merge(OmegaConf.structured(schema), cfg)


def load_config(
    argv: Sequence[str] | None = None,
    default_config: str = "t2i_training",
    *,
    config: str | None = None,
    overrides: Sequence[str] = (),
) -> Any:
    """The validated config dataclass (`DiTTrainConfig` or `ARTrainConfig`) of a command line or of Python.

    Command line: `load_config(sys.argv[1:], "t2i_training")`. Python: `load_config(config="ar_training",
    overrides=["trainer.num_steps=10"])`; `config` is a name in `configs/` or a YAML path, `overrides` Hydra
    overrides (`key=value`, `model=glm_image`, `hydra.run.dir=DIR`). Printing flags (`--cfg`, `--help`) belong
    to the entry points; from Python use `config_to_yaml(cfg)`.
    """
    args = list(argv or [])
    if config is not None:
        is_file = config.endswith((".yaml", ".yml")) or "/" in config
        args = ["--config" if is_file else "--config-name", config, *args]
    command = parse_command_line([*args, *overrides], default_config)
    if command.print_config or command.help:
        flag = "--help" if command.help else "--cfg"
        raise ConfigError(
            flag, "prints and exits in the entry points only; in Python print config_to_yaml(cfg)."
        )
    return compose_config(command)


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """A run's saved `config.yaml` (checkpoints carry one) with `key=value` overrides, as the typed config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "config.yaml", f"'{path}' does not exist; a checkpoint folder holds its run's config.yaml."
        )
    saved = OmegaConf.load(path)
    component = saved.get("component", "dit")
    schema = {"dit": DiTTrainConfig, "ar": ARTrainConfig}.get(component)
    if schema is None:
        raise ConfigError("component", f"'{component}' in {path} is neither 'dit' nor 'ar'.")
    if component == "dit":
        algo_name = OmegaConf.select(saved, "algo.name", default="flow_grpo")
        _check_choice(algo_name, tuple(DIT_SCHEMAS), "algo.name")
        schema = DIT_SCHEMAS[algo_name]
    try:
        cfg = OmegaConf.merge(
            OmegaConf.structured(schema), saved, OmegaConf.from_dotlist(list(overrides or []))
        )
        return OmegaConf.to_object(cfg)
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise _unknown_key_error(err) from None
    except ValidationError as err:
        raise ConfigError(_full_key(err), f"wrong type or value: {err.msg.splitlines()[0]}") from None


def _full_key(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    return str(key)


def _unknown_key_error(err: OmegaConfBaseException) -> ConfigError:
    full_key = _full_key(err)
    parent, _, leaf = full_key.rpartition(".")
    valid = _valid_keys(parent)
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" Did you mean '{(parent + '.') if parent else ''}{close[0]}'?" if close else ""
    return ConfigError(
        full_key, f"no such key.{hint} Valid keys{' under ' + parent if parent else ''}: {valid}."
    )


def _valid_keys(parent: str) -> list[str]:
    """Field names at a dotted path of any schema (union over the DiT and AR schemas)."""
    names: set[str] = set()
    for schema in SCHEMAS.values():
        node: Any = schema
        for part in [p for p in parent.split(".") if p]:
            match = [f for f in fields(node) if f.name == part] if is_dataclass(node) else []
            node = _field_type(match[0]) if match else None
            if node is None:
                break
        if node is not None and is_dataclass(node):
            names.update(f.name for f in fields(node))
    return sorted(names)


def _field_type(f: Any) -> Any:
    default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
    return type(default) if is_dataclass(default) else None


def config_to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


__all__ = [
    "ARTrainConfig",
    "ConfigError",
    "DiTTrainConfig",
    "MISSING",
    "NFTTrainConfig",
    "config_to_yaml",
    "load_config",
    "parse_command_line",
]
