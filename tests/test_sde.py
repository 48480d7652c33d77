"""Golden tests for the Flow-GRPO SDE / CPS steps and the Gaussian log-prob."""

import math

import pytest
import torch
from torch.distributions import Normal

from glm_training.algorithms.decoder.sde import cps_step, flow_sde_step, gaussian_log_prob
from glm_training.pipeline.euler import ode_step

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # 0.91893853


def _latents(*values: float) -> torch.Tensor:
    """Values as a [1, 1, 1, N] latent."""
    return torch.tensor(values, dtype=torch.float32).reshape(1, 1, 1, -1)


def _normal_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    lp = Normal(mean, std.expand_as(mean)).log_prob(sample)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


# ---------------------------------------------------------------- gaussian_log_prob


def test_gaussian_log_prob_by_hand() -> None:
    # x = [1, 3], m = [0, 1], std = 2:
    # per element -(1)^2/8 - log 2 - c and -(2)^2/8 - log 2 - c, c = log sqrt(2 pi) = 0.91893853
    # mean = -(0.125 + 0.5)/2 - 0.69314718 - 0.91893853 = -1.92458571
    lp = gaussian_log_prob(_latents(1.0, 3.0), _latents(0.0, 1.0), torch.tensor(2.0).reshape(1, 1, 1, 1))
    assert lp.shape == (1,) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.tensor([-1.92458571]), atol=1e-6, rtol=0)


def test_gaussian_log_prob_matches_torch_normal() -> None:
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 2, 4, 5, generator=g)
    mean = torch.randn(3, 2, 4, 5, generator=g)
    std = torch.rand(3, 1, 1, 1, generator=g) + 0.1
    torch.testing.assert_close(
        gaussian_log_prob(sample, mean, std), _normal_log_prob(sample, mean, std), atol=1e-5, rtol=1e-6
    )


def test_gaussian_log_prob_zero_std_is_zero_with_finite_grad() -> None:
    mean = torch.randn(2, 1, 2, 2, requires_grad=True)
    std = torch.tensor([0.0, 0.5]).reshape(2, 1, 1, 1)
    lp = gaussian_log_prob(torch.zeros(2, 1, 2, 2), mean, std)
    assert lp[0].item() == 0.0
    torch.testing.assert_close(
        lp[1:], _normal_log_prob(torch.zeros(1, 1, 2, 2), mean[1:], std[1:]), atol=1e-6, rtol=0
    )
    lp.sum().backward()
    assert torch.isfinite(mean.grad).all()
    assert (mean.grad[0] == 0).all()


# ---------------------------------------------------------------- ode_step


def test_ode_step_by_hand_and_dtype() -> None:
    # x = 1, v = 2, s = 0.8 -> 0.6: dt = -0.2, x + v dt = 1 - 0.4 = 0.6
    out = ode_step(_latents(1.0), _latents(2.0), 0.8, 0.6)
    torch.testing.assert_close(out, _latents(0.6), atol=1e-6, rtol=0)
    out_bf16 = ode_step(_latents(1.0).bfloat16(), _latents(2.0).bfloat16(), 0.8, 0.6)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), _latents(0.6), atol=4e-3, rtol=0)


# ---------------------------------------------------------------- flow_sde_step


def test_flow_sde_by_hand() -> None:
    # a = 1, s = 0.5, s_next = 0.25: dt = -0.25, std_t = sqrt(0.5 / 0.5) = 1
    # mean = x (1 + 1/(2*0.5) * -0.25) + v (1 + 1*0.5/(2*0.5)) * -0.25 = 0.75 x - 0.375 v
    # std = std_t sqrt(0.25) = 0.5
    # element 1: x=2, v=1, z=0.4 -> mean 1.125, x_next = 1.125 + 0.2 = 1.325
    #   lp = -(0.2)^2/(2*0.25) - log 0.5 - c = -0.08 + 0.69314718 - 0.91893853 = -0.30579135
    # element 2: x=0, v=2, z=-1 -> mean -0.75, x_next = -1.25
    #   lp = -(0.5)^2/0.5 - log 0.5 - c = -0.72579135;  mean lp = -0.51579135
    step = flow_sde_step(_latents(2.0, 0.0), _latents(1.0, 2.0), 0.5, 0.25, 1.0, noise=_latents(0.4, -1.0))
    torch.testing.assert_close(step.mean, _latents(1.125, -0.75), atol=1e-6, rtol=0)
    torch.testing.assert_close(step.std, torch.full((1, 1, 1, 1), 0.5), atol=1e-7, rtol=0)
    torch.testing.assert_close(step.prev_sample, _latents(1.325, -1.25), atol=1e-6, rtol=0)
    torch.testing.assert_close(step.log_prob, torch.tensor([-0.51579135]), atol=1e-6, rtol=0)


def test_flow_sde_first_step_at_sigma_one() -> None:
    # a = 0.5, s = 1, s_next = 0.75: 1 - s would be 0, so the denominator uses s_next:
    # std_t = 0.5 sqrt(1 / (1 - 0.75)) = 1; dt = -0.25
    # mean = x (1 + 1/2 * -0.25) + v (1 + 1*0/2) * -0.25 = 0.875 x - 0.25 v; x=1, v=2 -> 0.375
    # std = 1 * sqrt(0.25) = 0.5
    step = flow_sde_step(_latents(1.0), _latents(2.0), 1.0, 0.75, 0.5, noise=_latents(0.0))
    torch.testing.assert_close(step.mean, _latents(0.375), atol=1e-6, rtol=0)
    torch.testing.assert_close(step.std, torch.full((1, 1, 1, 1), 0.5), atol=1e-7, rtol=0)
    # z = 0: x_next = mean, lp = -log 0.5 - c = -0.22579135
    torch.testing.assert_close(step.log_prob, torch.tensor([-0.22579135]), atol=1e-6, rtol=0)
    # per-sample sigmas mixing a first step (s = 1) and a later one (s = 0.5) stay finite
    x = torch.randn(2, 1, 2, 2)
    step2 = flow_sde_step(x, torch.randn_like(x), torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.25]), 0.5)
    assert all(torch.isfinite(t).all() for t in (step2.prev_sample, step2.log_prob, step2.mean, step2.std))


def test_flow_sde_noise_level_zero_is_ode_bitwise() -> None:
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 4, 3, 3, generator=g).to(dtype)
        v = torch.randn(2, 4, 3, 3, generator=g).to(dtype)
        for s, s_next in ((1.0, 0.9), (0.5, 0.4), (0.1, 0.0)):
            step = flow_sde_step(x, v, s, s_next, 0.0, generator=g)
            assert step.prev_sample.dtype == dtype
            assert torch.equal(step.prev_sample, ode_step(x, v, s, s_next))
            assert torch.equal(step.log_prob, torch.zeros(2))
            assert torch.equal(step.std, torch.zeros(2, 1, 1, 1))
            assert torch.isfinite(step.mean).all()


def test_flow_sde_per_sample_sigmas_match_separate_calls() -> None:
    g = torch.Generator().manual_seed(2)
    x, v, z = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    sig, sig_next = torch.tensor([0.9, 0.4]), torch.tensor([0.8, 0.3])
    both = flow_sde_step(x, v, sig, sig_next, 0.7, noise=z)
    for i in range(2):
        one = flow_sde_step(
            x[i : i + 1], v[i : i + 1], float(sig[i]), float(sig_next[i]), 0.7, noise=z[i : i + 1]
        )
        torch.testing.assert_close(both.prev_sample[i : i + 1], one.prev_sample, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(both.log_prob[i : i + 1], one.log_prob, atol=1e-6, rtol=1e-6)


def test_flow_sde_log_prob_matches_torch_normal() -> None:
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    step = flow_sde_step(x, v, torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.9, 0.5, 0.0]), 0.7, generator=g)
    torch.testing.assert_close(
        step.log_prob, _normal_log_prob(step.prev_sample, step.mean, step.std), atol=1e-5, rtol=1e-6
    )


def test_flow_sde_statistics() -> None:
    # Same setting as the hand case: x = 2, v = 1 everywhere -> mean 1.125, std 0.5.
    n = 200_000
    x, v = torch.full((1, 1, 1, n), 2.0), torch.full((1, 1, 1, n), 1.0)
    step = flow_sde_step(x, v, 0.5, 0.25, 1.0, generator=torch.Generator().manual_seed(4))
    samples = step.prev_sample.flatten()
    # standard error of the mean 0.5/sqrt(2e5) = 1.1e-3; of the std about 0.5/sqrt(4e5) = 7.9e-4
    torch.testing.assert_close(samples.mean(), torch.tensor(1.125), atol=6e-3, rtol=0)
    torch.testing.assert_close(samples.std(), torch.tensor(0.5), atol=4e-3, rtol=0)


@pytest.mark.parametrize("step_fn", [flow_sde_step, cps_step])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_log_prob_equals_sampling_log_prob(step_fn, dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(2, 4, 4, 4, generator=g).to(dtype), torch.randn(2, 4, 4, 4, generator=g).to(dtype)
    sampled = step_fn(x, v, 0.7, 0.6, 0.7, generator=g)
    assert sampled.prev_sample.dtype == dtype
    recomputed = step_fn(x, v, 0.7, 0.6, 0.7, prev_sample=sampled.prev_sample)
    assert recomputed.prev_sample is sampled.prev_sample
    assert torch.equal(recomputed.log_prob, sampled.log_prob)
    assert torch.equal(torch.exp(recomputed.log_prob - sampled.log_prob), torch.ones(2))


def test_bf16_latents() -> None:
    g = torch.Generator().manual_seed(6)
    x, v = torch.randn(2, 4, 8, 8, generator=g).bfloat16(), torch.randn(2, 4, 8, 8, generator=g).bfloat16()
    for step_fn in (flow_sde_step, cps_step):
        step = step_fn(x, v, 1.0, 0.9, 0.7, generator=g)
        assert step.prev_sample.dtype == torch.bfloat16
        assert step.log_prob.dtype == step.mean.dtype == step.std.dtype == torch.float32
        assert step.log_prob.shape == (2,) and step.std.shape == (2, 1, 1, 1)
        assert torch.isfinite(step.log_prob).all() and torch.isfinite(step.prev_sample.float()).all()
        # the float32 math on the upcast latents gives the same mean
        ref = step_fn(x.float(), v.float(), 1.0, 0.9, 0.7, prev_sample=step.prev_sample.float())
        torch.testing.assert_close(step.mean, ref.mean, atol=0, rtol=0)
        torch.testing.assert_close(step.log_prob, ref.log_prob, atol=0, rtol=0)


def test_noise_and_generator() -> None:
    x, v = torch.randn(2, 1, 3, 3), torch.randn(2, 1, 3, 3)
    a = flow_sde_step(x, v, 0.8, 0.7, 0.7, generator=torch.Generator().manual_seed(7))
    b = flow_sde_step(x, v, 0.8, 0.7, 0.7, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.prev_sample, b.prev_sample)
    z = torch.randn(2, 1, 3, 3)
    c = flow_sde_step(x, v, 0.8, 0.7, 0.7, noise=z)
    torch.testing.assert_close(c.prev_sample, c.mean + c.std * z, atol=0, rtol=0)
    with pytest.raises(ValueError, match="noise has shape"):
        flow_sde_step(x, v, 0.8, 0.7, 0.7, noise=torch.randn(1, 1, 3, 3))
    with pytest.raises(ValueError, match="sigma must be"):
        flow_sde_step(x, v, torch.tensor([0.8, 0.8, 0.8]), 0.7, 0.7)


def test_flow_sde_log_prob_grad_wrt_velocity() -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 2, 3, 3, generator=g)
    v = torch.randn(2, 2, 3, 3, generator=g, requires_grad=True)
    s, s_next, a = 0.6, 0.5, 0.7
    with torch.no_grad():
        y = flow_sde_step(x, v, s, s_next, a, generator=g).prev_sample
    step = flow_sde_step(x, v, s, s_next, a, prev_sample=y)
    (grad,) = torch.autograd.grad(step.log_prob.sum(), v)

    # analytic: lp_b = mean_i -(y_i - m_i)^2/(2 std^2) + const, m = x c1 + v c2 dt
    # d lp_b / d v_i = (y_i - m_i) / std^2 * c2 * dt / N
    dt = s_next - s
    std_t2 = a**2 * s / (1 - s)
    c2 = 1 + std_t2 * (1 - s) / (2 * s)
    std2 = std_t2 * -dt
    n = x[0].numel()
    analytic = (y - step.mean.detach()) / std2 * c2 * dt / n
    torch.testing.assert_close(grad, analytic, atol=1e-6, rtol=1e-5)

    # torch.distributions on the same mean expression
    v2 = v.detach().clone().requires_grad_(True)
    mean = x * (1 + std_t2 / (2 * s) * dt) + v2 * c2 * dt
    ref = Normal(mean, math.sqrt(std2)).log_prob(y).mean(dim=(1, 2, 3))
    (grad_ref,) = torch.autograd.grad(ref.sum(), v2)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- cps_step


def test_cps_by_hand() -> None:
    # a = 1/3, s = 0.5, s_next = 0.25: std = 0.25 sin(pi/6) = 0.125
    # sqrt(0.25^2 - 0.125^2) = sqrt(0.046875) = 0.21650635
    # x = 2, v = 1: x0_hat = 2 - 0.5 = 1.5, x1_hat = 2 + 0.5 = 2.5
    # mean = 0.75 * 1.5 + 0.21650635 * 2.5 = 1.66626588; z = 0.4 -> x_next = 1.66626588 + 0.05 = 1.71626588
    # Flow-GRPO's CPS log-prob (default): -(0.05)^2 = -0.0025
    # full Gaussian: -(0.05)^2/(2 * 0.015625) - log 0.125 - c = -0.08 + 2.07944154 - 0.91893853 = 1.08050301
    step = cps_step(_latents(2.0), _latents(1.0), 0.5, 0.25, 1.0 / 3.0, noise=_latents(0.4))
    torch.testing.assert_close(step.std, torch.full((1, 1, 1, 1), 0.125), atol=1e-7, rtol=0)
    torch.testing.assert_close(step.std_dev_t, step.std, atol=0, rtol=0)  # Flow-GRPO's std_dev_t for CPS
    torch.testing.assert_close(step.mean, _latents(1.66626588), atol=1e-6, rtol=0)
    torch.testing.assert_close(step.prev_sample, _latents(1.71626588), atol=1e-6, rtol=0)
    torch.testing.assert_close(step.log_prob, torch.tensor([-0.0025]), atol=1e-7, rtol=0)
    full = cps_step(
        _latents(2.0), _latents(1.0), 0.5, 0.25, 1.0 / 3.0, noise=_latents(0.4), log_prob="gaussian"
    )
    torch.testing.assert_close(full.prev_sample, step.prev_sample, atol=0, rtol=0)
    torch.testing.assert_close(full.log_prob, torch.tensor([1.08050301]), atol=1e-5, rtol=0)


def test_cps_noise_level_zero_is_euler() -> None:
    g = torch.Generator().manual_seed(9)
    x, v = torch.randn(2, 4, 3, 3, generator=g), torch.randn(2, 4, 3, 3, generator=g)
    step = cps_step(x, v, 0.7, 0.55, 0.0, generator=g)
    torch.testing.assert_close(step.prev_sample, ode_step(x, v, 0.7, 0.55), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(step.mean, ode_step(x, v, 0.7, 0.55), atol=1e-6, rtol=1e-6)
    assert torch.equal(step.log_prob, torch.zeros(2)) and torch.equal(step.std, torch.zeros(2, 1, 1, 1))


def test_cps_last_step_sigma_next_zero() -> None:
    x = torch.randn(2, 1, 3, 3)
    v = torch.randn(2, 1, 3, 3, requires_grad=True)
    step = cps_step(x, v, 0.1, 0.0, 0.7)
    # std = 0 * sin(.) = 0: the step lands on x0_hat = x - s v, log-prob defined as 0
    torch.testing.assert_close(step.prev_sample, x - 0.1 * v, atol=1e-6, rtol=0)
    assert torch.equal(step.log_prob, torch.zeros(2))
    step.log_prob.sum().backward()
    assert torch.isfinite(v.grad).all()
    # the flow SDE onto sigma 0 is still a proper Gaussian (std_t sqrt(-dt) > 0) and finite
    flow = flow_sde_step(x, v.detach(), 0.1, 0.0, 0.7)
    assert torch.isfinite(flow.log_prob).all() and (flow.std > 0).all()


def test_cps_log_prob_matches_torch_normal_and_grad() -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(3, 2, 4, 4, generator=g)
    v = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    sig, sig_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        y = cps_step(x, v, sig, sig_next, 0.7, generator=g).prev_sample
    step = cps_step(x, v, sig, sig_next, 0.7, prev_sample=y, log_prob="gaussian")
    torch.testing.assert_close(step.log_prob, _normal_log_prob(y, step.mean, step.std), atol=1e-5, rtol=1e-6)

    (grad,) = torch.autograd.grad(step.log_prob.sum(), v)
    # torch.distributions on an independently written CPS mean
    v2 = v.detach().clone().requires_grad_(True)
    s, sn = sig.reshape(3, 1, 1, 1), sig_next.reshape(3, 1, 1, 1)
    std = sn * math.sin(0.7 * math.pi / 2)
    mean = (1 - sn) * (x - s * v2) + torch.sqrt(sn**2 - std**2) * (x + (1 - s) * v2)
    ref = Normal(mean, std.expand_as(mean)).log_prob(y).mean(dim=(1, 2, 3))
    (grad_ref,) = torch.autograd.grad(ref.sum(), v2)
    torch.testing.assert_close(grad, grad_ref, atol=1e-5, rtol=1e-5)


def test_cps_flow_grpo_log_prob_is_the_negative_mse_with_its_gradient() -> None:
    # Flow-GRPO's CPS reduction (sd3_sde_with_logprob.py, sde_type == "cps"): -mean((x - m)^2), written
    # independently here with F.mse_loss on an independently written CPS mean.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 2, 4, 4, generator=g)
    v = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    sig, sig_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        y = cps_step(x, v, sig, sig_next, 0.7, generator=g).prev_sample
    step = cps_step(x, v, sig, sig_next, 0.7, prev_sample=y)
    v2 = v.detach().clone().requires_grad_(True)
    s, sn = sig.reshape(3, 1, 1, 1), sig_next.reshape(3, 1, 1, 1)
    std = sn * math.sin(0.7 * math.pi / 2)
    mean = (1 - sn) * (x - s * v2) + torch.sqrt(sn**2 - std**2) * (x + (1 - s) * v2)
    ref = -torch.nn.functional.mse_loss(mean, y, reduction="none").mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob, ref, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(step.log_prob.sum(), v)
    (grad_ref,) = torch.autograd.grad(ref.sum(), v2)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)
    # A deterministic step (std 0) has log-prob 0 under either reduction.
    last = cps_step(x, v.detach(), 0.1, 0.0, 0.7, prev_sample=y)
    assert torch.equal(last.log_prob, torch.zeros(3))


def test_flow_sde_reports_flow_grpos_std_dev_t_and_the_velocity() -> None:
    # s = 0.5 -> 0.25, a = 1: std_dev_t = sqrt(0.5 / 0.5) = 1 (Flow-GRPO's value, no sqrt(-dt));
    # the transition std is std_dev_t sqrt(0.25) = 0.5
    step = flow_sde_step(_latents(2.0, 0.0), _latents(1.0, 2.0), 0.5, 0.25, 1.0, noise=_latents(0.4, -1.0))
    torch.testing.assert_close(step.std_dev_t, torch.ones(1, 1, 1, 1), atol=1e-7, rtol=0)
    torch.testing.assert_close(step.std, torch.full((1, 1, 1, 1), 0.5), atol=1e-7, rtol=0)
    torch.testing.assert_close(step.velocity, _latents(1.0, 2.0), atol=0, rtol=0)
