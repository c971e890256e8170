"""The estimator and time-to-quality benchmarks' math (issue 19), without running a model.

benchmarks/estimators.py scores window estimators by their weights on g_k; these tests check the weights
themselves in float64: the paper's are jagg.alphas, the fitted ones recover the paper's alpha exactly where
the affine-chord theorem makes JAGG exact (so they are exact there too), the sigma / log-SNR ones do not
(they are exact on a different chord, docs/method.md §8), and the three-anchor weights reproduce what
they should. Plus the time-to-quality summary helpers.
"""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from jagg_lightning.method.jagg import alphas
from jagg_lightning.method.sde import flow_match_sigmas

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


est = _load("estimators")
ttq = _load("time_to_quality")


def _chord_rollout(steps, B=3, D=(2, 3, 3), seed=0):
    """Latents on the chord z_a -> z_b at the time fraction, velocities of an affine map of (z, t)."""
    g = torch.Generator().manual_seed(seed)
    times = flow_match_sigmas(10, 3.0).double()
    S = times.shape[0]
    alpha = alphas(times, steps)
    za, zb = torch.randn(B, *D, generator=g, dtype=torch.float64), torch.randn(B, *D, generator=g, dtype=torch.float64)
    lat = torch.zeros(S, B, *D, dtype=torch.float64)
    for i, k in enumerate(steps):
        lat[k] = (1 - alpha[i]) * za + alpha[i] * zb
    n = math.prod(D)
    M = torch.randn(n, n, generator=g, dtype=torch.float64)
    c, d = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    vel = (lat.flatten(2) @ M.T + times[:S, None, None] * c + d).view(S, B, *D)
    return times, lat, vel, alpha


@pytest.mark.parametrize("steps", [[0, 1, 2], [0, 1, 2, 3], [4, 5, 6, 7], list(range(8))])
def test_paper_and_fitted_weights_agree_on_the_affine_chord(steps):
    times, lat, vel, alpha = _chord_rollout(steps)
    wa, wb = est.two_anchor_weights("t", times, lat, vel, steps)
    torch.testing.assert_close(wb[:, 0], alpha, rtol=0, atol=1e-15)
    torch.testing.assert_close(wa + wb, torch.ones_like(wa), rtol=0, atol=1e-15)
    for name in ("z_fit", "v_fit", "v_fit_window"):  # the fits recover the paper's alpha: exact where it is
        _, wb_fit = est.two_anchor_weights(name, times, lat, vel, steps)
        assert (wb_fit - alpha[:, None]).abs().max() < 1e-10, name
    ca, cb = est.two_anchor_weights("v_fit2", times, lat, vel, steps)  # free pair: the same (1 - alpha, alpha)
    assert (cb[:, 0] - alpha).abs().max() < 1e-8 and (ca[:, 0] - (1 - alpha)).abs().max() < 1e-8


def test_sigma_and_logsnr_are_not_the_time_fraction():
    steps = [0, 1, 2, 3]
    times, lat, vel, alpha = _chord_rollout(steps)
    for name in ("sigma", "logsnr"):
        _, wb = est.two_anchor_weights(name, times, lat, vel, steps)
        assert wb[0, 0] == 0 and wb[-1, 0] == 1
        assert (wb[1:-1, 0] - alpha[1:-1]).abs().max() > 0.05, name  # exact on their own chord, not the t-chord


@pytest.mark.parametrize("W", [4, 5, 8])
def test_three_anchor_weights(W):
    times = flow_match_sigmas(10, 3.0).double()
    steps = list(range(W))
    t = times[steps]
    for name in ("quad3", "pwl3", "halves"):
        w = est.three_anchor_weights(name, times, steps)
        total = sum(w.values())
        torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-12)  # constants
        torch.testing.assert_close(sum(w[j] * t[j] for j in w), t, rtol=0, atol=1e-12)  # affine in t
        for j in w:  # an anchor carries only itself
            torch.testing.assert_close(w[j][j], torch.tensor(1.0, dtype=torch.float64))
    w = est.three_anchor_weights("quad3", times, steps)
    torch.testing.assert_close(sum(w[j] * t[j] ** 2 for j in w), t**2, rtol=0, atol=1e-12)  # quadratic in t


def test_time_to_quality_helpers():
    m, h = ttq.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(h - 4.303 * 1.0 / math.sqrt(3)) < 1e-9
    assert ttq.crossing([0, 10, 20], [0.5, 0.6, 0.8], 0.7) == pytest.approx(15.0)
    assert math.isnan(ttq.crossing([0, 10], [0.5, 0.6], 0.7))
    assert ttq.model_cost("W=4") / ttq.model_cost("exact") < 1


def test_summary_when_exact_never_gains(rng_seed):
    """A job where exact GRPO falls (the scenes test bed's first study) has no time to exact's gain: nan, not a
    division by zero; the paired differences are still reported."""
    rng = np.random.default_rng(rng_seed)
    start = float(rng.uniform(0.2, 0.4))
    accs = {name: [start] + sorted(start - rng.uniform(0.01, 0.1, 2), reverse=True) for name in ("exact", "W=5 fused")}

    def run(setting, cpu_per_step):
        evals = [{"step": 10 * i, "cpu": 10 * i * cpu_per_step, "accuracy": a, "reward": a, "judge_accuracy": a,
                  "judge_agreement": 1.0} for i, a in enumerate(accs[setting])]
        return {"seed": 0, "setting": setting, "cpu": [cpu_per_step * (i + 1) for i in range(20)], "evals": evals}

    regime = {"config": "scenes.yaml", "num_steps": 10, "trained": 10}
    row = ttq.summarise({"runs": [run("exact", 1.0), run("W=5 fused", 0.5)], "regime": regime})["table"]["W=5 fused"]
    assert math.isnan(row["cpu_to_90_accuracy_vs_exact"]) and math.isnan(row["cpu_to_exact_accuracy"])
    assert row["accuracy_minus_exact"][0] == pytest.approx(accs["W=5 fused"][-1] - accs["exact"][-1])
    assert row["cpu_vs_exact"][0] == pytest.approx(0.5)


def test_extended_time_to_quality_on_synthetic_runs():
    def run(seed, setting, accs, cpu_per_step):
        steps = 10 * (len(accs) - 1)
        evals = [{"step": 10 * i, "cpu": 10 * i * cpu_per_step, "accuracy": a, "judge_accuracy": a} for i, a in enumerate(accs)]
        return {"seed": seed, "setting": setting, "cpu": [cpu_per_step * (i + 1) for i in range(steps)], "evals": evals}

    main = {"runs": [run(0, "exact", [0.5, 0.6, 0.7], 1.0), run(0, "W=4 fused", [0.5, 0.55, 0.65], 0.5)]}
    ext = {"runs": [run(0, "W=4 fused", [0.5, 0.55, 0.65, 0.75], 0.4)]}
    out = ttq.extended_time_to_quality(main, ext)["W=4 fused"]["accuracy"]
    assert out["per_seed_steps"][0] == pytest.approx(25.0)  # 0.7 reached halfway from step 20 to 30
    assert out["per_seed_ratio"][0] == pytest.approx(25 * 0.4 / 20)  # the extension's own clock
    priced = ttq.extended_time_to_quality(main, ext)["W=4 fused"]["accuracy_priced"]
    assert priced["per_seed_ratio"][0] == pytest.approx(25 * 0.5 / 20)  # priced at the main run's CPU per step


def test_one_prompt_study_trains_and_evaluates_the_one_row(rng_seed):
    # time_to_quality.py --prompt: one training row, every step one group of it, evaluated on that row alone
    import yaml

    from jagg_lightning.data import read_prompts

    heldout = _load("heldout")
    config = yaml.safe_load((ROOT / "configs" / "scenes.yaml").read_text())
    rows = read_prompts(config["data"]["prompts_file"])
    rng = np.random.default_rng(rng_seed)
    row, group = rows[rng.integers(len(rows))], int(rng.integers(2, 33))
    cfg, prompts, evaluator = heldout.one_prompt(config, rows, str(row), 3, group)
    assert prompts == [row] and evaluator.prompts == [row] and evaluator.samples == 3
    assert cfg["data"]["batch_size"] == 1 and cfg["model"]["sampling"]["group_size"] == group
    assert cfg["model"]["sampling"]["rollout_batch_size"] == cfg["model"]["grpo"]["train_batch_size"] == group
    assert config["data"]["batch_size"] == 16 and config["model"]["sampling"]["group_size"] == 8  # not mutated
    with pytest.raises(ValueError, match="--prompt"):
        heldout.one_prompt(config, rows, str(row) + " and a hat", 3, group)
