"""LoRA adapters folded into a sampling copy of their layers, for a rollout that runs the plain model.

A LoRA layer computes `base(x) + scale * B(A(dropout(x)))` in two extra matmuls and a few small kernels, and
its Python forward (peft's adapter bookkeeping) is where a compiled decoding step breaks into pieces. For
sampling, `FoldedLoRA` keeps beside each LoRA layer a plain `nn.Linear` whose weight is `W + scale * B A`
(peft's `get_delta_weight`, added in float32, stored in W's dtype) and whose bias is the base layer's own
tensor; `swapped()` puts those linears in the LoRA layers' places for the duration, so the model samples with
the plain layers' kernels, and puts the LoRA layers back on the way out. The base weights are never touched
(peft's in-place `merge` / `unmerge` would round the bf16 base weights a little at every step).

The copies are allocated once, in the constructor, and refreshed in place (`refresh`) before each rollout, so
a compiled decoding step sees the same tensors at every step of a run (no recompilation, CUDA graphs keep
their addresses). They cost the memory of the targeted weights (the AR recipes' attention projections, about
a sixth of GLM-Image's AR weights), held for the whole run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from glm_training.models.lora import ADAPTER, tuner_layers


class FoldedLoRA:
    """A plain linear beside each LoRA layer of `module`, holding its weights with the adapter folded in."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.layers = tuner_layers(module)
        if not self.layers:
            raise ValueError(
                "sampling.sampler=folded folds LoRA adapters into a sampling copy, and this model has none; "
                "enable model.lora, or set sampling.sampler=policy (with sampling.compile=true to compile "
                "the decoding step of a fully fine-tuned model)."
            )
        self.folded: list[nn.Linear] = []
        for name, layer in self.layers:
            base = layer.get_base_layer()
            if not isinstance(base, nn.Linear) or getattr(layer, "fan_in_fan_out", False):
                raise NotImplementedError(
                    f"sampling.sampler=folded folds LoRA on nn.Linear layers only; {name} wraps "
                    f"{type(base).__name__}. Set sampling.sampler=policy."
                )
            weight = base.weight
            linear = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(torch.empty_like(weight), requires_grad=False)
            linear.bias = base.bias  # the base layer's own tensor: a bias is never adapted
            self.folded.append(linear)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Each copy := W + scale * B A of its layer's current adapter weights (float32 sum, W's dtype),
        outside any autocast (the rollout runs under the policy's), so B A is not rounded to bf16 first."""
        for (_, layer), linear in zip(self.layers, self.folded):
            weight = layer.get_base_layer().weight
            with torch.autocast(weight.device.type, enabled=False):
                delta = layer.get_delta_weight(ADAPTER).float()
            linear.weight.copy_(weight.float() + delta)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[nn.Module]:
        """`module` with its LoRA layers replaced by the folded linears for the duration; restored after."""
        for (name, _), linear in zip(self.layers, self.folded):
            self._set(name, linear)
        try:
            yield self.module
        finally:
            for name, layer in self.layers:
                self._set(name, layer)

    def _set(self, name: str, child: nn.Module) -> None:
        parent_name, _, attribute = name.rpartition(".")
        setattr(self.module.get_submodule(parent_name), attribute, child)
