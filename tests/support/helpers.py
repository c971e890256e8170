"""Shared builders for tests on the real tiny SD3 (diffusers transformer + peft LoRA)."""

import copy
import os
from contextlib import contextmanager

import torch

from jagg_lightning.method.grpo import StepRecord, group_advantages, step_loss
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.policies.sd3 import SD3Policy
from jagg_lightning.rewards import JpegCompressibility, Reward

SEED_VARIABLE = "JAGG_TEST_SEED"


DRAWN_SEEDS: list[int] = []  # every seed fresh_seed gave, in order: a failing test's report names its own (conftest)


def fresh_seed(bits: int = 32) -> int:
    """A fresh random seed of ``bits`` bits, or ``JAGG_TEST_SEED``'s value (to replay one a failure printed)."""
    value = os.environ.get(SEED_VARIABLE)
    if value is None:
        seed = int.from_bytes(os.urandom(bits // 8), "little")
    elif not value.isdigit():
        raise ValueError(f"{SEED_VARIABLE} must be a non-negative integer (a seed a failing test printed), got {value!r}")
    else:
        seed = int(value) % (1 << bits)
    DRAWN_SEEDS.append(seed)
    return seed


TINY_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "proj_out"]


def tiny_policy_config(**overrides) -> PolicyConfig:
    kw = dict(lora_rank=4, lora_alpha=8, lora_targets=TINY_TARGETS, guidance_scale=1.0, max_sequence_length=4)
    kw.update(overrides)
    return PolicyConfig(**kw)


def randomize_lora_b(transformer, generator, scale=0.05):
    """peft's gaussian init leaves B = 0 (so dL/dA = 0): make both factors nonzero."""
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def lora_grads(policy):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in policy.lora_parameters()]


def sgd(params):
    """The distributed tests' optimizer: SGD with momentum, whose update is linear in the gradient (AdamW's first step is
    about lr * sign(g) per weight, so a near-zero gradient would turn float32 rounding into a full step), and stateful,
    so a resumed run must restore its momentum."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def rel_error(a, b):
    """||a - b|| / ||b|| over lists of tensors. A zero reference fails here, naming why: a comparison with nothing
    (tied rewards give zero advantages, hence no gradient) would otherwise be 0 / 0."""
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b)) ** 0.5
    den = sum((y**2).sum() for y in b) ** 0.5
    assert float(den) > 0, "the reference is zero: nothing to compare (tied rewards give zero advantages?)"
    return float(num / den)


def exact_per_step_gradient(policy, traj, cond, advantages, steps, kind="sde", noise_level=0.7, clip_range=1e-4,
                            kl_beta=0.0, ref_v=None, scale=1.0):
    """The straightforward reference: one forward with grad and one backward per trained step."""
    policy.transformer.zero_grad(set_to_none=True)
    n = traj.latents.shape[1]
    for k in steps:
        v = policy.velocity(traj.latents[k], traj.times[k].expand(n), cond)
        rec = StepRecord(traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1]),
                         traj.log_probs[k], advantages, None if ref_v is None else ref_v[k])
        loss, _ = step_loss(v, rec, kind, noise_level, clip_range, kl_beta)
        (loss.mean() * scale / len(steps)).backward()
    return lora_grads(policy)


def handwritten_update_error(module, prompts, lr, fit, check_advantages=lambda adv: adv) -> float:
    """``module``'s one SGD(``lr``) step (``fit(module)``, which leaves the trained module for the caller to inspect)
    against the hand-written per-step GRPO step, ``-lr`` times :func:`exact_per_step_gradient` on a copy's own
    rollout of ``prompts`` (the same seeds: the same trajectory): ||update - expected|| / ||expected||.
    ``check_advantages``: applied to the copy's advantages first (``nonzero_advantages`` fails on all-tied groups)."""
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    fit(module)
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]
    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(prompts, list(range(len(prompts))), step=0,
                                                                    reward=reference.reward_fn)
    adv = check_advantages(group_advantages(rewards.view(-1, reference.sampling.group_size)).flatten())
    expected = [-lr * g for g in exact_per_step_gradient(reference.policy, traj, cond, adv, reference.trained_steps)]
    assert sum(float(u.abs().sum()) for u in expected) > 0
    return rel_error(update, expected)


def checkpointed_gradient_error(policy, z, t, cond) -> float:
    """The LoRA gradient of sum v(z, t)^2 with gradient checkpointing on (every trained network: Wan2.2's two
    experts) against off: ||on - off|| / ||off|| (the recompute in backward must give the same gradient)."""
    networks = getattr(policy, "experts", [policy.transformer])

    def gradient():
        for network in networks:
            network.zero_grad(set_to_none=True)
        policy.velocity(z, t, cond).square().sum().backward()
        return lora_grads(policy)

    plain = gradient()
    policy.enable_gradient_checkpointing()
    assert all(network.is_gradient_checkpointing for network in networks)
    return rel_error(gradient(), plain)


def assert_loaded_velocity_is_the_trained(policy, loaded, z, t, cond) -> None:
    """Each transformer in ``loaded`` (an export loaded back), swapped in for the policy's, gives the trained policy's
    velocity bit for bit; the policy with its adapter off does not (the adapter is what was trained)."""
    own = policy.transformer
    with torch.no_grad():
        expected = policy.velocity(z, t, cond)
        for transformer in loaded:
            policy.transformer = transformer
            try:
                assert torch.equal(policy.velocity(z, t, cond), expected)
            finally:
                policy.transformer = own
        with policy.adapter_disabled():
            assert not torch.allclose(policy.velocity(z, t, cond), expected, rtol=1e-4, atol=1e-5)


def build_policy(generator, **overrides) -> SD3Policy:
    policy = SD3Policy(tiny_policy_config(**overrides))
    randomize_lora_b(policy.transformer, generator)
    return policy


@contextmanager
def counted_velocity(policy):
    """Inside the block every ``policy.velocity`` call is counted: the list it yields gets one entry per call."""
    calls, velocity = [], policy.velocity
    policy.velocity = lambda *args, **kwargs: calls.append(1) or velocity(*args, **kwargs)
    try:
        yield calls
    finally:
        del policy.velocity


class MeanIntensity(Reward):
    """A continuous reward: the mean pixel of each image. Where the reward is not the subject (gradient and update
    comparisons) tests score with it: the JPEG sizes of two tiny samples can tie (seed 4153 tied both groups of the
    Qwen-Image check), a tied group has zero advantages, and with every group tied there is no gradient to compare.
    Two samples tie only if their mean pixels are equal in float32."""

    name = "mean_intensity"

    def score(self, images, prompts):
        return images.double().flatten(1).mean(1)


def nonzero_advantages(advantages, seed):
    """``advantages``, after failing (naming the seed that replays it) if every one is zero: each group's rewards
    tie, the update is zero and a comparison of updates or gradients would compare nothing."""
    assert bool(advantages.ne(0).any()), (f"{SEED_VARIABLE}={seed}: every advantage is zero (each group's rewards "
                                          "tie): no gradient to compare")
    return advantages


def float64_reward(dtype) -> Reward | str:
    """The tests' reward at the test's precision: the continuous :class:`MeanIntensity` for a float64 run (whose
    comparisons need non-zero advantages at every seed), else the registered JPEG compressibility."""
    return MeanIntensity() if dtype in ("float64", torch.float64) else "jpeg_compressibility"


class SlowJpeg(JpegCompressibility):
    """JPEG compressibility that takes ``seconds`` per call: a served reward busy long enough for the reward server's
    in-flight limit to be seen (tests/rewards/test_reward_client.py)."""

    name = "slow_jpeg"

    def __init__(self, seconds: float = 1.0):
        super().__init__()
        self.seconds = float(seconds)

    def score(self, images, prompts):
        import time

        time.sleep(self.seconds)
        return super().score(images, prompts)


def velocities_with(weights, params, velocity, zs, times, batch, cond) -> list:
    """``velocity(z, t, cond)`` at each (z, t) with ``weights`` copied into ``params`` by hand and the parameters put
    back after: theta_old's velocities for a transcription, without the code under test (no grad)."""
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p, w in zip(params, weights):
            p.copy_(w)
        found = [velocity(z, t.expand(batch), cond) for z, t in zip(zs, times)]
        for p, s in zip(params, saved):
            p.copy_(s)
    return found
