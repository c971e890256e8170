"""The Qwen-Image family on its tiny offline twin: a real QwenImagePipeline, the policy against it, JAGG exactness."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import group_advantages
from jagg_lightning.policies import FAMILIES, PolicyConfig, build_policy, detect_family
from jagg_lightning.policies.qwen_image import (
    QWEN_IMAGE_LORA_TARGETS,
    QwenImagePolicy,
    build_tiny_qwen_image_pipeline,
    tiny_qwen_tokenizer,
)
from jagg_lightning.training.rollout import sample_generators, sample_trajectories

from helpers import MeanIntensity, exact_per_step_gradient, lora_grads, nonzero_advantages, randomize_lora_b, rel_error

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a small dog on green grass"]
STEPS = 5
TRAINED = list(range(STEPS - 1))


def qwen_config(**overrides) -> PolicyConfig:
    kw = dict(family="qwen_image", lora_rank=4, lora_alpha=8, lora_targets=QWEN_IMAGE_LORA_TARGETS + ["proj_out"], guidance_scale=4.0,
              negative_prompt=" ", max_sequence_length=16, resolution=32)
    kw.update(overrides)
    return PolicyConfig(**kw)


def qwen_policy(generator, pipeline=None, **overrides) -> QwenImagePolicy:
    policy = QwenImagePolicy(qwen_config(**overrides), pipeline=pipeline)
    randomize_lora_b(policy.transformer, generator)
    return policy


@pytest.fixture(scope="session")
def twin_dir(tmp_path_factory):
    """The tiny twin saved with ``save_pretrained``, as a user's local Qwen-Image directory would be."""
    path = tmp_path_factory.mktemp("qwen_image_twin")
    build_tiny_qwen_image_pipeline(seed=0).save_pretrained(path)
    return path


def run_pipeline(pipe, latents, guidance, steps, resolution=32, output_type="latent", record=None):
    """``QwenImagePipeline.__call__`` from given packed latents at ``resolution`` (a side or (height, width));
    ``record`` collects the timesteps it used."""
    height, width = (resolution, resolution) if isinstance(resolution, int) else resolution

    def on_step(p, i, t, kwargs):
        if record is not None:
            record.append(t.detach().clone())
        return {}

    return pipe(
        list(PROMPTS), negative_prompt=" " if guidance > 1 else None, true_cfg_scale=guidance, height=height,
        width=width, num_inference_steps=steps, latents=latents.clone(), output_type=output_type,
        max_sequence_length=16, callback_on_step_end=on_step,
    ).images


def policy_ode(policy, z, steps):
    times = policy.schedule(steps)
    cond = policy.encode_prompts(list(PROMPTS))
    with torch.no_grad():
        for k in range(steps):
            z = z + policy.velocity(z, times[k].expand(z.shape[0]), cond) * (times[k + 1] - times[k])
    return z


# ---------------------------------------------------------------------------------------------- the twin
def test_tokenizer_template_prefix_is_the_34_tokens_the_pipeline_drops():
    tokenizer = tiny_qwen_tokenizer()
    pipe = build_tiny_qwen_image_pipeline()
    prefix, _ = pipe.prompt_template_encode.split("{}")
    ids = tokenizer(pipe.prompt_template_encode.format("a red cat")).input_ids
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert tokenizer.decode(ids[:34]) == prefix  # exactly the system part and "user\n" are dropped
    assert tokenizer.convert_ids_to_tokens(ids[:1] + ids[29:30]) == ["<|im_start|>", "<|im_end|>"]


def test_twin_round_trips_through_save_and_from_pretrained(twin_dir, rng_seed):
    from diffusers import QwenImagePipeline

    built = build_tiny_qwen_image_pipeline(seed=0)
    loaded = QwenImagePipeline.from_pretrained(twin_dir)
    assert type(loaded.tokenizer).__name__ == "Qwen2Tokenizer"
    assert loaded.scheduler.config.use_dynamic_shifting and loaded.scheduler.config.shift_terminal == 0.02
    gen = torch.Generator().manual_seed(rng_seed)
    z0 = torch.randn(len(PROMPTS), 64, 16, generator=gen)
    for guidance in (1.0, 4.0):
        a = run_pipeline(built, z0, guidance, 2, output_type="pt")
        b = run_pipeline(loaded, z0, guidance, 2, output_type="pt")
        assert a.shape == (2, 3, 32, 32) and torch.equal(a, b)
    policy_built = qwen_policy(torch.Generator().manual_seed(rng_seed), pipeline=built)
    policy_loaded = qwen_policy(torch.Generator().manual_seed(rng_seed), pretrained=str(twin_dir))
    t = torch.rand(2, generator=gen)
    v_built = policy_built.velocity(z0, t, policy_built.encode_prompts(PROMPTS))
    v_loaded = policy_loaded.velocity(z0, t, policy_loaded.encode_prompts(PROMPTS))
    assert torch.equal(v_built, v_loaded) and v_built.abs().sum() > 0


# ------------------------------------------------------------------------------- policy vs the pipeline
@pytest.mark.parametrize("guidance,resolution", [(1.0, 32), (4.0, 32), (4.0, [48, 32]), (1.0, [32, 48])],
                         ids=["cfg_off", "cfg_on", "cfg_on_48x32", "cfg_off_32x48"])
def test_policy_samples_what_the_pipeline_samples(guidance, resolution, rng_seed):
    """Same packed noise: the policy's Euler ODE on its times and velocity equals the pipeline's denoising loop,
    and its decode equals the pipeline's image (latent un-normalisation, VAE, postprocess) -- square, tall and wide
    (the RoPE's image shapes and the unpacking take rows and columns apart)."""
    policy = qwen_policy(torch.Generator().manual_seed(rng_seed), guidance_scale=guidance, resolution=resolution)
    pipe = policy._pipeline  # the same (LoRA-adapted) transformer
    z0 = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    ours = policy_ode(policy, z0, 4)
    theirs = run_pipeline(pipe, z0, guidance, 4, resolution=resolution)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    image = run_pipeline(pipe, z0, guidance, 4, resolution=resolution, output_type="pt")
    assert image.shape[-2:] == policy.resolution
    torch.testing.assert_close(policy.decode(ours), image, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("resolution,steps", [(32, 3), (32, 10), (64, 7)])
def test_sampling_times_are_the_pipelines_scheduler_timesteps(resolution, steps):
    policy = QwenImagePolicy(qwen_config(resolution=resolution, guidance_scale=1.0))
    assert policy.latent_shape == ((resolution // 4) ** 2, 16)
    seen = []
    z0 = torch.randn(len(PROMPTS), *policy.latent_shape)
    run_pipeline(policy._pipeline, z0, 1.0, steps, resolution=resolution, record=seen)
    times = policy.schedule(steps)
    assert times.dtype == torch.float32 and times.shape == (steps + 1,)
    assert torch.equal(times[:-1] * 1000, torch.stack(seen))  # the transformer gets timestep / 1000 = t
    assert torch.equal(times, policy._pipeline.scheduler.sigmas)
    assert times[0] == 1 and times[-1] == 0 and abs(float(times[-2]) - 0.02) < 1e-6  # shift_terminal


def test_sde_math_stays_float32_with_bfloat16_weights(rng_seed):
    """bf16 frozen weights: the guided velocity comes back float32 and the rollout (SDE, log-probs) runs in
    float32, close to the float32 twin's; the LoRA weights stay float32."""
    p32 = qwen_policy(torch.Generator().manual_seed(rng_seed))
    p16 = qwen_policy(torch.Generator().manual_seed(rng_seed), dtype="bfloat16")
    assert p16.transformer.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in p16.lora_parameters())
    gens = lambda: sample_generators(rng_seed, 0, range(len(PROMPTS)), 1)  # noqa: E731
    trajs = [sample_trajectories(p.velocity, p.encode_prompts(PROMPTS), gens(), p.latent_shape, p.schedule(4),
                                 ["sde"] * 4, 1.2, 2) for p in (p32, p16)]
    assert trajs[1].latents.dtype == trajs[1].log_probs.dtype == trajs[1].velocities.dtype == torch.float32
    assert torch.isfinite(trajs[1].log_probs).all()
    v32, v16 = trajs[0].velocities, trajs[1].velocities
    assert float((v16 - v32).norm() / v32.norm()) < 0.05


def test_gradient_checkpointing_recomputes_blocks_and_keeps_the_gradient(rng_seed):
    policy = qwen_policy(torch.Generator().manual_seed(rng_seed), dtype="float64")
    gen = torch.Generator().manual_seed(rng_seed)
    z = torch.randn(2, *policy.latent_shape, generator=gen, dtype=torch.float64)
    t, weights = torch.rand(2, generator=gen, dtype=torch.float64), torch.randn(z.shape, generator=gen, dtype=torch.float64)
    cond = policy.encode_prompts(PROMPTS)
    calls = []
    # a pre-hook: the recompute stops early, once it has what backward needs, so it never reaches a forward hook
    policy.transformer.transformer_blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))

    def gradient():
        policy.transformer.zero_grad(set_to_none=True)
        calls.clear()
        (policy.velocity(z, t, cond) * weights).sum().backward()
        return lora_grads(policy), len(calls)

    plain, plain_calls = gradient()
    policy.enable_gradient_checkpointing()
    checkpointed, checkpointed_calls = gradient()
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the block ran again in backward
    assert rel_error(checkpointed, plain) < 1e-12 and sum(float(g.abs().sum()) for g in plain) > 0


def test_bad_resolution_names_the_field():
    with pytest.raises(ValueError, match="policy.resolution must be a multiple of 4"):
        QwenImagePolicy(qwen_config(resolution=30))
    with pytest.raises(ValueError, match=r"policy.resolution must be a multiple of 4 per side .*got \[32, 30\]"):
        QwenImagePolicy(qwen_config(resolution=[32, 30]))


# ------------------------------------------------------------------------------ the module and the exports
def qwen_module(seed, jagg_frac=0.5, window_size=2, optimizer=None, grpo=None, reward="jpeg_compressibility",
                **policy) -> JAGGModule:
    module = JAGGModule(
        qwen_config(**policy),
        SamplingConfig(num_steps=STEPS, group_size=2, noise_level=1.2, rollout_batch_size=4),
        GRPOConfig(**({"train_batch_size": 4} | (grpo or {}))),
        JAGGConfig(window_size=window_size, jagg_frac=jagg_frac),
        optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-2)),
        reward=reward,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def fit(module, root=None, callbacks=()):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=list(callbacks))
    trainer.fit(module, PromptDataModule(prompts=list(PROMPTS), batch_size=2, shuffle=False))
    return trainer


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_first_update_ratio_is_one(guidance, rng_seed):
    # no zero-advantage skip: it would repack a micro-batch smaller than the rollout's (tied rewards)
    module = qwen_module(rng_seed % 10_000, grpo={"skip_zero_advantage": False}, guidance_scale=guidance)
    assert isinstance(module.policy, FAMILIES["qwen_image"].policy_class()) and module.policy.guided == (guidance > 1)
    # the module samples on the pipeline's own schedule, not SD3's
    assert torch.equal(module.sampler.times, module.policy.schedule(STEPS))
    fit(module)
    # exactly 1 at every trained step: the anchors take one forward each on the first update, so every training
    # forward has the rollout's batch shape (one batched anchor forward of twice the rows drifted by 1-2 ulp)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)
    assert any(r.routed for r in module.window_records) and any(r.backwards > 0 for r in module.window_records)


def test_detection_picks_qwen_image_for_the_saved_twin(twin_dir):
    config = PolicyConfig(pretrained=str(twin_dir), lora_rank=2, lora_alpha=2, resolution=32)
    assert detect_family(config).name == "qwen_image"
    policy = build_policy(config)
    assert type(policy).__name__ == "QwenImagePolicy" and policy.family == "qwen_image"
    assert policy.transformer.peft_config["default"].target_modules == set(QWEN_IMAGE_LORA_TARGETS)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A" in n}
    assert len(adapted) == len(QWEN_IMAGE_LORA_TARGETS) * policy.transformer.config.num_layers  # each target, each block
    assert policy.pipeline_class.__name__ == "QwenImagePipeline"


@pytest.mark.parametrize("jagg_frac,window_size,resolution", [(0.0, 3, 32), (1.0, 2, 32), (1.0, 2, [48, 32])],
                         ids=["exact_grpo", "jagg_w2", "jagg_w2_48x32"])
def test_update_equals_handwritten_per_step_grpo(jagg_frac, window_size, resolution, rng_seed):
    """float64, true CFG on: one training step with jagg_frac 0 (windows of 3, all exact) and with JAGG on W = 2
    windows (no interior step) is the plain SGD step on the hand-written per-step GRPO gradient (square and not)."""
    seed, lr = rng_seed % 10_000, 0.5
    module = qwen_module(seed, jagg_frac, window_size, lambda p: torch.optim.SGD(p, lr=lr), {"max_grad_norm": None},
                         reward=MeanIntensity(), dtype="float64", resolution=resolution)
    assert module.policy.guided  # the gradient runs through true CFG and its norm rescale
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    fit(module)
    assert all(w.routed == (jagg_frac == 1.0) for w in module.windows if len(w.steps) == window_size)
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]

    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(list(PROMPTS), [0, 1], step=0, reward=reference.reward_fn)
    adv = nonzero_advantages(group_advantages(rewards.view(-1, 2)).flatten(), seed)
    grads = exact_per_step_gradient(reference.policy, traj, cond, adv, reference.trained_steps, noise_level=1.2)
    names = [n for n, q in reference.policy.transformer.named_parameters() if q.requires_grad]
    for factor in ("lora_A", "lora_B"):  # both LoRA factors receive gradient
        assert sum(float(g.abs().sum()) for n, g in zip(names, grads) if factor in n) > 0
    assert rel_error(update, [-lr * g for g in grads]) < 1e-10


def test_jagg_fit_with_the_tiny_qwen_config_writes_an_adapter_the_pipeline_reproduces(twin_dir, tmp_path, rng_seed):
    """`jagg fit` (LightningCLI, in process) with configs/qwen_image_tiny.yaml on the saved twin, the family
    detected from model_index.json; then a fresh ``QwenImagePipeline`` with ``load_lora_weights`` samples what
    the trained policy samples (its own loop: true CFG and rescale)."""
    from diffusers import QwenImagePipeline

    seed = str(rng_seed % 10_000)
    cli = cli_main([
        "--config", str(ROOT / "configs/qwen_image_tiny.yaml"), "--seed_everything", seed, "--model.seed", seed,
        "--model.policy.family", "null", "--model.policy.pretrained", str(twin_dir),
        "--model.sampling.num_steps", "4", "--model.sampling.group_size", "2", "--model.jagg.window_size", "2",
        "--data.prompts_file", str(ROOT / "configs/prompts/tiny.txt"), "--trainer.max_steps", "2",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
        "--trainer.default_root_dir", str(tmp_path), "--lora_export.dirpath", str(tmp_path / "lora"),
        "--model.policy.resolution", "[32, 48]",
    ], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy = cli.model.policy
    assert type(policy).__name__ == "QwenImagePolicy" and policy.guided and policy.resolution == (32, 48)
    final = tmp_path / "lora" / "final"

    z0 = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(int(seed)))
    trained = policy_ode(policy, z0, 3)
    pipe = QwenImagePipeline.from_pretrained(twin_dir)
    base = run_pipeline(pipe, z0, 4.0, 3, resolution=policy.resolution)
    pipe.load_lora_weights(str(final / "diffusers"))
    assert (base - trained).abs().max() > 1e-4  # training moved the adapter: without it the pipeline differs
    torch.testing.assert_close(run_pipeline(pipe, z0, 4.0, 3, resolution=policy.resolution), trained, rtol=1e-5,
                               atol=1e-5)
