"""Wan2.2 (two experts) beyond a fresh LoRA run: starting from an exported adapter loads *both* experts' LoRA
(PEFT and diffusers formats, each expert's own rank / alpha), a Wan2.1 / Wan2.2 mismatch fails naming
``policy.adapter``, `jagg validate` with the adapter scores what the trained policy scores; and full fine-tuning
(``trainable: full``) trains both experts' own weights, against a hand-written per-step GRPO gradient in float64,
with a frozen KL reference of both experts and an export of both."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file

from jagg_lightning.callbacks import LoRAExport
from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import group_advantages
from jagg_lightning.models.adapters import lora_state_dict, save_adapter
from jagg_lightning.policies import PolicyConfig, build_policy
from jagg_lightning.policies.checks import check_policy
from jagg_lightning.policies.wan import build_tiny_wan_pipeline
from jagg_lightning.utils.checks import PolicyBuildError

from wan_twins import WAN, full_module
from helpers import exact_per_step_gradient, nonzero_advantages, rel_error

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog"]
# 5 frames at 16 px (latents [4, 2, 2, 2]): the twin's smallest video, to keep the VAE and the forwards quick


def randomize_lora(policy, generator, scale=0.05):
    """Both LoRA factors of every expert random (a trained adapter, not peft's B = 0 start)."""
    with torch.no_grad():
        for expert in policy.experts:
            for name, p in expert.named_parameters():
                if "lora_" in name:
                    p.copy_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def velocities(policy, seed):
    """v at one time per expert (0.95: transformer, 0.3: transformer_2), CFG on."""
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.tensor([0.95, 0.3])
    with torch.no_grad():
        return policy.velocity(z, t, policy.encode_prompts(PROMPTS))


def test_a_wan22_adapter_restores_both_experts_in_both_formats(tmp_path, rng_seed):
    """Trained-like LoRA (rank 4 / alpha 8 on transformer; transformer_2 re-made at rank 2 / alpha 5 on fewer
    targets) exported, then given as ``policy.adapter`` to a policy configured at rank 8: each expert gets its own
    saved shape and weights, and the velocity through both experts equals the trained policy's bit for bit
    (float32, same weights, same operations: tolerance 0)."""
    from peft import LoraConfig

    seed = rng_seed % 10_000
    trained = build_policy(PolicyConfig(family="wan", lora_rank=4, lora_alpha=8, seed=seed, **WAN),
                           pipeline=build_tiny_wan_pipeline(0, two_experts=True))
    trained.transformer_2.delete_adapters("default")  # the second expert with another shape than the first
    trained.transformer_2.add_adapter(LoraConfig(r=2, lora_alpha=5, target_modules=["to_q", "to_v"]))
    randomize_lora(trained, torch.Generator().manual_seed(seed))
    save_adapter(trained, tmp_path / "export")
    expected = velocities(trained, seed)
    for where in ("export", "export/diffusers"):  # PEFT (the export folder's peft/ part), diffusers
        restored = build_policy(PolicyConfig(family="wan", lora_rank=8, lora_alpha=3, seed=seed + 1,
                                             adapter=str(tmp_path / where), **WAN),
                                pipeline=build_tiny_wan_pipeline(0, two_experts=True))
        shapes = [(c.r, c.lora_alpha, sorted(c.target_modules)) for c in
                  (e.peft_config["default"] for e in restored.experts)]
        assert shapes[0][:2] == (4, 8) and shapes[1] == (2, 5, ["to_q", "to_v"]), (where, shapes)
        for mine, theirs in zip(restored.experts, trained.experts):
            saved = lora_state_dict(theirs)
            assert all(torch.equal(v, saved[k]) for k, v in lora_state_dict(mine).items()), where
        assert torch.equal(velocities(restored, seed), expected), where


def test_wan21_and_wan22_adapters_do_not_cross(tmp_path, rng_seed):
    seed = rng_seed % 10_000
    for two in (False, True):
        policy = build_policy(PolicyConfig(family="wan", lora_rank=2, lora_alpha=2, seed=seed, **WAN),
                              pipeline=build_tiny_wan_pipeline(0, two_experts=two))
        save_adapter(policy, tmp_path / f"two_{two}")
    for two in (False, True):  # the other kind's adapter, in each format
        for part in ("", "diffusers"):
            with pytest.raises(PolicyBuildError, match=r"policy.adapter: .* holds a LoRA for .*Wan2.2 adapter"):
                build_policy(PolicyConfig(family="wan", adapter=str(tmp_path / f"two_{not two}" / part), **WAN),
                             pipeline=build_tiny_wan_pipeline(0, two_experts=two))
    with pytest.raises(ValueError, match=r"policy.adapter must be left at its default .* policy.trainable 'full'"):
        PolicyConfig(family="wan22", trainable="full", adapter=str(tmp_path / "two_True"))
    # with a saved pipeline the config check refuses it from the files, before any model is built; the right one passes
    for two in (False, True):
        build_tiny_wan_pipeline(0, two_experts=two).save_pretrained(tmp_path / f"pipe_{two}")
        for part in ("", "peft", "diffusers"):
            with pytest.raises(ValueError, match=r"policy.adapter: .* holds a LoRA for .*Wan2.2 adapter"):
                check_policy(PolicyConfig(pretrained=str(tmp_path / f"pipe_{two}"),
                                          adapter=str(tmp_path / f"two_{not two}" / part), **WAN))
            check_policy(PolicyConfig(pretrained=str(tmp_path / f"pipe_{two}"), adapter=str(tmp_path / f"two_{two}" / part),
                                      **WAN))


def test_jagg_validate_with_a_wan22_adapter_scores_the_trained_policy(tmp_path, rng_seed):
    """`jagg validate --model.policy.adapter <export>/diffusers` on configs/wan22_tiny.yaml logs the held-out
    rewards the trained policy's own validation logged (2 ODE steps: one per expert; 5 frames at 16 px, quick)."""
    seed = str(rng_seed % 10_000)
    args = ["--config", str(ROOT / "configs/wan22_tiny.yaml"), "--seed_everything", seed, "--model.seed", seed,
            "--model.evaluation.num_steps", "2", "--model.evaluation.grid_prompts", "0", "--model.policy.num_frames", "5",
            "--model.policy.resolution", "16",
            "--data.val_prompts", '["a red cat", "a blue dog"]', "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(tmp_path)]
    cli = cli_main(args, run=False)
    cli.model.configure_model()
    randomize_lora(cli.model.policy, torch.Generator().manual_seed(int(seed)))
    [trained] = cli.trainer.validate(cli.model, cli.datamodule, verbose=False)
    save_adapter(cli.model.policy, tmp_path / "export")
    assert len(trained) >= 2 and all(k.startswith("val/") for k in trained)
    again = cli_main(["validate", *args, "--model.policy.adapter", str(tmp_path / "export" / "diffusers")])
    got = {k: float(v) for k, v in again.trainer.callback_metrics.items()}
    assert got == pytest.approx(trained, rel=1e-6, abs=1e-9)


# ---------------------------------------------------------------------------------------------- full fine-tuning
def test_full_ft_wan22_trains_both_experts_as_per_step_grpo(tmp_path, rng_seed):
    """float64, CFG on, KL on against the frozen copies of both experts (the policy moved off them first, so the KL
    term is not zero), jagg_frac 0: the SGD update of every weight of both experts is -lr x the hand-written
    per-step GRPO gradient (< 1e-10); the reference is the initial model on both experts; the export writes both
    experts as diffusers loads them, reproducing the trained velocity."""
    seed, lr = rng_seed % 10_000, 0.5
    module = full_module(seed)
    module.configure_model()
    policy = module.policy
    per_expert = [[p for p in e.parameters() if p.requires_grad] for e in policy.experts]
    assert [len(ps) for ps in per_expert] == [len(list(e.parameters())) for e in policy.experts]  # every weight
    assert all(p.dtype == torch.float64 for ps in per_expert for p in ps) and not any(
        "lora" in n for n, _ in policy.named_parameters())
    with torch.no_grad():  # move off the initial weights, as training would
        gen = torch.Generator().manual_seed(seed)
        for p in policy.lora_parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in policy.lora_parameters()]
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[LoRAExport(str(tmp_path))])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:1], batch_size=1, shuffle=False))
    update = [p.detach() - b for p, b in zip(policy.lora_parameters(), before)]

    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(PROMPTS[:1], [0], step=0, reward=reference.reward_fn)
    adv = nonzero_advantages(group_advantages(rewards.view(-1, 2)).flatten(), seed)
    steps = reference.trained_steps
    assert set(reference.policy.expert_index(traj.times[steps])) == {0, 1}  # both experts have trained steps
    ref_v = reference.sampler.reference_velocities(traj, cond, steps)
    expected = [-lr * g for g in exact_per_step_gradient(reference.policy, traj, cond, adv, steps, kl_beta=0.3,
                                                         ref_v=ref_v)]
    split = len(per_expert[0])
    assert all(sum(float(u.abs().sum()) for u in part) > 0 for part in (expected[:split], expected[split:]))
    assert rel_error(update[:split], expected[:split]) < 1e-10 and rel_error(update[split:], expected[split:]) < 1e-10

    initial = build_policy(PolicyConfig(family="wan22", trainable="full", dtype="float64", seed=seed, **WAN))
    trained_v = velocities(policy, seed)
    with policy.adapter_disabled():
        reference_v = velocities(policy, seed)
    assert torch.equal(reference_v, velocities(initial, seed))
    assert all(not torch.allclose(trained_v[i], reference_v[i], rtol=1e-6, atol=1e-9) for i in (0, 1))

    loaded = {}
    for name, expert in zip(("transformer", "transformer_2"), policy.experts):  # the written weights are the trained
        loaded[name] = WanTransformer3DModel.from_pretrained(tmp_path / "final" / name, torch_dtype=torch.float64)
        written = load_file(tmp_path / "final" / name / "diffusion_pytorch_model.safetensors")
        assert written.keys() == expert.state_dict().keys()
        assert all(torch.equal(written[k], v) for k, v in expert.state_dict().items()), name
    own = dict(policy._modules)
    policy._modules.update(loaded)
    try:  # diffusers loads Wan's rope / time embedder / norms in float32 (_keep_in_fp32_modules): not bit for bit
        torch.testing.assert_close(velocities(policy, seed), trained_v, rtol=1e-4, atol=1e-5)
    finally:
        policy._modules.update({n: own[n] for n in loaded})


def test_full_ft_trainable_modules_apply_to_both_experts():
    policy = build_policy(PolicyConfig(family="wan22", trainable="full", trainable_modules=["attn2"], **WAN))
    for expert in policy.experts:
        trained = {n for n, p in expert.named_parameters() if p.requires_grad}
        assert trained and all(".attn2." in n for n in trained)
        assert trained == {n for n, _ in expert.named_parameters() if ".attn2." in n}
    assert len(policy.lora_parameters()) == 2 * len(trained)
