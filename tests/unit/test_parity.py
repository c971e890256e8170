"""Flow-GRPO parity: the library's defaults against our own transcription of Flow-GRPO's formulas
(flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, scripts/train_sd3.py, flow_grpo/stat_tracking.py),
float64 on random tensors; the library's own options against the formulas they name."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from jagg_lightning import GRPOConfig, SamplingConfig
from jagg_lightning.method.grpo import StepRecord, group_advantages, step_loss
from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution
from jagg_lightning.training.rollout import sample_generators, sample_trajectories

from toy import AffineLoRAVelocity

DIMS = (1, 2, 3)


def flow_grpo_sigmas(num_steps):
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(num_steps)
    return sched.sigmas.to(torch.float64)


def flow_grpo_step(sigmas, k, z, v, x, noise_level, sde_type):
    """Flow-GRPO's step with log-prob, re-derived: returns (mean, log_prob, std_dev_t)."""
    sigma, sigma_next, sigma_1 = sigmas[k], sigmas[k + 1], sigmas[1]
    dt = sigma_next - sigma
    if sde_type == "sde":
        # the (1 - sigma) denominator takes sigmas[1] at sigma = 1
        std_dev_t = noise_level * torch.sqrt(sigma / (1 - (sigma_1 if sigma == 1 else sigma)))
        mean = z * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std_dev_t * torch.sqrt(-dt)
        log_prob = -((x - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    else:
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        x0, x1 = z - sigma * v, z + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std_dev_t**2)
        log_prob = -((x - mean) ** 2)  # constants dropped
    return mean, log_prob.mean(dim=DIMS), std_dev_t


def flow_grpo_loss(adv, log_prob, old_log_prob, mean, ref_mean, std_dev_t, clip_range, beta, adv_clip=5.0):
    """train_sd3.py's per-step loss: clamp advantages, clipped surrogate (mean over the batch), KL / 2 std_dev_t^2."""
    adv = adv.clamp(-adv_clip, adv_clip)
    ratio = torch.exp(log_prob - old_log_prob)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    kl = ((mean - ref_mean) ** 2).mean(dim=DIMS) / (2 * std_dev_t**2)
    return ratio, policy, kl


def random_case(gen, shape=(4, 4, 3, 3)):
    z, v, dv, dref = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    return z, v, 0.2 * dv, 0.1 * dref


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("k", [0, 3, 8])
def test_log_prob_ratio_kl_loss_equal_flow_grpo(sde_type, k, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    steps, a, beta = 10, 0.8, 0.3
    sigmas = flow_grpo_sigmas(steps)
    torch.testing.assert_close(flow_match_sigmas(steps).double(), sigmas, rtol=0, atol=1e-7)
    times = sigmas  # the same schedule, float64
    z, v_old, dv, dref = random_case(gen)
    dist_old = step_distribution(z, v_old, times[k], times[k + 1], sde_type, a)
    x = sample_step(dist_old, torch.randn(z.shape, generator=gen, dtype=torch.float64))
    mean_old, lp_old, _ = flow_grpo_step(sigmas, k, z, v_old, x, a, sde_type)
    torch.testing.assert_close(dist_old.mean, mean_old, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dist_old.log_prob(x), lp_old, rtol=1e-12, atol=1e-12)

    v_new, v_ref = v_old + dv, v_old + dref
    adv = 3 * torch.randn(4, generator=gen, dtype=torch.float64)  # some beyond the clip at 5
    adv[0] = 7.0
    mean_new, lp_new, std_dev_t = flow_grpo_step(sigmas, k, z, v_new, x, a, sde_type)
    mean_ref, _, _ = flow_grpo_step(sigmas, k, z, v_ref, x, a, sde_type)
    clip_range = 0.5 * float((torch.exp(lp_new - lp_old) - 1).abs().max())  # so that the clip is exercised
    rec = StepRecord(z, x, float(times[k]), float(times[k + 1]), lp_old, adv.clamp(-5, 5), v_ref)
    loss, stats = step_loss(v_new, rec, sde_type, a, clip_range, beta)
    ratio, policy, kl = flow_grpo_loss(adv, lp_new, lp_old, mean_new, mean_ref, std_dev_t, clip_range, beta)
    torch.testing.assert_close(stats.ratio, ratio, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(stats.kl, kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, policy + beta * kl, rtol=1e-12, atol=1e-14)
    assert ((ratio - 1).abs() > clip_range).any() and (stats.clipped > 0).any()


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_named_options_are_the_true_density_and_the_exact_kl(sde_type, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(10).double()
    k, a = 4, 0.7
    z, v, dv, dref = random_case(gen)
    dist = step_distribution(z, v + dv, times[k], times[k + 1], sde_type, a)
    ref = step_distribution(z, v + dref, times[k], times[k + 1], sde_type, a)
    x = torch.randn(z.shape, generator=gen, dtype=torch.float64)
    normal = torch.distributions.Normal(dist.mean, dist.std.expand_as(dist.mean)).log_prob(x).mean(dim=DIMS)
    torch.testing.assert_close(dist.log_prob(x, "gaussian"), normal, rtol=1e-12, atol=1e-12)
    rec = StepRecord(z, x, float(times[k]), float(times[k + 1]), torch.zeros(4, dtype=torch.float64),
                     torch.zeros(4, dtype=torch.float64), v + dref)
    _, stats = step_loss(v + dv, rec, sde_type, a, kl_beta=1.0, kl_convention="exact")
    exact = (torch.distributions.kl_divergence(torch.distributions.Normal(dist.mean, dist.std.expand_as(dist.mean)),
                                               torch.distributions.Normal(ref.mean, ref.std.expand_as(ref.mean)))
             .mean(dim=DIMS))
    torch.testing.assert_close(stats.kl, exact, rtol=1e-10, atol=1e-14)
    _, default = step_loss(v + dv, rec, sde_type, a, kl_beta=1.0)
    dt = float(times[k] - times[k + 1])
    # Flow-GRPO's KL lacks the SDE's -dt (the two coincide for CPS, whose std has no dt)
    torch.testing.assert_close(default.kl, exact * (dt if sde_type == "sde" else 1.0), rtol=1e-10, atol=1e-14)
    if sde_type == "cps":  # the squared-error ratio is the Gaussian one raised to the power 2 s^2
        old = x + 0.01 * torch.randn(z.shape, generator=gen, dtype=torch.float64)
        sq = dist.log_prob(x) - dist.log_prob(old)
        gauss = dist.log_prob(x, "gaussian") - dist.log_prob(old, "gaussian")
        torch.testing.assert_close(sq, gauss * 2 * dist.std**2, rtol=1e-10, atol=1e-14)


def flow_grpo_advantages(rewards, global_std, adv_clip=5.0):
    """PerPromptStatTracker.update: per prompt (r - mean) / (np.std + 1e-4), then train-time clamp."""
    out = np.empty_like(rewards)
    for g in range(rewards.shape[0]):
        std = np.std(rewards) if global_std else np.std(rewards[g])
        out[g] = (rewards[g] - np.mean(rewards[g])) / (std + 1e-4)
    return np.clip(out, -adv_clip, adv_clip)


@pytest.mark.parametrize("global_std", [False, True])
def test_advantages_equal_flow_grpo_stat_tracker(global_std, rng_seed):
    rng = np.random.default_rng(rng_seed)
    rewards = rng.normal(size=(5, 6)) * rng.uniform(0.01, 3, size=(5, 1))
    rewards[1] = 0.3  # a constant group
    rewards[2, 0] = 40.0  # an outlier beyond the advantage clip
    ours = group_advantages(torch.from_numpy(rewards), "global" if global_std else "group", adv_clip=2.5)
    np.testing.assert_allclose(ours.numpy(), flow_grpo_advantages(rewards, global_std, 2.5), rtol=1e-12, atol=1e-12)
    assert (ours[1] == 0).all()
    # DanceGRPO's unbiased std is the named option ddof = 1
    dance = group_advantages(torch.from_numpy(rewards), "group", adv_clip=100, eps=1e-8, ddof=1)
    ref = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-8)
    np.testing.assert_allclose(dance[[0, 2, 3, 4]].numpy(), ref[[0, 2, 3, 4]], rtol=1e-12)


def test_default_update_settings_are_flow_grpo_base_config(rng_seed):
    """config/base.py: sample.global_std True, adv_clip_max 5, clip_range 1e-4, max_grad_norm 1.0, noise 0.7."""
    grpo, sampling = GRPOConfig(), SamplingConfig()
    assert (grpo.clip_range, grpo.max_grad_norm, grpo.kl_beta, sampling.noise_level) == (1e-4, 1.0, 0.0, 0.7)
    rng = np.random.default_rng(rng_seed)
    rewards = rng.normal(size=(4, 6)) * rng.uniform(0.01, 3, size=(4, 1))
    ours = group_advantages(torch.from_numpy(rewards), grpo.adv_std, grpo.adv_eps, grpo.adv_clip, grpo.std_ddof)
    np.testing.assert_allclose(ours.numpy(), flow_grpo_advantages(rewards, True, 5.0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cps_log_prob", ["squared_error", "gaussian"])
@pytest.mark.parametrize("kinds", [["sde"] * 6, ["cps"] * 6, ["ode"] * 6, ["ode", "sde", "sde", "cps", "ode", "cps"]])
def test_no_nan_in_trajectories_for_any_step_kind(kinds, cps_log_prob, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    model = AffineLoRAVelocity((2, 2, 2), generator=gen)
    traj = sample_trajectories(model, None, sample_generators(rng_seed, 0, [0, 1], 2), (2, 2, 2),
                               flow_match_sigmas(6).double(), kinds, 0.8, 3, dtype=torch.float64,
                               cps_log_prob=cps_log_prob)
    for tensor in (traj.latents, traj.velocities, traj.log_probs):
        assert torch.isfinite(tensor).all()
    for k, kind in enumerate(kinds):
        deterministic = kind == "ode" or (kind == "cps" and k == len(kinds) - 1)  # CPS into t = 0: std 0
        assert (traj.log_probs[k] == 0).all() == deterministic, (k, kind)
        if deterministic:
            dt = traj.times[k + 1] - traj.times[k]
            torch.testing.assert_close(traj.latents[k + 1], traj.latents[k] + traj.velocities[k] * dt, rtol=1e-12, atol=1e-12)


def dance_grpo_step(sigmas, i, z, v, x, eta):
    """DanceGRPO's flux_step with its SDE solver, re-derived: (mean, log_prob as it computes it)."""
    sigma, dsigma = sigmas[i], sigmas[i + 1] - sigmas[i]
    x0 = z - sigma * v
    score = -(z - x0 * (1 - sigma)) / sigma**2
    mean = z + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    std = eta * torch.sqrt(sigmas[i] - sigmas[i + 1])
    return mean, (-((x - mean) ** 2) / (2 * std**2)).mean(dim=DIMS)  # its normaliser terms are discarded


@pytest.mark.parametrize("i", [0, 4])
def test_constant_sde_is_dance_grpo_with_the_same_ratio(i, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    eta, steps = 0.3, 8
    base = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    sigmas = 3 * base / (1 + 2 * base)  # DanceGRPO's sd3_time_shift(3, linspace(1, 0, T + 1))
    z, v_old, dv, _ = random_case(gen)
    old = step_distribution(z, v_old, sigmas[i], sigmas[i + 1], "sde_constant", eta)
    x = sample_step(old, torch.randn(z.shape, generator=gen, dtype=torch.float64))
    mean_old, lp_old = dance_grpo_step(sigmas, i, z, v_old, x, eta)
    torch.testing.assert_close(old.mean, mean_old, rtol=1e-12, atol=1e-12)
    assert abs(float(old.std) - eta * float(sigmas[i] - sigmas[i + 1]) ** 0.5) < 1e-14
    rec = StepRecord(z, x, float(sigmas[i]), float(sigmas[i + 1]), old.log_prob(x), torch.ones(4, dtype=torch.float64))
    _, stats = step_loss(v_old + dv, rec, "sde_constant", eta, clip_range=10.0)
    _, lp_new = dance_grpo_step(sigmas, i, z, v_old + dv, x, eta)
    torch.testing.assert_close(stats.ratio, torch.exp(lp_new - lp_old), rtol=1e-10, atol=1e-14)
