"""The pipeline's deterministic Euler (ODE) step of a flow-matching DiT, and the shape helpers steps share.

Convention: ``x_s = (1 - s) * x0 + s * eps``; the model predicts the velocity ``v = eps - x0``; one step goes
from sigma ``s`` to ``s_next < s``, so ``dt = s_next - s < 0``. Flow-GRPO's stochastic steps
(`algorithms/decoder/sde.py`) reduce to this step when their noise level is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ode_step(latents: Tensor, velocity: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Euler step ``x + v * (s_next - s)``.

    Args:
        latents, velocity: ``[B, ...]``.
        sigma, sigma_next: float, 0-d tensor or ``[B]`` tensor.

    Returns:
        ``[B, ...]`` in the dtype of ``latents``; computed in float32.
    """
    check_shapes(latents, velocity, None, None)
    dt = sigma_like(sigma_next, latents) - sigma_like(sigma, latents)
    return (latents.float() + velocity.float() * dt).to(latents.dtype)


def sigma_like(sigma: float | Tensor, latents: Tensor) -> Tensor:
    """A float, 0-d or ``[B]`` sigma as a float32 ``[B or 1, 1, ..., 1]`` tensor on the latents' device."""
    sigma_t = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
    if sigma_t.ndim == 0:
        return sigma_t.reshape((1,) * latents.ndim)
    if sigma_t.ndim == 1 and sigma_t.shape[0] in (1, latents.shape[0]):
        return sigma_t.reshape((-1,) + (1,) * (latents.ndim - 1))
    raise ValueError(
        f"sigma must be a float, a 0-d tensor or a [B] tensor with B={latents.shape[0]}; "
        f"got shape {tuple(sigma_t.shape)}"
    )


def check_shapes(latents: Tensor, velocity: Tensor, noise: Tensor | None, prev_sample: Tensor | None) -> None:
    for name, other in (("velocity", velocity), ("noise", noise), ("prev_sample", prev_sample)):
        if other is not None and other.shape != latents.shape:
            raise ValueError(
                f"{name} has shape {tuple(other.shape)} but latents have shape {tuple(latents.shape)}"
            )
