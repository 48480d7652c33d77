"""The `model` section: which GLM-Image to load, where to place it, its dtype, LoRA or full fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from glm_training.config.options import (
    DEVICE_MAPS,
    DTYPES,
    _check,
    _check_choice,
    option,
)

# model.lora.init_weights: peft's `init_lora_weights` of each (models/lora.py LORA_INIT_WEIGHTS).
LORA_INITS = ("gaussian", "default")


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
    init_weights: str = option(
        "gaussian",
        (
            "How the adapters start (B = 0 either way, so the first output is the base model's): gaussian = "
            'A ~ N(0, 1/r), peft\'s init_lora_weights="gaussian", as Flow-GRPO, DiffusionNFT and AWM '
            "initialise theirs; default = peft's default Kaiming-uniform A, as TRL's GRPO (the AR configs)."
        ),
    )

    def __post_init__(self) -> None:
        _check(self.rank > 0, "model.lora.rank", f"must be > 0, got {self.rank}.")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}.")
        _check(0.0 <= self.dropout < 1.0, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}.")
        _check(len(self.target_modules) > 0, "model.lora.target_modules", "name at least one module.")
        _check_choice(self.init_weights, LORA_INITS, "model.lora.init_weights")


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
    compile_blocks: bool = option(
        False,
        (
            "torch.compile each DiT block (diffusers' compile_repeated_blocks) for the rollout and the "
            "update: fused kernels, once per input shape (about a minute a graph on an H200); the DiT only"
        ),
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
        _check(
            not (self.compile_blocks and self.gradient_checkpointing),
            "model.compile_blocks",
            "compiled blocks under gradient checkpointing fail on CUDA in bf16 (torch.utils.checkpoint: "
            "'Recomputed values ... have different metadata'; torch 2.11, H200): set "
            "model.gradient_checkpointing=false where the memory plan allows it "
            "(`python -m glm_training.plan`), or model.compile_blocks=false.",
        )
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
