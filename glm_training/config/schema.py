"""The config schema's shared sections: one dataclass per section, each field with its default and its
`--help` text (`option`).

Every setting a run reads is typed and validated at start-up (``__post_init__``), so a misspelt key, a wrong
type, a bad resolution or a missing value stops the run before any model is loaded, with a message that names
the key and the fix. Sizes that depend on the world size (per-rank batch, groups per rank) are derived in code
(`per_rank_samples`), never written in YAML; the YAML files in `configs/` choose values.

A run config (`run.py`) is a section per concern: `model` (`model.py`), `data`, `reward`, `optim`, `trainer`,
`eval`, `logging` (here), and the `sampling` and `algo` sections each algorithm declares in its own folder
(`algorithms/<name>/config.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_training.config.options import (
    BUNDLED_EVAL_PROMPTS,
    BUNDLED_PROMPTS,
    CHECKPOINT_FORMATS,
    REWARD_COMBINES,
    STRATEGIES,
    ConfigError,
    _check,
    _check_choice,
    option,
)


@dataclass
class DataConfig:
    """Prompts and grouping. A group is `num_generations` samples of one prompt."""

    prompt_file: str = option(
        "",
        (
            'One prompt per line (.txt) or one JSON object per line with a "prompt" key (.jsonl; '
            'other keys, e.g. "text" for the OCR reward, are passed to the rewards as metadata). '
            "Empty = the bundled prompts."
        ),
    )
    num_generations: int = option(4, "samples per prompt (a group); group-relative advantages need >= 2")
    num_groups_per_step: int = option(
        4,
        (
            "Groups (prompts) per step over all ranks. The groups x generations samples are split"
            " evenly over the ranks, so a group may straddle ranks (its statistics are gathered)."
        ),
    )
    prior_cache: str = option(
        "",
        (
            "DiT trainer only: a folder written by `python -m glm_training.priors`. Each group's "
            "prior tokens then come from the cache (chosen from (trainer.seed, step, group, "
            "prompt)) and the AR model is never loaded. Empty = the AR model samples them live at"
            " every step."
        ),
    )

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

    names: list[str] = option(
        factory=lambda: ["jpeg_compressibility"],
        help="registered rewards (ocr, pickscore, ...) or your own module:function (docs/rewards.md)",
    )
    weights: list[float] = option(factory=list, help="empty = 1.0 each")
    options: dict[str, Any] = option(factory=dict, help="per reward name: constructor keyword arguments")
    combine: str = option(
        "weighted_sum",
        (
            "weighted_sum: sum_k w_k r_k. normalized_sum: each reward standardised within its "
            "group first, so rewards on different scales count by their weights alone (see "
            "`rewards/combine.py`)."
        ),
    )
    overlap: bool = option(
        False,
        (
            "Score each decoded micro-batch in a worker thread while the rollout samples the next"
            " one. The scores are the same either way; it saves time when a reward model and the "
            "rollout can run side by side."
        ),
    )
    on_nonfinite: str = option(
        "error",
        (
            "A NaN/inf score: `error` stops the run naming the reward and samples; `drop` gives "
            "the sample's group zero advantage (it teaches nothing this step) and counts it as "
            "`dropped_nonfinite_groups`."
        ),
    )
    max_retries: int = option(
        3,
        (
            "Rewards that declare themselves retryable (remote, model scorers) are retried this "
            "many times, waiting retry_backoff_s * 2**k before retry k+1. Then `on_failure`: "
            "`error` stops every rank with the reward's name; `skip` makes the step's update a "
            "no-op on every rank (counted as `skipped_reward_failure`)."
        ),
    )
    retry_backoff_s: float = option(
        1.0, "seconds before the first retry of a retryable reward; doubled for each next one"
    )
    on_failure: str = option(
        "error", "after the retries: error (stop every rank) | skip (no update this step, counted)"
    )

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
        _check_choice(self.combine, REWARD_COMBINES, "reward.combine")
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


# The image statistics the reward-hacking monitors report (`glm_training/image_stats.py` STATISTICS), each
# with the drift from step 0 past which `eval.hacking_alarm` acts: mean luma and fractions of pixels in
# [0, 1], bits of colour entropy, mean thumbnail distances.
HACKING_BOUNDS = {
    "brightness": 0.25,
    "dark_fraction": 0.25,
    "bright_fraction": 0.25,
    "colour_entropy": 2.0,
    "edge_density": 0.2,
    "saturation": 0.25,
    "diversity": 0.1,
}
HACKING_ALARMS = ("off", "warn", "error")


@dataclass
class EvalConfig:
    """Held-out evaluation: deterministic sampling (ODE, no SDE noise, one fixed seed per prompt).

    Runs before the first step and every `every_n_steps` during training (0 = off), and standalone with
    `python -m glm_training.evaluate`. Writes `<output_dir>/eval/<step>.json` and an image grid each time.
    Zeros and nulls below mean "as the training sampling".
    """

    every_n_steps: int = option(0, "evaluate before training, every this many steps and at the end (0 = off)")
    prompt_file: str = option(
        "", ".txt or .jsonl like data.prompt_file; empty = the bundled held-out prompts"
    )
    num_prompts: int = option(0, "0 = every prompt in the file")
    seed: int = option(0, "each prompt's seed is derived from this and the prompt text")
    num_inference_steps: int = option(0, "denoising steps (0 = as the training sampling)")
    guidance_scale: float | None = option(None, "classifier-free guidance (null = as the training sampling)")
    height: int = option(0, "image height (0 = as the training sampling)")
    width: int = option(0, "image width (0 = as the training sampling)")
    batch_size: int = option(
        4, "prompts per sampling batch (fixed, so results do not depend on the number of ranks)"
    )
    num_grid_images: int = option(16, "images in the eval/<step>.png grid")
    watch_rewards: list[str] = option(
        factory=list,
        help=(
            "Rewards the evaluation reports but training never optimises (registered names or "
            "module:function, as reward.names), to catch reward hacking: eval/<step>.json `watched`, "
            "scalars eval/watched/<name>; not part of reward_mean. None may be in reward.names."
        ),
    )
    watch_reward_options: dict[str, Any] = option(
        factory=dict, help="per watched reward name: constructor keyword arguments (as reward.options)"
    )
    text_metrics: bool = option(
        False,
        (
            "OCR word accuracy and normalised edit distance of the text each held-out prompt asks for "
            "(its JSONL `text`, else its quoted text; prompts without text are left out and counted): "
            "eval/<step>.json `text_metrics`, scalars eval/text/word_accuracy and eval/text/ned. Reads "
            "with the ocr reward's recogniser (RapidOCR, offline; its options when ocr is a training or "
            "watched reward)."
        ),
    )

    image_stats: bool = option(
        True,
        (
            "Image statistics of every step's samples (metrics image/<name>) and of every evaluation "
            "(eval/image/<name>), each with its change from step 0 (<name>_change): brightness, near-black "
            "and near-white fractions, colour entropy, edge density, saturation, a group's diversity "
            "(docs/outputs.md)"
        ),
    )
    hacking_alarm: str = option(
        "warn",
        (
            "off | warn | error: when an image statistic has drifted from step 0 by more than its bound "
            "in eval.hacking_bounds while the reward rose, warn (once per statistic) or stop the run, "
            "naming the statistic and the step"
        ),
    )
    hacking_bounds: dict[str, float] = option(
        factory=lambda: dict(HACKING_BOUNDS),
        help="the largest drift from step 0 each image statistic may take before eval.hacking_alarm acts",
    )

    def __post_init__(self) -> None:
        _check(self.every_n_steps >= 0, "eval.every_n_steps", "must be >= 0 (0 = no evaluation).")
        _check_choice(self.hacking_alarm, HACKING_ALARMS, "eval.hacking_alarm")
        unknown = sorted(set(self.hacking_bounds) - set(HACKING_BOUNDS))
        _check(
            not unknown,
            "eval.hacking_bounds",
            f"{unknown} are not image statistics; the statistics are {sorted(HACKING_BOUNDS)}.",
        )
        _check(
            all(v > 0 for v in self.hacking_bounds.values()),
            "eval.hacking_bounds",
            "every bound must be > 0.",
        )
        _check(
            self.hacking_alarm == "off" or self.image_stats,
            "eval.hacking_alarm",
            "needs eval.image_stats=true (the statistics it watches); or set eval.hacking_alarm=off.",
        )
        repeated = sorted({n for n in self.watch_rewards if self.watch_rewards.count(n) > 1})
        _check(not repeated, "eval.watch_rewards", f"names {repeated} more than once; name each once.")
        _check(
            all(isinstance(n, str) and n for n in self.watch_rewards),
            "eval.watch_rewards",
            "entries must be reward names (registered, or module:function).",
        )
        unknown = sorted(set(self.watch_reward_options) - set(self.watch_rewards))
        _check(
            not unknown,
            "eval.watch_reward_options",
            f"options given for rewards not in eval.watch_rewards: {unknown}; add them there or drop "
            "their options.",
        )
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

    tensorboard: bool = option(True, "<output_dir>/tensorboard")
    wandb: bool = option(False, "log to Weights & Biases too (pip install -e .[wandb])")
    wandb_project: str = option("glm-training", "W&B project")
    wandb_entity: str | None = option(None, "W&B entity (team or user; null = your default)")
    wandb_mode: str = option("online", "online | offline (no network; `wandb sync` later) | disabled")
    images_every_n_steps: int = option(10, "a captioned grid of training samples (0 = never)")
    num_images: int = option(8, "images per logged training grid")

    def __post_init__(self) -> None:
        _check_choice(self.wandb_mode, ("online", "offline", "disabled"), "logging.wandb_mode")
        _check(self.images_every_n_steps >= 0, "logging.images_every_n_steps", "must be >= 0 (0 = never).")
        _check(self.num_images >= 1, "logging.num_images", "must be >= 1.")


@dataclass
class OptimConfig:
    lr: float = option(
        3e-4,
        "AdamW learning rate (0 keeps the weights: the update runs and changes nothing, e.g. to hold one "
        "half of a joint run fixed)",
    )
    weight_decay: float = option(1e-4, "AdamW weight decay")
    betas: list[float] = option(factory=lambda: [0.9, 0.999], help="AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "gradients are clipped to this global norm")
    warmup_steps: int = option(0, "linear learning-rate warm-up over this many optimizer steps (0 = none)")

    def __post_init__(self) -> None:
        _check(self.lr >= 0, "optim.lr", f"must be >= 0, got {self.lr}.")
        _check(len(self.betas) == 2, "optim.betas", "give two numbers, e.g. [0.9, 0.999].")
        _check(self.max_grad_norm > 0, "optim.max_grad_norm", "must be > 0.")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0.")


@dataclass
class TrainerConfig:
    """The loop: how long, where outputs go, checkpoints, distribution."""

    num_steps: int = option(20, "training steps (each: rollout, rewards, update)")
    seed: int = option(
        0, "seed of the prompts and the sampling noise of every step (resume continues it exactly)"
    )
    output_dir: str = option(
        "", "Empty = outputs/<run name>-<timestamp>, chosen by rank 0 and shared with every rank."
    )
    save_every: int = option(10, "training steps between checkpoints; a final one is always written")
    keep_last: int = option(0, "0 keeps every checkpoint")
    checkpoint_format: str = option(
        "gathered",
        "gathered: rank 0 writes the whole trained weights and AdamW state (trainable.safetensors, "
        "optimizer.pt; under fsdp gathered one tensor at a time into rank 0's host memory). sharded: each "
        "rank writes its own part at once (torch.distributed.checkpoint, a shards/ folder): no rank holds "
        "the whole state; resumes under any strategy and number of ranks; export and model.*_weights "
        "consolidate it in one process",
    )
    async_save: bool = option(
        False,
        "checkpoint_format=sharded only: each rank copies its part of a checkpoint to host memory and writes "
        "it in the background while training goes on (torch.distributed.checkpoint.async_save). The "
        "checkpoint is hashed and becomes final when its writing ends, at the latest when the next one "
        "starts; the last checkpoint of a run is written at once. A run stopped meanwhile resumes from the "
        "checkpoint before",
    )
    resume: str | None = option(None, 'a checkpoint folder, or "latest" (newest in output_dir)')
    mixed_precision: str = option(
        "no",
        "accelerate: no | bf16 | fp16. With float32 master weights (model.fp32_master_weights) no becomes "
        "model.dtype's (bf16 for a bfloat16 model): the weights' dtype is the model's",
    )
    strategy: str = option(
        "ddp",
        (
            "ddp (replicated weights, accelerate's DDP) | fsdp (FSDP2 `fully_shard`: the "
            "trainable component, its gradients and optimizer state split over the ranks; see "
            "glm_training/distributed/sharding.py)"
        ),
    )
    fsdp_gather_for_rollout: bool = option(
        True,
        (
            "fsdp: gather the whole trained component once for each rollout and evaluation "
            "instead of one unit per forward (per denoising step / generated token); one full "
            "copy per rank while sampling (TRL's ds3_gather_for_generation). false = least "
            "memory, many more all-gathers."
        ),
    )
    fsdp_shard_size: int = option(
        0,
        "fsdp: shard over groups of this many ranks and replicate across the groups (HSDP; set it to the "
        "GPUs of one node, so the all-gathers stay on the node's NVLink and only gradients cross nodes). "
        "0 = shard over all ranks. Must divide the number of ranks",
    )
    fsdp_reference_offload: bool = option(
        False,
        (
            "fsdp + full fine-tuning with algo.beta > 0: keep the frozen KL reference's shards in"
            " host memory and copy them to the device for each forward (FSDP2's "
            "CPUOffloadPolicy), instead of on the device."
        ),
    )
    fsdp_load_into_shards: bool = option(
        True,
        "fsdp: build the trained component on the meta device, shard it, and read each rank's part of its "
        "weights straight from the safetensors files (torch.distributed.checkpoint's "
        "HuggingFaceStorageReader): no rank holds the whole trained component or the whole KL reference "
        "(glm_training/distributed/loading.py). false = every rank loads the whole pipeline, then shards",
    )
    dist_timeout_s: float = option(
        600.0,
        (
            "Bound on every collective once training runs: a rank that dies or stalls makes the "
            "others fail within it, naming the step and phase. Loading is bounded by "
            "model.stage_timeout_s instead. It must cover the longest wait of one rank for "
            "another, e.g. rank 0 writing a full fine-tune's checkpoint."
        ),
    )
    max_consecutive_skips: int = option(
        5,
        (
            "Steps in a row that make no update (non-finite loss/gradients, a reward failure with"
            " on_failure=skip) before the run stops with TooManySkippedSteps; 0 = never stop."
        ),
    )
    progress_bar: bool = option(True, "show a progress bar on rank 0 (false: one log line per step)")

    def __post_init__(self) -> None:
        _check(self.num_steps >= 1, "trainer.num_steps", "must be >= 1.")
        _check(self.fsdp_shard_size >= 0, "trainer.fsdp_shard_size", "must be >= 0 (0 = all ranks).")
        _check(
            math.isfinite(self.dist_timeout_s) and self.dist_timeout_s > 0,
            "trainer.dist_timeout_s",
            "must be a finite number of seconds > 0.",
        )
        _check(self.max_consecutive_skips >= 0, "trainer.max_consecutive_skips", "must be >= 0 (0 = never).")
        _check(self.save_every >= 0, "trainer.save_every", "must be >= 0 (0 = only at the end).")
        _check(self.keep_last >= 0, "trainer.keep_last", "must be >= 0 (0 = keep all).")
        _check_choice(self.checkpoint_format, CHECKPOINT_FORMATS, "trainer.checkpoint_format")
        _check(
            not self.async_save or self.checkpoint_format == "sharded",
            "trainer.async_save",
            "writes sharded checkpoints in the background; set trainer.checkpoint_format=sharded (the "
            "gathered format is written by rank 0 alone, at once).",
        )
        _check_choice(self.mixed_precision, ("no", "bf16", "fp16"), "trainer.mixed_precision")
        _check(
            self.strategy != "deepspeed",
            "trainer.strategy",
            "deepspeed is not supported: no DeepSpeed run passes this project's tests. Use "
            "trainer.strategy=fsdp (FSDP2) to shard parameters, gradients and optimizer state.",
        )
        _check_choice(self.strategy, STRATEGIES, "trainer.strategy")
        _check(
            self.strategy != "fsdp" or self.mixed_precision != "fp16",
            "trainer.mixed_precision",
            "fp16 is not supported with trainer.strategy=fsdp (it would need a sharded gradient scaler); "
            "use bf16, whose FSDP2 policy computes in bf16 and reduces gradients in fp32.",
        )
