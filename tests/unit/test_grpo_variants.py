"""GRPO-Guard (RatioNorm + reweighting) and Flash-GRPO (temporal gradient rectification, one trained step) against
float64 transcriptions of the published formulas, through the JAGG engine, and their config checks."""

import math

import pytest
import torch

from jagg_lightning.config import GRPOConfig, JAGGConfig, SamplingConfig, check_sections
from jagg_lightning.method.grpo import StepRecord, gradient_scale, guarded_log_ratio, rectification_weights, step_loss
from jagg_lightning.method.routing import route_windows
from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution
from jagg_lightning.training.rollout import group_steps, plan_rollout, sample_trajectories

from helpers import rel_error
from toy import SineTimeVelocity, exact_gradient, jagg_gradient, setup

F64 = torch.float64


def flash_c(t: float, t_next: float, a: float) -> float:
    """Transcription of Flash-GRPO's rectified factor (the authors' train_wanx2_1_flash.py comment and
    sde_step_with_logprob, which returns its inverse): sqrt(-dt) / std_dev_t + std_dev_t sqrt(-dt) (1 - sigma) /
    (2 sigma), std_dev_t here Flow-GRPO's a sqrt(t / (1 - t)) with t_next in the denominator at t = 1."""
    dt = t_next - t
    std_dev_t = a * math.sqrt(t / (1 - (t_next if t >= 1 else t)))
    return math.sqrt(-dt) / std_dev_t + std_dev_t * math.sqrt(-dt) * (1 - t) / (2 * t)


def test_gradient_scale_is_flash_grpos_factor_and_the_log_prob_gradient(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    num_steps = int(torch.randint(6, 30, (1,), generator=gen))
    a = float(0.3 + torch.rand(1, generator=gen))
    times = flow_match_sigmas(num_steps, shift=float(1 + 3 * torch.rand(1, generator=gen))).double().tolist()
    for k in range(num_steps - 1):
        assert abs(gradient_scale("sde", times[k], times[k + 1], a) / flash_c(times[k], times[k + 1], a) - 1) < 1e-10
    # the definition, for every stochastic kind and log-prob convention: d log pi / dv = -c eps / n at theta_old
    shape, k = (3, 2, 4, 4), int(torch.randint(0, num_steps - 1, (1,), generator=gen))
    z, v, eps = (torch.randn(shape, generator=gen, dtype=F64) for _ in range(3))
    for kind, convention in (("sde", "gaussian"), ("sde_constant", "gaussian"), ("cps", "gaussian"),
                             ("cps", "squared_error")):
        dist = step_distribution(z, v, times[k], times[k + 1], kind, a)
        z_next = sample_step(dist, eps)
        leaf = v.clone().requires_grad_(True)
        log_prob = step_distribution(z, leaf, times[k], times[k + 1], kind, a).log_prob(z_next, convention)
        (grad,) = torch.autograd.grad(log_prob.sum(), leaf)
        c = gradient_scale(kind, times[k], times[k + 1], a, convention)
        assert rel_error([grad * eps[0].numel()], [-c * eps]) < 1e-10, (kind, convention)


def test_rectification_weights_average_one_and_equalise_the_gradient_scale(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(20).double().tolist()
    candidates = list(range(10))  # the authors' script: the first 10 of 20 steps
    a = float(0.5 + torch.rand(1, generator=gen))
    w = rectification_weights(times, candidates, candidates, "sde", a)
    assert abs(sum(w.values()) / len(w) - 1) < 1e-12
    scaled = [w[k] * flash_c(times[k], times[k + 1], a) for k in candidates]  # weight x gradient scale: one constant
    assert max(scaled) / min(scaled) - 1 < 1e-10
    assert w[0] > 1 > w[9]  # the high-noise steps' log-prob gradients are the small ones
    # the weight multiplies the policy term only (KL untouched)
    shape = (4, 2, 3, 3)
    z, v, eps, ref = (torch.randn(shape, generator=gen, dtype=F64) for _ in range(4))
    dist = step_distribution(z, v, times[3], times[4])
    z_next = sample_step(dist, eps)
    adv = torch.randn(4, generator=gen, dtype=F64)
    rec = StepRecord(z, z_next, times[3], times[4], dist.log_prob(z_next) - 0.01, adv, ref)
    plain, st = step_loss(v, rec, clip_range=0.2, kl_beta=0.3)
    rec.policy_weight = w[3]
    weighted, st_w = step_loss(v, rec, clip_range=0.2, kl_beta=0.3)
    assert rel_error([weighted], [w[3] * st.policy_loss + 0.3 * st.kl]) < 1e-12
    assert rel_error([weighted - plain], [(w[3] - 1) * st.policy_loss]) < 1e-12


def guard_loss(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, adv, clip, reweight):
    """Transcription of GRPO-Guard as verl-omni documents its GRPOGuardLoss (Flow-Factory's GRPOGuardTrainer makes the
    same rho): b_t = ||mu_theta - mu_old||^2_mean / (2 (sqrt(-dt) sigma_t)^2),
    rho_t = exp((log p_theta - log p_old + b_t) sqrt(-dt) sigma_t), L_t = 1 / (sqrt(-dt))^2 max(-A rho, -A clip(rho))."""
    b = (mean - old_mean).flatten(1).pow(2).mean(dim=1) / (2 * (sqrt_dt * std_dev_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + b) * (sqrt_dt * std_dev_t))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip))
    return loss / sqrt_dt**2 if reweight else loss


@pytest.mark.parametrize("kind, reweight", [("sde", True), ("sde", False), ("sde_constant", True)])
def test_guard_loss_and_gradient_equal_the_transcription_per_sample(kind, reweight, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(10).double().tolist()
    k = int(torch.randint(0, 8, (1,), generator=gen))
    shape, a, clip = (5, 2, 3, 3), 0.7, 0.05
    z, v_old, eps = (torch.randn(shape, generator=gen, dtype=F64) for _ in range(3))
    v_new = v_old + 0.3 * torch.randn(shape, generator=gen, dtype=F64)
    old = step_distribution(z, v_old, times[k], times[k + 1], kind, a)
    z_next = sample_step(old, eps)
    adv = torch.randn(5, generator=gen, dtype=F64)
    rec = StepRecord(z, z_next, times[k], times[k + 1], old.log_prob(z_next), adv, old_velocity=v_old)
    leaf = v_new.clone().requires_grad_(True)
    got, stats = step_loss(leaf, rec, kind, a, clip, ratio_norm=True, ratio_reweight=reweight)
    (got_grad,) = torch.autograd.grad(got.sum(), leaf)
    ref_leaf = v_new.clone().requires_grad_(True)
    new = step_distribution(z, ref_leaf, times[k], times[k + 1], kind, a)
    sqrt_dt = math.sqrt(times[k] - times[k + 1])
    want = guard_loss(new.log_prob(z_next), rec.old_log_prob, new.mean, old.mean, float(old.sigma), sqrt_dt, adv, clip,
                      reweight)
    (want_grad,) = torch.autograd.grad(want.sum(), ref_leaf)
    assert rel_error([got.detach()], [want.detach()]) < 1e-10 and rel_error([got_grad], [want_grad]) < 1e-10
    # the derivation in grpo.py: the normalised log-ratio is mean(eps (mu_theta - mu_old)) exactly
    delta = (new.mean - old.mean).detach()
    assert rel_error([torch.log(stats.ratio)], [(eps * delta).flatten(1).mean(1)]) < 1e-10
    # per sample: b is each sample's own; another sample's drift leaves a sample's ratio untouched
    moved = new.mean.detach().clone()
    moved[1:] += 1.0
    assert guarded_log_ratio(stats.log_ratio, moved, old.mean, old.std)[0] == \
        guarded_log_ratio(stats.log_ratio, new.mean.detach(), old.mean, old.std)[0]
    # at theta = theta_old the normalised ratio is exactly 1 (the first update)
    _, first = step_loss(v_old, rec, kind, a, clip, ratio_norm=True, ratio_reweight=reweight)
    assert torch.equal(first.ratio, torch.ones_like(first.ratio))


def guard_setup(window_size, gen, **kw):
    model, windows, latents, times, _, steps, cache, recs = setup(window_size, False, gen, perturb=0.3, **kw)
    for k in steps:
        recs[k].old_velocity = cache[k]  # the rollout's velocity, before the perturbation

    def loss_fn(k, v):
        return step_loss(v, recs[k], clip_range=0.2, ratio_norm=True, ratio_reweight=True)[0].mean() / len(steps)

    def plain_fn(k, v):
        return step_loss(v, recs[k], clip_range=0.2)[0].mean() / len(steps)

    return model, windows, latents, times, loss_fn, steps, plain_fn


@pytest.mark.parametrize("window_size, frac, model", [(4, 1.0, "affine"), (4, 0.0, "sine"), (2, 1.0, "sine")])
def test_jagg_with_guard_equals_exact_with_guard(window_size, frac, model, rng_seed):
    """Guard changes L_k as a function of v_k only, so JAGG folds its g_k as any other: on the affine chord a routed
    window is exact; at jagg_frac 0 or W = 2 the engine is exact on any model (float64)."""
    gen = torch.Generator().manual_seed(rng_seed)
    kw = {} if model == "affine" else dict(model_cls=SineTimeVelocity, off_chord=0.3)
    model_, windows, latents, times, loss_fn, steps, plain_fn = guard_setup(window_size, gen, **kw)
    route_windows(windows, [0.0] * len(windows), frac, window_size)
    exact = exact_gradient(model_, latents, times, loss_fn, steps)
    got, _ = jagg_gradient(model_, latents, times, loss_fn, windows)
    assert rel_error(exact_gradient(model_, latents, times, plain_fn, steps), exact) > 1e-2  # Guard changes it
    assert rel_error(got, exact) < 1e-10


def test_variant_fields_and_cross_checks():
    with pytest.raises(ValueError, match=r"grpo\.ratio_norm must be true or false"):
        GRPOConfig(ratio_norm="yes")
    with pytest.raises(ValueError, match=r"grpo\.temporal_rectification must be true or false"):
        GRPOConfig(temporal_rectification=1)
    cps = SamplingConfig(num_steps=6, step_kind="cps", trained_steps=4)
    with pytest.raises(ValueError, match=r"grpo\.ratio_norm must be false with sampling\.step_kind 'cps'"):
        check_sections(cps, GRPOConfig(ratio_norm=True), JAGGConfig(window_size=2))
    check_sections(cps, GRPOConfig(ratio_reweight=True), JAGGConfig(window_size=2))  # 1 / (-dt): any step kind
    check_sections(SamplingConfig(num_steps=6, step_kind="cps", trained_steps=4, cps_log_prob="gaussian"),
                   GRPOConfig(ratio_norm=True, ratio_reweight=True), JAGGConfig(window_size=2))


def test_one_trained_step_is_its_own_exact_window():
    """Flash-GRPO's one SDE step per rollout: any jagg.window_size is accepted and the step is one exact window."""
    sampling = SamplingConfig(num_steps=10, sde_window_size=1, sde_window_range=[0, 5])
    jagg = JAGGConfig(window_size=4, jagg_frac=1.0)
    check_sections(sampling, GRPOConfig(temporal_rectification=True), jagg)
    starts = set()
    for step in range(12):
        plan = plan_rollout(sampling, jagg, step)
        assert len(plan.windows) == 1 and len(plan.trained_steps) == 1 and plan.stochastic_steps == plan.trained_steps
        assert plan.step_kinds.count("sde") == 1 and 0 <= plan.trained_steps[0] < 5
        starts.add(plan.trained_steps[0])
    assert len(starts) > 1
    with pytest.raises(ValueError, match=r"jagg\.window_size must be <= sampling\.sde_window_size \(2\)"):
        check_sections(SamplingConfig(num_steps=10, sde_window_size=2), GRPOConfig(), jagg)


def test_group_draws_are_iso_temporal_and_layout_free(rng_seed):
    """Flash-GRPO's per-group draw: one step per prompt, from (seed, step, prompt index) alone."""
    sampling = SamplingConfig(num_steps=10, sde_window_size=1, sde_window_range=[2, 7], sde_window_draw="group",
                              seed=rng_seed % 1000 + 1)
    prompts = list(range(40))
    steps = group_steps(sampling, 3, prompts)
    assert all(2 <= k < 7 for k in steps) and len(set(steps)) > 1
    assert group_steps(sampling, 3, prompts[20:] + prompts[:20]) == steps[20:] + steps[:20]  # any split, any order
    assert group_steps(sampling, 4, prompts) != steps  # a fresh draw per rollout
    plan = plan_rollout(sampling, JAGGConfig(window_size=2, jagg_frac=0.0), 3)
    assert plan.step_kinds == ["ode"] * 10 and plan.trained_steps == [2, 3, 4, 5, 6] and plan.steps_per_sample == 1
    with pytest.raises(ValueError, match=r"sampling\.sde_window_draw must be 'rollout' unless"):
        SamplingConfig(num_steps=10, sde_window_size=2, sde_window_draw="group")
    with pytest.raises(ValueError, match=r"jagg\.fused_rollout must be false with sampling\.sde_window_draw 'group'"):
        check_sections(sampling, GRPOConfig(adv_std="group"), JAGGConfig(window_size=2, fused_rollout=True))
    with pytest.raises(ValueError, match=r"grpo\.kl_beta must be 0 with sampling\.sde_window_draw 'group'"):
        check_sections(sampling, GRPOConfig(kl_beta=0.01), JAGGConfig(window_size=2))


def test_rollout_row_steps_equal_each_rows_own_rollout(rng_seed):
    """A row whose step k is its own SDE step gets the trajectory (float64) it would get from a rollout with the SDE
    at k for every row: the rows' steps are computed on those rows alone, element-wise."""
    gen = torch.Generator().manual_seed(rng_seed)
    weight = torch.randn(8, 8, generator=gen, dtype=F64) / 3

    def velocity(z, t, cond):  # row-independent, non-linear in (z, t)
        return torch.tanh(z.flatten(1) @ weight.T).view_as(z) * (1 + t.view(-1, 1, 1, 1)) + cond

    times = flow_match_sigmas(8).double()
    n, shape = 6, (2, 2, 2)
    cond = torch.randn(n, *shape, generator=gen, dtype=F64)
    seeds = torch.randint(0, 2**31, (n,), generator=gen).tolist()
    row_steps = [int(k) for k in torch.randint(0, 5, (n,), generator=gen)]

    def gens():
        return [torch.Generator().manual_seed(s) for s in seeds]

    mixed = sample_trajectories(velocity, cond, gens(), shape, times, ["ode"] * 8, 0.7, 4, dtype=F64,
                                row_steps=row_steps)
    for i, k in enumerate(row_steps):
        own = sample_trajectories(velocity, cond, gens(), shape, times, ["sde" if j == k else "ode" for j in range(8)],
                                  0.7, 4, dtype=F64)
        assert rel_error([mixed.latents[:, i]], [own.latents[:, i]]) < 1e-12
        assert rel_error([mixed.log_probs[:, i]], [own.log_probs[:, i]]) < 1e-12
        assert (mixed.log_probs[:, i] != 0).tolist() == [j == k for j in range(8)]
