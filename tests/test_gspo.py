"""GSPO (arXiv 2507.18071): golden values, an independent formulation, gradients, the token-level limit."""

from __future__ import annotations

import math

import torch

from glm_training.algorithms.grpo.gspo import gspo_policy_loss, sequence_log_ratio, sequence_ratio_stats
from glm_training.algorithms.losses import clipped_policy_loss, masked_seq_mean_token_mean, ratio_stats


def _golden_inputs():
    # Sample 0: 3 tokens, log-ratios 0.3, -0.1, 0.1 -> mean 0.1. Sample 1: 2 tokens, log-ratios 0.2, -0.4 ->
    # mean -0.1; its third column is padding, holding -inf to check the mask.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    new = old + torch.tensor([[0.3, -0.1, 0.1], [0.2, -0.4, 0.0]])
    new[1, 2] = -math.inf
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return new.requires_grad_(True), old, mask


def test_sequence_log_ratio_and_loss_golden_values():
    new, old, mask = _golden_inputs()
    adv = torch.tensor([1.0, -2.0])
    torch.testing.assert_close(
        sequence_log_ratio(new, old, mask), torch.tensor([0.1, -0.1]), atol=1e-6, rtol=0
    )

    # s = exp(0.1) = 1.10517092, exp(-0.1) = 0.90483742; both inside [0.8, 1.28]:
    # loss_0 = -1 * 1.10517092 = -1.10517092, loss_1 = 2 * 0.90483742 = 1.80967484, on every valid token.
    loss_bt = gspo_policy_loss(new, old, adv, mask, 0.2, 0.28)
    expected = torch.tensor([[-1.10517092] * 3, [1.80967484, 1.80967484, 0.0]])
    torch.testing.assert_close(loss_bt, expected, atol=1e-6, rtol=0)

    # seq-mean-token-mean = (-1.10517092 + 1.80967484) / 2 = 0.35225196. Gradients: d/d new_0t =
    # 0.5 * (-A_0 s_0 / 3) = -0.18419515, d/d new_1t = 0.5 * (-A_1 s_1 / 2) = 0.45241871, padding 0.
    total = masked_seq_mean_token_mean(loss_bt, mask)
    torch.testing.assert_close(total, torch.tensor(0.35225196), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(total, new)
    expected_grad = torch.tensor([[-0.18419515] * 3, [0.45241871, 0.45241871, 0.0]])
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)


def test_clipped_sequences_have_no_gradient():
    new, old, mask = _golden_inputs()
    # GSPO's own ranges: s_0 = 1.105 > 1 + 4e-4 with A > 0 and s_1 = 0.905 < 1 - 3e-4 with A < 0: both
    # clipped. loss_0 = -(1 + 4e-4) = -1.0004, loss_1 = 2 * (1 - 3e-4) = 1.9994.
    loss_bt = gspo_policy_loss(new, old, torch.tensor([1.0, -2.0]), mask, 3e-4, 4e-4)
    torch.testing.assert_close(loss_bt[:, 0], torch.tensor([-1.0004, 1.9994]), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(masked_seq_mean_token_mean(loss_bt, mask), new)
    assert torch.equal(grad, torch.zeros_like(grad))
    stats = sequence_ratio_stats(new.detach(), old, mask, 3e-4, 4e-4)
    # clip_frac 2/2; approx_kl 0.5 * (0.1^2 + 0.1^2) / 2 = 0.005; ratio_mean (1.10517092 + 0.90483742) / 2.
    torch.testing.assert_close(stats["clip_frac"], torch.tensor(1.0))
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(0.005), atol=1e-7, rtol=0)
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.00500417), atol=1e-6, rtol=0)
    # As TRL's GSPO counts: s_0 above the range with A > 0 and s_1 below it with A < 0 both change the loss;
    # with the advantages' signs swapped neither clip acts.
    signed = sequence_ratio_stats(new.detach(), old, mask, 3e-4, 4e-4, torch.tensor([1.0, -2.0]))
    torch.testing.assert_close(signed["clip_frac"], torch.tensor(1.0))
    swapped = sequence_ratio_stats(new.detach(), old, mask, 3e-4, 4e-4, torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(swapped["clip_frac"], torch.tensor(0.0))


def _paper_objective(new, old, adv, lengths, clip_low, clip_high):
    """The paper's Eq. (5), written independently: probability ratios, product, |y|-th root, min form.

    J = 1/G sum_i min(s_i A_i, clip(s_i) A_i) with s_i = (prod_t pi(y_it) / pi_old(y_it)) ^ (1 / |y_i|);
    the loss is -J. float64, one sample at a time.
    """
    terms = []
    for i, n in enumerate(lengths):
        ratios = torch.exp(new[i, :n].double()) / torch.exp(old[i, :n].double())
        s = torch.prod(ratios) ** (1.0 / n)
        clipped = torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
        terms.append(torch.minimum(s * adv[i], clipped * adv[i]))
    return -torch.stack(terms).mean()


def test_matches_the_papers_formulation_with_gradients():
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 3, 6, 4, 6, 2]
    old = -torch.rand(6, 6, generator=generator) * 3 - 0.1
    # Log-ratios of a few 1e-2: with clip 0.01 / 0.012 some sequences are clipped, some not.
    new = (old + torch.randn(6, 6, generator=generator) * 0.02).requires_grad_(True)
    adv = torch.randn(6, generator=generator)
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    clip_low, clip_high = 0.01, 0.012

    ours = masked_seq_mean_token_mean(gspo_policy_loss(new, old, adv, mask, clip_low, clip_high), mask)
    theirs = _paper_objective(new, old, adv, lengths, clip_low, clip_high)
    s = torch.exp(sequence_log_ratio(new.detach(), old, mask))
    num_clipped = int(((s < 1 - clip_low) | (s > 1 + clip_high)).sum())
    assert 0 < num_clipped < 6  # both branches are exercised
    torch.testing.assert_close(ours.double(), theirs, atol=1e-6, rtol=0)
    (grad_ours,) = torch.autograd.grad(ours, new)
    (grad_theirs,) = torch.autograd.grad(theirs, new)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-6, rtol=0)
    assert torch.equal(grad_ours[~mask], torch.zeros(int((~mask).sum())))


def test_equals_the_token_level_loss_when_every_token_ratio_is_the_same():
    # If a sample's token log-ratios are all equal, its sequence ratio is its token ratio, so GSPO and the
    # token-level clipped loss agree (values and gradients) under seq-mean-token-mean.
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=generator) * 2
    per_sample = torch.tensor([0.05, -0.3, 0.2, 0.0])[:, None]
    new = (old + per_sample).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0])
    mask = torch.ones(4, 5, dtype=torch.bool)
    gspo = masked_seq_mean_token_mean(gspo_policy_loss(new, old, adv, mask, 0.2, 0.28), mask)
    token = masked_seq_mean_token_mean(clipped_policy_loss(new, old, adv[:, None], 0.2, 0.28), mask)
    torch.testing.assert_close(gspo, token, atol=1e-6, rtol=0)
    grads = [torch.autograd.grad(x, new)[0] for x in (gspo, token)]
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)
    seq_stats = sequence_ratio_stats(new.detach(), old, mask, 0.2, 0.28)
    tok_stats = ratio_stats(new.detach(), old, 0.2, 0.28, mask=mask)
    for key in ("clip_frac", "approx_kl", "ratio_mean"):
        torch.testing.assert_close(seq_stats[key], tok_stats[key], atol=1e-6, rtol=0)
