"""LTX-2 checks written for tests/families/test_family_ltx2.py that have NOT run yet: the session that wrote them had
no CPU to spare (a long training run held both cores). Not collected (the name does not start with ``test_``): run it
by name (``python -m pytest tests/families/ltx2_pending_checks.py``), fix what fails, then move the tests into
test_family_ltx2.py. Its one run so far: ``test_update_equals_handwritten_per_step_grpo[exact_grpo]`` (float64,
jagg_frac 0, W = 3) matched the hand-written per-step GRPO step to 2.5e-8 relative, failing the 1e-10 it then asked:
LTX-2's RoPE runs in float32 whatever the dtype (diffusers' ``apply_rotary_emb`` in transformer_ltx2.py upcasts q and
k with ``.float()``), so the engine's and the reference's gradients round differently there. The bound is now 1e-6
(as the distributed tests' float32 timestep embedding), not rerun.

The float64 GRPO / JAGG updates against their hand-written per-step reference, the LoRA export (LTX2Pipeline and
peft) and the full-weight export (LTX2VideoTransformer3DModel, LTX2Pipeline) loading bit for bit, gradient
checkpointing. Also written but not run, to add once these pass: ``"ltx2": dict(guidance_scale=3.0,
max_sequence_length=16)`` in tests/unit/test_memory_plan.py's ``TWINS`` (plan vs measured within 5 %), ``"ltx2":
dict(lora_targets=None, max_sequence_length=16, resolution=32, num_frames=9, guidance_scale=3.0)`` in
tests/families/test_cfg_one_batch.py's ``FAMILIES``, and configs/pending/ltx2.yaml's ``REFERENCE`` entry in
tests/cli/test_presets.py (the preset moved to configs/)."""

import copy
from pathlib import Path

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from peft import PeftModel

from jagg_lightning.cli import cli_main
from jagg_lightning.method.grpo import group_advantages
from jagg_lightning.models.export import save_transformer
from jagg_lightning.policies import PolicyConfig, build_policy

from family_cases import tiny_fit_args
from helpers import exact_per_step_gradient, lora_grads, rel_error
from ltx2_twins import PROMPTS, build, fit, lora_policy, ltx2_twin_dir, module_for  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("jagg_frac,window_size,shape", [(0.0, 3, None), (1.0, 2, None),
                                                         (1.0, 2, {"resolution": [32, 64], "num_frames": 5})],
                         ids=["exact_grpo", "jagg_w2", "jagg_w2_32x64_5f"])
def test_update_equals_handwritten_per_step_grpo(ltx2_twin_dir, jagg_frac, window_size, shape, rng_seed):
    """float64, CFG on: jagg_frac 0 and JAGG on W = 2 windows give the per-step GRPO step (< 1e-6: LTX-2's RoPE is
    float32); also on a wide clip of 5 frames."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(ltx2_twin_dir, seed, dtype="float64", jagg_frac=jagg_frac, window_size=window_size,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, shape=shape)
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    fit(module)
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]
    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(PROMPTS, [0, 1], step=0, reward=reference.reward_fn)
    adv = group_advantages(rewards.view(-1, 2)).flatten()
    expected = [-lr * g for g in exact_per_step_gradient(reference.policy, traj, cond, adv, reference.trained_steps)]
    assert sum(float(u.abs().sum()) for u in expected) > 0
    assert rel_error(update, expected) < 1e-6  # float64 but for LTX-2's float32 RoPE (module docstring)


def test_jagg_fit_lora_export_loads_exactly_in_the_pipeline_and_peft(ltx2_twin_dir, tmp_path, rng_seed):
    """`jagg fit` with configs/ltx2_tiny.yaml on the saved twin at a wide clip; LTX2Pipeline.load_lora_weights and
    PeftModel give the trained velocity bit for bit (the same layers, weights and order of operations)."""
    seed = str(rng_seed % 10_000)
    args = tiny_fit_args(ROOT / "configs/ltx2_tiny.yaml", seed, ltx2_twin_dir, tmp_path)
    cli = cli_main([*args, "--model.policy.resolution", "[32, 48]", "--model.policy.num_frames", "5"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy, final = cli.model.policy, tmp_path / "lora" / "final"
    assert policy.family == "ltx2" and policy.guided and policy.latent_shape == (2 * 4 * 6 + 5, 8)
    gen = torch.Generator().manual_seed(int(seed))
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    cond = policy.encode_prompts(PROMPTS)
    pipe = build()
    pipe.load_lora_weights(str(final / "diffusers"))
    fresh = PeftModel.from_pretrained(build().transformer, str(final / "peft")).base_model.model
    trained = policy.transformer
    with torch.no_grad():
        expected = policy.velocity(z, t, cond)
        for transformer in (pipe.transformer, fresh):
            policy.transformer = transformer
            try:
                assert torch.equal(policy.velocity(z, t, cond), expected)
            finally:
                policy.transformer = trained
        with policy.adapter_disabled():
            assert not torch.allclose(policy.velocity(z, t, cond), expected, rtol=1e-4, atol=1e-5)


def test_full_weight_export_loads_exactly_in_the_transformer_and_pipeline(tmp_path, rng_seed):
    """``trainable: full``: a gradient on the transformer's own weights (float32 masters), and its export loads with
    ``LTX2VideoTransformer3DModel.from_pretrained`` and into ``LTX2Pipeline`` to the trained velocity bit for bit."""
    seed = rng_seed % 1000
    policy = build_policy(PolicyConfig(family="ltx2", trainable="full", guidance_scale=3.0, max_sequence_length=8,
                                       resolution=32, num_frames=9, seed=seed), build())
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    t = torch.tensor([0.8, 0.4])
    cond = policy.encode_prompts(PROMPTS)
    policy.velocity(z, t, cond).square().mean().backward()
    params = policy.lora_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    moved = [p for p in params if p.grad is not None]
    assert len(moved) > 0.8 * len(params) and all(torch.isfinite(p.grad).all() for p in moved)
    with torch.no_grad():
        for p in moved:
            p -= 0.01 * p.grad.sign()  # the export must carry the trained values
    export = save_transformer(policy, tmp_path / "export", dtype=torch.float32)
    loaded = LTX2VideoTransformer3DModel.from_pretrained(export)
    pipe = build()
    pipe.transformer = loaded
    trained = policy.transformer
    with torch.no_grad():
        want = policy.velocity(z, t, cond)
        policy.transformer = pipe.transformer
        got = policy.velocity(z, t, cond)
        policy.transformer = trained
    assert torch.equal(got, want)
    with torch.no_grad():
        policy.transformer = build().transformer
        base = policy.velocity(z, t, cond)
        policy.transformer = trained
    assert not torch.allclose(base, want, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_keeps_the_lora_gradient(rng_seed):
    seed = rng_seed % 10_000
    policy = lora_policy(seed)
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.tensor([0.95, 0.3])
    cond = policy.encode_prompts(PROMPTS)

    def gradient():
        policy.transformer.zero_grad(set_to_none=True)
        policy.velocity(z, t, cond).square().sum().backward()
        return lora_grads(policy)

    plain = gradient()
    policy.enable_gradient_checkpointing()
    assert policy.transformer.is_gradient_checkpointing
    assert rel_error(gradient(), plain) < 1e-5
