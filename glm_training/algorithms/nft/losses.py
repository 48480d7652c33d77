"""DiffusionNFT (Zheng et al., arXiv 2509.16117): online RL on the forward process of a flow model.

Rewards become an optimality probability `r` in [0, 1]; clean samples from the rollout are noised again,
`x_t = (1 - t) x_0 + t eps`, and the velocity is trained through two *implicit* policies built from the
current model `v_theta` and the frozen old (sampling) model `v_old`:

    v+ = (1 - beta) v_old + beta v_theta        (the positive policy: pulled towards good samples)
    v- = (1 + beta) v_old - beta v_theta        (the negative policy: pulled towards bad samples)
    loss = adv_clip_max / beta * (r ||v+ -> x_0||_w + (1 - r) ||v- -> x_0||_w)

where `||v -> x_0||_w` is the squared error of the implied clean sample `x_0_hat = x_t - t v` divided by its
own (detached) mean absolute error: the paper's adaptive weighting. No log-probs, no CFG, no trajectories.
Everything follows NVlabs' reference (`scripts/train_nft_sd3.py`, `config/nft.py`) term for term; the
reductions are stated per function. `t` here is the flow sigma of the schedule (the reference's t / 1000).
"""

from __future__ import annotations

import torch
from torch import Tensor

# The reference's `return_decay(step, decay_type)`: (flat, uprate, uphold) of the old model's EMA decay.
# decay(step) = 0 before `flat` optimizer steps, then min((step - flat) * uprate, uphold).
DECAY_SCHEDULES: dict[int, tuple[int, float, float]] = {
    0: (0, 0.0, 0.0),  # the old model is the current one after every rollout
    1: (0, 0.001, 0.5),  # the reference's default (GenEval, PickScore, HPSv2)
    2: (75, 0.0075, 0.999),  # the reference's OCR recipe: on-policy for 75 steps, then slower and slower
}

# Floor of the adaptive weight (the reference's `.clip(min=0.00001)`).
MIN_WEIGHT = 1e-5


def old_model_decay(num_optimizer_steps: int, decay_type: int) -> float:
    """EMA decay of the old model after `num_optimizer_steps` optimizer steps (the reference's schedule).

    After each rollout's update: `old <- decay * old + (1 - decay) * current`.
    """
    flat, uprate, uphold = DECAY_SCHEDULES[decay_type]
    if num_optimizer_steps < flat:
        return 0.0
    return min((num_optimizer_steps - flat) * uprate, uphold)


def optimality_probability(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """[B] advantages -> [B] r = clip(A, +-adv_clip_max) / adv_clip_max / 2 + 1/2, in [0, 1].

    A zero advantage gives r = 1/2: positive and negative policies weigh the same and the sample still trains
    (the reference drops nothing).
    """
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def implicit_velocities(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(v+, v-) = ((1 - beta) v_old + beta v_theta, (1 + beta) v_old - beta v_theta); any shape.

    `v_old` is detached: only the current model receives gradients.
    """
    v_old = v_old.detach()
    positive = beta * v_theta + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v_theta
    return positive, negative


def adaptive_x0_loss(velocity: Tensor, x_t: Tensor, x0: Tensor, t: Tensor) -> Tensor:
    """[B] adaptively weighted x_0 error of a velocity: mean((x0_hat - x0)^2 / w), x0_hat = x_t - t v.

    w = mean over the sample's elements of |x0_hat - x0| (float64, detached, floored at 1e-5), so each
    sample's loss has gradient scale ~1 whatever its noise level or difficulty.
    velocity, x_t, x0: [B, ...]; t: [B]. Reduction: mean over every non-batch element.
    """
    dims = tuple(range(1, x0.ndim))
    t = t.float().view(-1, *([1] * (x0.ndim - 1)))
    x0_hat = x_t - t * velocity
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=MIN_WEIGHT)
    # The weight is computed in float64 as the reference does; the loss stays in the velocity's dtype.
    weight = weight.to(x0_hat.dtype)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor,
    r: Tensor,
    beta: float,
    adv_clip_max: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DiffusionNFT policy loss per sample, [B]; average it over samples and training times.

    `adv_clip_max / beta * (r L(v+) + (1 - r) L(v-))`, L = `adaptive_x0_loss`: the reference multiplies by
    `adv_clip_max` and divides by beta so the gradient does not shrink with small beta. Shapes: v_theta,
    v_old, x_t, x0 [B, ...]; t, r [B]. Also returns the two [B] terms (detached) for logging.
    """
    positive, negative = implicit_velocities(v_theta, v_old, beta)
    positive_loss = adaptive_x0_loss(positive, x_t, x0, t)
    negative_loss = adaptive_x0_loss(negative, x_t, x0, t)
    loss = adv_clip_max * (r * positive_loss + (1.0 - r) * negative_loss) / beta
    return loss, {"positive_loss": positive_loss.detach(), "negative_loss": negative_loss.detach()}


def train_time_indices(
    num_samples: int, num_steps: int, num_train_steps: int, generator: torch.Generator
) -> Tensor:
    """[B, num_train_steps] distinct schedule indices per sample: a random permutation's first entries.

    The reference trains each sample at `int(num_steps * timestep_fraction)` of its sampling schedule's
    times, shuffled per sample, each with fresh noise.
    """
    return torch.stack(
        [torch.randperm(num_steps, generator=generator)[:num_train_steps] for _ in range(num_samples)]
    )
