"""The forward-process math DiffusionNFT and AWM share: re-noising clean latents, the velocity KL of both
references (NVlabs' `train_nft_sd3.py`, the AWM authors' `train_sd3_awm.py`), and the EMA of a weight copy
(NFT's old model, AWM's anchor)."""

from __future__ import annotations

import torch
from torch import Tensor


def noised_latents(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """The forward process `x_t = (1 - t) x_0 + t eps`. x0, noise: [B, ...]; t: [B] -> [B, ...] float32."""
    t = t.float().view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - t) * x0.float() + t * noise.float()


def velocity_kl(v_theta: Tensor, v_ref: Tensor) -> Tensor:
    """[B] mean over elements of (v_theta - v_ref)^2: the reference's KL penalty to the base model."""
    return ((v_theta - v_ref.detach()) ** 2).mean(dim=tuple(range(1, v_theta.ndim)))


@torch.no_grad()
def ema_update_(old: list[Tensor], current: list[Tensor], decay: float) -> None:
    """In place `old <- decay * old + (1 - decay) * current` (the reference's old-model update)."""
    for target, source in zip(old, current, strict=True):
        target.copy_(target * decay + source.detach().to(target.device, target.dtype) * (1.0 - decay))
