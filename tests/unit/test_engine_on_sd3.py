"""The JAGG engine on the real tiny SD3 transformer with a peft LoRA, float64."""

import pytest
import torch

from jagg_lightning.method.grpo import StepRecord, step_loss
from jagg_lightning.method.jagg import accumulate_gradients, plan_windows
from jagg_lightning.method.routing import route_windows
from jagg_lightning.method.sde import flow_match_sigmas
from jagg_lightning.training.rollout import sample_generators, sample_trajectories

from helpers import build_policy, exact_per_step_gradient, lora_grads, rel_error

STEPS = 8
TRAINED = list(range(STEPS - 1))


@pytest.fixture(scope="module")
def policy64():
    return build_policy(torch.Generator().manual_seed(0), dtype="float64")


def rollout(policy, seed, prompts=("a red cat", "a blue dog"), group=2):
    cond = tuple(c.repeat_interleave(group, 0) for c in policy.encode_prompts(list(prompts)))
    gens = sample_generators(seed, 0, range(len(prompts)), group)
    traj = sample_trajectories(policy.velocity, cond, gens, policy.latent_shape, flow_match_sigmas(STEPS),
                               ["sde"] * STEPS, 0.7, 8, dtype=torch.float64)
    return traj, cond


def engine_gradient(policy, traj, cond, adv, windows, cache=False, low_memory=False):
    policy.transformer.zero_grad(set_to_none=True)

    def loss_fn(k, v):
        rec = StepRecord(traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1]),
                         traj.log_probs[k], adv)
        return step_loss(v, rec)[0].mean() / len(TRAINED)

    recs = accumulate_gradients(policy.velocity, traj.latents, traj.times, cond, loss_fn, windows,
                                traj.velocities if cache else None, low_memory)
    return lora_grads(policy), recs


@pytest.mark.parametrize("case", ["frac0_w4", "frac0_chained", "w2_all_routed"])
def test_exact_cases_reproduce_per_step_gradient(policy64, case, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    traj, cond = rollout(policy64, rng_seed)
    adv = torch.randn(traj.latents.shape[1], generator=gen, dtype=torch.float64)
    exact = exact_per_step_gradient(policy64, traj, cond, adv, TRAINED)
    names = [n for n, q in policy64.transformer.named_parameters() if q.requires_grad]
    for factor in ("lora_A", "lora_B"):  # both LoRA factors receive gradient
        assert sum(float(g.abs().sum()) for n, g in zip(names, exact) if factor in n) > 0
    if case == "w2_all_routed":
        windows = route_windows(plan_windows(TRAINED, 2), [0.0] * 4, 1.0, 2)
        assert sum(w.routed for w in windows) == 3
    else:
        windows = plan_windows(TRAINED, 4, chained=case == "frac0_chained")
        route_windows(windows, [0.0] * len(windows), 0.0, 4)
    got, _ = engine_gradient(policy64, traj, cond, adv, windows)
    assert rel_error(got, exact) < 1e-12


def test_cached_interior_equals_recomputed_at_theta_old(policy64, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    traj, cond = rollout(policy64, rng_seed)
    adv = torch.randn(traj.latents.shape[1], generator=gen, dtype=torch.float64)
    windows = route_windows(plan_windows(TRAINED, 4), [0.0, 0.0], 1.0, 4)
    recomputed, recs_a = engine_gradient(policy64, traj, cond, adv, windows)
    cached, recs_b = engine_gradient(policy64, traj, cond, adv, windows, cache=True)
    assert rel_error(cached, recomputed) < 1e-10
    assert sum(r.nograd_forwards for r in recs_a) == 2 and sum(r.nograd_forwards for r in recs_b) == 0
    # and JAGG on a real DiT is an approximation, not the exact gradient
    exact = exact_per_step_gradient(policy64, traj, cond, adv, TRAINED)
    assert 1e-8 < rel_error(recomputed, exact) < 1.0


class PassCounter:
    """Forward hooks (grad / no-grad) and a full backward hook on the transformer."""

    def __init__(self, transformer):
        self.grad_forwards = self.nograd_forwards = self.backwards = 0
        self.handles = [
            transformer.register_forward_hook(self.on_forward),
            transformer.register_full_backward_hook(self.on_backward),
        ]

    def on_forward(self, module, args, kwargs_or_out):
        if torch.is_grad_enabled():
            self.grad_forwards += 1
        else:
            self.nograd_forwards += 1

    def on_backward(self, module, grad_input, grad_output):
        self.backwards += 1

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("window_size", [3, 4, 7])
@pytest.mark.parametrize("low_memory", [False, True])
@pytest.mark.parametrize("cache", [False, True])
def test_pass_counts(policy64, window_size, low_memory, cache, rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    traj, cond = rollout(policy64, rng_seed)
    n = traj.latents.shape[1]
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    windows = plan_windows(TRAINED, window_size)
    route_windows(windows, [float(i) for i in range(len(windows))], 0.5, window_size)
    counter = PassCounter(policy64.transformer)
    sizes = []
    size_hook = policy64.transformer.register_forward_pre_hook(
        lambda m, a, kw: sizes.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    try:
        _, recs = engine_gradient(policy64, traj, cond, adv, windows, cache=cache, low_memory=low_memory)
    finally:
        counter.remove()
        size_hook.remove()
    expected_grad = expected_nograd = 0
    for w, rec in zip(windows, recs):
        W = len(w.steps)
        if w.routed:
            passes = 2 if low_memory else 1
            assert (rec.grad_forwards, rec.backwards) == (passes, passes)
            assert rec.nograd_forwards == (0 if cache else W - 2)
            expected_grad += passes
            expected_nograd += 0 if cache else W - 2
        else:
            assert (rec.grad_forwards, rec.backwards, rec.nograd_forwards) == (W, W, 0)
            expected_grad += W
    assert any(r.routed for r in recs)
    assert counter.grad_forwards == expected_grad
    assert counter.backwards == expected_grad
    assert counter.nograd_forwards == expected_nograd
    # a batched anchor pass sends both anchors through ONE transformer call
    if not low_memory:
        assert sizes.count(2 * n) == sum(r.routed for r in recs)
