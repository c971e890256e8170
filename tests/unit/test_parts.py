"""The plain parts beside JAGGModule, on their own (no Trainer, no model where none is needed)."""

import random

import pytest
import torch

from jagg_lightning.config import JAGGConfig, MemoryConfig, SamplingConfig
from jagg_lightning.distributed.collectives import Collectives
from jagg_lightning.method.jagg import plan_windows
from jagg_lightning.training.metrics import EvalSums
from jagg_lightning.training.passes import fused_samples, pass_plan, pass_steps_before_routing, reference_steps
from jagg_lightning.training.rollout import plan_rollout, step_kinds_at


def routed(windows, which):
    for i, w in enumerate(windows):
        w.routed = i in which
    return windows


def test_pass_plan_follows_its_cost_formula(rng_seed):
    """Against a direct count of the passes each layout makes: the chosen layout fits the budget and no layout
    that fits makes fewer passes (batched wins ties); without a budget the activation size is never measured."""
    rnd = random.Random(rng_seed)
    for _ in range(200):
        a = rnd.randint(1, 50) * 1000
        windows = routed(plan_windows(list(range(rnd.randint(4, 12))), rnd.randint(2, 4)), set(rnd.sample(range(6), 3)))
        n, budget_units = rnd.randint(1, 16), rnd.uniform(0.5, 40)
        memory = MemoryConfig(budget_mb=budget_units * a / 2**20)
        size, split = pass_plan(n, windows, memory, lambda: a)
        R = sum(w.routed for w in windows)
        E = len({k for w in windows if not w.routed for k in w.steps})

        def passes(c, split_anchors):
            return ((2 * R if split_anchors else R) + E) * -(-n // c)

        limit = int(memory.budget_mb * 2**20)
        fits = [(c, s) for c in range(1, n + 1) for s in (False, True) if c * a * (1 if s else 2) <= limit]
        assert 1 <= size <= n
        if fits:
            assert (size * a * (1 if split else 2) <= limit)
            assert passes(size, split) == min(passes(c, s) for c, s in fits)
        else:  # not one sample fits: split anchors, one sample a pass
            assert (size, split) == (1, True)
    never = lambda: pytest.fail("measured without a budget")  # noqa: E731
    assert pass_plan(7, windows, MemoryConfig(anchors="split"), never) == (7, True)
    assert pass_plan(7, windows, MemoryConfig(), never) == (7, False)
    assert fused_samples(3, MemoryConfig(), never) is None and fused_samples(3, MemoryConfig(fused_samples=2), never) == 2
    assert fused_samples(4, MemoryConfig(budget_mb=9 * 1000 / 2**20), lambda: 1000) == 2  # 9 a over 4 kept steps
    # a layout named under a budget is kept, with the samples per pass the budget allows it
    budget = MemoryConfig(budget_mb=5 * 1000 / 2**20, anchors="batched")
    assert pass_plan(7, windows, budget, lambda: 1000) == (2, False)  # 2 samples x 2 anchors x a <= 5 a
    assert pass_plan(7, windows, MemoryConfig(budget_mb=budget.budget_mb, anchors="split"), lambda: 1000) == (5, True)


@pytest.mark.parametrize("jagg_frac,limit", [(0.0, None), (0.5, None), (1.0, None), (1.0, 0.1)])
def test_steps_that_get_a_pass_before_routing_cover_every_routing(jagg_frac, limit, rng_seed):
    """Whatever the routing picks, every step that then gets a backward was known before routing (the fused mode
    keeps exactly their graphs), and the KL reference is taken for every trained step unless interpolated."""
    jagg = JAGGConfig(window_size=3, jagg_frac=jagg_frac, score_limit=limit)
    windows = plan_windows(list(range(10)), 3)  # 3 full windows and a tail of 1
    kept = pass_steps_before_routing(windows, jagg, interiors=True)
    full = [i for i, w in enumerate(windows) if len(w.steps) == 3]
    count = int(jagg_frac * len(full) + 0.5)
    rnd = random.Random(rng_seed)
    for _ in range(20):
        routed(windows, set(rnd.sample(full, rnd.randint(0, count))) if limit else set(rnd.sample(full, count)))
        needed = {k for w in windows for k in (w.anchors if w.routed else w.steps)}
        assert needed <= kept
    assert reference_steps(windows, jagg) == set(range(10))
    assert reference_steps(windows, JAGGConfig(window_size=3, jagg_frac=jagg_frac, interpolate_reference=True)) == \
        pass_steps_before_routing(windows, jagg, interiors=False)


def test_plan_rollout_is_drawn_from_seed_and_step_only(rng_seed):
    sampling = SamplingConfig(num_steps=10, step_kind="cps", sde_window_size=6, sde_window_range=[0, 9],
                              seed=rng_seed % 10_000)
    jagg = JAGGConfig(window_size=2, window_fraction=0.5)
    torch.manual_seed(rng_seed)
    first = [plan_rollout(sampling, jagg, step) for step in range(30)]
    torch.manual_seed(rng_seed + 1)  # the global stream must not matter
    assert [p.windows for p in first] == [plan_rollout(sampling, jagg, step).windows for step in range(30)]
    for step, plan in enumerate(first):
        kinds, stochastic = step_kinds_at(sampling, step)
        assert plan.step_kinds == kinds and plan.stochastic_steps == stochastic and len(stochastic) == 6
        assert [k for k, kind in enumerate(kinds) if kind == "cps"] == stochastic
        assert len(plan.windows) == 1 and set(plan.trained_steps) <= set(stochastic)  # half of 3 windows: 1
    # MixGRPO's progressive window counts rollouts, not optimizer steps
    progressive = SamplingConfig(num_steps=10, sde_window_size=3, sde_window_schedule="progressive",
                                 sde_window_shift_every=2)
    assert [plan_rollout(progressive, jagg, 0, rollouts).stochastic_steps[0] for rollouts in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_one_process_collectives_are_the_identity():
    c = Collectives()
    t = torch.randn(5)
    assert c.world_size == 1 and c.sum(t.clone()).equal(t) and c.mean(t).equal(t)
    assert c.max_count_if_sharded(torch.tensor(3)) == 3 and c.ddp_model() is None
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    grad = p.grad.clone()
    with c.local_backward():
        c.all_reduce_gradients([p])
    assert p.grad.equal(grad) and c.gradient_all_reduces == 0


def test_eval_sums_are_means_over_every_sample_and_keep_the_first_grid_images(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    sums = EvalSums(grid_images=5)
    batches = [(torch.rand(n, 3, 2, 2, generator=gen), torch.randn(n, generator=gen)) for n in (3, 4, 2)]
    for images, total in batches:
        sums.add(images, total, {"a": 2 * total})
    every = torch.cat([t for _, t in batches]).double()
    means = sums.means()
    assert means["reward_mean"] == pytest.approx(float(every.mean()), rel=1e-6)
    assert means["reward/a"] == pytest.approx(float(2 * every.mean()), rel=1e-6)
    assert torch.equal(torch.cat(sums.grid), torch.cat([i for i, _ in batches])[:5])
    assert sums.grid_prompts == []  # none given: the grid is drawn without prompts
    doubled = sums.means(lambda s: 2 * s)  # a sum over two identical processes: the same means
    assert all(torch.equal(doubled[k], means[k]) for k in means)
