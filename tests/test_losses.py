"""Golden tests for the clipped policy loss, KL terms, ratio diagnostics and token aggregations."""

import math

import pytest
import torch
from torch.distributions import Categorical, Normal, kl_divergence

from glm_training.algorithms.losses import (
    clipped_policy_loss,
    gaussian_mean_kl,
    k3_kl,
    masked_seq_mean_token_mean,
    masked_seq_mean_token_sum,
    masked_token_mean,
    ratio_stats,
)

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO: ratio clipped to [0.8, 1.28]

# ---------------------------------------------------------------- clipped_policy_loss


def test_clipped_policy_loss_by_hand_values_and_grads() -> None:
    # old log-prob 0, so r = exp(log_prob)
    # r=1.5, A=2:  max(-3,   -2*1.28=-2.56) = -2.56  clipped on the active side -> grad 0
    # r=1.1, A=2:  max(-2.2, -2.2)          = -2.2   inside the range          -> grad -A r = -2.2
    # r=0.5, A=2:  max(-1,   -2*0.8=-1.6)   = -1     below range, A>0 inactive  -> grad -A r = -1
    # r=0.5, A=-1: max(0.5,  0.8)           = 0.8    clipped on the active side -> grad 0
    # r=1.5, A=-1: max(1.5,  1.28)          = 1.5    above range, A<0 inactive  -> grad -A r = 1.5
    ratios = torch.tensor([1.5, 1.1, 0.5, 0.5, 1.5])
    log_prob = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    loss = clipped_policy_loss(log_prob, torch.zeros(5), adv, CLIP_LOW, CLIP_HIGH)
    assert loss.shape == (5,) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([-2.56, -2.2, -1.0, 0.8, 1.5]), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([0.0, -2.2, -1.0, 0.0, 1.5]), atol=1e-6, rtol=0)


def test_clipped_policy_loss_matches_piecewise_loop() -> None:
    g = torch.Generator().manual_seed(0)
    log_prob = (0.3 * torch.randn(4, 6, generator=g)).requires_grad_(True)
    old = 0.3 * torch.randn(4, 6, generator=g)
    adv_b = torch.randn(4, generator=g)
    loss = clipped_policy_loss(log_prob, old, adv_b[:, None], CLIP_LOW, CLIP_HIGH)
    (grad,) = torch.autograd.grad(loss.sum(), log_prob)
    for b in range(4):
        for t in range(6):
            a = adv_b[b].item()
            r = math.exp(log_prob[b, t].item() - old[b, t].item())
            # PPO written per sign of A: only the side that would help the objective is clipped
            if a >= 0:
                value = -a * min(r, 1 + CLIP_HIGH)
                slope = -a * r if r < 1 + CLIP_HIGH else 0.0
            else:
                value = -a * max(r, 1 - CLIP_LOW)
                slope = -a * r if r > 1 - CLIP_LOW else 0.0
            assert loss[b, t].item() == pytest.approx(value, abs=1e-5, rel=1e-5)
            assert grad[b, t].item() == pytest.approx(slope, abs=1e-5, rel=1e-5)


def test_clipped_policy_loss_ratio_one_and_bf16() -> None:
    # at r = 1 the loss is -A and the gradient -A (first inner step of an on-policy update)
    log_prob = torch.tensor([[0.3, -1.2]], dtype=torch.bfloat16, requires_grad=True)
    loss = clipped_policy_loss(log_prob, log_prob.detach(), torch.tensor([[1.5]]), CLIP_LOW, CLIP_HIGH)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([[-1.5, -1.5]]), atol=0, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), log_prob)
    torch.testing.assert_close(grad.float(), torch.tensor([[-1.5, -1.5]]), atol=0, rtol=0)


# ---------------------------------------------------------------- ratio_stats


def test_ratio_stats_by_hand() -> None:
    # log ratios [0, log 1.5, log 0.5, log 1.1] -> ratios [1, 1.5, 0.5, 1.1]; range [0.8, 1.28]
    # clip_frac: 1.5 and 0.5 outside -> 2/4 = 0.5
    # approx_kl: 0.5 * (0 + 0.16440195 + 0.48045301 + 0.00908403) / 4 = 0.08174237
    # ratio_mean: (1 + 1.5 + 0.5 + 1.1) / 4 = 1.025
    log_prob = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1])).requires_grad_(True)
    stats = ratio_stats(log_prob, torch.zeros(4), CLIP_LOW, CLIP_HIGH)
    torch.testing.assert_close(stats["clip_frac"], torch.tensor(0.5), atol=0, rtol=0)
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(0.08174237), atol=1e-7, rtol=0)
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.025), atol=1e-6, rtol=0)
    assert not any(v.requires_grad for v in stats.values())

    # mask drops the 0.5 ratio: clip_frac 1/3, approx_kl 0.5 * (0.16440195 + 0.00908403) / 3 = 0.02891433,
    # ratio_mean (1 + 1.5 + 1.1) / 3 = 1.2
    masked = ratio_stats(log_prob, torch.zeros(4), CLIP_LOW, CLIP_HIGH, mask=torch.tensor([1, 1, 0, 1]))
    torch.testing.assert_close(masked["clip_frac"], torch.tensor(1 / 3), atol=1e-7, rtol=0)
    torch.testing.assert_close(masked["approx_kl"], torch.tensor(0.02891433), atol=1e-7, rtol=0)
    torch.testing.assert_close(masked["ratio_mean"], torch.tensor(1.2), atol=1e-6, rtol=0)

    empty = ratio_stats(log_prob, torch.zeros(4), CLIP_LOW, CLIP_HIGH, mask=torch.zeros(4, dtype=torch.bool))
    assert all(v.item() == 0.0 for v in empty.values())


def test_clip_frac_with_advantages_counts_the_clips_that_change_the_loss() -> None:
    # verl's pg_clipfrac (TRL's clip_ratio): ratios [1, 1.5, 0.5, 1.1, 1.5, 0.5], advantages
    # [1, 1, 1, 1, -1, -1]: 1.5 with A > 0 is clipped (counts), 0.5 with A > 0 is not (the unclipped loss
    # is larger), 1.5 with A < 0 is not, 0.5 with A < 0 is -> 2/6. Without advantages (Flow-GRPO's
    # clipfrac) all four outside the range count: 4/6.
    log_prob = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1, 1.5, 0.5]))
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    signed = ratio_stats(log_prob, torch.zeros(6), CLIP_LOW, CLIP_HIGH, advantages=advantages)
    torch.testing.assert_close(signed["clip_frac"], torch.tensor(2 / 6), atol=1e-7, rtol=0)
    either = ratio_stats(log_prob, torch.zeros(6), CLIP_LOW, CLIP_HIGH)
    torch.testing.assert_close(either["clip_frac"], torch.tensor(4 / 6), atol=1e-7, rtol=0)
    # A zero advantage never counts: the clip cannot change a zero loss.
    zero = ratio_stats(log_prob, torch.zeros(6), CLIP_LOW, CLIP_HIGH, advantages=torch.zeros(6))
    assert zero["clip_frac"].item() == 0.0


def test_ratio_stats_masked_matches_selection() -> None:
    g = torch.Generator().manual_seed(1)
    log_prob, old = 0.3 * torch.randn(3, 8, generator=g), 0.3 * torch.randn(3, 8, generator=g)
    mask = torch.rand(3, 8, generator=g) > 0.4
    stats = ratio_stats(log_prob, old, CLIP_LOW, CLIP_HIGH, mask=mask)
    ratio = torch.exp(log_prob - old)[mask]
    outside = ((ratio < 0.8) | (ratio > 1.28)).float()
    torch.testing.assert_close(stats["clip_frac"], outside.mean(), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        stats["approx_kl"], 0.5 * ((log_prob - old)[mask] ** 2).mean(), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(stats["ratio_mean"], ratio.mean(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- gaussian_mean_kl


def test_gaussian_mean_kl_by_hand_and_grad() -> None:
    # means [1, 3] vs [0, 1], std 2: ((1)^2/8 + (2)^2/8) / 2 = (0.125 + 0.5) / 2 = 0.3125
    mean = torch.tensor([1.0, 3.0]).reshape(1, 1, 1, 2).requires_grad_(True)
    ref = torch.tensor([0.0, 1.0]).reshape(1, 1, 1, 2)
    kl = gaussian_mean_kl(mean, ref, torch.full((1, 1, 1, 1), 2.0))
    torch.testing.assert_close(kl, torch.tensor([0.3125]), atol=1e-7, rtol=0)
    # d/dmean = (mean - ref) / (std^2 N) = [1, 2] / 8 = [0.125, 0.25]
    (grad,) = torch.autograd.grad(kl.sum(), mean)
    torch.testing.assert_close(grad, torch.tensor([0.125, 0.25]).reshape(1, 1, 1, 2), atol=1e-7, rtol=0)


def test_gaussian_mean_kl_matches_torch_kl_divergence() -> None:
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    ref = torch.randn(3, 2, 4, 4, generator=g)
    std = torch.rand(3, 1, 1, 1, generator=g) + 0.1
    kl = gaussian_mean_kl(mean, ref, std)
    expected = kl_divergence(Normal(mean, std.expand_as(mean)), Normal(ref, std.expand_as(ref))).mean(
        dim=(1, 2, 3)
    )
    torch.testing.assert_close(kl, expected, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(kl.sum(), mean)
    (grad_ref,) = torch.autograd.grad(expected.sum(), mean)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)


def test_gaussian_mean_kl_zero_std() -> None:
    mean = torch.randn(2, 1, 2, 2, requires_grad=True)
    kl = gaussian_mean_kl(mean, torch.zeros(2, 1, 2, 2), torch.tensor([0.0, 1.0]).reshape(2, 1, 1, 1))
    assert kl[0].item() == 0.0 and torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[0] == 0).all()


# ---------------------------------------------------------------- k3_kl


def test_k3_by_hand_and_grad() -> None:
    # logp = 0, ref = log 2: d = log 2 -> 2 - 0.69314718 - 1 = 0.30685282
    # logp = log 2, ref = 0: d = -log 2 -> 0.5 + 0.69314718 - 1 = 0.19314718
    log_prob = torch.tensor([0.0, math.log(2.0)], requires_grad=True)
    k3 = k3_kl(log_prob, torch.tensor([math.log(2.0), 0.0]))
    torch.testing.assert_close(k3, torch.tensor([0.30685282, 0.19314718]), atol=1e-7, rtol=0)
    # d k3 / d logp = 1 - exp(d) = [1 - 2, 1 - 0.5] = [-1, 0.5]
    (grad,) = torch.autograd.grad(k3.sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([-1.0, 0.5]), atol=1e-6, rtol=0)


def test_k3_nonnegative_and_zero_when_equal() -> None:
    g = torch.Generator().manual_seed(3)
    log_prob, ref = 3 * torch.randn(1000, generator=g), 3 * torch.randn(1000, generator=g)
    assert (k3_kl(log_prob, ref) >= 0).all()
    assert torch.equal(k3_kl(log_prob, log_prob), torch.zeros(1000))


def test_k3_expectation_is_kl() -> None:
    # E_{x~p}[k3(x)] = sum p (q/p) - sum p log(q/p) - 1 = KL(p || q) exactly
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(torch.randn(7, generator=g), dim=0)
    logq = torch.log_softmax(torch.randn(7, generator=g), dim=0)
    expectation = (logp.exp() * k3_kl(logp, logq)).sum()
    expected = kl_divergence(Categorical(logits=logp), Categorical(logits=logq))
    torch.testing.assert_close(expectation, expected, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- aggregations

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
AGGREGATIONS = [masked_token_mean, masked_seq_mean_token_mean, masked_seq_mean_token_sum]


def test_aggregations_by_hand_with_grads() -> None:
    loss = LOSS_BT.clone().requires_grad_(True)
    cases = [
        # token-mean: (1 + 2 + 4) / 3 = 2.33333333; d/dloss = mask / 3
        (masked_token_mean, 7 / 3, [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]),
        # seq-mean-token-mean: ((1 + 2)/2 + 4/1) / 2 = (1.5 + 4) / 2 = 2.75; d/dloss = mask / (B * len_b)
        (masked_seq_mean_token_mean, 2.75, [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]),
        # seq-mean-token-sum: ((1 + 2) + 4) / 2 = 3.5; d/dloss = mask / B
        (masked_seq_mean_token_sum, 3.5, [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0]]),
    ]
    for fn, value, grad_expected in cases:
        out = fn(loss, MASK_BT)
        assert out.shape == () and out.dtype == torch.float32
        torch.testing.assert_close(out, torch.tensor(value), atol=1e-6, rtol=0)
        (grad,) = torch.autograd.grad(out, loss)
        torch.testing.assert_close(grad, torch.tensor(grad_expected), atol=1e-7, rtol=0)


def test_aggregations_match_loops() -> None:
    g = torch.Generator().manual_seed(5)
    loss = torch.randn(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.5
    mask[0, 0] = True
    tokens = [loss[b, t].item() for b in range(4) for t in range(9) if mask[b, t]]
    per_seq = [[loss[b, t].item() for t in range(9) if mask[b, t]] for b in range(4)]
    expected = {
        masked_token_mean: sum(tokens) / len(tokens),
        masked_seq_mean_token_mean: sum(sum(s) / len(s) if s else 0.0 for s in per_seq) / 4,
        masked_seq_mean_token_sum: sum(sum(s) for s in per_seq) / 4,
    }
    for fn, value in expected.items():
        assert fn(loss, mask).item() == pytest.approx(value, abs=1e-5, rel=1e-5)
        assert fn(loss, mask.float()).item() == pytest.approx(value, abs=1e-5, rel=1e-5)


def test_aggregations_empty_masks_and_nan_padding() -> None:
    # row 1 has no tokens: token-mean (1 + 2)/2 = 1.5; seq-mean-token-mean (1.5 + 0)/2 = 0.75;
    # seq-mean-token-sum (3 + 0)/2 = 1.5. NaN / inf in padded positions must not leak.
    loss = torch.tensor([[1.0, 2.0, float("nan")], [float("inf"), 5.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    for fn, value in zip(AGGREGATIONS, (1.5, 0.75, 1.5)):
        out = fn(loss, mask)
        torch.testing.assert_close(out, torch.tensor(value), atol=1e-7, rtol=0)
        (grad,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(grad).all() and (grad[1] == 0).all()
        assert fn(loss, torch.zeros_like(mask)).item() == 0.0


def test_aggregations_shape_error() -> None:
    for fn in AGGREGATIONS:
        with pytest.raises(ValueError, match=r"\[B, T\]"):
            fn(LOSS_BT, MASK_BT[:, :2])


def test_token_loss_golden_for_each_aggregation_and_both_clip_bounds() -> None:
    # Two sequences, three token slots; the last slot of sequence 1 is padding (mask 0).
    # old log-prob 0, so r = exp(logp). clip_low 0.2, clip_high 0.28 (DAPO).
    # seq 0, A = +1: r = [1.5, 1.1, 0.5] -> terms [max(-1.5, -1.28)=-1.28 (clipped high, grad 0),
    #                                               -1.1 (grad -1.1), max(-0.5, -0.8)=-0.5 (grad -0.5)]
    # seq 1, A = -1: r = [0.5, 1.5, pad] -> terms [max(0.5, 0.8)=0.8 (clipped low, grad 0),
    #                                               max(1.5, 1.28)=1.5 (grad +1.5), pad]
    ratios = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.5, 1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])[:, None]
    # token-mean:          (-1.28 - 1.1 - 0.5 + 0.8 + 1.5) / 5 = -0.58 / 5 = -0.116
    # seq-mean-token-mean: ((-2.88 / 3) + (2.3 / 2)) / 2 = (-0.96 + 1.15) / 2 = 0.095
    # seq-mean-token-sum:  (-2.88 + 2.3) / 2 = -0.29
    # grads w.r.t. logp = per-token grad x the aggregation's weight (1/5; 1/(2 n_seq); 1/2)
    token_grads = torch.tensor([[0.0, -1.1, -0.5], [0.0, 1.5, 0.0]])
    cases = [
        (masked_token_mean, -0.116, token_grads / 5),
        (masked_seq_mean_token_mean, 0.095, token_grads / torch.tensor([[6.0], [4.0]])),
        (masked_seq_mean_token_sum, -0.29, token_grads / 2),
    ]
    for aggregate, value, grad_expected in cases:
        log_prob = torch.log(ratios).requires_grad_(True)
        loss = aggregate(clipped_policy_loss(log_prob, torch.zeros(2, 3), adv, 0.2, 0.28), mask)
        torch.testing.assert_close(loss, torch.tensor(value), atol=1e-6, rtol=0)
        (grad,) = torch.autograd.grad(loss, log_prob)
        torch.testing.assert_close(grad, grad_expected, atol=1e-6, rtol=0)


# ------------------------------------------------------- verl's dual clip, log-ratio clamp, low-var KL


def _verl_vanilla_policy_loss(log_prob, old_log_prob, adv, clip_low, clip_high, clip_ratio_c, clamp):
    """verl's `compute_policy_loss` (vanilla) per token, written from its formulas: the log-ratio clamped,
    the two-sided clip taken with max, then for negative advantages the dual clip taken with min."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-clamp, max=clamp)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)


def test_dual_clip_and_log_ratio_clamp_match_verl_values_and_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    log_prob = (torch.randn(64, 16, generator=g) * 2.0).requires_grad_(True)  # many ratios far outside
    old = torch.randn(64, 16, generator=g)
    adv = torch.randn(64, 1, generator=g) * 2.0
    ours = clipped_policy_loss(
        log_prob, old, adv, CLIP_LOW, CLIP_HIGH, clip_ratio_c=3.0, log_ratio_clamp=20.0
    )
    (grad,) = torch.autograd.grad(ours.sum(), log_prob)
    reference_input = log_prob.detach().clone().requires_grad_(True)
    reference = _verl_vanilla_policy_loss(reference_input, old, adv, CLIP_LOW, CLIP_HIGH, 3.0, 20.0)
    (reference_grad,) = torch.autograd.grad(reference.sum(), reference_input)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, reference_grad, atol=1e-6, rtol=1e-6)
    # The dual clip acts here (negative advantages, ratios above 3): without it the losses differ.
    dual_acts = (adv < 0) & (torch.exp(log_prob.detach() - old) > 3.0)
    assert dual_acts.any()
    plain = clipped_policy_loss(log_prob.detach(), old, adv, CLIP_LOW, CLIP_HIGH)
    assert (plain[dual_acts] > ours.detach()[dual_acts]).all()
    assert torch.equal(plain[~dual_acts.expand_as(plain)], ours.detach()[~dual_acts.expand_as(plain)])


def test_dual_clip_by_hand_and_the_clamp_keeps_huge_ratios_finite() -> None:
    # A = -1, r = 5: two-sided clip gives max(5, 1.28) = 5; the dual clip caps it at -A c = 3, gradient 0.
    # A = -1, r = 2: max(2, 1.28) = 2 < 3, unchanged, gradient -A r = 2.
    # A = +1, r = 5: max(-5, -1.28) = -1.28, the dual clip does not apply.
    log_prob = torch.log(torch.tensor([5.0, 2.0, 5.0])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss = clipped_policy_loss(log_prob, torch.zeros(3), adv, CLIP_LOW, CLIP_HIGH, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, 2.0, -1.28]), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), log_prob)
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0]), atol=1e-6, rtol=0)
    huge = torch.tensor([200.0])  # exp(200) overflows float32
    assert torch.isinf(clipped_policy_loss(huge, torch.zeros(1), torch.tensor([-1.0]), 0.2, 0.28)).all()
    clamped = clipped_policy_loss(huge, torch.zeros(1), torch.tensor([-1.0]), 0.2, 0.28, log_ratio_clamp=20.0)
    torch.testing.assert_close(clamped, torch.exp(torch.tensor([20.0])))


def _verl_low_var_kl(log_prob, ref_log_prob):
    """verl's `kl_penalty(..., "low_var_kl")`, from its formulas."""
    kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def test_low_variance_k3_clamp_matches_verl_and_is_off_by_default() -> None:
    g = torch.Generator().manual_seed(1)
    log_prob = torch.randn(32, 8, generator=g) * 3.0
    ref = torch.randn(32, 8, generator=g) * 3.0
    torch.testing.assert_close(k3_kl(log_prob, ref, low_var_clamp=True), _verl_low_var_kl(log_prob, ref))
    plain = k3_kl(log_prob, ref)
    assert plain.max() > 10  # the clamp acts on these, and the default leaves them alone
    torch.testing.assert_close(plain, torch.exp(ref - log_prob) - (ref - log_prob) - 1)
