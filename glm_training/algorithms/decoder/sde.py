"""Stochastic sampling steps for a flow-matching DiT, with Gaussian transition log-probabilities.

Implements the SDE sampler of Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via
Online RL", arXiv 2505.05470) and its coefficients-preserving variant ("CPS"), plus the plain Euler
(ODE) step they reduce to when the noise level is 0.

Convention: ``x_s = (1 - s) * x0 + s * eps``; the model predicts the velocity ``v = eps - x0``; one
step goes from sigma ``s`` to ``s_next < s``, so ``dt = s_next - s < 0``.

Reduction: the log-probability of a step is the per-element Gaussian log-density **averaged** (not
summed) over all non-batch elements, as in Flow-GRPO. This keeps log-probs O(1) whatever the latent
size, and is why Flow-GRPO's clip range is tiny (1e-4). For CPS, Flow-GRPO's own code
(`flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`, `sde_type == "cps"`) keeps only the squared
error, ``-mean((x - m)^2)``: no ``1 / (2 std^2)``, no constants. That is the default here too
(``log_prob="flow_grpo"``); ``log_prob="gaussian"`` gives the full density (:data:`LOG_PROBS`).

All math runs in float32 whatever the dtype of the latents (bf16 latents work). A step whose
transition std is 0 (noise level 0, or the CPS step onto ``s_next == 0``) is deterministic and has no
density; its log-prob is defined as 0, so the policy ratio of such a step is exactly 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from glm_training.pipeline.euler import check_shapes, sigma_like

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class SDEStep:
    """Result of one stochastic step.

    Attributes:
        prev_sample: ``x_{s_next}``, same shape and dtype as the latents.
        log_prob: ``[B]`` float32, log-density of ``prev_sample``, mean over non-batch elements.
        mean: ``[B, ...]`` float32 transition mean.
        std: ``[B, 1, ..., 1]`` float32 transition std (for the flow SDE it includes ``sqrt(-dt)``).
        std_dev_t: ``[B, 1, ..., 1]`` float32, the std Flow-GRPO returns as ``std_dev_t`` and divides its
            KL by: ``a sqrt(s / (1 - s'))`` for the flow SDE (without ``sqrt(-dt)``), ``std`` for CPS.
        velocity: ``[B, ...]`` float32, the (guided) velocity the step used.
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    std_dev_t: Tensor
    velocity: Tensor


def _per_sample(std: Tensor, latents: Tensor) -> Tensor:
    """Expand a ``[1 or B, 1, ..., 1]`` std to ``[B, 1, ..., 1]``."""
    return std.expand((latents.shape[0],) + (1,) * (latents.ndim - 1))


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Log-density of ``sample`` under ``N(mean, std^2)``, averaged over non-batch elements.

    Per element: ``-(x - m)^2 / (2 std^2) - log(std) - log(sqrt(2 pi))``.

    Args:
        sample: ``[B, ...]``.
        mean: broadcastable to ``sample``.
        std: broadcastable to ``sample`` (typically ``[B, 1, ..., 1]``), ``>= 0``.

    Returns:
        ``[B]`` float32. Elements where ``std == 0`` contribute 0 (a deterministic transition has no
        density); they stay finite in value and gradient.
    """
    sample = sample.float()
    mean = mean.float()
    std = std.float()
    positive = std > 0
    # A safe std in the masked-out branch keeps the backward pass free of 0 * inf = NaN.
    safe_std = torch.where(positive, std, torch.ones_like(std))
    log_prob = -((sample - mean) ** 2) / (2.0 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_prob = torch.where(positive, log_prob, torch.zeros_like(log_prob))
    if log_prob.ndim <= 1:
        return log_prob
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def squared_error_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Flow-GRPO's CPS "log-prob": ``-(x - m)^2`` averaged over non-batch elements (no variance, no constant).

    Args:
        sample: ``[B, ...]``.
        mean: broadcastable to ``sample``.
        std: broadcastable to ``sample``; only its sign is used: elements with ``std == 0``
            (deterministic step) contribute 0, as in :func:`gaussian_log_prob`.

    Returns:
        ``[B]`` float32.
    """
    sample = sample.float()
    mean = mean.float()
    positive = std.float() > 0
    log_prob = torch.where(positive, -((sample - mean) ** 2), torch.zeros_like(sample))
    if log_prob.ndim <= 1:
        return log_prob
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


# How a step's log-prob is reduced, by name (`sampling.cps_log_prob`).
LOG_PROBS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "gaussian": gaussian_log_prob,
    "flow_grpo": squared_error_log_prob,
}


def _draw(latents: Tensor, noise: Tensor | None, generator: torch.Generator | None) -> Tensor:
    if noise is not None:
        return noise.float()
    return torch.randn(latents.shape, generator=generator, device=latents.device, dtype=torch.float32)


def _finish_step(
    latents: Tensor,
    mean: Tensor,
    std: Tensor,
    noise: Tensor | None,
    generator: torch.Generator | None,
    prev_sample: Tensor | None,
    *,
    std_dev_t: Tensor,
    velocity: Tensor,
    log_prob_fn: Callable[[Tensor, Tensor, Tensor], Tensor] = gaussian_log_prob,
) -> SDEStep:
    std = _per_sample(std, latents)
    if prev_sample is None:
        z = _draw(latents, noise, generator)
        # where() rather than mean + 0 * z: a zero-std step returns the mean bit for bit.
        prev_sample = torch.where(std > 0, mean + std * z, mean).to(latents.dtype)
    # The log-prob is of the sample as returned (after the dtype cast) and treats it as data, so
    # recomputing it later from the recorded trajectory gives the same number: ratio exactly 1.
    log_prob = log_prob_fn(prev_sample.detach(), mean, std)
    return SDEStep(
        prev_sample=prev_sample,
        log_prob=log_prob,
        mean=mean,
        std=std,
        std_dev_t=_per_sample(std_dev_t, latents),
        velocity=velocity,
    )


def flow_sde_step(
    latents: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
) -> SDEStep:
    """One step of Flow-GRPO's reverse SDE with noise level ``a``.

    ``std_t = a * sqrt(s / (1 - s'))`` with ``s' = s_next`` where ``s >= 1`` (first step, where
    ``1 - s`` would be 0) and ``s' = s`` otherwise;
    ``mean = x (1 + std_t^2 / (2 s) dt) + v (1 + std_t^2 (1 - s) / (2 s)) dt``;
    ``x_next = mean + std_t sqrt(-dt) z``. With ``a = 0`` this is exactly :func:`ode_step`.

    Args:
        latents, velocity: ``[B, ...]``; any float dtype.
        sigma, sigma_next: float, 0-d tensor or ``[B]`` tensor; ``0 <= sigma_next < sigma <= 1``.
        noise_level: ``a >= 0``.
        noise: optional ``z``, same shape as latents; otherwise drawn with ``generator``.
        generator: RNG for ``z`` (on the latents' device).
        prev_sample: if given, nothing is sampled and the log-prob of this sample is returned.

    Returns:
        :class:`SDEStep`; ``log_prob`` is ``[B]``, mean over non-batch elements, 0 when ``a = 0``.
    """
    check_shapes(latents, velocity, noise, prev_sample)
    s = sigma_like(sigma, latents)
    s_next = sigma_like(sigma_next, latents)
    dt = s_next - s
    s_den = torch.where(s >= 1, s_next, s)
    std_t = noise_level * torch.sqrt(s / (1 - s_den))
    x = latents.float()
    v = velocity.float()
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * torch.sqrt(-dt)
    return _finish_step(latents, mean, std, noise, generator, prev_sample, std_dev_t=std_t, velocity=v)


def cps_step(
    latents: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    log_prob: str = "flow_grpo",
) -> SDEStep:
    """One coefficients-preserving ("CPS") stochastic step with noise level ``a``.

    Predicts ``x0_hat = x - s v`` and ``x1_hat = x + (1 - s) v``, then re-noises to ``s_next`` so that
    the coefficients of signal and noise sum in quadrature like the forward process:
    ``std = s_next sin(a pi / 2)``, ``mean = (1 - s_next) x0_hat + sqrt(s_next^2 - std^2) x1_hat``,
    ``x_next = mean + std z``. With ``a = 0`` the mean equals the Euler step (up to rounding).

    ``log_prob="flow_grpo"`` (default) is Flow-GRPO's CPS reduction, ``-mean((x - m)^2)`` with no
    ``1 / (2 std^2)`` and no constants (its Fast configs pair it with ``clip_range=1e-5``);
    ``log_prob="gaussian"`` is the full Gaussian log-density, reduced like :func:`flow_sde_step`.

    Args and returns: as :func:`flow_sde_step`, plus ``log_prob`` (a key of :data:`LOG_PROBS`). The
    step onto ``s_next == 0`` has std 0: it returns ``x0_hat`` and a log-prob of 0.
    """
    check_shapes(latents, velocity, noise, prev_sample)
    s = sigma_like(sigma, latents)
    s_next = sigma_like(sigma_next, latents)
    std = s_next * math.sin(noise_level * math.pi / 2)
    x = latents.float()
    v = velocity.float()
    x0_hat = x - s * v
    x1_hat = x + (1 - s) * v
    # clamp: s_next^2 - std^2 can round below 0 at a = 1.
    mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp(min=0)) * x1_hat
    return _finish_step(
        latents,
        mean,
        std,
        noise,
        generator,
        prev_sample,
        std_dev_t=std,
        velocity=v,
        log_prob_fn=LOG_PROBS[log_prob],
    )
