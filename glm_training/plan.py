"""Memory plan: what one rank will hold, computed from the configs before any weight is loaded.

    python -m glm_training.plan --config recipes/flow_grpo_fast_ocr [--world-size 8] [--strategy fsdp] \
        [--gpu-memory-gb 80]

Every run logs the same plan at start-up (`log_memory_plan`, before `_build_model`); on GPUs a run predicted
not to fit stops there, naming the largest terms and the fixes.

The terms, per rank:

* weights of each component, by dtype and placement: parameter counts from the component configs,
  instantiated on the meta device (no weights are read or allocated);
* trainable parameters (LoRA adapters in float32, or the whole trained submodules), their gradients and the
  AdamW state (two tensors of the parameter's dtype), an EMA copy and, for full fine-tuning with KL, the
  frozen reference copy;
* activations saved for the backward pass of one micro-batch, with and without gradient checkpointing:
  `num_layers x tokens x width x coefficient`, the coefficients (bytes saved per token per unit of width
  for one layer) measured on the real-width fixture `model=glm_image_shape` (`benchmarks/bench_memory.py
  --calibrate`), plus the AR log-softmax over the image vocabulary;
* the rollout's transient peak (the VAE decode of one micro-batch) when it exceeds the update's;
* trajectory buffers (DiT latents of every trained step) and reward models (approximate parameter counts).

Sharding (FSDP, `trainer.strategy=fsdp`): the trainable component's parameters, gradients and optimizer
state are divided by the world size, and one shard unit (one DiT block / one GLM decoder layer) is gathered
at a time (two with prefetching), which the plan adds back. Frozen components are replicated on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.config.algorithms import algorithm_of
from glm_training.errors import UserError
from glm_training.models.halves import model_half

logger = logging.getLogger("glm_training")

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Activations: each half's `activation_coef` (`models/halves.py`) is the bytes saved for backward per token
# per unit of hidden width by ONE layer in a bf16-autocast LoRA training forward, measured with saved-tensor
# hooks on the real-width fixture (`bench_memory.py --calibrate`; 2-core CPU, torch 2.13). Linear in the
# tokens: attention saves no tokens x tokens matrix (flash kernels on GPU and CPU). Full fine-tuning saves
# the same inputs of every linear layer. With gradient checkpointing a layer keeps only its bf16 input
# (`checkpoint_coef`, 2 bytes), and one layer's full activations exist during its recompute (added in
# `build_plan`).
# The AR loss keeps the float32 log-softmax over the image vocabulary of every scored token (measured: exactly
# one copy saved); its gradient is a second copy during backward.
AR_LOGIT_COPIES = 2
# Rollout: the VAE decode's transient peak per output pixel (bytes) per channel of its full-resolution stage
# (block_out_channels[0]), 2-byte weights: measured on the fixture's VAE (CogView4 layout, 128 channels) in
# bf16 on CPU, 6046 bytes a pixel at 512² (`bench_memory.py --vae`), i.e. 47 per channel.
VAE_DECODE_BYTES_PER_PIXEL_CHANNEL = 47.0
# Reward models' approximate parameter counts (weights on each rank; float32 unless configured otherwise).
REWARD_PARAMS = {
    "jpeg_compressibility": 0,
    "jpeg_incompressibility": 0,
    "remote": 0,
    "clip_score": 151_000_000,  # CLIP ViT-B/32
    "aesthetic": 428_000_000,  # CLIP ViT-L/14 + linear head
    "pickscore": 986_000_000,  # CLIP ViT-H/14
    "hpsv2": 986_000_000,  # OpenCLIP ViT-H/14
    "imagereward": 447_000_000,  # BLIP ViT-L + BERT
    "ocr": 250_000_000,  # TrOCR-base-sized recogniser (approximate)
}
# Allocator slack, CUDA context, kernels' workspaces: what the terms do not see.
OVERHEAD_BYTES = 2 * GIB


class MemoryPlanError(UserError, RuntimeError):
    """The run is predicted not to fit its GPU; the message names the largest terms and the fixes."""


@dataclass
class Term:
    name: str
    bytes: float
    detail: str = ""


@dataclass
class MemoryPlan:
    """Per-rank memory terms (bytes); `peak` = static terms + the larger of update and rollout transients."""

    component: str
    strategy: str
    world_size: int
    static: list[Term] = field(default_factory=list)
    activations: Term | None = None
    activations_other: Term | None = None  # the same with checkpointing toggled, for comparison
    rollout: Term | None = None
    device_bytes: int | None = None

    @property
    def peak(self) -> float:
        transient = max(
            self.activations.bytes if self.activations else 0, self.rollout.bytes if self.rollout else 0
        )
        return sum(t.bytes for t in self.static) + transient

    def largest(self, n: int = 3) -> list[Term]:
        terms = [*self.static, *(t for t in (self.activations, self.rollout) if t is not None)]
        return sorted(terms, key=lambda t: -t.bytes)[:n]

    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes

    def table(self) -> str:
        lines = [f"memory plan per rank ({self.component}, {self.strategy}, world size {self.world_size}):"]
        for t in self.static:
            lines.append(f"  {t.name:<34} {_gib(t.bytes):>9}  {t.detail}")
        for t in (self.activations, self.activations_other, self.rollout):
            if t is not None:
                lines.append(f"  {t.name:<34} {_gib(t.bytes):>9}  {t.detail}")
        room = f" of {_gib(self.device_bytes)}" if self.device_bytes else ""
        lines.append(f"  {'predicted peak':<34} {_gib(self.peak):>9}{room}")
        return "\n".join(lines)

    def summary(self) -> str:
        top = ", ".join(f"{t.name} {_gib(t.bytes)}" for t in self.largest())
        return f"predicted peak {_gib(self.peak)} per rank ({top})"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(n: float | None) -> str:
    return f"{(n or 0) / GIB:.2f} GiB"


@contextlib.contextmanager
def saved_tensor_bytes(params):
    """Yield a dict {storage pointer: bytes} of the distinct storages autograd saves for backward inside the
    block, the given parameters excluded: the activations a training forward keeps alive until backward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


# -------------------------------------------------------------------------------------------------------
# Component configs -> meta modules


def meta_components(model_cfg: Any) -> dict[str, nn.Module]:
    """The four weight-holding components on the meta device, from their configs only.

    `glm_image_shape` and `zai-org/GLM-Image` come from `models/shape.py` (the real configs, with the
    fixture's or the real layer counts); `tiny` and local pipeline folders from the folder's config files.
    """
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import AutoConfig, GlmImageForConditionalGeneration, T5EncoderModel

    from glm_training.models import shape

    name = model_cfg.name
    from_code = name == shape.SHAPE_MODEL_NAME or name.rstrip("/") == "zai-org/GLM-Image"
    folder = None
    if not from_code:
        from glm_training.models.wrapper import resolve_model_path

        # Outside the meta-device block: resolving "tiny" builds it (real tensors) on first use.
        folder = Path(resolve_model_path(name, model_cfg.tiny_seed, model_cfg.shape_layers()))
        if not (folder / "model_index.json").is_file():
            raise FileNotFoundError(f"no local pipeline folder for '{name}' to read component configs from")
    with torch.device("meta"):
        if from_code:
            real = name != shape.SHAPE_MODEL_NAME
            num_ar, num_dit = (
                (shape.REAL_NUM_AR_LAYERS, shape.REAL_NUM_DIT_LAYERS) if real else model_cfg.shape_layers()
            )
            return {
                "vision_language_encoder": GlmImageForConditionalGeneration(
                    shape.glm_image_config(num_ar, shape.REAL_NUM_VISION_LAYERS if real else 1)
                ),
                "transformer": GlmImageTransformer2DModel(**shape.dit_config(num_dit)),
                "text_encoder": T5EncoderModel(
                    shape.glyph_config(shape.REAL_NUM_GLYPH_LAYERS if real else 1)
                ),
                "vae": AutoencoderKL(**shape.VAE_CONFIG),
            }
        return {
            "vision_language_encoder": GlmImageForConditionalGeneration(
                AutoConfig.from_pretrained(folder / "vision_language_encoder")
            ),
            "transformer": GlmImageTransformer2DModel.from_config(
                GlmImageTransformer2DModel.load_config(folder / "transformer")
            ),
            "text_encoder": T5EncoderModel(AutoConfig.from_pretrained(folder / "text_encoder")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae")),
        }


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lora_params(module: nn.Module, targets: list[str], rank: int) -> int:
    """Parameters of peft LoRA adapters r x (in + out) on every Linear whose name matches a target (peft's
    rule: the full name, or its last components, equal the target)."""
    total = 0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and any(
            name == t or name.endswith("." + t) or fnmatch.fnmatch(name, t) for t in targets
        ):
            total += rank * (sub.in_features + sub.out_features)
    return total


# -------------------------------------------------------------------------------------------------------
# The plan


def sequence_tokens(
    component: str, height: int, width: int, modules: dict[str, nn.Module]
) -> tuple[int, int]:
    """(tokens per sample of the trained forward, tokens whose logits are scored) at `height x width`."""
    if component == "dit":
        dit = modules["transformer"].config
        vae_factor = 2 ** (len(modules["vae"].config.block_out_channels) - 1)
        latent_tokens = (height // vae_factor // dit.patch_size) * (width // vae_factor // dit.patch_size)
        return latent_tokens, 0
    # AR: the prompt (~ 64 tokens), the 16 x 16 preview grid, the large (H/32) x (W/32) grid.
    generated = (height // 32) * (width // 32) + 256
    return 64 + generated, generated


def build_plan(
    cfg: Any,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    device_bytes: int | None = None,
    modules: dict[str, nn.Module] | None = None,
) -> MemoryPlan:
    """The per-rank plan of a DiT or AR training config (`cfg.component`)."""
    component = cfg.component
    m = cfg.model
    strategy = strategy or cfg.trainer.strategy
    # Under FSDP each rank holds 1/shard of the trained half: 1/world, or 1/fsdp_shard_size under HSDP.
    shard = (cfg.trainer.fsdp_shard_size or world_size) if strategy == "fsdp" and world_size > 1 else 1
    modules = modules if modules is not None else meta_components(m)
    wbytes = DTYPE_BYTES[m.dtype]
    half = model_half(component)
    trained_name = half.attribute
    plan = MemoryPlan(
        component, strategy if world_size > 1 else "single process", world_size, device_bytes=device_bytes
    )

    # A DiT run on cached prior tokens never loads the AR model (`data.prior_cache`).
    not_loaded = {"vision_language_encoder"} if component == "dit" and cfg.data.prior_cache else set()
    for name, module in modules.items():
        if name in not_loaded:
            continue
        n = _numel(module)
        sharded = name == trained_name and shard > 1  # LoRA too: fully_shard shards frozen base weights
        where = f"1/{shard} shard per rank" if sharded else "replicated"
        plan.static.append(
            Term(
                f"weights: {name}",
                n * wbytes / (shard if sharded else 1),
                f"{_count(n)} params, {m.dtype}, {where}",
            )
        )
    trained = modules[trained_name]
    parts = half.trained_parts(trained)
    layers = half.layers(trained)
    if m.lora.enabled:
        n_train = sum(lora_params(p, list(m.lora.target_modules), m.lora.rank) for p in parts)
        pbytes, kind = 4, f"LoRA r{m.lora.rank}, float32"
        # FSDP shards the adapters with their layers; DDP keeps them whole.
        plan.static.append(Term("trainable (LoRA adapters)", n_train * pbytes / shard, kind))
    elif m.keeps_master_weights():
        n_train = sum(_numel(p) for p in parts)
        pbytes = 4
        # The trained parameters are float32 masters: 2 more bytes each than the weights term counted.
        plan.static.append(
            Term(
                "float32 master weights",
                n_train * (pbytes - wbytes) / shard,
                f"full fine-tuning of a {m.dtype} model: the trained weights in float32 (beyond the above)",
            )
        )
    else:
        n_train = sum(_numel(p) for p in parts)
        pbytes, kind = wbytes, f"full fine-tuning, {m.dtype} (counted in the weights above)"
    local = n_train / shard
    plan.static.append(
        Term(
            "gradients",
            local * pbytes,
            f"{n_train / 1e6:.1f}M trainable params{'' if shard == 1 else f', 1/{shard} per rank'}",
        )
    )
    plan.static.append(Term("optimizer state (AdamW)", 2 * local * pbytes, "exp_avg + exp_avg_sq"))
    if getattr(cfg.algo, "ema", False):
        plan.static.append(Term("EMA copy", local * pbytes, ""))
    for name in algorithm_of(cfg).policy_copies:
        # E.g. DiffusionNFT's old (sampling) model: a copy of the adapters, or a frozen copy of the module
        # (of its float32 masters when it has them); the trained weights' own dtype either way.
        copy_bytes = n_train * pbytes
        plan.static.append(Term(name, copy_bytes / shard, "copy of the trained weights"))
    if not m.lora.enabled and cfg.algo.beta > 0:
        if shard > 1 and cfg.trainer.fsdp_reference_offload:
            plan.static.append(Term("KL reference copy", 0, "shards in host memory (fsdp_reference_offload)"))
        else:
            plan.static.append(
                # A copy of the whole component (the AR model's vision towers too).
                Term(
                    "KL reference copy",
                    _numel(trained) * wbytes / shard,
                    "frozen copy of the trained component",
                )
            )
    rollout_gather = 0.0
    if shard > 1:
        # One unit gathered for compute and the next one prefetched (FSDP2's default), plus the root unit
        # (everything outside the half's `shard_units`: embeddings, heads), gathered for the whole forward;
        # in the policy's compute dtype (bf16 under trainer.mixed_precision=bf16).
        unit = _numel(layers[0]) if len(layers) else 0
        root = _numel(trained) - sum(_numel(u) for u in half.shard_units(trained))
        gathered = min(2, len(layers))
        gbytes = DTYPE_BYTES["bfloat16"] if cfg.trainer.mixed_precision == "bf16" else wbytes
        units_bytes = (gathered * unit + root) * gbytes
        plan.static.append(
            Term(
                "FSDP gathered units",
                units_bytes,
                f"{gathered} layer(s) (one computing, one prefetched) + the root unit",
            )
        )
        if cfg.trainer.fsdp_gather_for_rollout:
            # Sampling gathers the component once (`sharding.gathered`; not the AR model's unused image
            # towers), in place of the units above.
            unused = sum(_numel(u) for u in half.unused_units(trained))
            rollout_gather = (_numel(trained) - unused) * gbytes - units_bytes

    s = cfg.sampling
    height, width = s.height, s.width
    tokens, scored = sequence_tokens(component, height, width, modules)
    if component == "dit":
        batch = s.micro_batch_size * (2 if s.guidance_scale > 1 else 1)  # CFG: two forwards with graphs
        width_h = trained.config.num_attention_heads * trained.config.attention_head_dim
        vae_factor = 2 ** (len(modules["vae"].config.block_out_channels) - 1)
        latent = modules["vae"].config.latent_channels * (height // vae_factor) * (width // vae_factor)
        kept, kept_what = cfg.rollout_latents_per_sample()
        samples = cfg.data.per_rank_samples(world_size)
        plan.static.append(
            Term(
                "trajectory buffers", samples * kept * latent * 4, f"{samples} samples x {kept_what}, float32"
            )
        )
        logits = 0.0
        decode_batch = s.micro_batch_size
    else:
        batch = cfg.algo.micro_batch_size
        width_h = trained.config.text_config.hidden_size
        samples = cfg.data.per_rank_samples(world_size)
        plan.static.append(
            Term("trajectory buffers", samples * tokens * 8 * 4, "token ids, masks, positions")
        )
        vocab = trained.config.text_config.vision_vocab_size
        logits = batch * scored * vocab * 4 * AR_LOGIT_COPIES
        decode_batch = cfg.algo.micro_batch_size
    n_layers = len(layers)
    full = half.activation_coef * n_layers * batch * tokens * width_h + logits
    ckpt = (half.checkpoint_coef * n_layers + half.activation_coef) * batch * tokens * width_h + logits
    on, off = (ckpt, full) if m.gradient_checkpointing else (full, ckpt)
    what = f"{batch} x {tokens} tokens x {n_layers} layers"
    plan.activations = Term(
        f"activations ({'with' if m.gradient_checkpointing else 'no'} checkpointing)", on, what
    )
    plan.activations_other = Term(
        f"  (would be {'without' if m.gradient_checkpointing else 'with'} checkpointing)",
        off,
        "not counted in the peak",
    )
    vae_bytes_per_pixel = VAE_DECODE_BYTES_PER_PIXEL_CHANNEL * modules["vae"].config.block_out_channels[0]
    plan.rollout = Term(
        "rollout VAE decode (transient)",
        vae_bytes_per_pixel * decode_batch * height * width * wbytes / 2,
        f"{decode_batch} images of {height}x{width}",
    )
    if rollout_gather:
        # A rollout decodes after the gathered weights are freed; evaluation holds them through the
        # pipeline's decode.
        evaluates = bool(cfg.eval.every_n_steps)
        total = rollout_gather + plan.rollout.bytes if evaluates else max(rollout_gather, plan.rollout.bytes)
        plan.rollout = Term(
            "FSDP sampling gather (transient)",
            total,
            f"{trained_name} gathered for sampling (trainer.fsdp_gather_for_rollout) less the units"
            + (", + the evaluation's VAE decode" if evaluates else ""),
        )
    reward_params = sum(REWARD_PARAMS.get(n, 0) for n in cfg.reward.names)
    if reward_params:
        plan.static.append(
            Term("reward models", reward_params * 4, ", ".join(cfg.reward.names) + " (approx.)")
        )
    plan.static.append(
        Term("overhead", OVERHEAD_BYTES if device_bytes else 0, "CUDA context, allocator slack")
    )
    return plan


def check_fits(plan: MemoryPlan) -> None:
    """Raise `MemoryPlanError` naming the largest terms and the fixes when the plan exceeds the device."""
    if plan.fits():
        return
    top = "; ".join(f"{t.name} {_gib(t.bytes)}" for t in plan.largest())
    raise MemoryPlanError(
        f"this run is predicted to need {_gib(plan.peak)} per GPU but {_gib(plan.device_bytes)} is available "
        f"(model.max_memory_fraction of the device). Largest terms: {top}. "
        "Fixes: LoRA (model.lora.enabled=true), "
        "sharding (trainer.strategy=fsdp under torchrun), model.gradient_checkpointing=true, a smaller "
        "sampling.micro_batch_size / algo.micro_batch_size, or a smaller resolution. See "
        "`python -m glm_training.plan --config ...` for the whole table."
    )


def log_memory_plan(cfg: Any, accelerator: Any) -> MemoryPlan | None:
    """Log the plan at the start of a run; on GPUs, stop before loading if it will not fit.

    The room is `model.max_memory_fraction` of this rank's GPU, or of all GPUs together when a single process
    spreads the model with a device map. A model whose configs cannot be read offline (a hub id other than
    zai-org/GLM-Image that is not a local folder) gets a warning, not an error: the plan is advice.
    """
    device_bytes = None
    if accelerator.device.type == "cuda":
        spread = accelerator.num_processes == 1 and cfg.model.device_map in ("auto", "balanced")
        indices = range(torch.cuda.device_count()) if spread else [accelerator.device.index or 0]
        total = sum(torch.cuda.get_device_properties(i).total_memory for i in indices)
        device_bytes = int(total * cfg.model.max_memory_fraction)
    plan, loading, error = None, None, None
    world = accelerator.num_processes
    # Rank 0 first: reading the tiny model's configs builds it, and only rank 0 may (see _build_model). No
    # exception may leave this block: each rank must reach both of its barriers.
    with accelerator.main_process_first():
        try:
            modules = meta_components(cfg.model)  # once, for both tables
            plan = build_plan(cfg, world_size=world, device_bytes=device_bytes, modules=modules)
            loading = loading_host_plan(
                cfg, world_size=world, device=accelerator.device.type, modules=modules
            )
        except Exception as err:  # the plan is advice: a model it cannot size still loads
            error = err
    if plan is None:
        logger.warning("[plan] no memory plan for model '%s': %s", cfg.model.name, error)
        return None
    for line in plan.table().splitlines():
        logger.info("[plan] %s", line)
    if loading is None:  # the device plan above still decides whether the run fits
        logger.warning("[plan] no loading plan for model '%s': %s", cfg.model.name, error)
    else:
        for line in loading.table().splitlines():
            logger.info("[plan] %s", line)
    check_fits(plan)
    return plan


# -------------------------------------------------------------------------------------------------------
# Host memory while loading

# What loading holds besides the weights (configs, tokenizers, the processor, from_pretrained's bookkeeping):
# measured on the real-width fixture (`benchmarks/bench_checkpoint_memory.py`: 0.083-0.085 GiB), rounded up.
LOADING_OVERHEAD_BYTES = 0.1 * GIB


@dataclass
class LoadingPlan:
    """Per-rank host memory while a run loads and shards its model (bytes above what it held before).

    `terms` add up to `peak`, the moment the most is resident; `way` says how the trained half loads.
    """

    way: str
    device: str
    terms: list[Term] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return sum(t.bytes for t in self.terms)

    def table(self) -> str:
        lines = [f"host memory per rank while loading ({self.way}; trained on {self.device}):"]
        lines += [f"  {t.name:<34} {_gib(t.bytes):>9}  {t.detail}" for t in self.terms]
        lines.append(f"  {'predicted peak':<34} {_gib(self.peak):>9}")
        return "\n".join(lines)


def _weights_folder(model_cfg: Any) -> Path | None:
    """The local pipeline folder of a model (without building a fixture that is not built yet), or None."""
    from glm_training.models import shape, tiny

    if model_cfg.name == "tiny":
        folder = tiny.ensure_tiny_pipeline(seed=model_cfg.tiny_seed)
    elif model_cfg.name == shape.SHAPE_MODEL_NAME:
        folder = tiny.default_cache_dir() / shape.shape_folder_name(
            *model_cfg.shape_layers(), model_cfg.tiny_seed
        )
    else:
        folder = Path(model_cfg.name).expanduser()
    return folder if (folder / "model_index.json").is_file() else None


def _file_weights(folder: Path | None, name: str, dtype: torch.dtype) -> tuple[float, int] | None:
    """(bytes, elements `from_pretrained` converts to `dtype`) of a component's safetensors files, from their
    headers only (a name in several files counted once); None when the folder is unknown."""
    if folder is None or not list((folder / name).glob("*.safetensors")):
        return None
    from safetensors import safe_open
    from safetensors.torch import _getdtype

    total, converted, seen = 0.0, 0, set()
    for file in sorted((folder / name).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in seen:
                    continue
                seen.add(key)
                piece = f.get_slice(key)
                numel = 1
                for size in piece.get_shape():
                    numel *= size
                file_dtype = _getdtype(piece.get_dtype())
                total += numel * torch.empty(0, dtype=file_dtype).element_size()
                if file_dtype.is_floating_point and file_dtype != dtype:
                    converted += numel
    return total, converted


def loading_host_plan(
    cfg: Any,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    device: str = "cuda",
    modules: dict[str, nn.Module] | None = None,
) -> LoadingPlan:
    """Each rank's host memory while loading, at its peak (`LoadingPlan.peak`).

    What the libraries do, as measured on the real-width fixture: `from_pretrained` maps a safetensors file
    whose dtype is the model's and reads nothing (its pages become resident as they are touched); a file in
    another dtype is converted into new tensors. Touching a mapped weight (copying it, upcasting it,
    sharding it, moving it to a GPU) makes its file pages resident until the last tensor of the file is gone.

    * Loaded whole (DDP, or `trainer.fsdp_load_into_shards=false`): a KL reference copy or float32 masters
      touch the whole trained file and are made whole before sharding; with neither, sharding copies this
      rank's rows out of the mapped file (and DDP touches nothing while loading). On a GPU the component is
      moved there first: the host holds only the pages of the component being moved.
    * Read into shards: this rank's shards (masters, reference) and the pages of its rows of the file; on a
      GPU only those pages.
    * Frozen components converted to another dtype are held (on the CPU) or pass through (on a GPU).
    """
    from glm_training.models.placement import parse_dtype

    m = cfg.model
    strategy = strategy or cfg.trainer.strategy
    shard = (cfg.trainer.fsdp_shard_size or world_size) if strategy == "fsdp" and world_size > 1 else 1
    into_shards = shard > 1 and cfg.trainer.fsdp_load_into_shards
    modules = modules if modules is not None else meta_components(m)
    dtype = parse_dtype(m.dtype)
    wbytes = DTYPE_BYTES[m.dtype]
    half = model_half(cfg.component)
    folder = _weights_folder(m)
    on_cpu = device == "cpu"
    if into_shards:
        way = f"read into 1/{shard} shards"
    else:
        way = "whole on every rank" + (", then sharded" if shard > 1 else "")
    plan = LoadingPlan(way, device)
    plan.terms.append(Term("libraries, configs, tokenizers", LOADING_OVERHEAD_BYTES, "measured, rounded up"))

    not_loaded = {"vision_language_encoder"} if cfg.component == "dit" and cfg.data.prior_cache else set()
    converted, passing = 0.0, 0.0
    for name, module in modules.items():
        if name == half.attribute or name in not_loaded:
            continue
        file_bytes, to_convert = _file_weights(folder, name, dtype) or (_numel(module) * wbytes, 0)
        if to_convert and on_cpu:
            converted += to_convert * wbytes
        if to_convert or not on_cpu:  # converted, or moved to the GPU: its pages pass through
            passing = max(passing, file_bytes)
    if converted:
        plan.terms.append(Term("frozen components (converted)", converted, f"into {m.dtype}, on the CPU"))

    trained = modules[half.attribute]
    n = _numel(trained)  # the KL reference is a copy of the whole component
    n_train = sum(_numel(p) for p in half.trained_parts(trained))
    file_bytes, to_convert = _file_weights(folder, half.attribute, dtype) or (n * wbytes, 0)
    masters = m.keeps_master_weights()
    reference = not m.lora.enabled and cfg.algo.beta > 0
    offloaded = reference and shard > 1 and cfg.trainer.fsdp_reference_offload
    trained_terms: list[Term] = []
    if into_shards:
        trained_terms.append(
            Term("its file pages this rank reads", file_bytes / shard, f"1/{shard} of the file")
        )
        if on_cpu:
            pbytes = 4 if masters else wbytes
            shards = (n_train * pbytes + (n - n_train) * wbytes) / shard
            detail = f"1/{shard}, {'float32 masters' if masters else m.dtype}"
            trained_terms.append(Term(f"{half.attribute} shards", shards, detail))
    elif on_cpu and (reference or masters or to_convert):
        trained_terms.append(Term(f"{half.attribute} file pages", file_bytes, "the whole file, touched"))
        if to_convert:
            trained_terms.append(
                Term(f"{half.attribute} (converted)", to_convert * wbytes, f"into {m.dtype}")
            )
        if reference:
            trained_terms.append(Term("KL reference copy", n * wbytes, "whole, before sharding"))
        if masters:
            trained_terms.append(Term("float32 masters", n_train * 4, "whole, before sharding"))
    elif on_cpu and shard > 1:
        detail = f"sharding copies 1/{shard} of the file"
        trained_terms.append(Term("its file pages this rank reads", file_bytes / shard, detail))
        trained_terms.append(Term(f"{half.attribute} shards", n * wbytes / shard, f"1/{shard}, {m.dtype}"))
    elif not on_cpu:
        trained_terms.append(Term(f"{half.attribute} file pages", file_bytes, "passing through to the GPU"))
    # (DDP on the CPU touches nothing while loading: the mapped file becomes resident as training reads it.)
    # The reference's shards in host memory: on a CPU when read into shards (loaded whole, its whole copy
    # above is the peak), on a GPU run when they are offloaded.
    if reference and ((into_shards and on_cpu) or (offloaded and not on_cpu)):
        where = f"1/{shard}" + (" in host memory (fsdp_reference_offload)" if offloaded else "")
        trained_terms.append(Term("KL reference shards", n * wbytes / shard, where))
    trained_bytes = sum(t.bytes for t in trained_terms)
    if passing > trained_bytes:  # the frozen components' moment is the peak
        plan.terms.append(Term("frozen component passing through", passing, "the largest one's file pages"))
    else:
        plan.terms += trained_terms
    return plan


def main(argv: list[str] | None = None) -> int:
    from glm_training.config import load_config

    parser = argparse.ArgumentParser(prog="python -m glm_training.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a training config (configs/t2i_training.yaml, ...)")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default=None, help="default: trainer.strategy")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="per-GPU memory to check against")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where the ranks train (the loading table)"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(["--config", args.config, *overrides], args.config)
    device_bytes = (
        int(args.gpu_memory_gb * 1e9 * cfg.model.max_memory_fraction) if args.gpu_memory_gb else None
    )
    modules = meta_components(cfg.model)
    plan = build_plan(
        cfg, world_size=args.world_size, strategy=args.strategy, device_bytes=device_bytes, modules=modules
    )
    print(plan.table())
    loading = loading_host_plan(
        cfg, world_size=args.world_size, strategy=args.strategy, device=args.device, modules=modules
    )
    print(loading.table())
    if not plan.fits():
        print(f"does NOT fit: {plan.summary()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
