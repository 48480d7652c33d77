"""The AR policy's log-probs under teacher forcing (the update's side of GRPO/DAPO/GSPO), and the per-sample
records a rollout is split into and collated back from.

`teacher_forced_log_probs` recomputes, with gradients and in one forward pass over prompt + generated tokens,
the log-probs `pipeline/ar.py` recorded while sampling: the same `process_logits`, the recorded M-RoPE
positions passed back explicitly (tests/test_ar_logprobs.py holds the two equal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glm_training.pipeline.ar import ARSamples, module_device
from glm_training.pipeline.ar_logits import SamplingParams, process_logits


@contextlib.contextmanager
def _contiguous_head_input(model: nn.Module) -> Iterator[None]:
    """Hand the LM head (`lm_head`, wrapped or not) a contiguous input inside the block.

    `logits_to_keep` gives the head a slice of the hidden states, a strided view. matmul folds a strided
    [B, T, H] input into one [B*T, H] GEMM only when its weight requires grad (a policy trained in full);
    a frozen head (the KL reference, or LoRA's) multiplies it sample by sample instead, and the two GEMMs
    may round differently. Contiguous, both fold into the same GEMM, so the first step's KL is exactly 0.
    """
    heads = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "lm_head"]
    handles = [
        head.register_forward_pre_hook(lambda _, args: tuple(a.contiguous() for a in args)) for head in heads
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def teacher_forced_log_probs(model: nn.Module, samples: ARSamples, params: SamplingParams) -> Tensor:
    """Log-probs [B, L] (float32, on the model's device, differentiable) of the sampled tokens.

    One forward pass over prompt + generated tokens with the positions, attention mask and grids generation
    used, then `process_logits` with `keep_ids` = the tokens themselves. 0 where `completion_mask` is False.
    Only the positions up to the last completion token are fed, and logits are computed only for the
    completion span (`logits_to_keep`). `model` may be wrapped (DDP, peft): it is called with keyword
    arguments only.
    """
    device = module_device(model)
    completion_columns = samples.completion_mask.any(dim=0).nonzero().squeeze(-1)
    if completion_columns.numel() == 0:
        raise ValueError("samples.completion_mask is empty: no generated tokens to score.")
    first, last = int(completion_columns[0]), int(completion_columns[-1])
    num_scored = last - first + 1
    # Logits at position i predict token i + 1: feeding tokens [0, last) yields the predictions of
    # tokens [first, last] in the final `num_scored` positions.
    with _contiguous_head_input(model):
        outputs = model(
            input_ids=samples.input_ids[:, :last].to(device),
            attention_mask=samples.attention_mask[:, :last].to(device),
            position_ids=samples.position_ids[:, :, :last].to(device),
            image_grid_thw=samples.image_grid_thw.to(device),
            logits_to_keep=num_scored,
            use_cache=False,
            **{key: value.to(device) for key, value in samples.extra.items()},
        )
    logits_btv = outputs.logits
    # Where the logits are: a module whose weights live in host memory (FSDP's CPU offload) computes
    # on the accelerator.
    device = logits_btv.device
    targets_bt = samples.input_ids[:, first : last + 1].to(device)
    log_probs_btv = process_logits(logits_btv, params, keep_ids_bt=targets_bt)
    log_probs_bt = log_probs_btv.gather(-1, targets_bt[..., None]).squeeze(-1)
    mask_bt = samples.completion_mask[:, first : last + 1].to(device)
    # where, not multiply: a filtered-out token outside the mask would give -inf * 0 = nan.
    log_probs_bt = torch.where(mask_bt, log_probs_bt, 0.0)
    batch_size, length = samples.input_ids.shape
    return torch.cat(
        [
            log_probs_bt.new_zeros(batch_size, first),
            log_probs_bt,
            log_probs_bt.new_zeros(batch_size, length - last - 1),
        ],
        dim=1,
    )


def split_samples(samples: ARSamples) -> list[dict[str, Tensor]]:
    """One record per sequence, left padding stripped, every tensor on CPU (safe to send to other ranks)."""
    num_grids = samples.image_grid_thw.shape[0] // samples.input_ids.shape[0]
    records = []
    for b in range(samples.input_ids.shape[0]):
        keep = samples.attention_mask[b].bool()
        record = {
            "input_ids": samples.input_ids[b, keep],
            "position_ids": samples.position_ids[:, b, keep],
            "completion_mask": samples.completion_mask[b, keep],
            "sampling_log_probs": samples.sampling_log_probs[b, keep],
            "prior_token_ids": samples.prior_token_ids[b],
            "image_grid_thw": samples.image_grid_thw[b * num_grids : (b + 1) * num_grids],
        }
        record.update({f"extra.{k}": v[b] for k, v in samples.extra.items()})
        records.append({k: v.detach().cpu() for k, v in record.items()})
    return records


def collate_samples(records: list[dict[str, Tensor]], pad_token_id: int) -> ARSamples:
    """Stack records into one left-padded batch (the layout generation used; pad positions are 1, as HF's)."""
    length = max(r["input_ids"].shape[0] for r in records)

    def left_pad(t: Tensor, value, dim: int = -1) -> Tensor:
        missing = length - t.shape[dim]
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([torch.full(shape, value, dtype=t.dtype), t], dim=dim)

    return ARSamples(
        input_ids=torch.stack([left_pad(r["input_ids"], pad_token_id) for r in records]),
        attention_mask=torch.stack([left_pad(torch.ones_like(r["input_ids"]), 0) for r in records]),
        position_ids=torch.stack([left_pad(r["position_ids"], 1) for r in records], dim=1),
        completion_mask=torch.stack([left_pad(r["completion_mask"], False) for r in records]),
        sampling_log_probs=torch.stack([left_pad(r["sampling_log_probs"], 0.0) for r in records]),
        prior_token_ids=torch.stack([r["prior_token_ids"] for r in records]),
        image_grid_thw=torch.cat([r["image_grid_thw"] for r in records]),
        extra={
            k.removeprefix("extra."): torch.stack([r[k] for r in records])
            for k in records[0]
            if k.startswith("extra.")
        },
    )


@dataclass
class ARRollout:
    records: list[dict]  # one per sample on this rank (see `split_samples`)
