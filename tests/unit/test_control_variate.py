"""The unbiased window estimator (``jagg.estimator: control_variate``): a routed window drawn with probability p
also gets its exact gradient and the estimate becomes JAGG + (B/p)(exact - JAGG), B ~ Bernoulli(p) (float64)."""

import math

import pytest
import torch

from jagg_lightning.config import JAGGConfig
from jagg_lightning.method.estimators import ControlVariateEstimator, draw_corrections
from jagg_lightning.method.jagg import Window, flat_gradient
from jagg_lightning.method.routing import route_windows

from helpers import rel_error
from test_fused import build, fit_once
from toy import exact_gradient, jagg_gradient, setup
from toy import SineTimeVelocity


CONTROL_VARIATE = ControlVariateEstimator().interior_terms  # its fold weights: of the drawn c of each window


def draw(windows, gen, p):
    draw_corrections(windows, p, gen)
    return [w.correction for w in windows]


@pytest.mark.parametrize("window_size, chained", [(3, False), (4, True), (8, True)])
def test_exact_on_the_affine_chord_for_any_draw(window_size, chained, rng_seed):
    """On §4's affine chord JAGG is exact, so JAGG + c (exact - JAGG) is too, whichever windows are drawn; the
    passes are counted: a drawn window of W steps makes W - 2 interior passes plus its anchors'."""
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, cache, _ = setup(window_size, chained, gen)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    seen = set()
    # two random p, then every window drawn (p = 1) and none (None: the paper's estimate), so both cases always run
    for p in [0.3 + 0.5 * float(torch.rand((), generator=gen, dtype=torch.float64)) for _ in range(2)] + [1.0, None]:
        corrections = draw(windows, gen, p)
        seen.update(c > 0 for c in corrections)
        for kwargs in (dict(), dict(cache=cache), dict(low_memory=True)):
            got, records = jagg_gradient(model, latents, times, loss_fn, windows, interior_terms=CONTROL_VARIATE,
                                         **kwargs)
            assert rel_error(got, exact) < 1e-10
            for i, (w, r) in enumerate(zip(windows, records)):
                assert r.correction == w.correction
                if not w.routed:
                    continue
                anchors = 2 if i == 0 or not chained else 1  # a chained window's first anchor was its neighbour's
                anchor_passes = 1 if anchors == 2 and "low_memory" not in kwargs else anchors
                if w.correction:  # interiors from passes of their own: no cache, no no-grad forward
                    assert r.cached_steps == r.nograd_forwards == 0
                    assert r.backwards == len(w.interior) + anchor_passes
                else:
                    assert r.cached_steps + r.nograd_forwards == len(w.interior)
                    assert r.backwards == anchor_passes
    assert seen == {True, False}


def test_p_one_is_the_exact_gradient_on_a_nonlinear_model(rng_seed):
    """p = 1 draws every routed window: c = 1, the anchors keep only their own g (no fold) -- the exact
    gradient, where the paper's estimate is visibly off."""
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = setup(4, True, gen, model_cls=SineTimeVelocity,
                                                                 off_chord=0.3)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    paper, _ = jagg_gradient(model, latents, times, loss_fn, windows, interior_terms=CONTROL_VARIATE)
    assert rel_error(paper, exact) > 1e-3
    assert draw(windows, gen, 1.0) == [1.0] * len(windows)
    got, records = jagg_gradient(model, latents, times, loss_fn, windows, interior_terms=CONTROL_VARIATE)
    assert rel_error(got, exact) < 1e-12
    # every step gets a pass, once (chained anchors are shared); only the first window's two anchors share one
    assert sum(r.backwards for r in records) == len(steps) - 1


def test_jagg_frac_zero_is_untouched(rng_seed):
    """Nothing routed: nothing drawn, the exact per-step passes as without the estimator."""
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = setup(4, False, gen, model_cls=SineTimeVelocity,
                                                                 off_chord=0.3)
    route_windows(windows, [0.0] * len(windows), 0.0, 4)
    assert draw(windows, gen, 0.5) == [0.0] * len(windows)
    exact = exact_gradient(model, latents, times, loss_fn, steps)
    got, records = jagg_gradient(model, latents, times, loss_fn, windows, interior_terms=CONTROL_VARIATE)
    assert rel_error(got, exact) < 1e-12
    assert [r.backwards for r in records] == [len(w.steps) for w in windows]


def binomial_tail(n: int, p: float, t: float) -> float:
    """P(|S - n p| > t), S ~ Binomial(n, p), exactly (summed in log space)."""
    log = lambda j: (math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * math.log(p)
                     + (n - j) * math.log1p(-p))
    return sum(math.exp(log(j)) for j in range(n + 1) if abs(j - n * p) > t)


@pytest.mark.slow
def test_mean_over_draws_is_the_exact_gradient(rng_seed):
    """Unbiased: the mean of N estimates equals the exact gradient on a non-affine model, within a bound from
    the variance.

    Per window w, d_w = exact_w - JAGG_w (one window's exact minus its paper's gradient, taken apart); if the
    estimator is what it claims, estimate = JAGG + sum_w c_w d_w and the mean of N draws is
    exact + sum_w Z_w d_w with Z_w = S_w / (N p) - 1, S_w ~ Binomial(N, p) independent. Each |S_w - N p| <= t
    = 6.5 sd(S) except with probability binomial_tail (computed exactly), so
    ||mean - exact||^2 = Z^T G Z <= lambda_max(G) * n_windows * (t / (N p))^2 (G the Gram matrix of the d_w).
    False-failure rate: the union over the windows, asserted < 1e-8 below (about 4e-10 at the p drawn here).
    The bound is tight enough to fail the paper's estimator (asserted), so a biased implementation fails too.
    """
    gen = torch.Generator().manual_seed(rng_seed)
    model, windows, latents, times, loss_fn, steps, _, _ = setup(8, True, gen, model_cls=SineTimeVelocity,
                                                                 off_chord=0.3)
    assert [len(w.steps) for w in windows] == [8, 8, 2]  # two routed windows sharing anchor 7, an exact tail
    params = list(model.parameters())

    def grad(ws):
        return flat_gradient(model, params, latents, times, None, loss_fn, ws, interior_terms=CONTROL_VARIATE)

    exact, paper = grad([Window(w.steps) for w in windows]), grad(windows)
    routed = [i for i, w in enumerate(windows) if w.routed and len(w.steps) > 2]
    d = torch.stack([grad([Window(windows[i].steps)]) - grad([Window(windows[i].steps, routed=True)]) for i in routed])
    assert float((paper + d.sum(0) - exact).norm() / exact.norm()) < 1e-10  # the d_w split exact - JAGG

    p = 0.3 + 0.4 * float(torch.rand((), generator=gen, dtype=torch.float64))
    n = 400
    t = 6.5 * math.sqrt(n * p * (1 - p))
    false_failure = len(routed) * binomial_tail(n, p, t)
    assert false_failure < 1e-8
    draws = torch.Generator().manual_seed(rng_seed + 1)
    total, counts, worst = torch.zeros_like(exact), torch.zeros(len(routed), dtype=torch.float64), 0.0
    for _ in range(n):
        c = torch.tensor(draw(windows, draws, p), dtype=torch.float64)[routed]
        estimate = grad(windows)
        worst = max(worst, float((estimate - paper - c @ d).norm() / exact.norm()))
        total += estimate
        counts += c > 0
    mean = total / n
    bound = math.sqrt(float(torch.linalg.eigvalsh(d @ d.T)[-1]) * len(routed)) * t / (n * p)
    assert float((mean - exact).norm()) <= bound * (1 + 1e-9) + 1e-12 * float(exact.norm())
    assert float((paper - exact).norm()) > bound  # the test can tell the biased estimator apart
    assert worst < 1e-10  # each draw is JAGG + sum_w c_w d_w
    assert ((counts - n * p).abs() <= t).all()


@pytest.mark.parametrize("fused, options", [(False, {}), (True, {}), (True, dict(fused_interior_graphs=False))])
def test_module_with_p_one_makes_the_exact_update(fused, options, rng_seed):
    """Through the module (tiny SD3, float64, one SGD step): every window routed and drawn with p = 1 gives
    exact GRPO's update, unfused and fused (interiors from kept graphs or re-run)."""
    seed = rng_seed % 10_000
    exact, _ = fit_once(build(seed, fused, jagg_frac=0.0, **options))
    got, passes = fit_once(build(seed, fused, jagg_frac=1.0, estimator="control_variate", control_p=1.0, **options))
    assert rel_error(got, exact) < 1e-10
    assert passes["routed_windows"] > 0 and passes["corrected_windows"] == passes["routed_windows"]  # p = 1: all
    if not fused:  # the windows are not linear: the paper's estimate alone is off (fused = unfused: test_fused.py)
        paper, _ = fit_once(build(seed, fused, jagg_frac=1.0, **options))
        assert rel_error(paper, exact) > 1e-10


@pytest.mark.parametrize("field, value, message", [
    ("control_p", 0.0, r"jagg.control_p must be in \(0, 1\]"),
    ("control_p", 1.5, r"jagg.control_p must be in \(0, 1\]"),
    ("estimator", "unbiased", r"jagg.estimator must be 'paper' or 'control_variate', got 'unbiased'"),
])
def test_bad_estimator_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        JAGGConfig(**{field: value})


def test_control_variate_refuses_the_interpolated_reference():
    with pytest.raises(ValueError, match="jagg.interpolate_reference must be false with jagg.estimator"):
        JAGGConfig(estimator="control_variate", interpolate_reference=True)
    assert JAGGConfig().estimator == "paper"  # the default is the paper's estimator
