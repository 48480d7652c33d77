"""`GLMImageWrapper`: one GLM-Image pipeline, split into the component being trained and the frozen rest.

GLM-Image is trained one half at a time (decoupled post-training): `component="dit"` trains the diffusion
transformer (`transformer`) and freezes the AR model, T5 glyph encoder and VAE; `component="ar"` trains the
autoregressive `vision_language_encoder` and freezes the rest. The same class loads the tiny offline model
(`model_name="tiny"`) and `zai-org/GLM-Image`, through the same `from_pretrained` call.

A component that a run does not need can be left out (`skip_components`): a DiT run on cached prior tokens
(`data.prior_cache`, see `glm_training.priors`) never loads the AR model, on any device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.errors import UserError
from glm_training.models.halves import HALVES, model_half
from glm_training.models.placement import PlacementPlan, pipeline_load_kwargs, run_stage

# (model folder, pipeline attribute, dtype) -> (the component built empty, the folder of its weights).
EmptyBuilder = Callable[[str, str, torch.dtype], tuple[nn.Module, Path]]

logger = logging.getLogger(__name__)

MODEL_COMPONENTS = ("vision_language_encoder", "text_encoder", "transformer", "vae")


def resolve_model_path(model_name: str, tiny_seed: int = 0, shape_layers: tuple[int, int] = (1, 1)) -> str:
    """`"tiny"` / `"glm_image_shape"` -> the cached offline fixture folder (built on first use, `shape_layers`
    = (AR layers, DiT blocks) of the real-width one); anything else unchanged."""
    if model_name == "tiny":
        from glm_training.models.tiny import ensure_tiny_pipeline

        return str(ensure_tiny_pipeline(seed=tiny_seed))
    if model_name == "glm_image_shape":
        from glm_training.models.shape import ensure_shape_pipeline

        return str(ensure_shape_pipeline(*shape_layers, seed=tiny_seed))
    path = Path(model_name).expanduser()
    if path.exists() and not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"model.name='{model_name}' is a folder but holds no model_index.json, so it is not a diffusers "
            "pipeline; point it at a folder written by GlmImagePipeline.save_pretrained or a hub id."
        )
    return str(path) if path.exists() else model_name


def model_path(model_cfg: Any) -> str:
    """`resolve_model_path` of a `ModelConfig` (or a run's recorded one: configs from before the real-width
    fixture have no shape_* keys, and that fixture then has one layer per stack)."""
    shape_layers = (
        getattr(model_cfg, "shape_num_ar_layers", 1),
        getattr(model_cfg, "shape_num_dit_layers", 1),
    )
    return resolve_model_path(model_cfg.name, model_cfg.tiny_seed, shape_layers)


class ModelNotAvailableError(UserError, OSError):
    """`model.name` is neither a local folder nor a complete copy in the hub cache that can be reached."""


def _not_available(path: str) -> ModelNotAvailableError:
    return ModelNotAvailableError(
        f"cannot load model '{path}': it is not a local folder, and not fully in the hub cache "
        f"({'HF_HUB_OFFLINE=1' if os.environ.get('HF_HUB_OFFLINE') == '1' else 'no network'}). Fix: "
        f"download it once with `hf download {path}` on a machine with network access, or set "
        "model.name to the folder of a local copy."
    )


def check_model_available(model_name: str) -> None:
    """Before anything loads or is written: offline (`HF_HUB_OFFLINE=1`), a hub id whose pipeline index is
    not in the hub cache is refused (`ModelNotAvailableError`). The fixtures and local folders pass; online,
    from_pretrained downloads what is missing."""
    from huggingface_hub import constants, try_to_load_from_cache

    if model_name in ("tiny", "glm_image_shape") or Path(model_name).expanduser().exists():
        return
    if constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(model_name, "model_index.json"), str
    ):
        raise _not_available(model_name)


def _from_pretrained(path: str, kwargs: dict[str, Any]):
    """`GlmImagePipeline.from_pretrained`; a hub id it cannot load (not cached, offline) is a user error."""
    from diffusers import GlmImagePipeline

    try:
        return GlmImagePipeline.from_pretrained(path, **kwargs)
    except OSError as err:
        if Path(path).is_dir():
            raise
        raise _not_available(path) from err


class GLMImageWrapper:
    """Load a `GlmImagePipeline` and expose its trainable component and its frozen components.

    Args:
        model_name: "tiny", a hub id such as "zai-org/GLM-Image", or a local pipeline folder.
        component: "dit" or "ar".
        torch_dtype: dtype of every component's weights.
        device_map: what `from_pretrained` receives: "cpu", "balanced" or "cuda" (see `placement.py`;
            "auto" is translated to "balanced" there, as diffusers pipelines do not accept "auto").
        build_empty: do not read the trained component: `build_empty(path, attribute, dtype)` builds it from
            its config on the meta device, to be sharded and then read shard by shard, and returns it with
            the folder of its weights (`trained_folder`; `distributed/loading.py`'s
            `empty_trained_component`).
    """

    def __init__(
        self,
        model_name: str,
        component: str,
        torch_dtype: torch.dtype = torch.float32,
        device_map: str = "cpu",
        *,
        max_memory: dict | None = None,
        stage_timeout_s: float = 1800.0,
        tiny_seed: int = 0,
        skip_components: tuple[str, ...] = (),
        build_empty: EmptyBuilder | None = None,
    ):
        trained = model_half(component).attribute  # ValueError naming the halves for another name
        if device_map == "auto":
            device_map = "balanced"

        bad = [c for c in skip_components if c not in MODEL_COMPONENTS or c == trained]
        if bad:
            raise ValueError(f"cannot leave out {bad}: only frozen components of {MODEL_COMPONENTS} can be.")
        self.component = component
        self.model_name = model_name
        self.skipped = tuple(skip_components)
        self.trained_folder: Path | None = None  # set when the trained component is built empty
        path = run_stage(
            f"resolve model '{model_name}'",
            lambda: resolve_model_path(model_name, tiny_seed),
            stage_timeout_s,
        )
        plan = PlacementPlan(False, "wrapper", device_map, None, max_memory)
        kwargs = pipeline_load_kwargs(plan, torch_dtype)
        # diffusers loads nothing for a component passed as None; the pipeline attribute is then None.
        kwargs.update(dict.fromkeys(self.skipped + ((trained,) if build_empty else ())))
        self.pipeline = run_stage(
            f"from_pretrained {path} (device_map={device_map})",
            lambda: _from_pretrained(path, kwargs),
            stage_timeout_s,
        )
        if build_empty is not None:
            module, self.trained_folder = build_empty(path, trained, torch_dtype)
            self.pipeline.register_modules(**{trained: module})
        # Set directly: reloading a GenerationConfig from the checkpoint after loading was seen to hang.
        ar = self.pipeline.vision_language_encoder
        if ar is not None and ar.generation_config.pad_token_id is None:
            ar.generation_config.pad_token_id = ar.generation_config.eos_token_id
        self._freeze_all_but_the_trained_half()

    @classmethod
    def from_pipeline(cls, pipeline, component: str) -> GLMImageWrapper:
        """A wrapper around a pipeline built in memory (`glm_training.gpu_check`'s, on the device it runs on):
        nothing is loaded or moved; the components are frozen but `component`'s half, as after loading."""
        wrapper = cls.__new__(cls)
        wrapper.component, wrapper.model_name, wrapper.skipped = component, "in memory", ()
        wrapper.trained_folder = None
        wrapper.pipeline = pipeline
        wrapper._freeze_all_but_the_trained_half()
        return wrapper

    @classmethod
    def other_half(cls, wrapper: GLMImageWrapper, component: str) -> GLMImageWrapper:
        """A wrapper that trains `component` of the pipeline `wrapper` already trains the other half of
        (`train_joint.py`): nothing is loaded, moved or frozen; that half's `Policy` then sets up its own."""
        other = cls.__new__(cls)
        other.component, other.model_name, other.skipped = component, wrapper.model_name, wrapper.skipped
        other.trained_folder = None
        other.pipeline = wrapper.pipeline
        return other

    def _freeze_all_but_the_trained_half(self) -> None:
        for name, module in self.components().items():
            module.requires_grad_(name == self.trainable_name)
            module.train(False)

    @property
    def trainable_name(self) -> str:
        return HALVES[self.component].attribute

    @property
    def trainable(self) -> nn.Module:
        return getattr(self.pipeline, self.trainable_name)

    @trainable.setter
    def trainable(self, module: nn.Module) -> None:
        # After LoRA wrapping the pipeline must run the adapted module.
        self.pipeline.register_modules(**{self.trainable_name: module})

    def components(self) -> dict[str, nn.Module]:
        """All loaded weight-holding components, by pipeline attribute name (skipped ones are absent)."""
        return {name: getattr(self.pipeline, name) for name in MODEL_COMPONENTS if name not in self.skipped}

    def frozen(self) -> dict[str, nn.Module]:
        return {n: m for n, m in self.components().items() if n != self.trainable_name}

    def loaded(self) -> dict[str, nn.Module]:
        """The components read by `from_pretrained`: all but a trained one built empty (`build_empty`)."""
        return self.frozen() if self.trained_folder is not None else self.components()

    def to(self, device: torch.device | str) -> GLMImageWrapper:
        """Move every loaded component; only for models loaded whole on one device (`move_to_device`). A
        trained component built empty is never moved: it gets its storage when it is read into shards."""
        from glm_training.models.placement import move_to_device

        move_to_device(self.loaded(), torch.device(device))
        return self


def load_for_training(
    model_cfg,
    component: str,
    *,
    distributed: bool,
    reason: str,
    device: torch.device,
    model_path: str | None = None,
    skip_components: tuple[str, ...] = (),
    skip_reason: str = "",
    build_empty: EmptyBuilder | None = None,
) -> tuple[GLMImageWrapper, PlacementPlan]:
    """Load GLM-Image and place it for training: the one code path for the tiny model and the real one.

    Plan (`plan_placement`) -> load with the plan's map -> refuse meta tensors by name -> move only when the
    plan says so -> log where every component landed. `model_path`: `model_cfg.name` already resolved
    (the engine resolves it on rank 0 first, so the tiny model is built or a checkpoint fetched once).
    `skip_components`: frozen components not to load at all (logged with `skip_reason`). `build_empty`: build
    the trained component empty, to be read into its shards after sharding (`GLMImageWrapper`).
    """
    from glm_training.models.placement import check_no_meta, describe_module, parse_dtype, plan_placement

    plan = plan_placement(
        model_cfg.device_map,
        distributed=distributed,
        reason=reason,
        device=device,
        max_memory_fraction=model_cfg.max_memory_fraction,
    )
    logger.info("[load] placement: %s", plan.describe())
    wrapper = GLMImageWrapper(
        model_path or model_cfg.name,
        component,
        parse_dtype(model_cfg.dtype),
        plan.load_device_map,
        max_memory=plan.max_memory,
        stage_timeout_s=model_cfg.stage_timeout_s,
        tiny_seed=model_cfg.tiny_seed,
        skip_components=skip_components,
        build_empty=build_empty,
    )
    check_no_meta(wrapper.loaded())
    if plan.move_to is not None:
        run_stage(
            f"move components to {plan.move_to}", lambda: wrapper.to(plan.move_to), model_cfg.stage_timeout_s
        )
    for name, module in wrapper.loaded().items():
        logger.info("[load] %s", describe_module(name, module))
    if wrapper.trained_folder is not None:
        logger.info(
            "[load] %s: built on the meta device; each rank reads its shards from %s once it is sharded",
            wrapper.trainable_name,
            wrapper.trained_folder,
        )
    for name in wrapper.skipped:
        logger.info("[load] %s: not loaded (%s)", name, skip_reason or "not needed")
    return wrapper, plan


def enable_gradient_checkpointing(module: nn.Module) -> int:
    """Recompute each transformer block / decoder layer in the backward pass; returns how many layers.

    diffusers' DiT checkpoints its blocks whenever gradients are enabled. transformers' layers checkpoint only
    in training mode, but the trainers keep the model in eval mode (no dropout: the recomputed log-probs must
    equal the rollout's), where `gradient_checkpointing_enable()` alone silently does nothing. So each
    checkpointed layer gets a pre-forward hook that sets that layer's own `training` flag (not its children's:
    every dropout stays off) to whether gradients are enabled. Non-reentrant checkpointing, so LoRA adapters
    inside a layer receive gradients although the layer input does not require any.
    """
    if hasattr(module, "enable_gradient_checkpointing"):  # diffusers ModelMixin
        module.enable_gradient_checkpointing()
        return len(getattr(module, "transformer_blocks", []))
    from transformers.modeling_layers import GradientCheckpointingLayer

    module.activation_checkpointing_enable({"use_reentrant": False})
    layers = [
        m for m in module.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]

    def follow_grad_mode(layer: nn.Module, args) -> None:
        layer.training = torch.is_grad_enabled()

    for layer in layers:
        layer.register_forward_pre_hook(follow_grad_mode)
    return len(layers)


def compile_blocks(module: nn.Module) -> int:
    """torch.compile each repeated block of the DiT in place (diffusers' `compile_repeated_blocks`), so that
    each block's norms, modulations, casts and adapters run as fused kernels; returns how many blocks.

    The blocks share one forward, so a graph compiled once serves all of them; a new input shape or grad mode
    (the rollout's no-grad CFG batch, the update's micro-batch) compiles once more. Gradient checkpointing
    recomputes the compiled block."""
    blocks = getattr(module, "_repeated_blocks", None)
    if not blocks or not hasattr(module, "compile_repeated_blocks"):
        raise ValueError(
            f"model.compile_blocks: {type(module).__name__} names no repeated blocks to compile; "
            "it applies to the DiT (sampling.compile compiles the AR model's decoding step)."
        )
    module.compile_repeated_blocks()
    return sum(type(m).__name__ in blocks for m in module.modules())
