"""The cheaper rollout (issue 29, MixGRPO-Flash): the ODE tail after the trained steps in ``sampling.ode_steps`` steps
of ``sampling.ode_solver``, on the tiny SD3. The trained steps -- their times, SDE transitions, noise, log-probs and
the GRPO / JAGG gradient on them -- are today's bit for bit; only the tail and its evaluations change; evaluation
keeps Euler on the full grid; the fields are checked."""

import copy

import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.method.grpo import group_advantages

from helpers import (
    counted_velocity, exact_per_step_gradient, float64_reward, lora_grads, nonzero_advantages, randomize_lora_b,
    rel_error, tiny_policy_config,
)
from modules import PROMPTS, fit

S, T, K = 7, 3, 3  # sampling steps, trained steps, group size
TODAY = dict(ode_solver="euler", ode_steps=None)


def build(seed, tail, jagg_frac=0.0, kl_beta=0.0, rollout_batch_size=6):
    """The tiny SD3 in float64, 3 trained steps of 7 with the ODE tail after them (``tail``: its solver and steps)."""
    module = JAGGModule(
        tiny_policy_config(dtype="float64"),
        SamplingConfig(num_steps=S, group_size=K, trained_steps=T, ode_after_trained=True,
                       rollout_batch_size=rollout_batch_size, **tail),
        GRPOConfig(train_batch_size=6, max_grad_norm=None, kl_beta=kl_beta, adv_std="group"),
        JAGGConfig(window_size=3, jagg_frac=jagg_frac),
        optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
        reward=float64_reward("float64"),
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def gradient(module, traj, cond, advantages):
    """The first update's gradient on ``traj`` with ``advantages`` (routing on its velocities, the KL reference it
    recorded, interiors from the cache): the unfused engine as the training step runs it."""
    plan = module.plan
    module.policy.transformer.zero_grad(set_to_none=True)
    module.updater.route(traj, plan.windows)
    module.updater.backward_samples(traj, advantages, cond, len(advantages), plan, plan.windows, True, [],
                                    torch.Tensor.backward)
    return lora_grads(module.policy)


@pytest.mark.parametrize("tail,jagg_frac,kl_beta", [
    (dict(ode_solver="dpmpp_2m", ode_steps=3), 0.0, 0.0),
    (dict(ode_solver="dpmpp_2m", ode_steps=2), 1.0, 0.2),
    (dict(ode_solver="dpmpp_2m", ode_steps=None), 1.0, 0.0),
    (dict(ode_solver="euler", ode_steps=1), 0.0, 0.2),
])
def test_flash_tail_keeps_the_trained_steps_and_their_gradient(tail, jagg_frac, kl_beta, rng_seed):
    """Against today's rollout (Euler on the grid's remaining steps) with the same seed: the first T + 1 latents, the
    T velocities, log-probs and KL reference velocities are equal bit for bit, so is the gradient taken on them with
    the same advantages; the tail itself differs (other times, other solver) and makes T + n transformer calls."""
    seed = rng_seed % 10_000
    today, flash = build(seed, TODAY, jagg_frac, kl_beta), build(seed, tail, jagg_frac, kl_beta)
    n = tail["ode_steps"] or S - T
    runs = {}
    for name, module in (("today", today), ("flash", flash)):
        with counted_velocity(module.policy) as calls:
            traj, cond = module.sampler.trajectories(PROMPTS[:2], [0, 1], 5, module.plan.step_kinds,
                                                     module.plan.trained_steps)
        runs[name] = traj, cond, len(calls)
    (a, cond, calls_today), (b, _, calls_flash) = runs["today"], runs["flash"]
    reference = T if kl_beta else 0  # the KL reference's adapter-off forwards, at the trained steps
    assert calls_today == S + reference and calls_flash == T + n + reference  # one micro-batch: one call per step
    assert b.latents.shape[0] == T + n + 1 and b.log_probs.shape[0] == T + n
    assert torch.equal(b.times[: T + 1], a.times[: T + 1]) and b.times[-1] == 0
    assert torch.equal(b.latents[: T + 1], a.latents[: T + 1])
    assert torch.equal(b.velocities[:T], a.velocities[:T]) and torch.equal(b.log_probs[:T], a.log_probs[:T])
    assert bool((a.log_probs[:T] != 0).all()) and bool((b.log_probs[T:] == 0).all())
    if kl_beta:
        assert torch.equal(b.ref_velocities[:T], a.ref_velocities[:T]) and b.ref_velocities[:T].abs().sum() > 0
    if tail != dict(ode_solver="euler", ode_steps=S - T):
        assert not torch.allclose(b.latents[-1], a.latents[-1])  # the tail is another solve
    advantages = torch.randn(b.latents.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected, got = gradient(today, a, cond, advantages), gradient(flash, b, cond, advantages)
    assert sum(float(g.abs().sum()) for g in expected) > 0
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


def test_training_on_the_flash_tail_is_exact_grpo_on_its_trajectory(rng_seed):
    """A real Trainer step with the 2M tail in 2 steps is minus the per-step exact GRPO gradient on the very rollout it
    sampled (rewards of its own final images), two micro-batches of samples; evaluation keeps Euler on the full grid."""
    seed = rng_seed % 10_000
    module = build(seed, dict(ode_solver="dpmpp_2m", ode_steps=2), rollout_batch_size=3)
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    with counted_velocity(module.sampler) as calls:
        fit(module, 1, PROMPTS[:2])
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]
    assert len(module.last_rollout.trajectory.times) == T + 2 + 1
    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(PROMPTS[:2], [0, 1], 0, reference.plan.step_kinds,
                                                                    reward=reference.reward_fn)
    assert torch.equal(traj.latents, module.last_rollout.trajectory.latents)
    advantages = nonzero_advantages(group_advantages(rewards.view(-1, K), "group").flatten(), seed)
    expected = [-g for g in exact_per_step_gradient(reference.policy, traj, cond, advantages, list(range(T)))]
    assert sum(float(g.abs().sum()) for g in expected) > 0 and rel_error(update, expected) < 1e-10
    # the rollout's velocity calls: (T + 2) per micro-batch of 3, then the update's T per training micro-batch
    assert len(calls) == 2 * (T + 2) + T
    with counted_velocity(reference.policy) as calls:  # evaluation: Euler on its own grid, whatever the tail
        reference.sampler.ode_images(PROMPTS[:1], [0], 1, seed, 0, 5)
    assert len(calls) == 5


@pytest.mark.parametrize("fields,field,allowed", [
    (dict(ode_solver="heun"), "sampling.ode_solver", "'euler' or 'dpmpp_2m'"),
    (dict(ode_solver="dpmpp_2m"), "sampling.ode_solver", "'euler' unless sampling.ode_after_trained true"),
    (dict(ode_steps=2), "sampling.ode_steps", "null unless sampling.ode_after_trained true"),
    (dict(ode_after_trained=True, trained_steps=4, ode_steps=0), "sampling.ode_steps", "in [1, 6]"),
    (dict(ode_after_trained=True, trained_steps=4, ode_steps=7), "sampling.ode_steps", "in [1, 6]"),
    (dict(ode_after_trained=True, ode_steps=2.5), "sampling.ode_steps", "an integer"),
    (dict(ode_after_trained=True, trained_steps=10, ode_steps=1), "sampling.ode_steps", "null when every step"),
    (dict(ode_after_trained=True, sde_window_size=3, ode_solver="dpmpp_2m"), "sampling.ode_solver",
     "no sampling.sde_window_size"),
    (dict(ode_after_trained=True, sde_window_size=3, ode_steps=3), "sampling.ode_steps", "no sampling.sde_window_size"),
])
def test_ode_tail_fields_are_checked(fields, field, allowed):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + " must be") as info:
        SamplingConfig(**({"num_steps": 10} | fields))
    assert allowed in str(info.value)
