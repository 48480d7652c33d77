"""The decoder's ODE rollout (DiffusionNFT, AWM): the pipeline's own sampler, final latents only.

DiffusionNFT and AWM train on the forward process, so a rollout keeps what the update re-noises (the clean
latents) and the conditioning, nothing per step: no trajectories, log-probs or transition means. The denoising
loop is `pipeline/dit.py`'s (same velocity, same Euler step), so it reproduces `GlmImagePipeline` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from glm_training.pipeline.dit import VELOCITY_FNS, GuidanceInputs
from glm_training.pipeline.euler import ode_step


@dataclass
class NFTSamples:
    """One micro-batch of B samples, on CPU.

    Attributes:
        cond: the guidance inputs without the unconditional embeddings (training is CFG-free).
        final_latents: [B, C, h, w] float32 clean latents, x_0 of the update's forward process.
    """

    cond: GuidanceInputs
    final_latents: torch.Tensor

    def num_bytes(self) -> int:
        """Bytes held per micro-batch (the figure compared with Flow-GRPO's trajectories)."""
        tensors = [self.final_latents, *(getattr(self.cond, f) for f in self.cond.__dataclass_fields__)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.no_grad()
def sample_ode(
    transformer: nn.Module,
    latents: torch.Tensor,
    cond: GuidanceInputs,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    guidance_scale: float,
    batched_cfg: bool = False,
) -> torch.Tensor:
    """Denoise `latents` [B, C, h, w] through the schedule with Euler steps; returns [B, C, h, w] float32."""
    velocity_fn = VELOCITY_FNS[batched_cfg]
    device = latents.device
    latents = latents.float()
    for i, t in enumerate(timesteps):
        velocity = velocity_fn(transformer, latents, t, cond, guidance_scale)
        latents = ode_step(latents, velocity, sigmas[i].to(device), sigmas[i + 1].to(device))
    return latents


def keep_for_update(cond: GuidanceInputs, final_latents: torch.Tensor) -> NFTSamples:
    """What the NFT update needs of a sampled micro-batch, moved to CPU."""
    conditional = replace(cond, negative_embeds=None).to(torch.device("cpu"))
    return NFTSamples(conditional, final_latents.detach().float().cpu())
