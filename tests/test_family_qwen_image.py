"""The Qwen-Image family on its tiny offline twin: a real QwenImagePipeline, the policy against it, JAGG exactness."""

import pytest
import torch

from jagg_lightning.grpo import StepRecord, step_loss
from jagg_lightning.jagg import accumulate_gradients, plan_windows, route_windows
from jagg_lightning.policies.qwen_image import (
    QWEN_IMAGE_LORA_TARGETS,
    QwenImagePolicy,
    build_tiny_qwen_image_pipeline,
    tiny_qwen_tokenizer,
)
from jagg_lightning.policy import PolicyConfig
from jagg_lightning.rollout import sample_generators, sample_trajectories

from helpers import exact_per_step_gradient, lora_grads, randomize_lora_b, rel_error

PROMPTS = ["a red cat", "a small dog on green grass"]
STEPS = 5
TRAINED = list(range(STEPS - 1))


def qwen_config(**overrides) -> PolicyConfig:
    kw = dict(lora_rank=4, lora_alpha=8, lora_targets=QWEN_IMAGE_LORA_TARGETS + ["proj_out"], guidance_scale=4.0,
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


@pytest.fixture(scope="module")
def policy64():
    return qwen_policy(torch.Generator().manual_seed(0), dtype="float64")


def run_pipeline(pipe, latents, guidance, steps, resolution=32, output_type="latent", record=None):
    """``QwenImagePipeline.__call__`` from given packed latents; ``record`` collects the timesteps it used."""

    def on_step(p, i, t, kwargs):
        if record is not None:
            record.append(t.detach().clone())
        return {}

    return pipe(
        list(PROMPTS), negative_prompt=" " if guidance > 1 else None, true_cfg_scale=guidance, height=resolution,
        width=resolution, num_inference_steps=steps, latents=latents.clone(), output_type=output_type,
        max_sequence_length=16, callback_on_step_end=on_step,
    ).images


def policy_ode(policy, z, steps):
    times = policy.sampling_times(steps)
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
@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_policy_samples_what_the_pipeline_samples(guidance, rng_seed):
    """Same packed noise: the policy's Euler ODE on its times and velocity equals the pipeline's denoising loop,
    and its decode equals the pipeline's image (latent un-normalisation, VAE, postprocess)."""
    policy = qwen_policy(torch.Generator().manual_seed(rng_seed), guidance_scale=guidance)
    pipe = policy._pipeline  # the same (LoRA-adapted) transformer
    z0 = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    ours = policy_ode(policy, z0, 4)
    theirs = run_pipeline(pipe, z0, guidance, 4)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(policy.decode(ours), run_pipeline(pipe, z0, guidance, 4, output_type="pt"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("resolution,steps", [(32, 3), (32, 10), (64, 7)])
def test_sampling_times_are_the_pipelines_scheduler_timesteps(resolution, steps):
    policy = QwenImagePolicy(qwen_config(resolution=resolution, guidance_scale=1.0))
    assert policy.latent_shape == ((resolution // 4) ** 2, 16)
    seen = []
    z0 = torch.randn(len(PROMPTS), *policy.latent_shape)
    run_pipeline(policy._pipeline, z0, 1.0, steps, resolution=resolution, record=seen)
    times = policy.sampling_times(steps)
    assert times.dtype == torch.float32 and times.shape == (steps + 1,)
    assert torch.equal(times[:-1] * 1000, torch.stack(seen))  # the transformer gets timestep / 1000 = t
    assert torch.equal(times, policy._pipeline.scheduler.sigmas)
    assert times[0] == 1 and times[-1] == 0 and abs(float(times[-2]) - 0.02) < 1e-6  # shift_terminal


def test_bad_resolution_names_the_field():
    with pytest.raises(ValueError, match="policy.resolution must be a multiple of 4"):
        QwenImagePolicy(qwen_config(resolution=30))


# --------------------------------------------------------------------------------- JAGG exactness, float64
def rollout64(policy, seed, group=2):
    cond = tuple(c.repeat_interleave(group, 0) for c in policy.encode_prompts(PROMPTS))
    gens = sample_generators(seed, 0, range(len(PROMPTS)), group)
    traj = sample_trajectories(policy.velocity, cond, gens, policy.latent_shape, policy.sampling_times(STEPS).double(),
                               ["sde"] * STEPS, 1.2, 8, dtype=torch.float64)
    return traj, cond


@pytest.mark.parametrize("case", ["frac0_w4", "w2_all_routed"])
def test_exact_cases_reproduce_per_step_gradient(policy64, case, rng_seed):
    assert policy64.guided  # true CFG, so the gradient runs through the norm rescale
    traj, cond = rollout64(policy64, rng_seed)
    adv = torch.randn(traj.latents.shape[1], generator=torch.Generator().manual_seed(rng_seed), dtype=torch.float64)
    exact = exact_per_step_gradient(policy64, traj, cond, adv, TRAINED, noise_level=1.2)
    names = [n for n, q in policy64.transformer.named_parameters() if q.requires_grad]
    for factor in ("lora_A", "lora_B"):
        assert sum(float(g.abs().sum()) for n, g in zip(names, exact) if factor in n) > 0
    if case == "w2_all_routed":
        windows = route_windows(plan_windows(TRAINED, 2), [0.0] * 2, 1.0, 2)
        assert sum(w.routed for w in windows) == len(windows) > 1
    else:
        windows = plan_windows(TRAINED, 4)
        route_windows(windows, [0.0] * len(windows), 0.0, 4)
        assert not any(w.routed for w in windows)

    def loss_fn(k, v):
        rec = StepRecord(traj.latents[k], traj.latents[k + 1], float(traj.times[k]), float(traj.times[k + 1]),
                         traj.log_probs[k], adv)
        return step_loss(v, rec, noise_level=1.2)[0].mean() / len(TRAINED)

    policy64.transformer.zero_grad(set_to_none=True)
    accumulate_gradients(policy64.velocity, traj.latents, traj.times, cond, loss_fn, windows)
    assert rel_error(lora_grads(policy64), exact) < 1e-10
