"""Gradient checkpointing (diffusers' non-reentrant switch) leaves the JAGG gradients unchanged, float64."""

import pytest
import torch

from jagg_lightning.jagg import plan_windows, route_windows

from helpers import build_policy, rel_error
from test_jagg_sd3 import TRAINED, engine_gradient, rollout


@pytest.mark.parametrize("low_memory", [False, True])
def test_checkpointing_keeps_window_gradients(low_memory, rng_seed):
    policy = build_policy(torch.Generator().manual_seed(rng_seed % 10_000), dtype="float64")
    gen = torch.Generator().manual_seed(rng_seed)
    traj, cond = rollout(policy, rng_seed)
    adv = torch.randn(traj.latents.shape[1], generator=gen, dtype=torch.float64)
    # windows (0..3) routed (both anchors batched in one forward unless low_memory), (4..6) exact
    windows = route_windows(plan_windows(TRAINED, 4), [0.0, 1.0], 0.5, 4)
    assert [w.routed for w in windows] == [True, False]

    block = policy.transformer.transformer_blocks[0]
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    plain, plain_recs = engine_gradient(policy, traj, cond, adv, windows, low_memory=low_memory)
    plain_calls = len(calls)

    policy.enable_gradient_checkpointing()
    calls.clear()
    checkpointed, recs = engine_gradient(policy, traj, cond, adv, windows, low_memory=low_memory)
    # the block really was recomputed in backward: one extra forward per grad pass
    assert len(calls) == plain_calls + sum(r.backwards for r in recs)
    assert [r.backwards for r in recs] == [r.backwards for r in plain_recs]
    assert sum(float(g.abs().sum()) for g in plain) > 0
    error = rel_error(checkpointed, plain)
    print(f"relative gradient difference with checkpointing: {error:.2e}")
    assert error < 1e-10
