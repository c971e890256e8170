"""JAGG equals the exact per-step gradient for an affine velocity on the chord (float64)."""

import pytest
import torch

from jagg_lightning.method.grpo import step_loss
from jagg_lightning.method.jagg import alphas, interpolation_terms, plan_windows, weighted_sum
from jagg_lightning.method.routing import interpolation_residual, route_windows
from jagg_lightning.method.sde import flow_match_sigmas

from helpers import rel_error
from toy import SineTimeVelocity, exact_gradient, jagg_gradient, setup

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
    terms = interpolation_terms(al)  # the paper's fold weights: 1 - alpha into G_a, alpha into G_b
    g_a, g_b = weighted_sum(g, terms.to_a), weighted_sum(g, terms.to_b)
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
