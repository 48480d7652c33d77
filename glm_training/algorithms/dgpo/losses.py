"""DGPO's loss as the authors' code computes it (`scripts/train_sd3_dgpo.py` at 01ceb4b,
`compute_group_dgpo_loss_allreduce` and its training loop), as pure functions.

Each clean sample `x_0` of a group is noised again with the group's one noise, `x_t = (1 - s) x_0 + s eps`,
and the velocity is fitted to `eps - x_0`:

- `matching_loss`: `l_i = mean (eps - x_0 - v_i)^2` per sample (the reference's `dsm_loss`);
- `clipped_loss`: a PPO-style clip against the old (EMA-ref) model's loss, ratio `r = exp(l_old - l)`: where
  `A > 0` and `r > 1 + c`, or `A <= 0` and `r < 1 - c`, the loss is detached (no gradient);
- `group_sums`: `S_g = sum_{i in g} (beta_dpo / G) A_i (sg(l_i) - l_i^ref)`, this rank's share (the reference
  all-reduces it over ranks; `G` is the group size);
- `dgpo_loss`: `mean_i sigmoid(S_g(i)) A_i l~_i` with the weight detached;
- `train_time_indices`: the `num_train_timesteps` schedule indices drawn without replacement from
  `{0, ..., trunc_steps}` (the reference's `generate_shared_sampled_timesteps`);
- `ref_decay`: the EMA reference's decay `min(cap, 0.001 k)` after k optimizer steps.

The signed advantage is the preference: `A > 0` is the positive set, `A < 0` the negative one, `|A|` the
weight; a group whose rewards are all equal has `A = 0` and contributes nothing. The gradient is
`(G / (beta_dpo B)) sum_g grad[-log sigmoid(-S_g)]`: DGPO's group-level DPO objective
`-log sigmoid(R(G+) - R(G-))`, up to that constant (the reference's docstring: "gradient-equivalent").
"""

from __future__ import annotations

import torch
from torch import Tensor


def matching_loss(velocity: Tensor, target: Tensor) -> Tensor:
    """[B] `mean((target - velocity)^2)` over every non-batch element (the reference's `dsm_loss`)."""
    return (target - velocity).square().reshape(velocity.shape[0], -1).mean(dim=1)


def clip_mask(loss: Tensor, old_loss: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """[B] bool: where the reference's clip acts, `r = exp(old_loss - loss)` above `1 + c` with `A > 0` or
    below `1 - c` with `A <= 0`."""
    ratio = torch.exp(-loss.detach() + old_loss.detach())
    return torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def clipped_loss(loss: Tensor, old_loss: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """[B] the loss, detached where the clip acts (`clip_mask`)."""
    return torch.where(clip_mask(loss, old_loss, advantages, clip_range), loss.detach(), loss)


def group_sums(
    loss: Tensor,
    ref_loss: Tensor,
    advantages: Tensor,
    group_index: Tensor,
    num_groups: int,
    beta_dpo: float,
    group_size: int,
) -> Tensor:
    """[num_groups] this rank's share of `S_g = sum_{i in g} (beta_dpo / G) A_i (sg(l_i) - l_i^ref)`; summed
    over the ranks it is the reference's `global_group_sums`. group_index [B]: each sample's group."""
    term = advantages * beta_dpo * (loss.detach() - ref_loss.detach()) / group_size
    sums = torch.zeros(num_groups, dtype=term.dtype, device=term.device)
    return sums.scatter_add_(0, group_index, term)


def dgpo_loss(loss: Tensor, advantages: Tensor, sums: Tensor, group_index: Tensor) -> Tensor:
    """0-d: `mean_i w_g(i) A_i l_i` with `w = sigmoid(S)`, `sums` every rank's `group_sums`, detached."""
    weights = torch.sigmoid(sums)[group_index].detach()
    return (weights * advantages * loss).mean()


def train_time_indices(trunc_steps: int, num_times: int, generator: torch.Generator) -> Tensor:
    """[num_times] distinct schedule indices from {0, ..., trunc_steps}, in the order drawn (the reference's
    `random.sample(range(trunc_steps + 1), M)` on rank 0, broadcast)."""
    if not 1 <= num_times <= trunc_steps + 1:
        raise ValueError(f"cannot draw {num_times} distinct indices from {{0, ..., {trunc_steps}}}")
    return torch.randperm(trunc_steps + 1, generator=generator)[:num_times]


def ref_decay(steps_before: int, cap: float) -> float:
    """The EMA reference's decay at the optimizer step after `steps_before` ones: `min(cap, 0.001 k)` (the
    reference's `ema_ref.step(..., decay=min(0.3, 0.001 * global_step))` before `global_step` counts it)."""
    return min(cap, 0.001 * steps_before)
