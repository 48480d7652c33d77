"""The transient terms of the device plan: the update's saved activations and the rollout's peak.

Activations saved for the backward pass of one micro-batch, with and without gradient checkpointing:
`num_layers x tokens x width x coefficient`, the coefficients (each half's `activation_coef` and
`checkpoint_coef`, `models/halves.py`: bytes saved per token per unit of width for one layer) measured on the
real-width fixture `model=glm_image_shape` with `saved_tensor_bytes` (`benchmarks/bench_memory.py
--calibrate`), plus the AR log-softmax over the image vocabulary. The rollout's transient is the VAE decode
of one micro-batch, or under `trainer.fsdp_gather_for_rollout` the trained component gathered for sampling;
the plan's peak counts the larger of the update's and the rollout's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from glm_training.models.halves import ModelHalf
from glm_training.plan.components import DTYPE_BYTES
from glm_training.plan.report import Term
from glm_training.plan.workload import Workload

# Activations: each half's `activation_coef` (`models/halves.py`) is the bytes saved for backward per token
# per unit of hidden width by ONE layer in a bf16-autocast LoRA training forward, measured with saved-tensor
# hooks on the real-width fixture (`bench_memory.py --calibrate`; 2-core CPU, torch 2.13). Linear in the
# tokens: attention saves no tokens x tokens matrix (flash kernels on GPU and CPU). Full fine-tuning saves
# the same inputs of every linear layer. With gradient checkpointing a layer keeps only its bf16 input
# (`checkpoint_coef`, 2 bytes), and one layer's full activations exist during its recompute (added in
# `activation_terms`).
# Rollout: the VAE decode's transient peak per output pixel (bytes) per channel of its full-resolution stage
# (block_out_channels[0]), 2-byte weights: measured on the fixture's VAE (CogView4 layout, 128 channels) in
# bf16 on CPU, 6046 bytes a pixel at 512² (`bench_memory.py --vae`), i.e. 47 per channel.
VAE_DECODE_BYTES_PER_PIXEL_CHANNEL = 47.0


@contextlib.contextmanager
def saved_tensor_bytes(params):
    """Yield a dict {storage pointer: bytes} of the distinct storages autograd saves for backward inside the
    block, the given parameters excluded: the activations a training forward keeps alive until backward."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def activation_terms(
    checkpointing: bool, half: ModelHalf, n_layers: int, work: Workload
) -> tuple[Term, Term]:
    """(the activations the run keeps, the same with gradient checkpointing toggled, for comparison)."""
    batch, tokens, width_h, logits = work.batch, work.tokens, work.width, work.logits
    full = half.activation_coef * n_layers * batch * tokens * width_h + logits
    ckpt = (half.checkpoint_coef * n_layers + half.activation_coef) * batch * tokens * width_h + logits
    on, off = (ckpt, full) if checkpointing else (full, ckpt)
    what = f"{batch} x {tokens} tokens x {n_layers} layers"
    kept = Term(f"activations ({'with' if checkpointing else 'no'} checkpointing)", on, what)
    other = Term(
        f"  (would be {'without' if checkpointing else 'with'} checkpointing)", off, "not counted in the peak"
    )
    return kept, other


def rollout_term(
    cfg: Any, modules: dict[str, nn.Module], work: Workload, rollout_gather: float, trained_name: str
) -> Term:
    """The rollout's transient: the VAE decode of one micro-batch, or the sampling gather
    (`sharding.gathered_units`) when there is one."""
    s = cfg.sampling
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    vae_bytes_per_pixel = VAE_DECODE_BYTES_PER_PIXEL_CHANNEL * modules["vae"].config.block_out_channels[0]
    decode = Term(
        "rollout VAE decode (transient)",
        vae_bytes_per_pixel * work.decode_batch * s.height * s.width * wbytes / 2,
        f"{work.decode_batch} images of {s.height}x{s.width}",
    )
    if not rollout_gather:
        return decode
    # A rollout decodes after the gathered weights are freed; evaluation holds them through the pipeline's
    # decode.
    evaluates = bool(cfg.eval.every_n_steps)
    total = rollout_gather + decode.bytes if evaluates else max(rollout_gather, decode.bytes)
    return Term(
        "FSDP sampling gather (transient)",
        total,
        f"{trained_name} gathered for sampling (trainer.fsdp_gather_for_rollout) less the units"
        + (", + the evaluation's VAE decode" if evaluates else ""),
    )
