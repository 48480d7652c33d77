"""GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071): sequence-level ratios.

GRPO/DAPO clip one ratio per token. GSPO uses one ratio per sample, the geometric mean of its token ratios
(length-normalised sequence likelihood ratio),

    s_i = exp( (1 / |y_i|) * sum_t (log pi(y_it) - log pi_old(y_it)) ),

and the clipped surrogate ``max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))`` per sample. This is
TRL's ``importance_sampling_level="sequence"``: the per-sample loss is written on every token of the sample
(a ``[B, T]`` tensor constant along T), so the token-loss aggregations apply unchanged; with
``seq-mean-token-mean`` the result is the paper's mean over samples, and because every AR sample here has the
same number of tokens (fixed grids), ``token-mean`` gives the same value.

Because ``s_i`` averages log-ratios over hundreds of tokens, it moves far less than a token ratio: the paper
clips to [1 - 3e-4, 1 + 4e-4] (TRL's GSPO recipe: ``epsilon=3e-4, epsilon_high=4e-4``), not DAPO's 0.2 / 0.28.

Masks are ``[B, T]``, non-zero on the tokens of each sample; masked-out entries are exactly 0 in the outputs
even where the inputs are inf or NaN (padding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_training.algorithms.losses import clipped_fraction


def sequence_log_ratio(log_prob_bt: Tensor, old_log_prob_bt: Tensor, mask_bt: Tensor) -> Tensor:
    """``[B]`` float32 length-normalised log-ratio: masked mean over T of ``log_prob - old_log_prob``.

    ``old_log_prob_bt`` is a constant (detached). A sample with no masked-in token gets 0 (ratio 1).
    """
    mask_f = mask_bt.float()
    log_ratio_bt = log_prob_bt.float() - old_log_prob_bt.detach().float()
    log_ratio_bt = torch.where(mask_f != 0, log_ratio_bt * mask_f, 0.0)
    return log_ratio_bt.sum(dim=1) / mask_f.sum(dim=1).clamp(min=1.0)


def gspo_policy_loss(
    log_prob_bt: Tensor,
    old_log_prob_bt: Tensor,
    advantages_b: Tensor,
    mask_bt: Tensor,
    clip_low: float,
    clip_high: float,
) -> Tensor:
    """Per-token GSPO loss ``[B, T]`` float32: the sample's clipped surrogate on each of its tokens.

    Per sample ``max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))`` with ``s = exp(sequence_log_ratio)``;
    0 where ``mask_bt`` is 0. Where the clip is active the gradient is 0; elsewhere the gradient w.r.t. each
    masked token's log-prob is ``-A s / |y|`` per unit weight of that token in the aggregation.

    Args:
        log_prob_bt: ``[B, T]`` log-probs of the sampled tokens under the current policy (with gradients).
        old_log_prob_bt: ``[B, T]`` the same under the weights that sampled (detached).
        advantages_b: ``[B]`` one advantage per sample (detached).
        mask_bt: ``[B, T]`` bool or 0/1, the sample's tokens.
        clip_low, clip_high: the sequence ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
    """
    ratio_b = torch.exp(sequence_log_ratio(log_prob_bt, old_log_prob_bt, mask_bt))
    adv_b = advantages_b.detach().float().reshape(-1)
    loss_b = torch.maximum(-adv_b * ratio_b, -adv_b * ratio_b.clamp(1.0 - clip_low, 1.0 + clip_high))
    mask_f = mask_bt.float()
    return torch.where(mask_f != 0, loss_b[:, None] * mask_f, 0.0)


@torch.no_grad()
def sequence_ratio_stats(
    log_prob_bt: Tensor,
    old_log_prob_bt: Tensor,
    mask_bt: Tensor,
    clip_low: float,
    clip_high: float,
    advantages_b: Tensor | None = None,
) -> dict[str, Tensor]:
    """Diagnostics of the sequence ratios, without gradients (means over the ``B`` samples).

    Returns 0-d float32 tensors: ``clip_frac`` (the fraction of samples where the clip counts,
    `losses.clipped_fraction`: outside ``[1 - clip_low, 1 + clip_high]``, or with ``advantages_b`` where the
    clip changes the loss, as TRL's GSPO counts), ``approx_kl`` (``0.5 * mean(sequence_log_ratio^2)``) and
    ``ratio_mean``.
    """
    log_ratio_b = sequence_log_ratio(log_prob_bt, old_log_prob_bt, mask_bt)
    ratio_b = torch.exp(log_ratio_b)
    adv_b = None if advantages_b is None else advantages_b.reshape(-1)
    return {
        "clip_frac": clipped_fraction(ratio_b, clip_low, clip_high, adv_b).float().mean(),
        "approx_kl": 0.5 * (log_ratio_b**2).mean(),
        "ratio_mean": ratio_b.mean(),
    }
