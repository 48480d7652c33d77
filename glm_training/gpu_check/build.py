"""GLM-Image at its real depth (or one layer per stack with `--toy`), built with random weights directly on
the device, and the check that its AR model gives finite logits.

The widths are those of `models/shape.py`; each component is created on the meta device, materialised with
`to_empty` and filled by a seeded deterministic init (`shape.build_components`; no round trip through disk).

Weights: biases 0, norm scales 1, every other parameter N(0, 0.02) values. To fill billions of them in seconds
on any device, one seeded block of 2^20 - 3 normal values (a prime length) is tiled through each tensor from a
per-tensor offset: rows of a matrix are distinct windows of the block, which keeps activations and logits in
their usual range (the build checks the logits).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from glm_training.gpu_check.settings import PROMPT, Settings

logger = logging.getLogger("glm_training.gpu_check")


def build_pipeline(settings: Settings):
    """GLM-Image with `settings.layers` layers per stack, random weights, built on `settings.device`
    (`shape.build_components`: meta device, then materialised there and seeded)."""
    from glm_training.models import shape

    built = shape.build_components(settings.layers, settings.device, settings.dtype, settings.seed)
    for name, module in built.items():
        logger.info("[gpu_check]   %s: %.2fB parameters", name, numel(module) / 1e9)
    pipe = shape.finish_shape_pipeline(**built)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def numel(module: nn.Module) -> int:
    """The number of parameters of `module`."""
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def ar_logits_check(pipe, device: torch.device) -> dict[str, Any]:
    """One AR forward on the prompt: its next-token logits must be finite (the init is numerically sane)."""
    from glm_training.pipeline.ar import chat_inputs

    inputs = chat_inputs(pipe, [PROMPT], 512, 512)
    out = pipe.vision_language_encoder(**{k: v.to(device) for k, v in inputs.items()}, logits_to_keep=1)
    logits = out.logits.float()
    return {"finite": bool(torch.isfinite(logits).all()), "logits_std": float(logits.std())}
