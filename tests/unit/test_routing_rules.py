"""The routing rules: the interpolation residual (ours), the published cosine rule and the random baseline."""

import pytest
import torch

from jagg_lightning import JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.method.jagg import alphas
from jagg_lightning.method.routing import cosine_score, interpolation_residual, routing_score
from jagg_lightning.method.sde import flow_match_sigmas
from jagg_lightning.training.rollout import Trajectory
from helpers import tiny_policy_config


def reference_cosine_score(v, steps):
    """1 - mean over interior k and samples of cos(v_k - v_a, v_b - v_a), one sample at a time."""
    a, b = steps[0], steps[-1]
    values = []
    for i in range(v.shape[1]):
        chord = (v[b, i] - v[a, i]).flatten()
        for k in steps[1:-1]:
            offset = (v[k, i] - v[a, i]).flatten()
            values.append(torch.dot(offset, chord) / (offset.norm() * chord.norm()))
    return 1.0 - float(torch.stack(values).mean())


def test_cosine_score_matches_its_definition(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    times = flow_match_sigmas(8).double()
    v = torch.randn(9, 3, 4, 2, 2, generator=gen, dtype=torch.float64)
    steps = [2, 3, 4, 5]
    assert float(cosine_score(v, times, steps)) == pytest.approx(reference_cosine_score(v, steps), abs=1e-12)
    assert routing_score("cosine", v, times, steps) == cosine_score(v, times, steps)
    assert routing_score("residual", v, times, steps) == interpolation_residual(v, times, steps)
    assert cosine_score(v, times, [4, 5]) == 0.0
    # on the chord at any pace (not the t-lerp): the angle is 0 although the residual is not
    pace = torch.rand(2, generator=gen, dtype=torch.float64) * 0.5 + 0.25
    for k, p in zip(steps[1:-1], pace):
        v[k] = v[2] + p * (v[5] - v[2])
    assert cosine_score(v, times, steps) < 1e-12
    assert interpolation_residual(v, times, steps) > 1e-3
    with pytest.raises(ValueError, match="jagg.routing"):
        routing_score("angle", v, times, steps)


def _disagreeing_trajectory(times, gen):
    """8 trained steps = two W=4 windows: window 0 on the chord at the wrong pace (cosine 0, large residual),
    window 1 on the t-lerp plus a small sideways offset (small residual, cosine > 0)."""
    n, shape = 2, (4, 2, 2)
    v = torch.randn(len(times) - 1, n, *shape, generator=gen)
    for k, p in zip((1, 2), (0.9, 0.95)):  # window 0 = steps 0..3
        v[k] = v[0] + p * (v[3] - v[0])
    al = alphas(times, [4, 5, 6, 7])
    for k, a in zip((5, 6), al[1:-1]):  # window 1 = steps 4..7
        v[k] = (1 - a) * v[4] + a * v[7] + 0.02 * torch.randn(v[k].shape, generator=gen)
    latents = torch.randn(len(times), n, *shape, generator=gen)
    return Trajectory(latents, torch.zeros(len(times) - 1, n), v, times)


@pytest.mark.parametrize("rule, routed", [("residual", [False, True]), ("cosine", [True, False])])
def test_module_routes_by_the_configured_rule(rule, routed, rng_seed):
    module = JAGGModule(policy=tiny_policy_config(), sampling=SamplingConfig(num_steps=9, group_size=2),
                        jagg=JAGGConfig(window_size=4, jagg_frac=0.5, routing=rule))
    module.configure_model()
    module.configure_model()  # the schedule is the policy's
    traj = _disagreeing_trajectory(module.sampler.times, torch.Generator().manual_seed(rng_seed))
    r = [float(interpolation_residual(traj.velocities, traj.times, w.steps)) for w in module.windows]
    c = [float(cosine_score(traj.velocities, traj.times, w.steps)) for w in module.windows]
    assert r[0] > r[1] and c[0] < c[1]  # the two rules disagree on this trajectory
    windows = module.updater.route(traj, module.windows)
    assert [w.routed for w in windows] == routed
    assert [w.score for w in windows] == pytest.approx(r if rule == "residual" else c)


def test_unknown_routing_rule_is_rejected_before_any_model_is_built(monkeypatch):
    with pytest.raises(ValueError, match=r"jagg.routing must be 'residual', 'cosine' or 'random', got 'angle'"):
        JAGGConfig(routing="angle")
    import jagg_lightning.module as module_lib

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked")

    for name in ("SD3Policy", "build_policy"):
        if hasattr(module_lib, name):
            monkeypatch.setattr(module_lib, name, no_model)
    with pytest.raises(ValueError, match="jagg.routing"):
        JAGGModule(jagg={"routing": "angle"})


def _random_router(seed, estimator="paper"):
    module = JAGGModule(policy=tiny_policy_config(), sampling=SamplingConfig(num_steps=13, group_size=2),
                        jagg=JAGGConfig(window_size=3, chained=True, jagg_frac=0.5, routing="random",
                                        estimator=estimator, control_p=0.5), seed=seed)
    module.configure_model()
    return module


def test_random_routing_is_seeded_by_step_and_alike_on_every_process(rng_seed):
    """12 trained steps, W = 3 chained: 5 full windows + a tail, round(0.5 * 5) = 3 routed per step. The draw
    depends on (seed, step) only: two trajectories (two processes' samples) route alike, a second module with
    the same seed repeats it, the global RNG is untouched; steps differ (40 steps of one pattern of C(5, 3) = 10:
    probability 10^-39) and every window is routed at some step (each misses all 40 with probability (2/5)^40)."""
    seed = rng_seed % 10_000
    module, again = _random_router(seed), _random_router(seed)
    gen = torch.Generator().manual_seed(rng_seed)
    trajs = [_disagreeing_trajectory(module.sampler.times, gen) for _ in range(2)]
    state = torch.get_rng_state()
    patterns = []
    for step in range(40):
        routed = [[w.routed for w in module.updater.route(t, module.windows, step=step)] for t in trajs]
        routed.append([w.routed for w in again.updater.route(trajs[0], again.windows, step=step)])
        assert routed[0] == routed[1] == routed[2]
        assert sum(routed[0]) == 3 and not routed[0][-1]  # the share; the short tail stays exact
        assert all(0.0 <= w.score < 1.0 for w in module.windows)
        patterns.append(tuple(routed[0]))
    assert torch.equal(torch.get_rng_state(), state)
    assert len(set(patterns)) > 1
    assert all(any(p[i] for p in patterns) for i in range(5))
    other = _random_router(seed + 1)
    assert [tuple(w.routed for w in other.updater.route(trajs[0], other.windows, step=s)) for s in range(40)] != patterns


def test_control_variate_draws_are_seeded_by_step(rng_seed):
    """The Bernoulli(p) draws of the routed windows: alike for two processes' trajectories, reproducible, only
    on routed windows with an interior, c = 1/p; over 40 steps both outcomes occur."""
    seed = rng_seed % 10_000
    module, again = _random_router(seed, "control_variate"), _random_router(seed, "control_variate")
    gen = torch.Generator().manual_seed(rng_seed)
    trajs = [_disagreeing_trajectory(module.sampler.times, gen) for _ in range(2)]
    seen = set()
    for step in range(40):
        c = [[w.correction for w in module.updater.route(t, module.windows, step=step)] for t in trajs]
        c.append([w.correction for w in again.updater.route(trajs[0], again.windows, step=step)])
        assert c[0] == c[1] == c[2]
        assert all(x in (0.0, 2.0) and (x == 0.0 or w.routed) for x, w in zip(c[0], module.windows))
        seen.update(c[0][i] for i, w in enumerate(module.windows) if w.routed)
    assert seen == {0.0, 2.0}


def test_random_routing_refuses_a_score_limit():
    with pytest.raises(ValueError, match="jagg.score_limit must be null with jagg.routing 'random'"):
        JAGGConfig(routing="random", score_limit=0.1)
    with pytest.raises(ValueError, match="jagg.routing 'random' needs a generator"):
        routing_score("random", torch.zeros(3, 1, 2), flow_match_sigmas(2), [0, 1, 2])
