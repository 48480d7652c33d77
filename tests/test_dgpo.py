"""DGPO's math (`algorithms/dgpo/losses.py`) against the authors' code (`Luo-Yihong/DGPO` at 01ceb4b,
`scripts/train_sd3_dgpo.py`): `compute_group_dgpo_loss_allreduce` and the clip of its training loop,
transcribed below for one process (its all-reduce is then the identity). Values and gradients, several group
sizes, ties and all-equal groups."""

from __future__ import annotations

import pytest
import torch

from glm_training.algorithms.dgpo.losses import clip_mask, clipped_loss, dgpo_loss, group_sums, matching_loss


def reference_step(
    model_v, ref_v, old_v, target_v, advantages, group_index, beta_dpo, group_size, clip_range
):
    """train_sd3_dgpo.py lines 1132-1144 and `compute_group_dgpo_loss_allreduce`, one process."""
    batch_size = model_v.shape[0]
    dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    old_dsm_loss = (target_v - old_v).square().reshape(batch_size, -1).mean(dim=1)
    ratio = torch.exp(-dsm_loss + old_dsm_loss)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    num_groups = int(group_index.max()) + 1
    sums = torch.zeros(num_groups, dtype=per_sample_term.dtype).scatter_add_(0, group_index, per_sample_term)
    weights = torch.sigmoid(sums.clone().detach())[group_index]
    return (weights.detach() * advantages * dsm_loss).mean()


def ours(model_v, ref_v, old_v, target_v, advantages, group_index, beta_dpo, group_size, clip_range):
    loss = matching_loss(model_v, target_v)
    loss = clipped_loss(loss, matching_loss(old_v, target_v), advantages, clip_range)
    num_groups = int(group_index.max()) + 1
    sums = group_sums(
        loss, matching_loss(ref_v, target_v), advantages, group_index, num_groups, beta_dpo, group_size
    )
    return dgpo_loss(loss, advantages, sums, group_index)


def _inputs(group_size: int, num_groups: int, seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    n = group_size * num_groups
    target = torch.randn(n, 2, 3, 3, generator=g, dtype=torch.float64)
    base = torch.randn(n, 2, 3, 3, generator=g, dtype=torch.float64)
    model_v = (base + spread * torch.randn(n, 2, 3, 3, generator=g, dtype=torch.float64)).requires_grad_(True)
    old_v = base + 0.5 * spread * torch.randn(n, 2, 3, 3, generator=g, dtype=torch.float64)
    rewards = torch.randn(num_groups, group_size, generator=g, dtype=torch.float64)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std() + 1e-4)).reshape(-1).clamp(-5, 5)
    group_index = torch.arange(num_groups).repeat_interleave(group_size)
    return model_v, base, old_v, target, advantages, group_index


@pytest.mark.parametrize("group_size, num_groups", [(2, 3), (3, 2), (4, 4), (16, 1)])
@pytest.mark.parametrize("clip_range", [1e-2, 10.0])
def test_value_and_gradient_equal_the_authors_code(group_size, num_groups, clip_range):
    model_v, ref_v, old_v, target, adv, index = _inputs(
        group_size, num_groups, seed=group_size * 7 + num_groups
    )
    args = (ref_v, old_v, target, adv, index, 100.0, group_size, clip_range)
    expected = reference_step(model_v, *args)
    (expected_grad,) = torch.autograd.grad(expected, model_v)
    got = ours(model_v, *args)
    (got_grad,) = torch.autograd.grad(got, model_v)
    # The same float64 operations in the same order on both sides: equal to the last bit.
    assert torch.equal(got, expected)
    assert torch.equal(got_grad, expected_grad)


def test_the_gradient_is_the_group_dpo_objectives_up_to_beta_over_g_and_the_batch():
    # grad L = (G / (beta_dpo B)) sum_g grad[-log sigmoid(-S_g)],
    # S_g = (beta_dpo / G) sum_{i in g} A_i (l_i - l_i^ref).
    group_size, num_groups, beta_dpo = 3, 4, 50.0
    model_v, ref_v, old_v, target, adv, index = _inputs(group_size, num_groups, seed=5)
    no_clip = 1e9
    (grad,) = torch.autograd.grad(
        ours(model_v, ref_v, old_v, target, adv, index, beta_dpo, group_size, no_clip), model_v
    )
    loss, ref_loss = matching_loss(model_v, target), matching_loss(ref_v, target)
    s = torch.zeros(num_groups, dtype=loss.dtype).index_add(
        0, index, adv * beta_dpo * (loss - ref_loss) / group_size
    )
    objective = -torch.nn.functional.logsigmoid(-s).sum()
    (dpo_grad,) = torch.autograd.grad(objective, model_v)
    batch = group_size * num_groups
    torch.testing.assert_close(grad, dpo_grad * group_size / (beta_dpo * batch), rtol=1e-12, atol=1e-15)


def test_an_all_equal_group_contributes_nothing_and_ties_weigh_one_half():
    group_size, num_groups = 4, 2
    model_v, ref_v, old_v, target, adv, index = _inputs(group_size, num_groups, seed=11)
    adv = adv.clone()
    adv[:group_size] = 0.0  # group 0: every reward equal
    loss = matching_loss(model_v, target)
    sums = group_sums(loss, matching_loss(ref_v, target), adv, index, num_groups, 100.0, group_size)
    assert sums[0] == 0.0  # its weight is sigmoid(0) = 1/2
    (grad,) = torch.autograd.grad(dgpo_loss(loss, adv, sums, index), model_v)
    assert not grad[:group_size].any() and grad[group_size:].any()
    # At the reference (the policy is the base model) every S_g is 0: every group weighs 1/2.
    at_ref = group_sums(loss, loss, adv, index, num_groups, 100.0, group_size)
    assert torch.equal(at_ref, torch.zeros(num_groups, dtype=at_ref.dtype))


def test_the_clip_detaches_the_samples_whose_ratio_left_the_range_on_the_side_of_their_advantage():
    loss = torch.tensor([1.0, 1.0, 1.0, 1.0], requires_grad=True)
    old = torch.tensor([1.5, 0.5, 1.5, 0.5])  # ratios exp(0.5), exp(-0.5), exp(0.5), exp(-0.5)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert clip_mask(loss, old, adv, 0.1).tolist() == [True, False, False, True]
    (grad,) = torch.autograd.grad(clipped_loss(loss, old, adv, 0.1).sum(), loss)
    assert grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert not clip_mask(loss, old, torch.zeros(4), 1.0).any()  # A <= 0 clips below 1 - c only
