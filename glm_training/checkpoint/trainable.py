"""The trained parameters as a checkpoint stores them: only the parameters that train (the LoRA adapters, or
the whole component for full fine-tuning), by name; the frozen rest is reloaded from `model.name`."""

from __future__ import annotations

import torch
from torch import nn

from glm_training.checkpoint.layout import CheckpointError


def trainable_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (LoRA adapters or the whole component), detached, on CPU, contiguous."""
    return {n: p.detach().cpu().contiguous() for n, p in module.named_parameters() if p.requires_grad}


def check_trainable_names(module: nn.Module, names: set[str]) -> None:
    """Refuse a checkpoint whose parameter names are not exactly the trainable parameters of `module`."""
    expected = {n for n, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = expected - names, names - expected
    if missing or unexpected:
        raise CheckpointError(
            "checkpoint does not match the model being trained: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. Was it written with other "
            "model.lora settings or another model.name?"
        )


def load_trainable_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    check_trainable_names(module, set(state))
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
