"""Grouped-query attention for the decoding step without repeating the key/value heads.

GLM-Image's AR model has 32 query heads over 2 key/value heads. transformers' SDPA attention repeats each
key/value head over its 16 query heads (`repeat_kv`) whenever a mask is given, unless it runs eagerly with one
query token (then it packs the query instead, `pack_gqa`); a compiled decoding step takes the first branch,
and so copies the whole preallocated KV cache, 16 times over, twice a layer at every step, and runs attention
over the copies. Measured on one H200 at batch 16 (docs/benchmarks.md): that copy and the attention over it
were 56% of the compiled step's device time.

`PACKED_GQA` is an attention implementation that packs instead, compiled or not: the query heads that share
a key/value head become rows of one query ([B, H, S, D] -> [B, H_kv, G*S, D], transformers' head order), the
mask is repeated over those rows, and one `scaled_dot_product_attention` reads each key/value head once. It
computes the same attention up to float rounding (the reductions run in another order). `packed_gqa(model)`
switches the model's text decoder to it for the duration; the decoding loop uses it for its per-token steps
(the prefill keeps SDPA), where it is given the loop's own 4-D boolean mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

PACKED_GQA = "glm_training_packed_gqa"


def packed_gqa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention of `query` [B, H, S, D] over `key` / `value` [B, H_kv, L, D] with a boolean (True = attend)
    or additive mask [B, 1, S, L'] (L' >= L), as transformers' attention functions are called; returns
    ([B, S, H, D], None)."""
    if attention_mask is None:
        raise ValueError(f"{PACKED_GQA} takes an explicit mask (the decoding loop's); none was given.")
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # transformers' repeat_kv gives query head h the key/value head h // groups: group-major rows per kv head.
    packed = query.reshape(batch, kv_heads, groups * length, dim)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, mask.shape[1], groups * length, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)


@contextlib.contextmanager
def packed_gqa(model: nn.Module) -> Iterator[None]:
    """The model's text decoder computing attention with `PACKED_GQA` for the duration."""
    config = model.config.get_text_config(decoder=True)
    before = config._attn_implementation
    config._attn_implementation = PACKED_GQA
    try:
        yield
    finally:
        config._attn_implementation = before
