"""The model as the plan sees it: the components on the meta device, their parameter counts, their dtype.

Parameter counts come from the component configs, instantiated on the meta device: no weights are read or
allocated.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def meta_components(model_cfg: Any) -> dict[str, nn.Module]:
    """The four weight-holding components on the meta device, from their configs only.

    `glm_image_shape` and `zai-org/GLM-Image` come from `models/shape.py` (the real configs, with the
    fixture's or the real layer counts); `tiny` and local pipeline folders from the folder's config files.
    """
    from glm_training.models import shape

    name = model_cfg.name
    if name == shape.SHAPE_MODEL_NAME or name.rstrip("/") == "zai-org/GLM-Image":
        return _components_from_code(model_cfg)
    from glm_training.models.wrapper import resolve_model_path

    # Outside the meta-device block: resolving "tiny" builds it (real tensors) on first use.
    folder = Path(resolve_model_path(name, model_cfg.tiny_seed, model_cfg.shape_layers()))
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"no local pipeline folder for '{name}' to read component configs from")
    return _components_from_folder(folder)


def _components_from_code(model_cfg: Any) -> dict[str, nn.Module]:
    """The real model's or the real-width fixture's components (`models/shape.py`), on the meta device."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import GlmImageForConditionalGeneration, T5EncoderModel

    from glm_training.models import shape

    with torch.device("meta"):
        real = model_cfg.name != shape.SHAPE_MODEL_NAME
        num_ar, num_dit = (
            (shape.REAL_NUM_AR_LAYERS, shape.REAL_NUM_DIT_LAYERS) if real else model_cfg.shape_layers()
        )
        return {
            "vision_language_encoder": GlmImageForConditionalGeneration(
                shape.glm_image_config(num_ar, shape.REAL_NUM_VISION_LAYERS if real else 1)
            ),
            "transformer": GlmImageTransformer2DModel(**shape.dit_config(num_dit)),
            "text_encoder": T5EncoderModel(shape.glyph_config(shape.REAL_NUM_GLYPH_LAYERS if real else 1)),
            "vae": AutoencoderKL(**shape.VAE_CONFIG),
        }


def _components_from_folder(folder: Path) -> dict[str, nn.Module]:
    """A local pipeline folder's components from its config files, on the meta device."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import AutoConfig, GlmImageForConditionalGeneration, T5EncoderModel

    with torch.device("meta"):
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


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lora_targets(module: nn.Module, targets: list[str]) -> list[nn.Linear]:
    """Every Linear whose name matches a target (peft's rule: the full name, or its last components, equal
    the target)."""
    return [
        sub
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Linear)
        and any(name == t or name.endswith("." + t) or fnmatch.fnmatch(name, t) for t in targets)
    ]


def lora_params(module: nn.Module, targets: list[str], rank: int) -> int:
    """Parameters of peft LoRA adapters r x (in + out) on every targeted Linear."""
    return sum(rank * (sub.in_features + sub.out_features) for sub in lora_targets(module, targets))


def not_loaded(cfg: Any) -> set[str]:
    """The components a run never loads: a DiT run on cached prior tokens never loads the AR model
    (`data.prior_cache`)."""
    return {"vision_language_encoder"} if cfg.component == "dit" and cfg.data.prior_cache else set()
