"""Advantage Weighted Matching (AWM, arXiv 2509.25050): the pretraining loss, weighted by advantage.

The rollout's clean samples are noised again, `x_t = (1 - t) x_0 + t eps`, and the policy's velocity is fitted
to the flow-matching target `eps - x_0` exactly as in pretraining; the only RL ingredient is that each
sample's loss is multiplied by its (signed, clipped) advantage, so good samples are fitted and bad ones pushed
away. The sampler does not enter the loss: any sampler can make the rollout, and nothing is stored per step.

Everything follows the authors' reference (`scxue/advantage_weighted_matching`, `scripts/train_sd3_awm.py`
`compute_log_prob_awm` and its training loop; `config/dgx_awm.py`) term for term:

- the per-sample matching error `l = mean((v - (eps - x_0))^2)` over every non-batch element, in float64;
- a time weighting of it (`WEIGHTINGS`; the reference's default "ghuber": `t ((l + 1e-10)^p - 1e-10^p) / p`,
  p = 0.25, which down-weights samples the model fits badly);
- the reference treats `-L` as a log-probability inside a PPO ratio, `r = exp(-L + L.detach())`, and takes
  `max(-A r, -A clip(r, 1 - c, 1 + c))`. Its shipped configs are on-policy: the ratio is exactly 1, and the
  gradient is `A grad L`; with more optimizer steps per rollout the later ones take `r = exp(L_old - L)`.
  `awm_policy_loss` keeps that form, so the logged loss means what it means there;
- advantages `clip(A, +-adv_clip_max) / adv_clip_max * advantage_max`;
- training times: `train_timesteps` indices of the sampling schedule, one drawn in each of that many equal
  bins of its first `int(num_steps * timestep_fraction)` steps, shared by a micro-batch
  (`train_time_indices`);
- besides the KL to the base model, a velocity KL to an EMA of the policy (the "ema" adapter), whose decay
  after k optimizer steps is `min(kl_ema_decay, 0.001 k)` (`anchor_decay`).

`t` here is the flow sigma of the schedule (the reference's `timesteps / 1000`).
"""

from __future__ import annotations

import torch
from torch import Tensor

# The reference's `1e-10` inside the generalised Huber weighting (and `1e-5` of the plain Huber one).
GHUBER_EPS = 1e-10
HUBER_OFFSET = 1e-5

# How the matching error l [B] becomes the per-sample loss; the reference's `train.weighting` choices.
WEIGHTINGS = ("ghuber", "huber", "t", "t_squared", "uniform")
# Where the training times are drawn from (the reference's `time_type`: its two discrete modes).
TIME_TYPES = ("discrete_wo_init", "discrete")
# The EMA anchor's decay schedule (the reference's `kl_ema_decay_type`).
ANCHOR_DECAY_TYPES = ("linear", "constant")


def advantage_weights(advantages: Tensor, adv_clip_max: float, advantage_max: float) -> Tensor:
    """[B] advantages -> [B] weights `clip(A, +-adv_clip_max) / adv_clip_max * advantage_max` (signed)."""
    return advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max


def matching_error(velocity: Tensor, noise: Tensor, x0: Tensor) -> Tensor:
    """[B] float64 `mean((v - (eps - x_0))^2)` over every non-batch element: the flow-matching error."""
    error = (velocity.double() - (noise.double() - x0.double())) ** 2
    return error.mean(dim=tuple(range(1, error.ndim)))


def weighted_matching_loss(error: Tensor, t: Tensor, weighting: str, ghuber_power: float = 0.25) -> Tensor:
    """[B] per-sample loss from the matching error [B] at flow times t [B] (the reference's `-log_prob`).

    `t` keeps its dtype (float32 times, as the reference: `t**2` is squared before meeting the float64 error).
    """
    if weighting == "ghuber":
        floor = torch.tensor(GHUBER_EPS, dtype=error.dtype, device=error.device)
        return ((error + GHUBER_EPS) ** ghuber_power - floor**ghuber_power) * t / ghuber_power
    if weighting == "huber":
        return (torch.sqrt(error + GHUBER_EPS) - HUBER_OFFSET) * t
    if weighting == "t":
        return error * t
    if weighting == "t_squared":
        return error * t**2
    if weighting == "uniform":
        return error
    raise ValueError(f"unknown AWM weighting '{weighting}'; choose one of {WEIGHTINGS}.")


def awm_policy_loss(
    loss: Tensor, weights: Tensor, clip_range: float, old_loss: Tensor | None = None
) -> Tensor:
    """[B] the reference's clipped objective on `log p = -loss`: `max(-A r, -A clip(r, 1 - c, 1 + c))`.

    `r = exp(old_loss - loss)`. On-policy (the reference's shipped setting, `old_loss` None) the old loss is
    the loss itself, detached: r = 1, the value is `-A` and the gradient `A grad loss`. loss, weights: [B].
    """
    old = loss.detach() if old_loss is None else old_loss.detach()
    ratio = torch.exp(old - loss)
    weights = weights.to(loss.dtype)
    unclipped = -weights * ratio
    clipped = -weights * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped)


def train_time_indices(
    num_steps: int,
    timestep_fraction: float,
    num_times: int,
    time_type: str,
    generator: torch.Generator,
) -> Tensor:
    """[num_times] schedule indices: one uniform draw in each of `num_times` bins of the trained steps.

    The bins split [first, int(num_steps * timestep_fraction)] evenly (first = 1 for "discrete_wo_init", which
    never trains the pure-noise step, 0 for "discrete"); an index is `lower + floor(u (upper - lower))`, so
    a bin narrower than one step gives its lower end. As the reference, the draw is shared by a micro-batch.
    """
    first = {"discrete_wo_init": 1, "discrete": 0}.get(time_type)
    if first is None:
        raise ValueError(f"unknown AWM time_type '{time_type}'; choose one of {TIME_TYPES}.")
    boundaries = torch.linspace(first, int(num_steps * timestep_fraction), num_times + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    u = torch.rand(num_times, generator=generator)
    return lower + (u * (upper - lower)).long()


def anchor_decay(num_optimizer_steps: int, kl_ema_decay: float, decay_type: str) -> float:
    """Decay of the EMA anchor after `num_optimizer_steps`: `min(kl_ema_decay, 0.001 k)` (linear) or constant.

    After each rollout's update: `anchor <- decay * anchor + (1 - decay) * policy`.
    """
    if decay_type == "linear":
        return min(kl_ema_decay, 0.001 * num_optimizer_steps)
    if decay_type == "constant":
        return kl_ema_decay
    raise ValueError(f"unknown AWM anchor decay type '{decay_type}'; choose one of {ANCHOR_DECAY_TYPES}.")
