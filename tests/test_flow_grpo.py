"""Golden tests for `algorithms/flow_grpo/losses.py`: KL expressions, GRPO-Guard's ratio, SDE windows and
step counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from glm_training.algorithms.decoder.sde import SDEStep, flow_sde_step
from glm_training.algorithms.flow_grpo.losses import (
    KL_FNS,
    LOG_RATIOS,
    exact_kl,
    flow_grpo_kl,
    grpo_guard_log_ratio,
    nonzero_advantage_mask,
    num_train_steps,
    plain_log_ratio,
    progressive_window_start,
    random_window_start,
    velocity_kl,
)


def _latents(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(1, 1, 1, -1)


def _step(mean: torch.Tensor, std: float, std_dev_t: float, velocity: torch.Tensor | None = None) -> SDEStep:
    b = mean.shape[0]
    return SDEStep(
        prev_sample=mean,
        log_prob=torch.zeros(b),
        mean=mean,
        std=torch.full((b, 1, 1, 1), std),
        std_dev_t=torch.full((b, 1, 1, 1), std_dev_t),
        velocity=mean if velocity is None else velocity,
    )


# ---------------------------------------------------------------- KL


def test_kl_expressions_by_hand() -> None:
    # mu = [1, 3], mu_ref = [0, 1]: dmu^2 = [1, 4], mean 2.5
    # flow_grpo: 2.5 / (2 * std_dev_t^2) with std_dev_t = 2 -> 0.3125
    # exact: 2.5 / (2 * std^2) with std = 0.5 -> 5.0
    # velocity: v = [2, 0], v_ref = [1, 1]: mean([1, 1]) = 1.0
    policy = _step(_latents(1.0, 3.0), std=0.5, std_dev_t=2.0, velocity=_latents(2.0, 0.0))
    reference = _step(_latents(0.0, 1.0), std=0.5, std_dev_t=2.0, velocity=_latents(1.0, 1.0))
    torch.testing.assert_close(flow_grpo_kl(policy, reference), torch.tensor([0.3125]), atol=1e-7, rtol=0)
    torch.testing.assert_close(exact_kl(policy, reference), torch.tensor([5.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(velocity_kl(policy, reference), torch.tensor([1.0]), atol=1e-7, rtol=0)
    assert set(KL_FNS) == {"flow_grpo", "exact", "velocity"}


def test_kl_of_real_sde_steps_against_flow_grpo_and_torch_distributions() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 4, generator=g)
    v = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    v_ref = torch.randn(3, 2, 4, 4, generator=g)
    s, s_next, a = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.1]), 0.7
    policy = flow_sde_step(x, v, s, s_next, a, generator=g)
    reference = flow_sde_step(x, v_ref, s, s_next, a, prev_sample=policy.prev_sample)

    # Flow-GRPO's own line (train_sd3.py), written as there: .mean over (1, 2, 3) / (2 * std_dev_t ** 2)
    sc, snc = s.reshape(3, 1, 1, 1), s_next.reshape(3, 1, 1, 1)
    std_dev_t = torch.sqrt(sc / (1 - torch.where(sc == 1, snc, sc))) * a
    theirs = ((policy.mean - reference.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    torch.testing.assert_close(flow_grpo_kl(policy, reference), theirs.flatten(), atol=1e-6, rtol=1e-5)

    # exact: the KL of the two transition Gaussians (torch.distributions), per element then mean
    std = std_dev_t * torch.sqrt(sc - snc)
    ref_kl = kl_divergence(Normal(policy.mean, std.expand_as(x)), Normal(reference.mean, std.expand_as(x)))
    torch.testing.assert_close(exact_kl(policy, reference), ref_kl.mean(dim=(1, 2, 3)), atol=1e-5, rtol=1e-5)
    # Their ratio is -dt: Flow-GRPO's KL is the exact one times (s - s_next).
    torch.testing.assert_close(
        flow_grpo_kl(policy, reference), exact_kl(policy, reference) * (s - s_next), atol=1e-6, rtol=1e-5
    )

    # Gradients w.r.t. the velocity: autograd through the step vs the analytic d/dv of mean(dmu^2) / (2 c^2),
    # dmu/dv = (1 + std_t^2 (1 - s) / (2 s)) dt.
    (grad,) = torch.autograd.grad(flow_grpo_kl(policy, reference).sum(), v)
    dt = snc - sc
    dmu_dv = (1 + std_dev_t**2 * (1 - sc) / (2 * sc)) * dt
    n = x[0].numel()
    analytic = (policy.mean - reference.mean).detach() * dmu_dv / (std_dev_t**2 * n)
    torch.testing.assert_close(grad, analytic, atol=1e-6, rtol=1e-5)


def test_velocity_kl_against_mse_loss_with_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(2, 3, 4, 4, generator=g, requires_grad=True)
    v_ref = torch.randn(2, 3, 4, 4, generator=g)
    kl = velocity_kl(_step(v, 1.0, 1.0, velocity=v), _step(v_ref, 1.0, 1.0, velocity=v_ref))
    v2 = v.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.mse_loss(v2, v_ref, reduction="none").mean(dim=(1, 2, 3))
    torch.testing.assert_close(kl, ref, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(kl.sum(), v)
    (grad_ref,) = torch.autograd.grad(ref.sum(), v2)
    torch.testing.assert_close(grad, grad_ref, atol=1e-7, rtol=1e-6)


def test_kl_of_a_deterministic_step_is_zero() -> None:
    policy = _step(_latents(1.0, 3.0), std=0.0, std_dev_t=0.0)
    reference = _step(_latents(0.0, 1.0), std=0.0, std_dev_t=0.0)
    assert flow_grpo_kl(policy, reference).item() == 0.0 and exact_kl(policy, reference).item() == 0.0


# ---------------------------------------------------------------- GRPO-Guard


def test_grpo_guard_log_ratio_by_hand() -> None:
    # old mean 0, sample x = 1 (eps = x / sigma = 2 with sigma = 0.5); new mean 0.1:
    # plain log-ratio = [-(1 - 0.1)^2 + 1^2] / (2 * 0.25) = (1 - 0.81) / 0.5 = 0.38
    # guard = (0.38 + 0.1^2 / (2 * 0.25)) * 0.5 = (0.38 + 0.02) * 0.5 = 0.2 = dmu * eps = 0.1 * 2
    std = torch.full((1, 1, 1, 1), 0.5)
    x, old_mean, new_mean = _latents(1.0), _latents(0.0), _latents(0.1)
    lp_new = Normal(new_mean, 0.5).log_prob(x).mean(dim=(1, 2, 3))
    lp_old = Normal(old_mean, 0.5).log_prob(x).mean(dim=(1, 2, 3))
    torch.testing.assert_close(
        plain_log_ratio(lp_new, lp_old, new_mean, old_mean, std), torch.tensor([0.38]), atol=1e-6, rtol=0
    )
    guard = grpo_guard_log_ratio(lp_new, lp_old, new_mean, old_mean, std)
    torch.testing.assert_close(guard, torch.tensor([0.2]), atol=1e-6, rtol=0)
    assert set(LOG_RATIOS) == {"none", "grpo_guard"}


def test_grpo_guard_is_the_centred_reweighted_ratio_with_its_gradient() -> None:
    # Independent form: with x = mu_old + sigma eps, the guarded log-ratio is mean((mu - mu_old) * eps):
    # zero-mean under the old policy, and its gradient w.r.t. mu is eps / N whatever sigma is.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 4, 4, generator=g)
    v_old = torch.randn(3, 2, 4, 4, generator=g)
    s, s_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.1])
    old = flow_sde_step(x, v_old, s, s_next, 0.7, generator=g)
    v = (v_old + 0.05 * torch.randn(3, 2, 4, 4, generator=g)).requires_grad_(True)
    new = flow_sde_step(x, v, s, s_next, 0.7, prev_sample=old.prev_sample)
    guard = grpo_guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
    eps = (old.prev_sample - old.mean) / old.std
    independent = ((new.mean - old.mean) * eps).mean(dim=(1, 2, 3))
    torch.testing.assert_close(guard, independent, atol=2e-5, rtol=1e-4)

    (grad,) = torch.autograd.grad(guard.sum(), new.mean, retain_graph=True)
    torch.testing.assert_close(grad, eps / x[0].numel(), atol=1e-6, rtol=1e-4)
    # The plain ratio's gradient is (eps - dmu / sigma) / (sigma N): GRPO-Guard removes the drift term
    # (normalisation) and the 1 / sigma (reweighting).
    plain = plain_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
    (grad_plain,) = torch.autograd.grad(plain.sum(), new.mean)
    dmu = (new.mean - old.mean).detach()
    expected_plain = (eps - dmu / new.std) / (new.std * x[0].numel())
    torch.testing.assert_close(grad_plain, expected_plain, atol=1e-5, rtol=1e-4)


def test_grpo_guard_ratio_is_exactly_one_on_policy_and_zero_std_is_safe() -> None:
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 1, 3, 3, generator=g), torch.randn(2, 1, 3, 3, generator=g)
    old = flow_sde_step(x, v, 0.8, 0.6, 0.7, generator=g)
    again = flow_sde_step(x, v, 0.8, 0.6, 0.7, prev_sample=old.prev_sample)
    guard = grpo_guard_log_ratio(again.log_prob, old.log_prob, again.mean, old.mean, again.std)
    assert torch.equal(torch.exp(guard), torch.ones(2))
    mean = torch.randn(2, 1, 3, 3, requires_grad=True)
    zero = grpo_guard_log_ratio(
        torch.zeros(2), torch.zeros(2), mean, torch.zeros(2, 1, 3, 3), torch.zeros(2, 1, 1, 1)
    )
    assert torch.equal(zero, torch.zeros(2))
    zero.sum().backward()
    assert torch.isfinite(mean.grad).all()


# ---------------------------------------------------------------- steps and windows


@pytest.mark.parametrize(
    ("num_sde", "num_steps", "fraction", "expected"),
    [
        (9, 10, 0.99, 9),  # Flow-GRPO's SD3 configs: 10 steps, window (0, 9), int(9.9) = 9: every SDE step
        (2, 10, 0.99, 2),  # a 2-step window trains both steps (the old rule int(2 * 0.99) = 1 dropped one)
        (9, 10, 1.0, 9),
        (9, 10, 0.5, 5),  # a deliberate subsample: the first int(10 * 0.5) = 5 steps
        (2, 3, 0.2, 1),  # never fewer than one
    ],
)
def test_num_train_steps_follows_flow_grpo(num_sde, num_steps, fraction, expected) -> None:
    assert num_train_steps(num_sde, num_steps, fraction) == expected


def test_random_window_start_is_reproducible_uniform_and_inside_the_range() -> None:
    starts = [random_window_start(7, step, 2, 1, 6) for step in range(400)]
    assert starts == [
        random_window_start(7, step, 2, 1, 6) for step in range(400)
    ]  # a function of (seed, step)
    assert set(starts) == {1, 2, 3, 4}  # Flow-GRPO-Fast: randint(lo, hi - size), both ends included
    counts = torch.bincount(torch.tensor(starts))[1:]
    # 400 draws over 4 values: 100 each, binomial sd ~8.7; 5 sd either side
    assert counts.min() > 55 and counts.max() < 145, counts.tolist()
    assert starts != [random_window_start(8, step, 2, 1, 6) for step in range(400)]
    with pytest.raises(ValueError, match="does not fit"):
        random_window_start(0, 0, 3, 2, 4)


def test_progressive_window_slides_and_wraps() -> None:
    # lo 0, hi 6, size 2: starts 0..4 (5 positions); stride 2 every 3 steps:
    # steps 0-2 -> 0, 3-5 -> 2, 6-8 -> 4, 9-11 -> 6 % 5 = 1
    starts = [progressive_window_start(step, 2, 0, 6, 2, 3) for step in range(12)]
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 1, 1, 1]


def test_nonzero_advantage_mask() -> None:
    adv = torch.tensor([0.0, 1.5, -0.0, -2.0])
    assert nonzero_advantage_mask(adv).tolist() == [False, True, False, True]
    assert math.isclose(1 - nonzero_advantage_mask(adv).float().mean().item(), 0.5)
