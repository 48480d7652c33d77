"""The decoding loop's step (`pipeline/ar.py` `_decode_loop`): the 4-D mask it hands the model, the KV cache
preallocated for the whole sequence, the step function around both (compiled where asked), and what a sampler
keeps of them from one call to the next (`DecodeState`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import StaticCache
from transformers.cache_utils import StaticLayer


class DecodeState:
    """What a sampler keeps between decoding-loop calls: for each (batch, total length) it decoded, the KV
    cache and the decoding step (compiled, where asked) built around it, reused by later calls of that shape
    so that a compiled step is compiled once and its CUDA graphs keep their addresses."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, int, bool], tuple[StaticCache, Callable]] = {}


# The 4-D masks the decoding loop hands the model, by attention implementation: (the mask's dtype and fill,
# the value that opens a column). SDPA takes a boolean mask (True = attend); eager attention adds the mask to
# its scores, so it takes 0 to attend and the dtype's lowest value not to, as transformers builds it.
ATTENTION_MASKS = ("sdpa", "eager")


def decoding_mask(model: nn.Module, attention_mask: Tensor, total_length: int) -> tuple[Tensor, bool | float]:
    """The loop's [B, 1, 1, L] mask over the preallocated cache, open over the prompt's tokens, and the value
    that opens a column, in the form the model's attention implementation takes (`ATTENTION_MASKS`)."""
    implementation = model.config.get_text_config(decoder=True)._attn_implementation
    if implementation not in ATTENTION_MASKS:
        raise ValueError(
            f"the decoding loop hands the model a 4-D mask, which attention '{implementation}' does not "
            f"take; load the AR model with attn_implementation in {ATTENTION_MASKS}, or set "
            "sampling.decoding=generate."
        )
    prompt = attention_mask.bool()
    shape = (prompt.shape[0], 1, 1, total_length)
    if implementation == "sdpa":
        mask = torch.zeros(shape, dtype=torch.bool, device=prompt.device)
        mask[:, 0, 0, : prompt.shape[1]] = prompt
        return mask, True
    closed = torch.finfo(model.dtype).min
    mask = torch.full(shape, closed, dtype=model.dtype, device=prompt.device)
    mask[:, 0, 0, : prompt.shape[1]] = torch.where(prompt, 0.0, closed)
    return mask, 0.0


class _AutocastStaticLayer(StaticLayer):
    """transformers' `StaticLayer`, holding the values in the keys' dtype.

    Under autocast (bf16 compute of fp32 weights, `trainer.mixed_precision=bf16`) GLM-Image's keys leave the
    rotary embedding in float32 while the values leave their projection in bfloat16; `StaticLayer` allocates
    both in the first keys' dtype and then refuses the values. Upcasting them is exact, and attention under
    autocast casts both back to bf16, so it computes what it would with a growing cache of mixed dtypes.
    Without autocast both already share a dtype and nothing changes.
    """

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return super().update(key_states, value_states.to(key_states.dtype), *args, **kwargs)


class _RolloutCache(StaticCache):
    """The decoding loop's preallocated KV cache: `StaticCache` with `_AutocastStaticLayer` layers."""

    def __init__(self, config, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        if any(type(layer) is not StaticLayer for layer in self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers})
            raise NotImplementedError(
                f"the decoding loop's cache supports full-attention layers only, got {kinds}."
            )
        self.layers = [_AutocastStaticLayer(max_cache_len=max_cache_len) for _ in self.layers]


def cache_and_step(
    model, state: DecodeState | None, batch_size: int, total_length: int, compile: bool, device: torch.device
) -> tuple[StaticCache, Callable]:
    """The loop's KV cache for the whole sequence and its decoding step (logits of the last token, float32):
    new, or `state`'s for this shape, emptied."""
    key = (batch_size, total_length, compile)
    if state is not None and key in state.steps:
        cache, step_fn = state.steps[key]
        cache.reset()
        return cache, step_fn
    cache = _RolloutCache(config=model.config.get_text_config(decoder=True), max_cache_len=total_length)

    def decode_step(ids: Tensor, position_ids: Tensor, cache_position: Tensor, mask: Tensor) -> Tensor:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=cache_position,
        )
        return out.logits[:, -1].to(dtype=torch.float32, copy=True)

    step_fn = _compiled_step(decode_step, device) if compile else decode_step
    if state is not None:
        state.steps[key] = (cache, step_fn)
    return cache, step_fn


def _compiled_step(decode_step, device: torch.device):
    """torch.compile of the decoding step: CUDA graphs on CUDA ("reduce-overhead"), inductor elsewhere.
    Fixed shapes (`dynamic=False`): one graph for every step of a rollout of a given batch and length."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(decode_step, mode=mode, dynamic=False, fullgraph=False)
