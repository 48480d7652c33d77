"""The config schema: one dataclass per section, each field with its default and its `--help` text.

Every setting a run reads lives here, typed and validated at start-up (``__post_init__``), so a misspelt key,
a wrong type, a bad resolution or a missing value stops the run before any model is loaded, with a message
that names the key and the fix. Sizes that depend on the world size (per-rank batch, groups per rank) are
derived in code (`per_rank_samples`), never written in YAML. A field's doc is its `help` metadata
(`option(default, help)`), which `--help` prints; the YAML files in `configs/` choose values.

A run config is a section per concern (`model`, `data`, `reward`, `sampling`, `algo`, `optim`, `trainer`,
`eval`, `logging`); the decoder algorithms share `DiffusionTrainConfig` and differ in `sampling` and `algo`.
Which run config belongs to which algorithm and trainer is `config/algorithms.py`'s table.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from glm_training.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
BUNDLED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts_tiny.txt"
BUNDLED_EVAL_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts_eval.txt"


class ConfigError(UserError, ValueError):
    """A user-facing configuration error; the message names the key and the fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def option(
    default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None
) -> Any:
    """A config field with its `--help` text as field metadata (TRL's `field(metadata={"help": ...})`).

    `factory` makes a fresh default for each config (lists, dicts), as `field(default_factory=...)`.
    """
    metadata = {"help": " ".join(help.split())}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def _check_choice(value: Any, choices: tuple, key: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(key, f"'{value}' is not one of {list(choices)}.{hint}")


RUN_NAME_HELP = "names the default output folder outputs/<run_name>-<time> and the tracker run"
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "cpu", "cuda")
# The choices of keys that pick an entry of a dispatch table elsewhere (named beside each). They are spelt
# here, not imported from those tables, so that `--help` and `--cfg` answer without loading torch;
# tests/test_config.py checks that each equals the keys of its table.
SCALE_REWARDS = ("group", "batch", "none")  # trainers/reward_trainer.py ADVANTAGE_FNS
REWARD_COMBINES = ("weighted_sum", "normalized_sum")  # rewards/combine.py COMBINE_FNS
STRATEGIES = ("ddp", "fsdp")  # parallel.py STRATEGIES
CHECKPOINT_FORMATS = ("gathered", "sharded")
DECODING_PATHS = ("loop", "generate")  # rollout/ar.py DECODING_PATHS
SDE_TYPES = ("flow_sde", "cps")  # rollout/dit.py SDE_STEPS
CPS_LOG_PROBS = ("flow_grpo", "gaussian")  # algorithms/sde.py LOG_PROBS
SDE_WINDOW_SCHEDULES = ("random", "progressive")  # trainers/dit_trainer.py WINDOW_STARTS
DIT_KL_TYPES = ("flow_grpo", "exact", "velocity")  # algorithms/flow_grpo.py KL_FNS
RATIO_NORMS = ("none", "grpo_guard")  # algorithms/flow_grpo.py LOG_RATIOS
NFT_DECAY_TYPES = (0, 1, 2)  # algorithms/nft.py DECAY_SCHEDULES
AWM_WEIGHTINGS = ("ghuber", "huber", "t", "t_squared", "uniform")  # algorithms/awm.py WEIGHTINGS
AWM_TIME_TYPES = ("discrete_wo_init", "discrete")  # algorithms/awm.py TIME_TYPES
AWM_ANCHOR_DECAY_TYPES = ("linear", "constant")  # algorithms/awm.py ANCHOR_DECAY_TYPES
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # trainers/ar_trainer.py IMPORTANCE_SAMPLING
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # ar_trainer.py AGGREGATIONS


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the trainable component; `enabled=False` means full fine-tuning."""

    enabled: bool = option(
        True, "LoRA adapters on the trainable component; false trains every weight (full fine-tuning)"
    )
    rank: int = option(32, "LoRA rank r")
    alpha: int = option(64, "LoRA alpha; the adapter output is scaled by alpha / rank")
    dropout: float = option(
        0.0, "dropout on the adapter input (keep 0: the recomputed log-probs must equal the rollout's)"
    )
    target_modules: list[str] = option(
        factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        help="Attention projections of the GLM-Image DiT; the AR trainer's YAML names the GLM ones.",
    )

    def __post_init__(self) -> None:
        _check(self.rank > 0, "model.lora.rank", f"must be > 0, got {self.rank}.")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}.")
        _check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}.")
        _check(len(self.target_modules) > 0, "model.lora.target_modules", "name at least one module.")


@dataclass
class ModelConfig:
    """Which GLM-Image to load and how to place it (see `glm_training.models.placement`)."""

    name: str = option(
        MISSING,
        (
            'Required (the `model/` config group sets it). "tiny" builds (once, cached) a random-'
            "weight GLM-Image offline; anything else is a hub id or a local folder loaded through"
            ' the very same `from_pretrained` path, e.g. "zai-org/GLM-Image".'
        ),
    )
    tiny_seed: int = option(0, "seed of the tiny model's random weights (model.name=tiny only)")
    dtype: str = option("float32", "weight dtype of the loaded pipeline: float32 | bfloat16 | float16")
    device_map: str = option(
        "auto",
        (
            'Single process only: "auto" (-> diffusers\' "balanced"), "balanced", "cuda", or "cpu"'
            " (load on CPU, then move to the training device). Distributed runs always load on "
            "CPU and move to the rank's device."
        ),
    )
    max_memory_fraction: float = option(
        0.9, "share of each GPU's memory a single-process device map may fill (0.1 to 1)"
    )
    stage_timeout_s: float = option(
        1800.0,
        (
            "A loading stage (download/read, placement, wrapping) that runs longer than this "
            "fails with an error naming the stage instead of hanging silently."
        ),
    )
    gradient_checkpointing: bool = option(
        False, "recompute activations in the backward pass (less memory, more time)"
    )
    shape_num_ar_layers: int = option(
        1,
        (
            "model.name=glm_image_shape only (the real-width random fixture, `models/shape.py`): "
            "how many AR decoder layers and DiT blocks it has (the real model: 40 and 30)."
        ),
    )
    shape_num_dit_layers: int = option(1, "DiT blocks of the real-width fixture (model=glm_image_shape only)")
    fp32_master_weights: bool = option(
        True,
        "full fine-tuning of a model loaded in bfloat16 / float16 keeps the trained weights and their "
        "AdamW state in float32 (master weights; checkpoints keep them, export writes model.dtype) and "
        "computes in model.dtype through trainer.mixed_precision; the frozen half and the KL reference "
        "stay in model.dtype. false trains the low-precision weights themselves: an update smaller than "
        "their rounding is lost (at RL learning rates, most of them). LoRA adapters are float32 either way",
    )
    lora: LoraConfig = field(default_factory=LoraConfig)
    ar_weights: str = option(
        "",
        (
            "Chaining the decoupled stages (docs/decoupled.md): the AR model the DiT "
            "trainer and `python -m glm_training.priors` sample prior tokens with, as an AR run "
            "folder, a checkpoint step folder (LoRA or full) or an export folder. Empty = the "
            "base model's own AR weights."
        ),
    )
    dit_weights: str = option(
        "",
        (
            "The DiT the AR trainer renders with, as a DiT run folder, a checkpoint step folder "
            "(LoRA or full) or an export folder. Empty = the base model's own DiT weights."
        ),
    )

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

    def keeps_master_weights(self) -> bool:
        """Whether the trained weights are float32 masters of a lower-precision model (full fine-tuning)."""
        return self.fp32_master_weights and not self.lora.enabled and self.dtype != "float32"

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

    def __post_init__(self) -> None:
        _check(self.every_n_steps >= 0, "eval.every_n_steps", "must be >= 0 (0 = no evaluation).")
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
    lr: float = option(3e-4, "AdamW learning rate")
    weight_decay: float = option(1e-4, "AdamW weight decay")
    betas: list[float] = option(factory=lambda: [0.9, 0.999], help="AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "gradients are clipped to this global norm")
    warmup_steps: int = option(0, "linear learning-rate warm-up over this many optimizer steps (0 = none)")

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}.")
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
            "glm_training/sharding.py)"
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
        "(glm_training/models/sharded_loading.py). false = every rank loads the whole pipeline, then shards",
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


@dataclass
class DiffusionSamplingConfig:
    """The DiT rollout: what every decoder algorithm's sampling has (DiffusionNFT: its ODE sampler)."""

    height: int = option(64, "image height in pixels, a multiple of 32")
    width: int = option(64, "image width in pixels, a multiple of 32")
    num_steps: int = option(10, "denoising steps of the rollout")
    guidance_scale: float = option(1.5, "classifier-free guidance of the DiT (<= 1 disables it)")
    batched_cfg: bool = option(
        False,
        (
            "Conditional and unconditional CFG passes in one DiT forward of 2B samples (rollout "
            "and training). Off by default: GLM-Image's DiT takes no text mask, so padding the "
            "empty prompt's glyph embeddings to the prompt's length changes the unconditional "
            "prediction slightly (docs/benchmarks.md)."
        ),
    )
    micro_batch_size: int = option(4, "images per DiT forward pass during the rollout")

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
        _check(self.micro_batch_size >= 1, "sampling.micro_batch_size", "must be >= 1.")


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
class FlowGRPOConfig:
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
    adv_clip_max: float = option(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]")
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
    num_inner_epochs: int = option(1, "passes over each rollout's samples")
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
    ema: bool = option(
        False, "keep an exponential moving average of the trained weights (evaluated and exported)"
    )
    ema_decay: float = option(0.9, "EMA decay per optimizer step")

    def __post_init__(self) -> None:
        _check(
            self.name == "flow_grpo",
            "algo.name",
            f"'{self.name}' needs its own schema: for DiffusionNFT use --config configs/nft_training.yaml.",
        )
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check_choice(self.kl_type, DIT_KL_TYPES, "algo.kl_type")
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check_choice(self.scale_rewards, SCALE_REWARDS, "algo.scale_rewards")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check_choice(self.ratio_norm, RATIO_NORMS, "algo.ratio_norm")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")


@dataclass
class NFTConfig:
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
    num_inner_epochs: int = option(1, "passes over each rollout's samples")
    num_mini_batches: int = option(1, "optimizer steps per rollout (the reference: 1; OCR: 2)")
    ema: bool = option(
        True,
        "EMA of the policy for evaluation (the reference's `train.ema`, decay 0.9); not the old model.",
    )
    ema_decay: float = option(0.9, "decay of the evaluation EMA (algo.ema)")

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
        _check_choice(self.decay_type, NFT_DECAY_TYPES, "algo.decay_type")
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check_choice(self.scale_rewards, SCALE_REWARDS, "algo.scale_rewards")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")

    def num_train_times(self, num_steps: int) -> int:
        """Training times per sample: the reference's int(num_steps * timestep_fraction), at least 1."""
        return max(1, int(num_steps * self.timestep_fraction))


@dataclass
class AWMConfig:
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
    num_inner_epochs: int = option(1, "passes over each rollout's samples")
    num_mini_batches: int = option(1, "optimizer steps per rollout (the reference: 1)")
    ema: bool = option(True, "EMA of the policy for evaluation (the reference's train.ema, decay 0.99)")
    ema_decay: float = option(0.99, "decay of the evaluation EMA (algo.ema); not the KL anchor")

    def __post_init__(self) -> None:
        _check(
            self.name == "awm",
            "algo.name",
            f"the awm schema trains AWM; for '{self.name}' use configs/t2i_training.yaml.",
        )
        _check_choice(self.weighting, AWM_WEIGHTINGS, "algo.weighting")
        _check(self.ghuber_power > 0, "algo.ghuber_power", "must be > 0 (the reference: 0.25).")
        _check(self.train_timesteps >= 1, "algo.train_timesteps", "must be >= 1.")
        _check(0 < self.timestep_fraction <= 1, "algo.timestep_fraction", "must be in (0, 1].")
        _check_choice(self.time_type, AWM_TIME_TYPES, "algo.time_type")
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check(self.ema_beta >= 0, "algo.ema_beta", "must be >= 0 (0 = no EMA anchor).")
        _check(0 <= self.kl_ema_decay < 1, "algo.kl_ema_decay", "must be in [0, 1).")
        _check_choice(self.kl_ema_decay_type, AWM_ANCHOR_DECAY_TYPES, "algo.kl_ema_decay_type")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check(self.advantage_max > 0, "algo.advantage_max", "must be > 0.")
        _check(self.clip_range > 0, "algo.clip_range", "must be > 0.")
        _check_choice(self.scale_rewards, SCALE_REWARDS, "algo.scale_rewards")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(0 <= self.ema_decay < 1, "algo.ema_decay", "must be in [0, 1).")


@dataclass
class ARSamplingConfig:
    """The AR rollout: image-token sampling, and the frozen DiT that renders each sample for the reward."""

    height: int = option(64, "image height in pixels, a multiple of 32")
    width: int = option(64, "image width in pixels, a multiple of 32")
    temperature: float | None = option(
        None,
        (
            "The policy trained is the distribution the tokens are sampled from, so temperature /"
            " top_p / top_k unset (null) = what GlmImagePipeline itself samples with: the AR "
            "checkpoint's generation_config, and transformers' defaults where it is silent (real "
            "checkpoint and tiny model: 0.9 / 0.75 / 50). The resolved values are logged at start"
            ' ("AR sampling: ..."); a value set here overrides.'
        ),
    )
    top_p: float | None = option(None, "nucleus sampling threshold (1 = off; null = the pipeline's)")
    top_k: int | None = option(
        None, "top-k filter (0 = off; null = the pipeline's, transformers' 50 when unset)"
    )
    decoding: str = option(
        "loop",
        (
            "How image tokens are decoded. loop: the project's own decoding loop (positions computed up "
            "front, a preallocated KV cache, each token's log-prob computed in its step; ~20% faster than "
            "generate() on CPU, see docs/benchmarks.md); generate: transformers' generate(). Both draw "
            "the same tokens for a seed and record the same log-probs up to float rounding "
            "(tests/test_ar_logprobs.py)."
        ),
    )
    static_cache: bool = option(
        False,
        (
            'decoding=generate only: a static KV cache (transformers\' cache_implementation="static"), '
            "the same tokens for the same seed, log-probs equal up to fp32 rounding. The loop always "
            "preallocates its cache."
        ),
    )
    compile: bool = option(
        False,
        (
            "decoding=loop only: torch.compile of the decoding step (CUDA graphs on CUDA); compiles on first "
            "use and for every new batch size or resolution. The same tokens for the same seed."
        ),
    )
    dit_num_steps: int = option(
        4, "denoising steps of the frozen DiT that renders each sample for the reward"
    )
    dit_guidance_scale: float = option(1.5, "classifier-free guidance of that DiT")
    dit_noise_seed: str = option(
        "step",
        (
            "The DiT noise that renders a group is fixed per group (rewards inside a group differ"
            ' only through the AR tokens). "step": drawn anew for every group of every step; '
            '"prompt": the same for a prompt at every step, which makes the reward a '
            "deterministic function of (prompt, tokens): less variance, at the cost of learning "
            "tokens for one noise draw per prompt."
        ),
    )

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
        _check_choice(self.decoding, DECODING_PATHS, "sampling.decoding")
        _check(
            self.decoding == "generate" or not self.static_cache,
            "sampling.static_cache",
            "applies to sampling.decoding=generate; the decoding loop always preallocates its KV cache. "
            "Drop sampling.static_cache, or set sampling.decoding=generate.",
        )
        _check(
            self.decoding == "loop" or not self.compile,
            "sampling.compile",
            "compiles the decoding loop's step; set sampling.decoding=loop, or sampling.compile=false.",
        )
        _check(self.dit_num_steps >= 1, "sampling.dit_num_steps", "must be >= 1.")
        _check_choice(self.dit_noise_seed, ("step", "prompt"), "sampling.dit_noise_seed")


@dataclass
class DAPOConfig:
    """GRPO/DAPO token-level loss and dynamic sampling."""

    name: str = option(
        "grpo",
        "the AR model's algorithm: grpo (GRPO, DAPO and GSPO are its settings: clip-higher, dynamic "
        "sampling, algo.importance_sampling_level=sequence)",
    )
    epsilon_low: float = option(
        0.2,
        (
            "The ratio is clipped to [1 - epsilon_low, 1 + epsilon_high]. DAPO's clip-higher (0.2"
            " / 0.28) is for token-level ratios; GSPO's sequence-level ratios need far smaller "
            "ranges: the paper uses 3e-4 / 4e-4 (TRL's GSPO recipe: epsilon=3e-4, "
            "epsilon_high=4e-4)."
        ),
    )
    epsilon_high: float = option(0.28, "upper clip: 1 + epsilon_high (DAPO's clip-higher 0.28; GSPO: 4e-4)")
    importance_sampling_level: str = option(
        "token",
        (
            "token: one ratio per token (GRPO / DAPO). sequence: GSPO (arXiv 2507.18071; TRL's "
            'importance_sampling_level="sequence"), one ratio per sample, the geometric mean of '
            "its token ratios."
        ),
    )
    loss_aggregation: str = option("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum")
    beta: float = option(0.0, "KL (k3) coefficient")
    clip_ratio_c: float | None = option(
        None,
        "dual clip (verl's clip_ratio_c; verl's default 3.0): where the advantage is negative the token loss "
        "is at most -A c, so one very off-policy bad token cannot dominate a later mini-batch. null = off "
        "(TRL's loss). Token-level ratios only",
    )
    log_ratio_clamp: float | None = option(
        None,
        "clamp the token log-ratio to [-v, v] before exp (verl clamps at 20). null = off (TRL). Token-level "
        "ratios only",
    )
    kl_low_var_clamp: bool = option(
        False,
        "verl's low_var_kl: the k3 log-ratio clamped to [-20, 20] and the estimate to [-10, 10]. false = "
        "TRL's unclamped k3",
    )
    scale_rewards: str = option("group", "advantage scaling: group | batch | none")
    adv_clip_max: float = option(5.0, "advantages are clipped to [-adv_clip_max, adv_clip_max]")
    num_inner_epochs: int = option(1, "passes over each rollout's samples")
    num_mini_batches: int = option(1, "optimizer steps per rollout (1 = fully on-policy)")
    micro_batch_size: int = option(4, "samples per forward/backward pass of the AR model")
    dynamic_sampling: bool = option(
        True, "DAPO's dynamic sampling: drop flat groups (min_group_std) and resample"
    )
    min_group_std: float = option(
        0.0,
        (
            "A group whose reward std (population) is below this counts as flat: dynamic sampling"
            " drops it and frac_zero_std_groups counts it. 0 = only exact ties. Continuous "
            "rewards (PickScore, HPS, aesthetic) almost never tie, so set it to the reward's "
            "noise level there, or nothing is ever dropped and groups of pure noise get unit "
            "advantages."
        ),
    )
    max_resample_rounds: int = option(3, "extra sampling rounds per step to replace dropped groups")
    on_budget_exhausted: str = option("warn", "warn (train on what was found) | error")

    def __post_init__(self) -> None:
        _check(
            self.name == "grpo",
            "algo.name",
            f"the AR trainer runs 'grpo' (GRPO/DAPO/GSPO), got '{self.name}'.",
        )
        _check(0 < self.epsilon_low < 1, "algo.epsilon_low", "must be in (0, 1).")
        _check(self.epsilon_high > 0, "algo.epsilon_high", "must be > 0.")
        _check_choice(
            self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, "algo.importance_sampling_level"
        )
        _check(self.min_group_std >= 0, "algo.min_group_std", "must be >= 0 (0 = only exact ties are flat).")
        _check_choice(
            self.loss_aggregation,
            LOSS_AGGREGATIONS,
            "algo.loss_aggregation",
        )
        _check(self.beta >= 0, "algo.beta", "must be >= 0.")
        _check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            "algo.clip_ratio_c",
            f"must be > 1 (verl's default is 3.0) or null, got {self.clip_ratio_c}.",
        )
        _check(
            self.log_ratio_clamp is None or self.log_ratio_clamp > 0,
            "algo.log_ratio_clamp",
            f"must be > 0 (verl: 20) or null, got {self.log_ratio_clamp}.",
        )
        _check(
            self.importance_sampling_level == "token"
            or (self.clip_ratio_c is None and self.log_ratio_clamp is None),
            "algo.clip_ratio_c",
            "the dual clip and the log-ratio clamp act on token ratios; with importance_sampling_level="
            "sequence (GSPO) set algo.clip_ratio_c and algo.log_ratio_clamp to null.",
        )
        _check_choice(self.scale_rewards, SCALE_REWARDS, "algo.scale_rewards")
        _check(self.adv_clip_max > 0, "algo.adv_clip_max", "must be > 0.")
        _check(self.num_inner_epochs >= 1, "algo.num_inner_epochs", "must be >= 1.")
        _check(self.num_mini_batches >= 1, "algo.num_mini_batches", "must be >= 1.")
        _check(self.micro_batch_size >= 1, "algo.micro_batch_size", "must be >= 1.")
        _check(self.max_resample_rounds >= 0, "algo.max_resample_rounds", "must be >= 0.")
        _check_choice(self.on_budget_exhausted, ("warn", "error"), "algo.on_budget_exhausted")


@dataclass
class RunConfig:
    """The sections of every run config; a run config names its own `sampling` and `algo` dataclasses."""

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


@dataclass
class DiTTrainConfig(RunConfig):
    """`python train_dit.py`: Flow-GRPO on the GLM-Image DiT decoder.

    The run config of the decoder: another decoder algorithm's is a subclass with its own `sampling` and
    `algo` sections and its own `_check_algorithm` (`NFTTrainConfig`).
    """

    run_name: str = option("dit", RUN_NAME_HELP)
    component: str = option("dit", "the half of GLM-Image that trains: dit here (train_ar.py trains ar)")
    sampling: DiTSamplingConfig = field(default_factory=DiTSamplingConfig)
    algo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)

    def __post_init__(self) -> None:
        _check(self.component == "dit", "component", "train_dit.py trains the DiT; use train_ar.py for 'ar'.")
        super().__post_init__()
        self._check_algorithm()

    def _check_algorithm(self) -> None:
        """The rules that tie the algorithm to the other sections (each decoder algorithm has its own)."""
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


@dataclass
class ForwardProcessTrainConfig(DiTTrainConfig):
    """The run config of a decoder algorithm that trains on the forward process from the rollout's clean
    latents (`trainers/forward_trainer.py`): the decoder's common sampling (an ODE: no SDE keys)."""

    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)  # type: ignore[assignment]

    def _check_algorithm(self) -> None:
        """Nothing ties these algorithms to the other sections (Flow-GRPO's rule reads SDE keys they lack)."""

    def rollout_latents_per_sample(self) -> tuple[int, str]:
        return 1, "1 final latent"  # the clean latents the update noises again


@dataclass
class NFTTrainConfig(ForwardProcessTrainConfig):
    """`python train_dit.py --config configs/nft_training.yaml`: DiffusionNFT on the GLM-Image DiT decoder
    (the old model samples with the ODE)."""

    run_name: str = option("nft", RUN_NAME_HELP)
    algo: NFTConfig = field(default_factory=NFTConfig)  # type: ignore[assignment]


@dataclass
class AWMTrainConfig(ForwardProcessTrainConfig):
    """`python train_dit.py --config configs/awm_training.yaml`: AWM on the GLM-Image DiT decoder (the policy
    samples with the ODE)."""

    run_name: str = option("awm", RUN_NAME_HELP)
    algo: AWMConfig = field(default_factory=AWMConfig)  # type: ignore[assignment]


@dataclass
class ARTrainConfig(RunConfig):
    """`python train_ar.py`: GRPO/DAPO on the GLM-Image autoregressive token model."""

    run_name: str = option("ar", RUN_NAME_HELP)
    component: str = option("ar", "the half of GLM-Image that trains: ar here (train_dit.py trains dit)")
    sampling: ARSamplingConfig = field(default_factory=ARSamplingConfig)
    algo: DAPOConfig = field(default_factory=DAPOConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
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
