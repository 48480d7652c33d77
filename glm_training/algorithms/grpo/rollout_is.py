"""The sampler-learner mismatch of the AR rollout, and verl's truncated importance sampling (TIS) over it.

The learner teacher-forces the old log-probs under the weights that sampled, so the clipped ratio starts at
exactly 1; the tokens, though, were drawn from the sampler's distribution, whose log-probs differ from the
learner's by float rounding (the policy sampler: incremental decoding against one forward pass) or a little
more (the folded sampler: the adapters folded into the weights, `pipeline/ar_sampler.py`).

`mismatch_stats`: mean and max |log p_sampler - log p_learner| over the sampled tokens, logged at every step.

`rollout_is_weights`: verl's rollout importance sampling in its token-level truncate mode (TIS;
`verl/trainer/ppo/mismatch_helper.py`, `compute_rollout_importance_weights` with `rollout_is_level="token"`,
`rollout_is_mode="truncate"`; Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training", 2025): per token `w = min(exp(clamp(log p_learner - log p_sampler, -20, 20)), threshold)`,
0 off the sampled tokens, detached. verl multiplies the per-token policy loss by `w` after its clip and dual
clip and before the aggregation (`core_algos.compute_policy_loss_vanilla`: `pg_losses * rollout_is_weights`);
so does `GRPO.loss_and_backward` when `algo.rollout_is` is true. With `algo.rollout_is_threshold` set and
`algo.rollout_is` false the weights are only measured, as verl's metrics-only mode does. verl's sequence and
geometric levels, its mask mode and its veto are not implemented.
"""

from __future__ import annotations

import torch
from torch import Tensor

# verl's SAFETY_BOUND: the log-ratio is clamped to [-20, 20] before exp.
LOG_RATIO_BOUND = 20.0


def mismatch_stats(learner_bt: Tensor, sampler_bt: Tensor, mask_bt: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, max) of |learner - sampler| over the masked tokens, float32 (the caller divides by the count)."""
    gap = (learner_bt.float() - sampler_bt.float()).abs()[mask_bt.bool()]
    return gap.sum(), gap.max() if gap.numel() else gap.new_zeros(())


@torch.no_grad()
def rollout_is_weights(learner_bt: Tensor, sampler_bt: Tensor, mask_bt: Tensor, threshold: float) -> Tensor:
    """verl's token-level truncated importance weights [B, T], float32 (module docstring)."""
    log_ratio = (learner_bt.float() - sampler_bt.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(log_ratio).clamp(max=threshold) * mask_bt.float()


def rollout_is_stats(weights_bt: Tensor, mask_bt: Tensor, threshold: float) -> dict[str, float]:
    """verl's `rollout_is_mean` (after truncation) and `rollout_is_ratio_fraction_high` (the tokens whose
    weight reached the threshold) over the masked tokens."""
    mask = mask_bt.bool()
    kept = weights_bt[mask]
    if not kept.numel():
        return {"rollout_is_mean": 1.0, "rollout_is_ratio_fraction_high": 0.0}
    return {
        "rollout_is_mean": float(kept.mean()),
        "rollout_is_ratio_fraction_high": float((kept >= threshold).float().mean()),
    }
