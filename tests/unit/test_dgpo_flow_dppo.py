"""DGPO and Flow-DPPO (``objectives/dgpo.py``, ``objectives/flow_dppo.py``): each loss and its gradient against a
float64 transcription of the released code written here independently (DGPO on the real tiny SD3, whole groups, a
lagging theta_old and its clip; Flow-DPPO per sample, its mask both ways); JAGG exact where the interpolation is (the
affine chord: Flow-DPPO over SDE windows with the mask active, and its mask at the interpolated means equal to the
exact one; DGPO over its noise levels is tests/unit/test_objectives.py's) and not elsewhere; DGPO's micro-batches of whole groups and its group
noise; the config's checks."""

import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, MemoryConfig, ObjectiveConfig, SamplingConfig
from jagg_lightning.method.grpo import StepRecord
from jagg_lightning.method.routing import route_windows
from jagg_lightning.method.sde import flow_match_sigmas, sample_step, step_distribution
from jagg_lightning.objectives import build_objective
from jagg_lightning.objectives.dgpo import dgpo_decay, group_weights
from jagg_lightning.objectives.flow_dppo import dppo_step_loss, mask_agreement
from jagg_lightning.objectives.forward_process import OldPolicy, noise_levels
from jagg_lightning.training.sampler import Sampler
from jagg_lightning.training.update import StepReport

from helpers import build_policy, rel_error, velocities_with
from toy import SineTimeVelocity, exact_gradient, jagg_gradient, setup

F64 = torch.float64
G, B, K = 2, 4, 4  # DGPO: two groups of two samples, four levels


# ---------------------------------------------------------------------------------------------------------- DGPO
def dgpo_transcription(v, v_old, v_ref, x0, eps, adv, groups, beta, clip, kl_beta):
    """The released ``compute_group_dgpo_loss_allreduce`` and its training loop, per sample, in float64."""
    mean = lambda x: x.reshape(x.shape[0], -1).mean(dim=1)  # noqa: E731
    target = eps - x0
    dsm = mean((target - v) ** 2)
    ref_dsm = mean((target - v_ref) ** 2)
    old_dsm = mean((target - v_old) ** 2)
    ratio = torch.exp(-dsm.detach() + old_dsm)
    should_clip = torch.where(adv > 0, ratio > 1.0 + clip, ratio < 1.0 - clip)
    dsm = torch.where(should_clip, dsm.detach(), dsm)
    term = adv * beta * (dsm.detach() - ref_dsm) / G
    sums = torch.zeros(int(groups.max()) + 1, dtype=F64).scatter_add(0, groups, term)
    weight = torch.sigmoid(sums)[groups]
    return weight * adv * dsm + kl_beta * mean((v - v_ref) ** 2), should_clip


@pytest.fixture(scope="module")
def tiny_sd3():
    return build_policy(torch.Generator().manual_seed(0), dtype="float64", resolution=64)


def test_dgpo_loss_and_gradient_equal_the_released_code(tiny_sd3, rng_seed):
    """The update's loss and gradient over K levels (exact passes, two groups in one micro-batch, theta_old lagging so
    the clip acts on some points) equal the float64 transcription's, < 1e-10."""
    gen = torch.Generator().manual_seed(rng_seed % 100_000)
    policy = tiny_sd3
    for name, p in policy.transformer.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    params = list(policy.lora_parameters())
    config = ObjectiveConfig(name="dgpo", dgpo_clip_range=2e-3, kl_beta=0.05, num_levels=K, dgpo_trunc_steps=5)
    sampling = SamplingConfig(num_steps=6, group_size=G, rollout_batch_size=B)
    objective = build_objective(config, sampling, GRPOConfig(train_batch_size=B), JAGGConfig(window_size=2))
    sampler = Sampler(policy, sampling, 0.0)
    updater = objective.updater(policy, sampling, GRPOConfig(train_batch_size=B), JAGGConfig(window_size=2),
                                MemoryConfig(), sampler)
    updater.guard.start_rollout([0, 1], sampler.device)
    cond = sampler.encode(["a red cat", "a blue dog"])  # each prompt's condition for its G samples
    x0 = torch.randn(B, *policy.latent_shape, generator=gen, dtype=F64)
    eps = torch.randn(B, K, *policy.latent_shape, generator=gen, dtype=F64)
    times = noise_levels("uniform", K, sampler.times, 1.0, gen)
    adv = 2.0 * torch.randn(B, generator=gen, dtype=F64)
    old = OldPolicy(params)
    for s in old.shadow:
        s.add_(0.05 * torch.randn(s.shape, generator=gen, dtype=s.dtype))
    old.matches = False
    for p in params:
        p.grad = None
    report = StepReport(cond)
    samples = torch.arange(B)
    records = updater.backward_points(x0, eps, adv, cond, times, B, report, torch.Tensor.backward, samples, old)
    got = [p.grad.clone() for p in params]
    assert sum(r.backwards for r in records) == K
    got_loss = sum(st.policy_loss + objective.kl_beta * st.kl for _, st in report.stats).mean() / K

    zs = [(1 - t) * x0 + t * eps[:, k] for k, t in enumerate(times)]
    with torch.no_grad():
        v_refs = [sampler.reference_velocity(z, t.expand(B), cond) for z, t in zip(zs, times)]
    v_olds = velocities_with(old.shadow, params, sampler.velocity, zs, times, B, cond)
    total, clipped = 0, []
    for k in range(K):
        v = sampler.velocity(zs[k], times[k].expand(B), cond)
        loss, should_clip = dgpo_transcription(v, v_olds[k], v_refs[k], x0, eps[:, k], adv, samples // G,
                                               config.dgpo_beta, config.dgpo_clip_range, 0.05)
        total = total + loss.mean() / K
        clipped.append(should_clip)
    want = torch.autograd.grad(total, params)
    clipped = torch.stack(clipped)
    assert 0 < int(clipped.sum()) < clipped.numel()  # the clip acts on some points, not all
    assert torch.equal(clipped.T.to(F64), torch.stack([st.clipped for _, st in report.stats]).T)
    assert abs(float(got_loss - total.detach())) <= 1e-10 * max(1.0, abs(float(total.detach())))
    assert rel_error(got, want) < 1e-10


def test_dgpo_group_weight_reads_its_own_group_only(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    # margins of 1e-3 keep beta 100's sigmoid off its saturation (there a moved margin changes nothing in float64)
    adv, margin = torch.randn(6, generator=gen, dtype=F64), 1e-3 * torch.randn(6, generator=gen, dtype=F64)
    groups = torch.tensor([3, 3, 3, 7, 7, 7])
    w = group_weights(adv, margin, groups, 100.0, 3)
    assert torch.equal(w[:3], w[:1].expand(3)) and torch.equal(w[3:], w[3:4].expand(3))
    want = torch.sigmoid((adv[:3] * 100.0 * margin[:3] / 3).sum())
    assert abs(float(w[0] - want)) < 1e-14
    moved = margin.clone()
    moved[4] += 1e-3
    changed = group_weights(adv, moved, groups, 100.0, 3)
    assert torch.equal(changed[:3], w[:3]) and not torch.equal(changed[3:], w[3:])


def test_dgpo_updates_hold_whole_groups_and_share_group_noise(tiny_sd3, rng_seed):
    sampling = SamplingConfig(num_steps=6, group_size=3, rollout_batch_size=6)
    grpo = GRPOConfig(train_batch_size=6, micro_batches_per_update=1)
    config = ObjectiveConfig(name="dgpo")
    objective = build_objective(config, sampling, grpo, JAGGConfig(window_size=2))
    updater = objective.updater(tiny_sd3, sampling, grpo, JAGGConfig(window_size=2), MemoryConfig(),
                                Sampler(tiny_sd3, sampling, 0.0))
    updates = updater.epoch_updates(12, torch.Generator().manual_seed(rng_seed))
    rows = [m for update in updates for m in update]
    assert len(updates) == 2 and sorted(torch.cat(rows).tolist()) == list(range(12))
    for m in rows:  # every group in a micro-batch is there whole
        assert set(torch.bincount(m // 3, minlength=4).tolist()) == {0, 3}
    like = torch.zeros(12, 2, 2, dtype=F64)
    eps = updater.noise([5, 9, 2, 4], 3, 0, 4, like)
    assert eps.shape == (12, 4, 2, 2)
    for g in range(4):
        assert all(torch.equal(eps[3 * g], eps[3 * g + i]) for i in (1, 2))
    assert not torch.equal(eps[0], eps[3]) and not torch.equal(eps[0, 0], eps[0, 1])


def test_dgpo_schedule_and_old_policy():
    objective = build_objective(ObjectiveConfig(name="dgpo", dgpo_old_rollout_after=3))
    assert [dgpo_decay(n) for n in (0, 1, 2, 301, 10_000)] == pytest.approx([0.0, 0.0, 0.001, 0.3, 0.3])
    assert [objective.rollout_with_old(s) for s in (0, 3, 4)] == [False, False, True]
    times = flow_match_sigmas(10)
    assert torch.equal(objective.level_schedule(times), times[:6])  # levels among the first trunc_steps + 1 = 5
    assert ObjectiveConfig(name="dgpo").levels_for(10) == 4


# ------------------------------------------------------------------------------------------------------ Flow-DPPO
def dppo_transcription(v, z, z_next, t, t_next, old_log_prob, v_old, adv, threshold, kl_beta, v_ref, a):
    """verl-omni's ``FlowDPPOLoss.compute_loss`` per sample (the SDE step's mean, std and log-prob written out)."""
    dt = t_next - t
    sigma = a * (t / (1 - t)) ** 0.5
    std = sigma * (-dt) ** 0.5

    def mean_of(u):
        return z + (u + sigma**2 / (2 * t) * (z + (1 - t) * u)) * dt

    mean = mean_of(v)
    log_prob = (-((z_next - mean) ** 2) / (2 * std**2) - torch.log(torch.tensor(std, dtype=F64))
                - 0.5 * torch.log(torch.tensor(2 * torch.pi, dtype=F64))).flatten(1).mean(1)
    ratio = torch.exp(log_prob - old_log_prob)
    kl = ((mean.detach() - mean_of(v_old)) ** 2 / (2 * std**2)).flatten(1).mean(1)
    high = kl >= threshold
    drop = (high & (ratio > 1.0) & (adv > 0)) | (high & (ratio < 1.0) & (adv < 0))
    loss = torch.where(~drop, -adv * ratio, torch.zeros((), dtype=F64))
    ref_kl = ((mean - mean_of(v_ref)) ** 2).flatten(1).mean(1) / (2 * sigma**2)
    return loss + kl_beta * ref_kl, drop


def test_dppo_loss_and_gradient_equal_the_released_code(rng_seed):
    """Per sample, float64, with the threshold at the drift's median so the mask drops some samples and keeps others
    (both advantage signs); at theta = theta_old nothing is dropped and the ratio is 1."""
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(10).double().tolist()
    k = int(torch.randint(1, 8, (1,), generator=gen))
    n, shape, a = 32, (32, 2, 3, 3), 0.7
    z, v_old, eps, v_ref = (torch.randn(shape, generator=gen, dtype=F64) for _ in range(4))
    v_new = v_old + 0.3 * torch.randn(shape, generator=gen, dtype=F64) * torch.rand(n, 1, 1, 1, generator=gen,
                                                                                      dtype=F64)
    old = step_distribution(z, v_old, times[k], times[k + 1])
    z_next = sample_step(old, eps)
    adv = torch.randn(n, generator=gen, dtype=F64)
    rec = StepRecord(z, z_next, times[k], times[k + 1], old.log_prob(z_next), adv, v_ref, v_old)
    new = step_distribution(z, v_new, times[k], times[k + 1])
    divergence = (((new.mean - old.mean) ** 2).flatten(1).mean(1) / (2 * new.std.flatten() ** 2)).sort().values
    threshold = float(divergence[n // 2 - 1] + divergence[n // 2]) / 2  # between two: no tie to round either way
    leaf = v_new.clone().requires_grad_(True)
    got, stats = dppo_step_loss(leaf, rec, "sde", a, threshold, kl_beta=0.1, cps_log_prob="gaussian")
    (got_grad,) = torch.autograd.grad(got.sum(), leaf)
    ref_leaf = v_new.clone().requires_grad_(True)
    want, drop = dppo_transcription(ref_leaf, z, z_next, times[k], times[k + 1], rec.old_log_prob, v_old, adv,
                                    threshold, 0.1, v_ref, a)
    (want_grad,) = torch.autograd.grad(want.sum(), ref_leaf)
    assert 0 < int(drop.sum()) < int((((stats.ratio > 1) & (adv > 0)) | ((stats.ratio < 1) & (adv < 0))).sum())
    assert torch.equal(stats.clipped.bool(), drop)
    assert rel_error([got.detach()], [want.detach()]) < 1e-10 and rel_error([got_grad], [want_grad]) < 1e-10
    _, first = dppo_step_loss(v_old, rec, "sde", a, 0.0, cps_log_prob="gaussian")
    assert torch.equal(first.ratio, torch.ones_like(first.ratio)) and not bool(first.clipped.any())


def dppo_setup(window_size, gen, threshold, perturb=0.3, **kw):
    """The toy trajectory, theta moved off theta_old (so ratios leave 1 and the mask acts), the Flow-DPPO step loss."""
    model, windows, latents, times, _, steps, cache, recs = setup(window_size, False, gen, perturb=perturb, **kw)
    for k in steps:
        recs[k].old_velocity = cache[k]

    def record_loss(v, record):
        return dppo_step_loss(v, record, "sde", 0.7, threshold, cps_log_prob="gaussian")

    def loss_fn(k, v):
        return record_loss(v, recs[k])[0].mean() / len(steps)

    return model, windows, latents, times, loss_fn, steps, recs, cache, record_loss


@pytest.mark.parametrize("window_size, frac, model", [(4, 1.0, "affine"), (5, 1.0, "affine"), (4, 0.0, "sine"),
                                                      (2, 1.0, "sine")])
def test_jagg_with_dppo_equals_exact_and_its_mask_too(window_size, frac, model, rng_seed):
    """The mask is a constant in theta and L_k a function of v_k alone, so JAGG folds its g_k unchanged: on the affine
    chord a routed window's gradient is exact (< 1e-10, with the mask dropping some (step, sample) pairs), and the mask
    at the interpolated means agrees with the exact per-step mask everywhere; at jagg_frac 0 or W = 2 the engine is
    exact on any model."""
    gen = torch.Generator().manual_seed(rng_seed)
    kw = {} if model == "affine" else dict(model_cls=SineTimeVelocity, off_chord=0.3)
    model_, windows, latents, times, loss_fn, steps, recs, cache, record_loss = dppo_setup(window_size, gen, 1e-4, **kw)
    route_windows(windows, [0.0] * len(windows), frac, window_size)
    exact = exact_gradient(model_, latents, times, loss_fn, steps)
    got, _ = jagg_gradient(model_, latents, times, loss_fn, windows)
    with torch.no_grad():
        dropped = [record_loss(model_(latents[k], times[k].expand(latents.shape[1])), recs[k])[1].clipped
                   for k in steps]
    assert 0 < float(torch.stack(dropped).mean()) < 1
    assert rel_error(got, exact) < 1e-10
    agreement = mask_agreement(model_, latents, times, None, recs.__getitem__, windows, record_loss)
    if model == "affine":
        assert agreement == 1.0
    else:
        assert agreement is None  # no routed window of >= 3 steps


def test_dppo_mask_at_interpolated_means_can_disagree_off_the_chord(rng_seed):
    """Off the chord with a sine time embedding the interpolated mean is not the step's: the agreement measures it
    (theta a little off theta_old, ratios near 1: some pair's mask flips)."""
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, recs, cache, record_loss = dppo_setup(
        8, gen, 0.0, perturb=0.01, model_cls=SineTimeVelocity, off_chord=1.0)
    route_windows(windows, [0.0] * len(windows), 1.0, 8)
    agreement = mask_agreement(model, latents, times, None, recs.__getitem__, windows, record_loss)
    assert agreement is not None and 0.0 <= agreement < 1.0


def test_dppo_jagg_first_update_from_the_cache_equals_exact(rng_seed):
    """The fused / first update: theta = theta_old, the interiors' g_k from the rollout's recorded velocities (no
    forward): the same gradient as the exact per-step one on the affine chord, nothing dropped (ratio 1)."""
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, _, steps, cache, recs = setup(4, False, gen)
    for k in steps:
        recs[k].old_velocity = cache[k]

    def loss_fn(k, v):
        return dppo_step_loss(v, recs[k], "sde", 0.7, 0.0, cps_log_prob="gaussian")[0].mean() / len(steps)

    exact = exact_gradient(model, latents, times, loss_fn, steps)
    got, records = jagg_gradient(model, latents, times, loss_fn, windows, cache=cache)
    assert sum(r.cached_steps for r in records) > 0 and sum(r.nograd_forwards for r in records) == 0
    assert rel_error(got, exact) < 1e-10


# ---------------------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("field, value, words", [
    ("dgpo_beta", 0.0, "objective.dgpo_beta"),
    ("dgpo_clip_range", -1.0, "objective.dgpo_clip_range"),
    ("dgpo_trunc_steps", -1, "objective.dgpo_trunc_steps"),
    ("dgpo_old_rollout_after", 1.5, "objective.dgpo_old_rollout_after"),
    ("dgpo_group_noise", "yes", "objective.dgpo_group_noise"),
    ("dppo_threshold", -1e-5, "objective.dppo_threshold"),
])
def test_bad_fields_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        ObjectiveConfig(**{"name": "dgpo", field: value})


def test_checks_across_sections():
    sampling = SamplingConfig(num_steps=6, group_size=4)
    with pytest.raises(ValueError, match=r"grpo\.train_batch_size must be a multiple of sampling\.group_size=4"):
        build_objective(ObjectiveConfig(name="dgpo"), sampling, GRPOConfig(train_batch_size=6), None)
    with pytest.raises(ValueError, match=r"objective\.dgpo_trunc_steps must be < sampling\.num_steps=6"):
        build_objective(ObjectiveConfig(name="dgpo", dgpo_trunc_steps=6), sampling, GRPOConfig(train_batch_size=8),
                        None)
    with pytest.raises(ValueError, match=r"objective\.num_levels must be <= objective\.dgpo_trunc_steps \+ 1 = 3"):
        build_objective(ObjectiveConfig(name="dgpo", dgpo_trunc_steps=2, num_levels=4), sampling,
                        GRPOConfig(train_batch_size=8), None)
    with pytest.raises(ValueError, match=r"grpo\.ratio_norm must be false with objective\.name 'flow_dppo'"):
        build_objective(ObjectiveConfig(name="flow_dppo"), SamplingConfig(), GRPOConfig(ratio_norm=True), None)
    with pytest.raises(ValueError, match=r"sampling\.cps_log_prob must be 'gaussian' with objective\.name 'flow_dppo'"):
        build_objective(ObjectiveConfig(name="flow_dppo"), SamplingConfig(step_kind="cps", cps_log_prob="squared_error"),
                        GRPOConfig(), None)
