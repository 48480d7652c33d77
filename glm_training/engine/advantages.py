"""Group-relative advantages for GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300).

Each prompt is sampled ``group_size`` times; a sample's advantage is its reward relative to the other
samples of its group. Variants: normalised by the group's std (GRPO, Flow-GRPO), by the std of the
whole batch (TRL ``scale_rewards="batch"``, Flow-GRPO ``global_std``), or only centred (Dr. GRPO,
TRL ``scale_rewards="none"``).

Layout: rewards as ``[num_groups, group_size]`` (every group the same size); :func:`rewards_to_groups`
builds that layout from flat rewards and group ids. Standard deviations are population stds
(``unbiased=False``, like ``np.std`` in Flow-GRPO; TRL uses the unbiased estimator, a factor
``sqrt(n / (n - 1))`` apart). Outputs are float32.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from glm_training.guards import nonfinite_groups

logger = logging.getLogger("glm_training")


def _check_groups(rewards_gk: Tensor) -> Tensor:
    if rewards_gk.ndim != 2:
        raise ValueError(
            f"rewards must have shape [num_groups, group_size]; got shape {tuple(rewards_gk.shape)} "
            "(use rewards_to_groups to build it from flat rewards)"
        )
    return rewards_gk.float()


def group_normalized_advantages(rewards_gk: Tensor, eps: float = 1e-4) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` with the population std of each group.

    Args:
        rewards_gk: ``[num_groups, group_size]``.
        eps: added to the std; a group whose rewards are all equal gets advantages 0.

    Returns:
        ``[num_groups, group_size]`` float32.
    """
    rewards_gk = _check_groups(rewards_gk)
    mean_g1 = rewards_gk.mean(dim=1, keepdim=True)
    std_g1 = rewards_gk.std(dim=1, keepdim=True, unbiased=False)
    return (rewards_gk - mean_g1) / (std_g1 + eps)


def batch_std_advantages(rewards_gk: Tensor, eps: float = 1e-4) -> Tensor:
    """``(r - mean_g) / (std_all + eps)``: centred per group, scaled by the population std of all rewards.

    Args:
        rewards_gk: ``[num_groups, group_size]``; pass the globally gathered rewards so every rank
            uses the same scale.

    Returns:
        ``[num_groups, group_size]`` float32.
    """
    rewards_gk = _check_groups(rewards_gk)
    mean_g1 = rewards_gk.mean(dim=1, keepdim=True)
    std_all = rewards_gk.std(unbiased=False)
    return (rewards_gk - mean_g1) / (std_all + eps)


def centered_advantages(rewards_gk: Tensor) -> Tensor:
    """``r - mean_g``, no scaling (Dr. GRPO).

    Returns:
        ``[num_groups, group_size]`` float32.
    """
    rewards_gk = _check_groups(rewards_gk)
    return rewards_gk - rewards_gk.mean(dim=1, keepdim=True)


def clip_advantages(adv: Tensor, max_abs: float) -> Tensor:
    """Clamp advantages elementwise to ``[-max_abs, max_abs]`` (Flow-GRPO uses 5). Any shape."""
    if max_abs <= 0:
        raise ValueError(f"max_abs must be > 0; got {max_abs}")
    return adv.clamp(min=-max_abs, max=max_abs)


def zero_std_groups(rewards_gk: Tensor, atol: float = 0.0) -> Tensor:
    """Groups whose rewards are all equal within ``atol`` (max - min <= atol).

    Such groups have zero advantage and carry no learning signal; DAPO's dynamic sampling drops them
    and their fraction is worth logging (TRL ``frac_reward_zero_std``).

    Returns:
        ``[num_groups]`` bool.
    """
    rewards_gk = _check_groups(rewards_gk)
    spread_g = rewards_gk.amax(dim=1) - rewards_gk.amin(dim=1)
    return spread_g <= atol


def flat_groups(rewards_gk: Tensor, min_std: float = 0.0) -> Tensor:
    """Groups without usable reward spread: population std ``< min_std``, or all equal when ``min_std == 0``.

    With ``min_std = 0`` this is exactly :func:`zero_std_groups` (ties only). Continuous rewards almost never
    tie, so a threshold at the reward's noise level is what makes DAPO's dynamic sampling drop groups whose
    spread is noise (their normalised advantages would otherwise be noise scaled up to unit size).

    Args:
        rewards_gk: ``[num_groups, group_size]``.
        min_std: threshold on the population std of each group, ``>= 0``.

    Returns:
        ``[num_groups]`` bool.
    """
    if min_std < 0:
        raise ValueError(f"min_std must be >= 0; got {min_std}")
    if min_std == 0:
        return zero_std_groups(rewards_gk)
    rewards_gk = _check_groups(rewards_gk)
    return rewards_gk.std(dim=1, unbiased=False) < min_std


def rewards_to_groups(rewards_n: Tensor, group_ids_n: Tensor) -> tuple[Tensor, Tensor]:
    """Arrange flat rewards into ``[num_groups, group_size]`` by group id.

    Groups are ordered by ascending id; within a group the original order is kept (stable sort).

    Args:
        rewards_n: ``[N]`` rewards.
        group_ids_n: ``[N]`` integer id of each sample's group (e.g. its prompt index); any values.

    Returns:
        ``(rewards_gk, inverse_n)``: ``rewards_gk`` is ``[num_groups, group_size]`` float32 and
        ``adv_gk.reshape(-1)[inverse_n]`` puts per-group values back into the flat order.

    Raises:
        ValueError: if the inputs are not matching 1-D tensors, or the groups differ in size.
    """
    if rewards_n.ndim != 1 or group_ids_n.ndim != 1 or rewards_n.shape != group_ids_n.shape:
        raise ValueError(
            f"rewards_n and group_ids_n must be 1-D of the same length; got shapes "
            f"{tuple(rewards_n.shape)} and {tuple(group_ids_n.shape)}"
        )
    if rewards_n.numel() == 0:
        raise ValueError("rewards_n is empty")
    order_n = torch.argsort(group_ids_n, stable=True)
    ids, counts = torch.unique_consecutive(group_ids_n[order_n], return_counts=True)
    if bool((counts != counts[0]).any()):
        sizes = ", ".join(f"{int(i)}: {int(c)}" for i, c in zip(ids.tolist(), counts.tolist()))
        raise ValueError(
            f"groups have unequal sizes (group id: size) {sizes}; every group must hold the same "
            "number of samples (group_size). Check that each prompt was sampled group_size times "
            "and that no sample was dropped."
        )
    rewards_gk = rewards_n[order_n].float().reshape(ids.numel(), int(counts[0]))
    inverse_n = torch.argsort(order_n)
    return rewards_gk, inverse_n


# `algo.scale_rewards` -> how a group's rewards become advantages.
ADVANTAGE_FNS = {
    "group": group_normalized_advantages,
    "batch": batch_std_advantages,
    "none": lambda rewards_gk, eps=0.0: centered_advantages(rewards_gk),
}


class GroupAdvantages:
    """Every rank's total rewards, group-major -> (advantages, reward statistics for the log).

    `scale_rewards` picks the function (`ADVANTAGE_FNS`), `adv_clip_max` clips. Groups with a NaN/inf reward
    (`reward.on_nonfinite=drop`, or a failed reward) get zero advantage and stay out of every statistic, so
    nothing non-finite reaches the loss. `min_group_std`: the threshold of `flat_groups`, whose fraction is
    logged. `exact_zero_flat` (the decoder's algorithms): a group whose rewards are all equal has advantage
    exactly 0, by definition; the rounding of its mean must not turn that into noise that Flow-GRPO's
    `drop_zero_advantage` would keep; the fraction of zero advantages is logged.
    """

    def __init__(
        self,
        num_generations: int,
        scale_rewards: str,
        adv_clip_max: float,
        min_group_std: float = 0.0,
        exact_zero_flat: bool = False,
    ):
        self.num_generations = num_generations
        self.advantage_fn = ADVANTAGE_FNS[scale_rewards]
        self.adv_clip_max = adv_clip_max
        self.min_group_std = min_group_std
        self.exact_zero_flat = exact_zero_flat

    def __call__(self, all_rewards: Tensor, all_parts: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """[G * K] total rewards of every rank -> ([G * K] advantages, reward statistics)."""
        k = self.num_generations
        rewards_gk = all_rewards.view(-1, k)
        bad_g = nonfinite_groups(rewards_gk)
        good_gk = rewards_gk[~bad_g]
        advantages_gk = torch.zeros_like(rewards_gk)
        if len(good_gk):
            advantages_gk[~bad_g] = clip_advantages(self.advantage_fn(good_gk), self.adv_clip_max)
        advantages = advantages_gk.reshape(-1)
        good = good_gk.reshape(-1)
        flat = flat_groups(good_gk, self.min_group_std)
        stats = {
            "reward_mean": good.mean().item() if len(good) else math.nan,
            "reward_std": good.std(unbiased=False).item() if len(good) else math.nan,
            "frac_zero_std_groups": flat.float().mean().item() if len(good) else 1.0,
        }
        if bad_g.any():
            stats["dropped_nonfinite_groups"] = int(bad_g.sum())
            logger.warning("%d group(s) with non-finite rewards get zero advantage", int(bad_g.sum()))
        keep = (~bad_g).repeat_interleave(k)
        stats.update({f"reward/{name}": values[keep].mean().item() for name, values in all_parts.items()})
        if self.exact_zero_flat:
            flat_n = zero_std_groups(rewards_gk).repeat_interleave(k)
            advantages = torch.where(flat_n, torch.zeros_like(advantages), advantages)
            stats["frac_zero_advantage"] = 1.0 - (advantages != 0).float().mean().item()
        return advantages, stats
