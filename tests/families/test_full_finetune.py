"""Full-parameter GRPO (``policy.trainable: full``) on the tiny SD3 twin, one process: the engine's gradient over
every weight against a hand-written per-step GRPO gradient (float64), the frozen KL reference copy, subsets,
the first update's ratio, the consolidated export, and config errors. Many processes: test_full_finetune_fsdp2.py."""

import math

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import StepRecord, step_loss
from jagg_lightning.method.jagg import accumulate_gradients, plan_windows
from jagg_lightning.method.routing import route_windows
from jagg_lightning.method.sde import flow_match_sigmas
from jagg_lightning.models.export import save_transformer
from jagg_lightning.models.reference import attach_reference
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.policies.sd3 import SD3Policy
from jagg_lightning.training.rollout import sample_generators, sample_trajectories
from jagg_lightning.training.sampler import Sampler

from helpers import counted_velocity, rel_error

STEPS = 6
TRAINED = list(range(STEPS - 1))
PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]


def full_config(seed=0, **overrides) -> PolicyConfig:
    return PolicyConfig(**({"trainable": "full", "guidance_scale": 1.0, "max_sequence_length": 4, "seed": seed}
                           | overrides))


def perturb(module: torch.nn.Module, generator, scale=0.02) -> None:
    """Move every trainable weight off its initial value, as training would."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def grads(policy):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in policy.lora_parameters()]


def hand_gradient(policy, traj, cond, adv, ref_v, noise=0.7, clip=1e-4, beta=0.0):
    """Per-step GRPO written out here (Flow-GRPO SDE density, clipped surrogate, KL over 2 sigma^2), one forward
    and one backward per trained step, summed: the reference the engine must reproduce."""
    policy.transformer.zero_grad(set_to_none=True)
    n = traj.latents.shape[1]
    for k in TRAINED:
        z, z1, t, t1 = traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1])
        v = policy.velocity(z, traj.times[k].expand(n), cond).to(torch.float64)
        dt = t1 - t
        sigma = noise * math.sqrt(t / (1 - (t1 if t >= 1 else t)))
        s = sigma * math.sqrt(-dt)

        def mean_of(vel):
            return z + (vel + sigma**2 / (2 * t) * (z + (1 - t) * vel)) * dt

        mu = mean_of(v)
        logp = (-((z1 - mu) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
        ratio = torch.exp(logp - traj.log_probs[k])
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
        if beta:
            loss = loss + beta * ((mu - mean_of(ref_v[k])) ** 2).flatten(1).mean(1) / (2 * sigma**2)
        (loss.mean() / len(TRAINED)).backward()
    return grads(policy)


def rollout(policy, seed):
    cond = tuple(c.repeat_interleave(2, 0) for c in policy.encode_prompts(PROMPTS[:2]))
    traj = sample_trajectories(policy.velocity, cond, sample_generators(seed, 0, range(2), 2), policy.latent_shape,
                               flow_match_sigmas(STEPS), ["sde"] * STEPS, 0.7, 8, dtype=torch.float64)
    return traj, cond


def test_full_ft_engine_equals_hand_written_grpo_gradient_float64(rng_seed):
    """jagg_frac = 0 and a W = 2 routed window give the per-step GRPO gradient over every weight (< 1e-10), with
    KL against the frozen initial copy (the policy moved off it first, so the KL term is not zero)."""
    gen = torch.Generator().manual_seed(rng_seed)
    policy = SD3Policy(full_config(rng_seed % 1000, dtype="float64"))
    attach_reference(policy, kl_beta=0.3)
    perturb(policy.transformer, gen)
    assert all(p.dtype == torch.float64 for p in policy.transformer.parameters())
    traj, cond = rollout(policy, rng_seed)
    sampler = Sampler(policy, SamplingConfig(num_steps=STEPS, group_size=2), kl_beta=0.3)
    with counted_velocity(policy) as forwards:
        ref_v = sampler.reference_velocities(traj, cond, TRAINED)
    assert len(forwards) == len(TRAINED) and float(ref_v[0].abs().sum()) > 0
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    expected = hand_gradient(policy, traj, cond, adv, ref_v, beta=0.3)
    trainable = policy.lora_parameters()
    assert len(trainable) == len(list(policy.transformer.parameters())) > 20  # every weight, none a LoRA factor
    assert all(float(g.abs().sum()) > 0 for g in expected[:3])

    def loss_fn(k, v):
        record = StepRecord(traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1]),
                            traj.log_probs[k], adv, ref_v[k])
        return step_loss(v, record, kl_beta=0.3)[0].mean() / len(TRAINED)

    for window_size, frac in ((3, 0.0), (2, 1.0)):
        windows = plan_windows(TRAINED, window_size)
        route_windows(windows, [0.0] * len(windows), frac, window_size)
        assert any(w.routed for w in windows) == (frac > 0)
        policy.transformer.zero_grad(set_to_none=True)
        accumulate_gradients(policy.velocity, traj.latents, traj.times, cond, loss_fn, windows)
        assert rel_error(grads(policy), expected) < 1e-10, (window_size, frac)


def test_frozen_reference_is_the_initial_model(rng_seed):
    """The reference copy of a trained (moved) full policy gives the velocity of a separately built, untouched
    model of the same weights, bit for bit; it is kept in the compute dtype, outside the module tree; with
    kl_beta = 0 no copy is made."""
    seed = rng_seed % 1000
    policy = SD3Policy(full_config(seed, dtype="float64"))
    assert attach_reference(policy, kl_beta=0.0) is None and getattr(policy, "frozen_reference", None) is None
    reference = attach_reference(policy, kl_beta=0.1)
    names = {n for n, _ in policy.named_parameters()}
    assert not any(p.requires_grad for p in reference.parameters()) and len(names) == len(dict(policy.named_parameters()))
    perturb(policy.transformer, torch.Generator().manual_seed(rng_seed))
    untouched = SD3Policy(full_config(seed, dtype="float64"))
    cond = policy.encode_prompts(PROMPTS[:3])
    z = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed), dtype=torch.float64)
    t = torch.rand(3, generator=torch.Generator().manual_seed(rng_seed + 1), dtype=torch.float64)
    sampler = Sampler(policy, SamplingConfig(num_steps=STEPS, group_size=3), kl_beta=0.1)
    with torch.no_grad(), counted_velocity(policy) as forwards:
        got = sampler.reference_velocity(z, t, cond)
    with torch.no_grad():
        trained, want = policy.velocity(z, t, cond), untouched.velocity(z, t, cond)
    assert torch.equal(got, want) and not torch.equal(trained, want)
    assert len(forwards) == 1
    # bf16 compute: the copy holds bf16 weights while the policy's masters are float32
    low = SD3Policy(full_config(seed, dtype="bfloat16"))
    low_ref = attach_reference(low, kl_beta=0.1)
    assert {p.dtype for p in low.transformer.parameters()} == {torch.float32}
    assert {p.dtype for p in low_ref.parameters()} == {torch.bfloat16}
    with torch.no_grad(), low.adapter_disabled():
        assert low.velocity(z.float(), t.float(), low.encode_prompts(PROMPTS[:3])).dtype == torch.bfloat16


def full_module(seed, dtype="float64", patterns=None, kl_beta=0.2, **grpo):
    return JAGGModule(
        full_config(seed, dtype=dtype, trainable_modules=patterns),
        SamplingConfig(num_steps=STEPS, group_size=3, rollout_batch_size=6),
        GRPOConfig(**({"train_batch_size": 6, "kl_beta": kl_beta, "skip_zero_advantage": False} | grpo)),
        JAGGConfig(window_size=3, jagg_frac=0.5),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        seed=seed,
    )


def fit(module, steps=1, callbacks=()):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
    trainer.fit(module, PromptDataModule(prompts=PROMPTS[:2], batch_size=2, shuffle=False))
    return trainer


def test_subset_trains_exactly_the_named_modules_and_ratio_is_one(rng_seed):
    """``trainable_modules: [attn]``: after a step every attention weight moved (AdamW, float32 masters), every
    other weight is bit-unchanged; the first update's ratio is exactly 1; the KL reference was counted."""
    module = full_module(rng_seed % 1000, dtype="float32", patterns=["attn"])
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.transformer.named_parameters()}
    trainable = {n for n, p in module.policy.transformer.named_parameters() if p.requires_grad}
    assert trainable == {n for n in before if ".attn." in n} and len(trainable) < len(before)
    trainer = fit(module)
    after = dict(module.policy.transformer.named_parameters())
    assert all(not torch.equal(after[n], before[n]) for n in trainable)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trainable)
    assert module.first_update_ratio_deviation == 0.0
    assert float(trainer.callback_metrics["train/passes/reference_forward"]) > 0
    state = trainer.optimizers[0].state
    assert state and all(t.dtype == torch.float32 for s in state.values() for t in s.values() if t.ndim)


def test_consolidated_export_loads_in_the_family_pipeline(tmp_path, rng_seed):
    """A trained full policy written by ``save_transformer`` (sharded safetensors) loads as
    ``StableDiffusion3Pipeline.from_pretrained(base, transformer=SD3Transformer2DModel.from_pretrained(export))``
    and gives the trained velocity bit for bit; the checkpoint holds every trainable weight."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    seed = rng_seed % 1000
    module = full_module(seed, dtype="float32", kl_beta=0.0)
    fit(module)
    assert getattr(module.policy, "frozen_reference", None) is None  # kl_beta = 0: no copy
    base = tmp_path / "base"
    SD3Policy.build_tiny_pipeline(seed).save_pretrained(base)
    export = save_transformer(module.policy, tmp_path / "export", max_shard_size=40_000)
    assert len(list(export.glob("diffusion_pytorch_model-*.safetensors"))) > 1  # really sharded
    pipe = StableDiffusion3Pipeline.from_pretrained(base, transformer=SD3Transformer2DModel.from_pretrained(export),
                                                    text_encoder_3=None, tokenizer_3=None)
    loaded = SD3Policy(full_config(seed), pipeline=pipe)  # plain diffusers objects underneath, no adapter
    cond = module.policy.encode_prompts(PROMPTS[:2])
    z = torch.randn(2, *module.policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    t = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        want, got = module.policy.velocity(z, t, cond), loaded.velocity(z, t, cond)
    assert torch.equal(got, want)


def test_bad_full_ft_config_fails_before_any_model():
    with pytest.raises(ValueError, match=r"policy.lora_rank must be left at its default"):
        PolicyConfig(trainable="full", lora_rank=8)
    with pytest.raises(ValueError, match=r"policy.lora_targets"):
        PolicyConfig(trainable="full", lora_targets=["attn.to_q"])
    with pytest.raises(ValueError, match=r"policy.trainable must be 'lora' or 'full'"):
        PolicyConfig(trainable="all")
    with pytest.raises(ValueError, match=r"policy.trainable_modules must be null with policy.trainable 'lora'"):
        PolicyConfig(trainable_modules=["attn"])
    with pytest.raises(ValueError, match=r"policy.trainable_modules must be a non-empty list"):
        PolicyConfig(trainable="full", trainable_modules="attn")
    with pytest.raises(ValueError, match=r"policy.trainable_modules: 'no_such_block' matches no module"):
        SD3Policy(full_config(trainable_modules=["attn", "no_such_block"]))


def family_cases():
    """tests/support/family_cases.py's twins (SD3.5's shape aside) and Qwen-Image's, which has its own test file."""
    from types import SimpleNamespace

    from jagg_lightning.policies.qwen_image import build_tiny_qwen_image_pipeline

    from family_cases import CASES

    qwen = SimpleNamespace(name="qwen_image", overrides={"family": "qwen_image", "max_sequence_length": 16},
                           build=build_tiny_qwen_image_pipeline, guidance=(1.0, 4.0))
    return [c for c in CASES if c.name != "sd35"] + [qwen]


@pytest.mark.parametrize("case", family_cases(), ids=lambda c: c.name)
def test_every_family_trains_in_full_and_exports(case, tmp_path, rng_seed):
    """Each family's twin with ``trainable: full`` in bf16: float32 masters get a finite gradient on every weight
    (guidance on), the bf16 reference copy runs through the family's velocity, and the export loads back with
    the family's transformer class to the same velocity (float32 export of the masters)."""
    from jagg_lightning.policies import build_policy

    seed = rng_seed % 1000
    overrides = {k: v for k, v in case.overrides.items() if not k.startswith("lora")}
    config = PolicyConfig(**({"max_sequence_length": 4} | overrides | {"trainable": "full", "dtype": "bfloat16",
                                                                       "guidance_scale": case.guidance[1], "seed": seed}))
    policy = build_policy(config, case.build(seed, torch.bfloat16))
    attach_reference(policy, kl_beta=0.1)
    cond = policy.encode_prompts(getattr(case, "prompts", ["a cat", "a dog"]))  # an editing family's carry sources
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    t = torch.tensor([0.8, 0.4])
    v = policy.velocity(z, t, cond)
    v.float().square().mean().backward()
    params = policy.lora_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    assert all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    assert sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params) > 0.8 * len(params)
    with torch.no_grad(), policy.adapter_disabled():
        ref = policy.velocity(z, t, cond)
    assert {p.dtype for p in policy.frozen_reference.parameters()} == {torch.bfloat16} and torch.isfinite(ref).all()
    assert not torch.equal(ref.float(), v.detach().float())  # another dtype: another velocity
    export = save_transformer(policy, tmp_path / "export", dtype=torch.float32)
    loaded = type(policy.transformer).from_pretrained(export)
    assert loaded.dtype == torch.float32
    # a plain loaded transformer has no up-cast hook: give both float32 conditions (what the hook makes of bf16)
    cond = tuple(c.float() if c.is_floating_point() else c for c in cond)
    policy.transformer, trained = loaded, policy.transformer
    with torch.no_grad():
        got = policy.velocity(z, t, cond)
        policy.transformer = trained
        want = policy.velocity(z, t, cond)
    assert torch.equal(got, want)
