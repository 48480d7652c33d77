"""Policy-gradient losses and their aggregation for GRPO / DAPO and Flow-GRPO.

- Clipped surrogate of PPO (Schulman et al., arXiv 1707.06347) with asymmetric "clip-higher" bounds
  from DAPO (Yu et al., arXiv 2503.14476).
- KL penalties: the closed-form KL between two Gaussians sharing a std, used by Flow-GRPO
  (arXiv 2505.05470) on SDE transition means; Schulman's "k3" estimator for token models
  (http://joschu.net/blog/kl-approx.html).
- Token-loss aggregations named as in verl/DAPO: ``token-mean``, ``seq-mean-token-mean``,
  ``seq-mean-token-sum``.

Elementwise losses are computed in float32. Masks are ``[B, T]``, non-zero for tokens that count;
masked-out entries count as exactly 0 even if the loss there is inf or NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clipped_policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    *,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float | None = None,
) -> Tensor:
    """Elementwise clipped surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    ``r = exp(log_prob - old_log_prob)``. ``old_log_prob`` and ``advantages`` are constants of the
    update and are detached. Where the clip is active the gradient w.r.t. ``log_prob`` is 0; elsewhere
    it is ``-A r``.

    Args:
        log_prob: any shape, e.g. ``[B]`` (DiT step) or ``[B, T]`` (tokens).
        old_log_prob: same shape as ``log_prob``.
        advantages: broadcastable to ``log_prob`` (``[B]`` advantages need ``[:, None]`` for ``[B, T]``).
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        clip_ratio_c: dual clip (Ye et al., arXiv 1912.09729; verl's ``clip_ratio_c``, default there 3.0):
            where ``A < 0`` the loss is at most ``-A c``, so a very large ratio of a bad token cannot
            dominate an off-policy update (its gradient is then 0). None: off (TRL's loss).
        log_ratio_clamp: the log-ratio is clamped to ``[-v, v]`` before ``exp`` (verl clamps at 20), so a
            far off-policy token cannot overflow. None: off.

    Returns:
        float32, the broadcast shape; not reduced.
    """
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is None:
        return loss
    dual = torch.minimum(loss, -adv * clip_ratio_c)
    return torch.where(adv < 0, dual, loss)


def _apply_mask(x: Tensor, mask_f: Tensor) -> Tensor:
    """``x * mask``, but exactly 0 where the mask is 0 even if ``x`` is inf or NaN there (padding)."""
    return torch.where(mask_f != 0, x.float() * mask_f, 0.0)


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return x.float().mean()
    mask_f = torch.broadcast_to(mask, x.shape).float()
    return _apply_mask(x, mask_f).sum() / mask_f.sum().clamp(min=1.0)


def clipped_fraction(
    ratio: Tensor, clip_low: float, clip_high: float, advantages: Tensor | None = None
) -> Tensor:
    """[bool] where the clip counts, elementwise. Without ``advantages``: every ratio outside
    ``[1 - clip_low, 1 + clip_high]`` (Flow-GRPO's ``clipfrac``, ``|r - 1| > clip_range``). With them: only
    where the clip changes the loss, ``-A clip(r) > -A r`` (verl's ``pg_clipfrac``, TRL's ``clip_ratio``): a
    ratio above the range with ``A > 0`` or below it with ``A < 0``."""
    if advantages is None:
        return (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    adv = torch.broadcast_to(advantages.float(), ratio.shape)
    return torch.gt(-adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high), -adv * ratio)


@torch.no_grad()
def ratio_stats(
    log_prob: Tensor,
    old_log_prob: Tensor,
    clip_low: float,
    clip_high: float,
    mask: Tensor | None = None,
    advantages: Tensor | None = None,
) -> dict[str, Tensor]:
    """Diagnostics of the policy ratio, without gradients.

    Args:
        log_prob, old_log_prob: any shape (same).
        clip_low, clip_high: bounds as in :func:`clipped_policy_loss`.
        mask: optional, broadcastable to ``log_prob``; means are taken over non-zero entries (0 if none).
        advantages: optional, broadcastable to ``log_prob``: ``clip_frac`` then counts only the clips that
            change the loss (:func:`clipped_fraction`).

    Returns:
        0-d float32 tensors: ``clip_frac`` (:func:`clipped_fraction`'s mean), ``approx_kl``
        (``0.5 * mean((log_prob - old)^2)``) and ``ratio_mean``.
    """
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    return {
        "clip_frac": _masked_mean(clipped_fraction(ratio, clip_low, clip_high, advantages), mask),
        "approx_kl": 0.5 * _masked_mean(log_ratio**2, mask),
        "ratio_mean": _masked_mean(ratio, mask),
    }


def gaussian_mean_kl(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """KL between ``N(mean, std^2)`` and ``N(ref_mean, std^2)`` per element, averaged per sample.

    Per element ``(mean - ref_mean)^2 / (2 std^2)`` (the log-std terms cancel when the stds are equal),
    then the mean over non-batch elements, matching the reduction of the SDE log-prob.

    Args:
        mean, ref_mean: ``[B, ...]`` transition means of the policy and the reference model.
        std: broadcastable, typically ``[B, 1, ..., 1]``; elements with ``std == 0`` (deterministic
            step) contribute 0.

    Returns:
        ``[B]`` float32.
    """
    mean = mean.float()
    ref_mean = ref_mean.float()
    std = std.float()
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    kl = (mean - ref_mean) ** 2 / (2.0 * safe_std**2)
    kl = torch.where(positive, kl, torch.zeros_like(kl))
    if kl.ndim <= 1:
        return kl
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor, *, low_var_clamp: bool = False) -> Tensor:
    """Schulman's k3 estimator of ``KL(policy || ref)``: ``exp(d) - d - 1`` with ``d = ref - log_prob``.

    Unbiased when ``log_prob`` are log-probs of samples drawn from the policy, and ``>= 0`` elementwise.
    ``low_var_clamp``: verl's ``low_var_kl``, ``d`` clamped to ``[-20, 20]`` and the estimate to
    ``[-10, 10]`` (bounded gradients for tokens the reference finds very unlikely). Off: TRL's.

    Returns:
        float32, the broadcast shape of the inputs; not reduced.
    """
    d = ref_log_prob.float() - log_prob.float()
    if not low_var_clamp:
        return torch.exp(d) - d - 1.0
    d = d.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


# verl's bounds of its low-variance k3 (`kl_penalty="low_var_kl"`).
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _check_bt(loss_bt: Tensor, mask_bt: Tensor) -> Tensor:
    if loss_bt.ndim != 2 or loss_bt.shape != mask_bt.shape:
        raise ValueError(
            f"loss and mask must both be [B, T]; got shapes {tuple(loss_bt.shape)} and {tuple(mask_bt.shape)}"
        )
    return mask_bt.to(torch.float32)


def masked_token_mean(loss_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """DAPO ``token-mean``: ``sum(loss * mask) / sum(mask)`` over the whole batch.

    Every token weighs the same, so long sequences weigh more. An all-zero mask gives 0.

    Args:
        loss_bt: ``[B, T]``.
        mask_bt: ``[B, T]``, bool or 0/1.

    Returns:
        0-d float32.
    """
    mask_bt = _check_bt(loss_bt, mask_bt)
    return _apply_mask(loss_bt, mask_bt).sum() / mask_bt.sum().clamp(min=1.0)


def masked_seq_mean_token_mean(loss_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """``seq-mean-token-mean`` (original GRPO): mean over the ``B`` sequences of each one's masked mean.

    A sequence with no masked-in token contributes 0 and still counts in the ``B`` of the outer mean,
    so the normaliser does not depend on the data.

    Args:
        loss_bt: ``[B, T]``.
        mask_bt: ``[B, T]``, bool or 0/1.

    Returns:
        0-d float32.
    """
    mask_bt = _check_bt(loss_bt, mask_bt)
    seq_mean_b = _apply_mask(loss_bt, mask_bt).sum(dim=1) / mask_bt.sum(dim=1).clamp(min=1.0)
    return seq_mean_b.mean()


def masked_seq_mean_token_sum(loss_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """``seq-mean-token-sum``: mean over the ``B`` sequences of each one's masked sum.

    A sequence with no masked-in token contributes 0.

    Args:
        loss_bt: ``[B, T]``.
        mask_bt: ``[B, T]``, bool or 0/1.

    Returns:
        0-d float32.
    """
    mask_bt = _check_bt(loss_bt, mask_bt)
    return _apply_mask(loss_bt, mask_bt).sum(dim=1).mean()
