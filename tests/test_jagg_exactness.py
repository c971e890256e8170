"""JAGG equals the exact per-step gradient for an affine velocity on the chord (float64)."""

import pytest
import torch

from jagg_lightning.grpo import StepRecord, step_loss
from jagg_lightning.jagg import (
    accumulate_gradients,
    alphas,
    composite_gradients,
    interpolation_residual,
    plan_windows,
    route_windows,
)
from jagg_lightning.sde import flow_match_sigmas, sample_step, step_distribution

from helpers import rel_error
from toy import AffineLoRAVelocity, SineTimeVelocity

NUM_STEPS = 17  # trained steps 0..15


def chord_trajectory(model, windows, gen, batch=3, off_chord=0.0):
    """Latents whose interior window points lie on the t-chord between the anchors (plus an offset)."""
    times = flow_match_sigmas(NUM_STEPS).double()
    shape = (batch, *model.shape)
    latents = torch.randn(NUM_STEPS + 1, *shape, generator=gen, dtype=torch.float64)
    for w in windows:
        a, b = w.anchors
        for k, al in zip(w.steps, alphas(times, w.steps)):
            if k not in (a, b):
                latents[k] = (1 - al) * latents[a] + al * latents[b]
                latents[k] += off_chord * torch.randn(shape, generator=gen, dtype=torch.float64)
    return latents, times


def records_for(model, latents, times, gen, steps):
    """Step records (old log-probs under the current theta) for ``steps``."""
    batch = latents.shape[1]
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    recs, cache = {}, torch.zeros_like(latents[:-1])
    with torch.no_grad():
        for k in steps:
            v = model(latents[k], times[k].expand(batch))
            cache[k] = v
            dist = step_distribution(latents[k], v, times[k], times[k + 1])
            # z_{k+1} here is an SDE sample from z_k (the loss's target), not the chord point
            z_next = sample_step(dist, torch.randn(latents[k].shape, generator=gen, dtype=torch.float64))
            recs[k] = StepRecord(latents[k], z_next, float(times[k]), float(times[k + 1]), dist.log_prob(z_next), adv)
    return recs, cache


def exact_gradient(model, latents, times, loss_fn, steps):
    model.zero_grad()
    for k in steps:
        v = model(latents[k], times[k].expand(latents.shape[1]))
        loss_fn(k, v).backward()
    return [p.grad.clone() for p in model.parameters()]


def jagg_gradient(model, latents, times, loss_fn, windows, cache=None, low_memory=False):
    model.zero_grad()
    recs = accumulate_gradients(model, latents, times, None, loss_fn, windows, cache, low_memory)
    return [p.grad.clone() for p in model.parameters()], recs


def setup(window_size, chained, gen, model_cls=AffineLoRAVelocity, off_chord=0.0, perturb=0.0, clip=1e-4):
    model = model_cls(generator=gen)
    steps = list(range(NUM_STEPS - 1))
    windows = plan_windows(steps, window_size, chained)
    route_windows(windows, [0.0] * len(windows), 1.0, window_size)
    latents, times = chord_trajectory(model, windows, gen, off_chord=off_chord)
    recs, cache = records_for(model, latents, times, gen, steps)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb * torch.randn(p.shape, generator=gen, dtype=p.dtype))

    def loss_fn(k, v):
        loss, _ = step_loss(v, recs[k], clip_range=clip)
        return loss.mean() / len(steps)

    return model, windows, latents, times, loss_fn, steps, cache, recs


@pytest.mark.parametrize("window_size", [3, 4, 6, 8])
@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("perturb", [0.0, 0.5])
def test_jagg_is_exact_for_affine_velocity_on_chord(window_size, chained, perturb, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, cache, recs = setup(window_size, chained, gen, perturb=perturb)
    assert any(w.routed and len(w.steps) >= 3 for w in windows)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    assert sum(float(g.abs().sum()) for g in exact) > 0
    got, _ = jagg_gradient(model, latents, times, loss_fn, windows)
    assert rel_error(got, exact) < 1e-10
    got_lm, _ = jagg_gradient(model, latents, times, loss_fn, windows, low_memory=True)
    assert rel_error(got_lm, exact) < 1e-10
    if perturb:
        # clipping is active somewhere: some sample's ratio left the trust region
        ratios = torch.stack([step_loss(model(latents[k], times[k].expand(3)), recs[k], clip_range=1e-4)[1].ratio for k in steps])
        assert ((ratios - 1).abs() > 1e-4).any()
    else:
        got_cached, _ = jagg_gradient(model, latents, times, loss_fn, windows, cache=cache)
        assert rel_error(got_cached, exact) < 1e-10


def test_off_chord_error_grows_with_offset(rng_seed):
    errors = []
    for offset in (1e-3, 1e-2, 1e-1):
        gen = torch.Generator().manual_seed(rng_seed)  # same model and data, only the offset changes
        model, windows, latents, times, loss_fn, steps, _, _ = setup(4, False, gen, off_chord=offset)
        exact = exact_gradient(model, latents, times, loss_fn, steps)
        got, _ = jagg_gradient(model, latents, times, loss_fn, windows)
        errors.append(rel_error(got, exact))
    assert errors[0] > 1e-8, errors
    assert errors[0] < errors[1] < errors[2], errors


def test_sinusoidal_time_breaks_exactness_on_chord(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = setup(4, False, gen, model_cls=SineTimeVelocity)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    got, _ = jagg_gradient(model, latents, times, loss_fn, windows)
    assert rel_error(got, exact) > 1e-6


def test_jagg_frac_zero_is_exact_for_nonlinear_model(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = setup(4, True, gen, model_cls=SineTimeVelocity, off_chord=0.3)
    route_windows(windows, [0.0] * len(windows), 0.0, 4)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    got, recs = jagg_gradient(model, latents, times, loss_fn, windows)
    assert rel_error(got, exact) < 1e-12
    assert not any(r.routed for r in recs)


def test_composite_gradients_and_alphas(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(10)
    steps = [2, 3, 4, 5]
    al = alphas(times, steps)
    assert al[0] == 0 and al[-1] == 1 and (al.diff() > 0).all()
    g = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in steps]
    g_a, g_b = composite_gradients(g, al)
    torch.testing.assert_close(g_a + g_b, sum(g))
    torch.testing.assert_close(g_b, sum(float(a) * x for a, x in zip(al, g)))


def test_plan_windows_disjoint_chained_and_bad_sizes():
    steps = list(range(9))
    assert [w.steps for w in plan_windows(steps, 4)] == [(0, 1, 2, 3), (4, 5, 6, 7), (8,)]
    assert [w.steps for w in plan_windows(steps, 4, chained=True)] == [(0, 1, 2, 3), (3, 4, 5, 6), (6, 7, 8)]
    assert [w.steps for w in plan_windows(list(range(7)), 4, chained=True)] == [(0, 1, 2, 3), (3, 4, 5, 6)]
    with pytest.raises(ValueError, match="window_size must be >= 2"):
        plan_windows(steps, 1)
    with pytest.raises(ValueError, match="window_size must be <= the number of trained steps"):
        plan_windows(steps, 10)


def test_routing_picks_smallest_residuals_and_keeps_tail_exact():
    windows = plan_windows(list(range(14)), 4)  # 3 full windows + tail of 2
    route_windows(windows, [0.3, 0.1, 0.2, 0.0], 2 / 3, 4)
    assert [w.routed for w in windows] == [False, True, True, False]
    route_windows(windows, [0.3, 0.1, 0.2, 0.0], 1.0, 4, score_limit=0.25)
    assert [w.routed for w in windows] == [False, True, True, False]
    route_windows(windows, [0.3, 0.1, 0.2, 0.0], 0.0, 4)
    assert not any(w.routed for w in windows)
    with pytest.raises(ValueError, match=r"jagg_frac must be in \[0, 1\]"):
        route_windows(windows, [0.0] * 4, 1.5, 4)


def test_interpolation_residual(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(8).double()
    v = torch.randn(9, 2, 4, 3, 3, generator=gen, dtype=torch.float64)
    steps = [1, 2, 3, 4]
    al = alphas(times, steps)
    for k, a in zip(steps[1:-1], al[1:-1]):  # interior exactly on the t-lerp: residual 0
        v[k] = (1 - a) * v[1] + a * v[4]
    assert interpolation_residual(v, times, steps) < 1e-12
    v[2] += 0.1 * torch.randn(v[2].shape, generator=gen, dtype=torch.float64)
    small = interpolation_residual(v, times, steps)
    v[2] += torch.randn(v[2].shape, generator=gen, dtype=torch.float64)
    assert 0 < small < interpolation_residual(v, times, steps)
    assert interpolation_residual(v, times, [5, 6]) == 0.0
