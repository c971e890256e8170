"""Gradient checkpointing (diffusers' non-reentrant switch) leaves the JAGG gradients unchanged, float64."""

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.jagg import plan_windows
from jagg_lightning.method.routing import route_windows

from helpers import build_policy, randomize_lora_b, rel_error, tiny_policy_config
from test_engine_on_sd3 import TRAINED, engine_gradient, rollout


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


def test_config_field_turns_checkpointing_on_in_training(rng_seed):
    """``policy.gradient_checkpointing: true`` (what a config sets): configure_model enables it, the blocks are
    recomputed in every backward of a real training step, and the update equals the one without (float64)."""
    seed = rng_seed % 10_000
    updates, calls, backwards, grad_forwards = [], [], [], []
    for checkpointing in (False, True):
        module = JAGGModule(
            tiny_policy_config(dtype="float64", gradient_checkpointing=checkpointing),
            SamplingConfig(num_steps=6, group_size=2, rollout_batch_size=4),
            GRPOConfig(train_batch_size=4, max_grad_norm=None), JAGGConfig(window_size=3, jagg_frac=0.5),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
            seed=seed,
        )
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        module.configure_model()  # as the Trainer does (idempotent); the LoRA B made nonzero before the step
        assert module.policy.transformer.is_gradient_checkpointing == checkpointing
        randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
        before = [p.detach().clone() for p in module.policy.lora_parameters()]
        count = []
        module.policy.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *_: count.append(1))
        trainer.fit(module, PromptDataModule(prompts=["a red cat", "a blue dog"], batch_size=2, shuffle=False))
        updates.append([p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)])
        calls.append(len(count))
        backwards.append(sum(r.backwards for r in module.window_records))
        grad_forwards.append(sum(r.grad_forwards for r in module.window_records))
    assert backwards[0] == backwards[1] > 0 and grad_forwards[0] == grad_forwards[1] >= backwards[1]
    # rollout and training forwards alike, plus one recompute of the block per forward with grad (on the first
    # update a routed window's anchors take a forward each and share one backward)
    assert calls[1] == calls[0] + grad_forwards[1]
    assert sum(float(u.abs().sum()) for u in updates[0]) > 0
    assert rel_error(updates[1], updates[0]) < 1e-10
