"""Flow-GRPO's choices, as pure functions chosen by name: KL expressions, GRPO-Guard ratios, SDE windows.

References (the project matches these by default, see docs/algorithms.md):

- Flow-GRPO (Liu et al., arXiv 2505.05470), `yifan123/flow_grpo`: `scripts/train_sd3.py` (KL loss
  ``mean(dmu^2) / (2 std_dev_t^2)``, training steps ``range(int(num_steps * timestep_fraction))``,
  zero-advantage samples filtered out), `scripts/train_sd3_fast.py` and
  `diffusers_patch/sd3_pipeline_with_logprob_fast.py` (Flow-GRPO-Fast: an SDE window of
  ``sde_window_size`` steps whose start is drawn uniformly from
  ``[range_lo, range_hi - size]``, ODE steps elsewhere).
- MixGRPO (Li et al., arXiv 2507.21802): a window that slides forward by a stride every few iterations.
- GRPO-Guard (Wang et al., arXiv 2510.22319), as implemented in Flow-Factory
  (`X-GenGroup/Flow-Factory`, `trainers/rl/grpo.py`, `GRPOGuardTrainer._guard_ratio`): the log-ratio
  of a Gaussian step, re-centred (adding ``mse(mu_new, mu_old) / (2 sigma^2)`` removes its negative
  mean) and multiplied by the transition std ``sigma`` (the per-step gradient reweighting).

Shapes: ``[B, ...]`` latents / means; ``[B, 1, ..., 1]`` stds; ``[B]`` per-sample results. Reductions
over latent elements are means, like the SDE log-prob (`sde.py`). Outputs are float32.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from glm_training.algorithms.decoder.sde import SDEStep
from glm_training.algorithms.losses import gaussian_mean_kl


def _per_sample_mean(x: Tensor) -> Tensor:
    return x if x.ndim <= 1 else x.mean(dim=tuple(range(1, x.ndim)))


# ---------------------------------------------------------------------------------------------------
# KL to the reference policy (`algo.kl_type`)


def flow_grpo_kl(policy: SDEStep, reference: SDEStep) -> Tensor:
    """Flow-GRPO's KL loss: ``mean(mu - mu_ref)^2 / (2 std_dev_t^2)`` per sample.

    ``std_dev_t`` is the std Flow-GRPO's step returns: for the flow SDE ``a sqrt(s / (1 - s))``
    *without* the ``sqrt(-dt)`` of the transition, so this is the exact Gaussian KL times ``-dt``
    (for CPS ``std_dev_t`` is the transition std and both agree). Flow-GRPO's betas (0.04 GenEval /
    OCR, 0.01 PickScore) are for this expression. Steps with ``std_dev_t == 0`` contribute 0.

    Returns:
        ``[B]`` float32.
    """
    return gaussian_mean_kl(policy.mean, reference.mean, policy.std_dev_t)


def exact_kl(policy: SDEStep, reference: SDEStep) -> Tensor:
    """The exact KL of the two Gaussian transitions, ``mean(mu - mu_ref)^2 / (2 std^2)``, ``std`` the
    transition's (``std_dev_t sqrt(-dt)`` for the flow SDE). Returns ``[B]`` float32."""
    return gaussian_mean_kl(policy.mean, reference.mean, policy.std)


def velocity_kl(policy: SDEStep, reference: SDEStep) -> Tensor:
    """Mean squared difference of the guided velocities, ``mean(v - v_ref)^2`` (Flow-Factory's
    ``v-based`` KL): no ``1 / std^2`` weighting, so late (low-noise) steps are not up-weighted.
    Returns ``[B]`` float32."""
    return _per_sample_mean((policy.velocity.float() - reference.velocity.float()) ** 2)


KL_FNS: dict[str, Callable[[SDEStep, SDEStep], Tensor]] = {
    "flow_grpo": flow_grpo_kl,
    "exact": exact_kl,
    "velocity": velocity_kl,
}


# ---------------------------------------------------------------------------------------------------
# Policy log-ratio (`algo.ratio_norm`)


def plain_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor
) -> Tensor:
    """``log_prob - old_log_prob`` (Flow-GRPO). ``mean``, ``old_mean`` and ``std`` are unused.

    Returns:
        ``[B]`` float32.
    """
    return log_prob.float() - old_log_prob.detach().float()


def grpo_guard_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor
) -> Tensor:
    """GRPO-Guard's regulated log-ratio: ``(log_prob - old + mean(mu - mu_old)^2 / (2 sigma^2)) * sigma``.

    For a Gaussian step with sample ``x = mu_old + sigma eps`` the plain log-ratio is
    ``mean((mu - mu_old) eps) / sigma - mean(mu - mu_old)^2 / (2 sigma^2)``: its second term makes the
    ratio's mean drift below 1 as the policy moves, so the clip stops binding on one side, and the
    ``1 / sigma`` makes low-noise steps dominate the gradient. Adding the squared term back centres it
    (ratio normalisation) and multiplying by ``sigma`` equalises the steps (gradient reweighting); the
    result is ``mean((mu - mu_old) eps)``. Equal to Flow-Factory's ``GRPOGuardTrainer._guard_ratio``.

    Args:
        log_prob: ``[B]`` current log-probs (with gradients), Gaussian, mean over elements.
        old_log_prob: ``[B]`` the rollout's (detached).
        mean: ``[B, ...]`` current transition mean (with gradients).
        old_mean: ``[B, ...]`` the rollout's transition mean (detached).
        std: ``[B, 1, ..., 1]`` transition std ``sigma``; a step with ``sigma == 0`` gets log-ratio 0.

    Returns:
        ``[B]`` float32.
    """
    std_b = std.float().reshape(std.shape[0], -1)[:, 0]
    positive = std_b > 0
    safe = torch.where(positive, std_b, torch.ones_like(std_b))
    mse = _per_sample_mean((mean.float() - old_mean.detach().float()) ** 2)
    delta = log_prob.float() - old_log_prob.detach().float()
    guarded = (delta + mse / (2.0 * safe**2)) * safe
    return torch.where(positive, guarded, torch.zeros_like(guarded))


LOG_RATIOS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "none": plain_log_ratio,
    "grpo_guard": grpo_guard_log_ratio,
}


# ---------------------------------------------------------------------------------------------------
# Which steps sample with noise, and which of them train


def num_train_steps(num_sde_steps: int, num_steps: int, timestep_fraction: float) -> int:
    """How many of a rollout's SDE steps train: the first ``int(num_steps * fraction)``, at most all.

    Flow-GRPO's rule (`train_sd3.py`: ``range(int(num_steps * timestep_fraction))`` over the recorded
    steps, counted on the whole schedule), so its ``0.99`` with a last deterministic step trains every
    SDE step; at least one step always trains.
    """
    return max(1, min(num_sde_steps, int(num_steps * timestep_fraction)))


def random_window_start(seed: int, step: int, size: int, lo: int, hi: int) -> int:
    """Flow-GRPO-Fast's window start, uniform on ``[lo, hi - size]``, a function of (seed, step) only.

    The same on every rank and after a resume (no global RNG involved), unlike Flow-GRPO's
    ``random.randint`` on each process's global generator.
    """
    if not 0 <= lo <= hi - size:
        raise ValueError(f"window of {size} steps does not fit in [{lo}, {hi})")
    return random.Random(seed * 1_000_003 + step).randint(lo, hi - size)


def progressive_window_start(step: int, size: int, lo: int, hi: int, stride: int, every: int) -> int:
    """MixGRPO's sliding window: starts at ``lo`` and moves ``stride`` steps later every ``every``
    training steps; past ``hi - size`` it wraps around to ``lo`` (this project's choice, so that a long
    run keeps visiting every position)."""
    if not 0 <= lo <= hi - size:
        raise ValueError(f"window of {size} steps does not fit in [{lo}, {hi})")
    num_positions = hi - size - lo + 1
    return lo + ((step // every) * stride) % num_positions


# ---------------------------------------------------------------------------------------------------
# Samples that carry no signal


def nonzero_advantage_mask(advantages: Tensor) -> Tensor:
    """``advantages != 0``: Flow-GRPO trains only on samples with a non-zero advantage (`train_sd3.py`
    filters the others out before the update), so their KL does not dilute the batch. ``[N]`` bool."""
    return advantages != 0
