"""Golden tests of the DiffusionNFT math (`glm_training/algorithms/nft/losses.py`)."""

import pytest
import torch

from glm_training.algorithms.decoder.forward_math import ema_update_, noised_latents, velocity_kl
from glm_training.algorithms.nft.losses import (
    adaptive_x0_loss,
    implicit_velocities,
    nft_loss,
    old_model_decay,
    optimality_probability,
    train_time_indices,
)

TOL = {"rtol": 1e-6, "atol": 1e-7}


def hand_case():
    x0 = torch.tensor([[1.0, 0.0]])
    noise = torch.tensor([[0.0, 2.0]])
    t = torch.tensor([0.5])
    v_theta = torch.tensor([[1.0, 1.0]], requires_grad=True)
    v_old = torch.tensor([[0.0, 1.0]])
    return x0, noise, t, v_theta, v_old


def test_hand_computed_loss():
    x0, noise, t, v_theta, v_old = hand_case()
    x_t = noised_latents(x0, noise, t)  # (1 - .5) [1, 0] + .5 [0, 2] = [0.5, 1.0]
    torch.testing.assert_close(x_t, torch.tensor([[0.5, 1.0]]), **TOL)
    positive, negative = implicit_velocities(v_theta, v_old, 0.5)
    # v+ = .5 [1, 1] + .5 [0, 1] = [0.5, 1];  v- = 1.5 [0, 1] - .5 [1, 1] = [-0.5, 1]
    torch.testing.assert_close(positive, torch.tensor([[0.5, 1.0]]), **TOL)
    torch.testing.assert_close(negative, torch.tensor([[-0.5, 1.0]]), **TOL)
    # x0_hat+ = x_t - .5 v+ = [0.25, 0.5]: err [-0.75, 0.5], w = 0.625, mean([0.5625, 0.25] / 0.625) = 0.65
    torch.testing.assert_close(adaptive_x0_loss(positive, x_t, x0, t), torch.tensor([0.65]), **TOL)
    # x0_hat- = [0.75, 0.5]: err [-0.25, 0.5], w = 0.375, mean([0.0625, 0.25] / 0.375) = 0.416667
    torch.testing.assert_close(adaptive_x0_loss(negative, x_t, x0, t), torch.tensor([5.0 / 12.0]), **TOL)
    r = optimality_probability(torch.tensor([2.5]), 5.0)  # 2.5 / 5 / 2 + 0.5 = 0.75
    torch.testing.assert_close(r, torch.tensor([0.75]), **TOL)
    loss, terms = nft_loss(v_theta, v_old, x_t, x0, t, r, beta=0.5, adv_clip_max=5.0)
    # 5 / 0.5 * (0.75 * 0.65 + 0.25 * 5/12) = 10 * (0.4875 + 0.1041667) = 5.916667
    torch.testing.assert_close(loss, torch.tensor([5.916666666]), **TOL)
    torch.testing.assert_close(terms["positive_loss"], torch.tensor([0.65]), **TOL)


def test_optimality_probability_clips_and_centres():
    r = optimality_probability(torch.tensor([-7.0, -5.0, 0.0, 1.0, 9.0]), 5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.6, 1.0]), **TOL)


def velocity_space_loss(v, noise, x0, t):
    """Independent formulation: x0_hat - x0 = t (v_target - v) with v_target = eps - x0, so the weighted
    loss is t * mean((v - v_target)^2) / mean|v - v_target| (the weight floor never binds here)."""
    diff = (v - (noise - x0)).double()
    dims = tuple(range(1, v.ndim))
    return (t.double() * (diff**2).mean(dim=dims) / diff.abs().mean(dim=dims)).float()


def test_against_velocity_space_formulation():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    t = torch.rand(4, generator=g) * 0.9 + 0.05
    v_theta, v_old = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    adv = torch.randn(4, generator=g) * 3
    beta, clip = 0.3, 5.0
    x_t = noised_latents(x0, noise, t)
    loss, _ = nft_loss(v_theta, v_old, x_t, x0, t, optimality_probability(adv, clip), beta, clip)
    r = (adv.clamp(-clip, clip) / clip + 1) / 2
    pos = velocity_space_loss(beta * v_theta + (1 - beta) * v_old, noise, x0, t)
    neg = velocity_space_loss((1 + beta) * v_old - beta * v_theta, noise, x0, t)
    torch.testing.assert_close(loss, clip * (r * pos + (1 - r) * neg) / beta, rtol=1e-5, atol=1e-6)


def test_gradient_matches_closed_form():
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    v_old = torch.randn(3, 2, 4, 4, generator=g)
    v_theta = (v_old + 0.1 * torch.randn(3, 2, 4, 4, generator=g)).requires_grad_(True)
    r = torch.tensor([0.1, 0.5, 0.95])
    beta, clip = 0.7, 5.0
    x_t = noised_latents(x0, noise, t)
    loss, _ = nft_loss(v_theta, v_old, x_t, x0, t, r, beta, clip)
    loss.sum().backward()
    # d/dv of mean((x_t - t v - x0)^2) / w is -2 t err / (n w), with err, w of that velocity (w detached);
    # v+ moves with +beta, v- with -beta, and the 1/beta in front cancels both.
    n = x0[0].numel()
    tt = t.view(-1, 1, 1, 1)
    expected = torch.zeros_like(v_theta)
    for v, sign, weight in (
        (beta * v_theta + (1 - beta) * v_old, 1.0, r),
        ((1 + beta) * v_old - beta * v_theta, -1.0, 1 - r),
    ):
        err = (x_t - tt * v - x0).detach()
        w = err.abs().mean(dim=(1, 2, 3), keepdim=True)
        expected += clip * weight.view(-1, 1, 1, 1) * sign * (-2 * tt * err / (n * w))
    torch.testing.assert_close(v_theta.grad, expected, rtol=1e-5, atol=1e-6)
    assert v_old.grad is None


def test_gradient_at_old_model_is_a_signed_flow_matching_gradient():
    """At v_theta = v_old the gradient is (2r - 1) times the adaptive x0 loss's: beta drops out."""
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(2, 2, 3, 3, generator=g), torch.randn(2, 2, 3, 3, generator=g)
    t, r = torch.tensor([0.3, 0.8]), torch.tensor([0.9, 0.2])
    v_old = torch.randn(2, 2, 3, 3, generator=g)
    x_t = noised_latents(x0, noise, t)
    grads = []
    for beta in (0.1, 1.0):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, x_t, x0, t, r, beta, 5.0)[0].sum().backward()
        grads.append(v.grad)
    v = v_old.clone().requires_grad_(True)
    (5.0 * (2 * r - 1) * adaptive_x0_loss(v, x_t, x0, t)).sum().backward()
    torch.testing.assert_close(grads[0], v.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], v.grad, rtol=1e-5, atol=1e-6)


def test_weight_floor():
    x0 = torch.zeros(1, 4)
    loss = adaptive_x0_loss(torch.zeros(1, 4), x0, x0, torch.tensor([0.5]))  # perfect: 0 / 1e-5
    assert loss.item() == 0.0


def test_velocity_kl():
    # mean([1 - 0, 3 - 1]^2) = mean([1, 4]) = 2.5
    torch.testing.assert_close(
        velocity_kl(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])), torch.tensor([2.5])
    )


@pytest.mark.parametrize(
    ("steps", "decay_type", "expected"),
    [
        (0, 1, 0.0),
        (100, 1, 0.1),
        (2000, 1, 0.5),
        (74, 2, 0.0),
        (75, 2, 0.0),
        (76, 2, 0.0075),
        (999, 2, 0.999),
    ],
)
def test_old_model_decay_schedules(steps, decay_type, expected):
    assert old_model_decay(steps, decay_type) == pytest.approx(expected)
    assert old_model_decay(steps, 0) == 0.0


def test_ema_update_and_time_indices():
    old, new = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    ema_update_(old, new, 0.25)  # .25 [1, 2] + .75 [3, 6] = [2.5, 5]
    torch.testing.assert_close(old[0], torch.tensor([2.5, 5.0]))
    idx = train_time_indices(5, 10, 9, torch.Generator().manual_seed(0))
    assert idx.shape == (5, 9)
    assert all(len(set(row.tolist())) == 9 for row in idx)
    again = train_time_indices(5, 10, 9, torch.Generator().manual_seed(0))
    assert torch.equal(idx, again)
