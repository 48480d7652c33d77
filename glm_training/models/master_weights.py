"""Float32 master weights for full fine-tuning of a bfloat16 / float16 model (`model.fp32_master_weights`).

AdamW's update at an RL learning rate (1e-6 to 1e-5) is far below a bf16 weight's rounding step (2^-8 of
its magnitude), so bf16 weights trained in place mostly stay what they were. The trained parameters are
therefore upcast to float32 after loading: their gradients and AdamW state follow (16 bytes a trained
parameter), checkpoints keep them, and the forward computes in the model's dtype through the policy's
precision (autocast under DDP, FSDP2's `param_dtype` under FSDP). The frozen half and the KL reference copy
stay in the model's dtype.

The KL reference must compute exactly as the policy does while they are equal (the first KL is 0): under
DDP, autocast computes the matmuls of both in bf16, but ops outside autocast (embeddings, hand-written norms,
additions) see the policy's float32 parameters; `computing_like_masters` gives the reference copy the same
float32 values for the duration of each of its submodules' forward (one submodule at a time, so the extra
memory is one layer's weights). Under FSDP the precision policy casts every parameter of both to bf16, and
nothing is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def upcast_trained_(module: nn.Module) -> int:
    """Make every trainable parameter of `module` float32 in place; returns how many elements were upcast."""
    count = 0
    for param in module.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
            count += param.numel()
    return count


def master_names(module: nn.Module) -> set[str]:
    """Names of the float32 trainable parameters of `module` (the masters)."""
    return {n for n, p in module.named_parameters() if p.requires_grad and p.dtype == torch.float32}


@contextlib.contextmanager
def computing_like_masters(module: nn.Module, names: set[str]) -> Iterator[nn.Module]:
    """`module` (a low-precision copy) computes with its `names` parameters upcast to float32, as the masters.

    Each submodule holding such parameters gets them upcast for its own forward and restored after it, so at
    most one submodule's weights exist twice at a time. For no-grad forwards (the KL reference).
    """
    handles = []

    def upcast(sub: nn.Module, *_):
        sub._low_precision = {}  # type: ignore[attr-defined]
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in wanted and param.dtype != torch.float32:
                sub._low_precision[name] = param.data  # type: ignore[attr-defined]
                param.data = param.data.float()

    def restore(sub: nn.Module, *_):
        for name, data in sub.__dict__.pop("_low_precision", {}).items():
            getattr(sub, name).data = data

    wanted = {id(p) for n, p in module.named_parameters() if n in names}
    for sub in module.modules():
        if any(id(p) in wanted for p in sub.parameters(recurse=False)):
            handles.append(sub.register_forward_pre_hook(upcast))
            handles.append(sub.register_forward_hook(restore))
    try:
        yield module
    finally:
        for handle in handles:
            handle.remove()
        for sub in module.modules():  # a forward that raised leaves its submodule upcast
            restore(sub)


__all__ = ["computing_like_masters", "master_names", "upcast_trained_"]
