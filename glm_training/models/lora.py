"""LoRA adapters on either half of GLM-Image, through peft's own API only.

One code path for the DiT (a diffusers model) and the AR model (a transformers model): peft injects its LoRA
layers in place (`inject_adapter_in_model`, adapter "default"), so the pipeline keeps its classes and calls
the adapted module as before. Nothing here goes through diffusers' or transformers' peft integration
(`add_adapter`, `disable_adapters`, adapter `save_pretrained`): those layers check the installed peft's
version on every call and refuse to run when a new release of theirs asks for a peft that does not exist yet
(transformers 5.24 asks for peft >= 0.22). peft's own functions have no such gate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

ADAPTER = "default"
# peft's adapter weights file (read by `PeftModel.from_pretrained` and transformers' `load_adapter`).
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


# `model.lora.init_weights` -> peft's `init_lora_weights`: A ~ N(0, 1/r) (Flow-GRPO, DiffusionNFT, AWM), or
# peft's default Kaiming-uniform A (TRL). B starts at 0 in both.
LORA_INIT_WEIGHTS = {"gaussian": "gaussian", "default": True}


def add_lora_adapters(module: nn.Module, lora: Any) -> None:
    """Inject LoRA adapters (peft, in place, adapter "default") as `model.lora` describes; only they train.

    The same call builds the adapters for training and, in `glm_training.export`, to load a checkpoint's
    adapter weights back, so the parameter names always match `trainable.safetensors`.
    """
    from peft import LoraConfig, inject_adapter_in_model

    module.requires_grad_(False)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        init_lora_weights=LORA_INIT_WEIGHTS[lora.init_weights],
    )
    # What the adapter file records as its base model (transformers records the model's path, diffusers none).
    config.base_model_name_or_path = vars(module).get("name_or_path")
    inject_adapter_in_model(config, module, ADAPTER)
    # Adapters train in float32 even when the base weights are bf16 (the usual LoRA recipe).
    for p in module.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, layer) pairs of the peft layers injected into `module`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, m) for name, m in module.named_modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapter_inputs_uncast(module: nn.Module, device_type: str) -> Iterator[None]:
    """Under autocast, each LoRA layer's input left in its own dtype for the duration (peft's
    `cast_input_dtype_enabled` off), where that changes nothing the layer computes.

    peft casts a LoRA layer's input to its adapter weights' dtype; autocast then casts it to the
    autocast dtype for the matmul. With float32 adapters (float32 masters) or adapters in the autocast
    dtype, the first cast is exact or undone, so the matmul sees the same values either way, and the
    gradient flows back through the same exact casts: skipping it computes the same numbers bit for bit.
    It saves two copies of every adapted layer's input, forward and backward: on GLM-Image's DiT step,
    casts were 20 % of the device time (docs/benchmarks.md). Outside autocast, or for adapters in another
    dtype, peft's cast stays.
    """
    import torch

    if not torch.is_autocast_enabled(device_type):
        yield
        return
    exact = {torch.float32, torch.get_autocast_dtype(device_type)}
    layers = [
        layer
        for _, layer in tuner_layers(module)
        if all(p.dtype in exact for n, p in layer.named_parameters() if not n.startswith("base_layer."))
    ]
    before = [getattr(layer, "cast_input_dtype_enabled", True) for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for layer, flag in zip(layers, before, strict=True):
            layer.cast_input_dtype_enabled = flag


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """`module` computing with its base weights only (every LoRA layer's adapters off) for the duration."""
    layers = [layer for _, layer in tuner_layers(module)]
    if not layers:
        raise ValueError("adapters_disabled: the module has no LoRA layers to disable")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield module
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_lora_adapters(module: nn.Module, *, merge: bool = True) -> None:
    """peft's `merge_and_unload` (or `unload` with `merge=False`) for adapters injected in place.

    `inject_adapter_in_model` puts peft LoRA layers into the model without a `PeftModel` around it, so there
    is no `merge_and_unload` to call: as peft does, each layer merges itself (`merge(safe_merge=True)`,
    which also refuses NaNs) and is then replaced by its base layer. The model's adapter bookkeeping
    (`peft_config`) goes too, so the module saves and loads as the plain model it now is.
    """
    layers = tuner_layers(module)
    assert layers, "merge_lora_adapters called on a module without LoRA layers"
    for name, layer in layers:
        if merge:
            layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, layer.get_base_layer())
    if "peft_config" in vars(module):
        del module.peft_config


def save_lora_adapters(module: nn.Module, folder: Path) -> None:
    """Save the component's adapter "default" in the format its own library loads back.

    diffusers models: `save_lora_adapter` (read back by `load_lora_adapter(folder, weight_name=...,
    prefix=None)`); transformers models: peft's adapter format (`adapter_model.safetensors` with keys
    under `base_model.model.`, and `adapter_config.json`), read back by transformers' `load_adapter` or
    peft's `PeftModel.from_pretrained`. Both are written from peft's `get_peft_model_state_dict`.
    """
    from diffusers import ModelMixin

    if isinstance(module, ModelMixin):
        module.save_lora_adapter(folder, adapter_name=ADAPTER, safe_serialization=True)
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(module, adapter_name=ADAPTER)
    state = {f"base_model.model.{key}": value.contiguous() for key, value in state.items()}
    save_file(state, str(folder / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    module.peft_config[ADAPTER].save_pretrained(str(folder))  # adapter_config.json
