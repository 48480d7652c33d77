"""AWM's pure functions (`glm_training/algorithms/awm/losses.py`) against the reference's formulas.

Golden values come from two independent formulations: the reference's own expressions
(`scxue/advantage_weighted_matching`, `scripts/train_sd3_awm.py`: `compute_log_prob_awm` and the
`exp_first` loss, transcribed below in their log-prob form), and closed-form gradients.
"""

from __future__ import annotations

import pytest
import torch

from glm_training.algorithms.awm.losses import (
    WEIGHTINGS,
    advantage_weights,
    anchor_decay,
    awm_policy_loss,
    matching_error,
    train_time_indices,
    weighted_matching_loss,
)

B, C, H, W = 3, 4, 2, 2


def _reference_log_prob(model_output, noise, clean, timestep, weighting, power=0.25):
    """`compute_log_prob_awm`'s log-prob, as the reference writes it (its weighting names)."""
    log_prob = -((model_output.double() - (noise.double() - clean.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "t":
        return log_prob * timestep.view(-1)
    if weighting == "t**2":
        return log_prob * timestep.view(-1) ** 2
    if weighting == "Uniform":
        return log_prob
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    eps = torch.tensor(1e-10, dtype=log_prob.dtype)
    return -(torch.pow(-log_prob + 1e-10, power) - torch.pow(eps, power)) * timestep.view(-1) / power


REFERENCE_NAMES = {"ghuber": "ghuber", "huber": "huber", "t": "t", "t_squared": "t**2", "uniform": "Uniform"}


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, C, H, W, generator=g)
    noise = torch.randn(B, C, H, W, generator=g)
    x0 = torch.randn(B, C, H, W, generator=g)
    t = torch.rand(B, generator=g) * 0.9 + 0.05
    return v, noise, x0, t


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_the_weighted_loss_is_the_references_negative_log_prob(weighting):
    assert set(REFERENCE_NAMES) == set(WEIGHTINGS)
    v, noise, x0, t = _tensors()
    ours = weighted_matching_loss(matching_error(v, noise, x0), t, weighting)
    reference = _reference_log_prob(v, noise, x0, t, REFERENCE_NAMES[weighting])
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, -reference, rtol=1e-12, atol=1e-15)


def test_the_policy_loss_matches_the_references_exp_first_objective():
    """Value and gradient of the reference's `exp_first` loss, its advantage scaling and time repetition."""
    torch.manual_seed(0)
    num_times, adv_clip_max, advantage_max, clip_range = 2, 5.0, 1.0, 1.0
    advantages = torch.tensor([7.0, -1.5, 0.25])
    v = torch.randn(num_times * B, C, H, W, dtype=torch.float64, requires_grad=True)
    noise, x0 = torch.randn(num_times * B, C, H, W), torch.randn(B, C, H, W).repeat(num_times, 1, 1, 1)
    t = torch.rand(num_times).repeat_interleave(B)

    # The reference: log-probs [T, B], old = detached (on-policy), advantages clamped, scaled, repeated.
    log_probs = _reference_log_prob(v, noise, x0, t, "ghuber").view(num_times, B)
    ratio = torch.exp(log_probs.view(-1) - log_probs.detach().view(-1))
    adv = advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max
    adv = adv.unsqueeze(0).repeat(num_times, 1).view(-1)
    reference = torch.mean(torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)))
    (reference_grad,) = torch.autograd.grad(reference, v)

    weights = advantage_weights(advantages, adv_clip_max, advantage_max)
    loss = weighted_matching_loss(matching_error(v, noise, x0), t, "ghuber")
    ours = awm_policy_loss(loss, weights.repeat(num_times), clip_range).mean()
    (grad,) = torch.autograd.grad(ours, v)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad, reference_grad)
    # On-policy the value is -mean(A) and the gradient A grad L (checked in closed form below).
    torch.testing.assert_close(ours, -weights.double().mean())


def test_the_gradient_is_the_advantage_times_the_ghuber_gradient():
    """d/dv of A t ((l + e)^p - e^p) / p = A t (l + e)^(p - 1) * 2 (v - (eps - x0)) / N, per sample."""
    v, noise, x0, t = _tensors(1)
    v = v.double().requires_grad_(True)
    weights = torch.tensor([0.8, -0.4, 0.0])
    power = 0.25
    loss = weighted_matching_loss(matching_error(v, noise, x0), t, "ghuber", power)
    awm_policy_loss(loss, weights, clip_range=1.0).sum().backward()

    residual = v.detach() - (noise.double() - x0.double())
    n = residual[0].numel()
    error = (residual**2).mean(dim=(1, 2, 3))
    scale = weights.double() * t.double() * (error + 1e-10) ** (power - 1)
    expected = scale.view(-1, 1, 1, 1) * 2 * residual / n
    torch.testing.assert_close(v.grad, expected)
    assert torch.all(v.grad[2] == 0)  # a zero advantage trains nothing


def test_off_policy_ratios_are_clipped_like_ppo():
    """With an older loss the ratio is exp(old - new); beyond 1 +- clip the gradient stops, as in PPO."""
    old = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    loss = torch.tensor([0.9, 0.5, 0.5, 1.5], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = awm_policy_loss(loss, weights, 0.2, old_loss=old)
    out.sum().backward()
    ratio = torch.exp(old - loss.detach())  # [1.105, 1.649, 1.649, 0.607]
    # A > 0 and r < 1.2: -A r, gradient A r. A > 0 and r > 1.2: clipped at -1.2, no gradient.
    # A < 0 and r > 1.2: the unclipped -A r = r is larger, so it counts (PPO's pessimism), gradient -r.
    # A < 0 and r < 0.8: clipped at 0.8, no gradient.
    torch.testing.assert_close(
        out.detach(),
        torch.stack([-ratio[0], torch.tensor(-1.2).double(), ratio[2], torch.tensor(0.8).double()]),
    )
    torch.testing.assert_close(
        loss.grad, torch.stack([ratio[0], torch.tensor(0.0).double(), -ratio[2], torch.tensor(0.0).double()])
    )


def test_advantages_are_clipped_then_scaled():
    out = advantage_weights(torch.tensor([-9.0, -2.5, 0.0, 1.0, 6.0]), 5.0, 1.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, -0.5, 0.0, 0.2, 1.0]))
    torch.testing.assert_close(advantage_weights(torch.tensor([10.0]), 5.0, 2.0), torch.tensor([2.0]))


@pytest.mark.parametrize(
    ("time_type", "bins"),
    [
        # SD3.5-M in the reference's OCR / GenEval configs: 14 steps, fraction 0.9, 6 times, no pure noise.
        ("discrete_wo_init", [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
        # Its PickScore config: the pure-noise step may train.
        ("discrete", [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
    ],
)
def test_training_times_cover_the_references_bins(time_type, bins):
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in bins]
    for _ in range(200):
        indices = train_time_indices(14, 0.9, 6, time_type, g)
        for i, index in enumerate(indices.tolist()):
            seen[i].add(index)
    assert seen == bins


def test_the_anchor_decays_like_the_references_ema_adapter():
    assert anchor_decay(0, 0.3, "linear") == 0.0
    assert anchor_decay(120, 0.3, "linear") == pytest.approx(0.12)
    assert anchor_decay(5000, 0.3, "linear") == 0.3
    assert anchor_decay(7, 0.3, "constant") == 0.3


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: weighted_matching_loss(torch.ones(1), torch.ones(1), "l2"), "weighting"),
        (lambda: train_time_indices(10, 0.9, 2, "logit_normal", torch.Generator()), "time_type"),
        (lambda: anchor_decay(1, 0.3, "cosine"), "decay type"),
    ],
)
def test_unknown_choices_name_the_options(call, message):
    with pytest.raises(ValueError, match=message):
        call()
