import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution


@pytest.mark.parametrize("steps,shift", [(10, 3.0), (40, 3.0), (7, 1.0), (16, 5.0)])
def test_schedule_matches_diffusers(steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    ours = flow_match_sigmas(steps, shift)
    assert ours.shape == sched.sigmas.shape
    torch.testing.assert_close(ours, sched.sigmas, rtol=0, atol=1e-6)
    assert ours[0] == 1.0 and ours[-1] == 0.0


@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("k", [0, 3])
def test_log_prob_equals_normal_log_prob(kind, k, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(8, 3.0)
    z, v, x = (torch.randn(3, 4, 5, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    dist = step_distribution(z, v, times[k], times[k + 1], kind, 0.7)
    expected = torch.distributions.Normal(dist.mean, dist.std.expand_as(dist.mean)).log_prob(x).mean(dim=(1, 2, 3))
    torch.testing.assert_close(dist.log_prob(x, "gaussian"), expected, rtol=1e-12, atol=1e-12)
    if kind == "sde":  # the SDE's default is the Gaussian density too (Flow-GRPO)
        torch.testing.assert_close(dist.log_prob(x), expected, rtol=1e-12, atol=1e-12)
    else:  # CPS default: Flow-GRPO's -mean((x - mu)^2)
        torch.testing.assert_close(dist.log_prob(x), -((x - dist.mean) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=1e-12)


def test_sde_mean_matches_design_formula_and_t1_rule(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(6, 3.0)
    z, v = (torch.randn(2, 4, 3, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    a = 0.7
    for k in range(5):
        t, tn = float(times[k]), float(times[k + 1])
        dt = tn - t
        sigma = a * math.sqrt(t / (1 - (tn if t == 1.0 else t)))
        mu = z + (v + sigma**2 / (2 * t) * (z + (1 - t) * v)) * dt
        dist = step_distribution(z, v, times[k], times[k + 1], "sde", a)
        torch.testing.assert_close(dist.mean, mu, rtol=1e-6, atol=1e-6)
        assert abs(float(dist.std) - sigma * math.sqrt(-dt)) < 1e-6


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_sampled_steps_match_mean_and_variance(kind, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(10, 3.0)
    z, v = torch.randn(1, 4, 2, 2, generator=gen), torch.randn(1, 4, 2, 2, generator=gen)
    dist = step_distribution(z, v, times[2], times[3], kind, 0.9)
    n = 40000
    samples = sample_step(step_distribution(z.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), times[2], times[3], kind, 0.9),
                          torch.randn(n, 4, 2, 2, generator=gen))
    std = float(dist.std)
    # 5 standard errors of the mean / of the variance estimate
    assert (samples.mean(0) - dist.mean[0]).abs().max() < 5 * std / math.sqrt(n)
    assert (samples.var(0) / std**2 - 1).abs().max() < 5 * math.sqrt(2 / n)


def test_noise_level_zero_is_euler(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(5, 3.0)
    z, v = torch.randn(2, 4, 3, 3, generator=gen), torch.randn(2, 4, 3, 3, generator=gen)
    for k in range(1, 4):
        euler = z + v * (times[k + 1] - times[k])
        for kind in ("sde", "cps", "ode"):
            dist = step_distribution(z, v, times[k], times[k + 1], kind, 0.0 if kind != "ode" else 0.7)
            torch.testing.assert_close(dist.mean, euler, rtol=1e-5, atol=1e-5)
            assert float(dist.std.max()) == 0.0


def test_half_precision_inputs_compute_in_float32(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    z, v = torch.randn(2, 4, 3, 3, generator=gen), torch.randn(2, 4, 3, 3, generator=gen)
    dist = step_distribution(z.bfloat16(), v.bfloat16(), 0.6, 0.5)
    assert dist.mean.dtype == torch.float32
    ref = step_distribution(z.bfloat16().float(), v.bfloat16().float(), 0.6, 0.5)
    torch.testing.assert_close(dist.mean, ref.mean)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="step kind"):
        step_distribution(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, "euler")
