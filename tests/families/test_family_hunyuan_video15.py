"""HunyuanVideo 1.5 text-to-video and image-to-video on their tiny offline twins: detection, round trip, what the
family refuses, the pipelines' own runs (schedule, Qwen2.5-VL + ByT5 prompts and masks, the condition latent and
SigLIP tokens, CFG, decode), the SDE and its log-prob on the family's sigmas, GRPO/JAGG updates against the
hand-written per-step reference in float64, and the LoRA and full-weight exports loaded exactly by diffusers and
peft."""

import copy
import math
import re

import lightning as L
import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Transformer3DModel
from peft import PeftModel
from PIL import Image

from jagg_lightning.data import PromptDataModule
from jagg_lightning.models.adapters import save_adapter
from jagg_lightning.models.export import save_transformer
from jagg_lightning.policies import build_policy, detect_family

from helpers import assert_loaded_velocity_is_the_trained, handwritten_update_error, randomize_lora_b
from plan_checks import assert_folder_plans_as_twin
from hunyuan_video15_twins import hunyuan_twin_dirs  # noqa: F401 (the shared fixture: both twins saved once)
from hunyuan_video15_twins import TWINS, build, config, exact_size_prompts, module_for, prompts

by_twin = pytest.mark.parametrize("twin", list(TWINS))


def lora_policy(twin, seed, pipe=None, **kw):
    policy = build_policy(config(seed=seed, family=twin, **kw), pipeline=pipe if pipe is not None else build(twin))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    return policy


def lora_weights(network) -> dict:
    """Every LoRA weight of a network, by its name without the adapter's (peft's "default", diffusers' "default_0")."""
    return {re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", n): p.detach() for n, p in network.named_parameters()
            if ".lora_" in n}


def fit(module):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=prompts(module.policy.family), batch_size=2, shuffle=False))


@by_twin
def test_detection_and_roundtrip(twin, hunyuan_twin_dirs, rng_seed):
    """The saved twin is detected from model_index.json and loads through from_pretrained to the same condition,
    velocity and schedule as the twin built in memory; ``jagg plan`` reads the folder as the twin (a wide 5-frame
    clip)."""
    seed = rng_seed % 10_000
    path = str(hunyuan_twin_dirs[twin])
    assert detect_family(config(pretrained=path)).name == twin
    loaded, built = build_policy(config(pretrained=path, seed=seed)), lora_policy(twin, seed)
    randomize_lora_b(loaded.transformer, torch.Generator().manual_seed(seed))
    assert type(loaded) is type(built) and built.condition_images == ((1, 1) if TWINS[twin] else (0, 0))
    z = torch.randn(2, *built.latent_shape, generator=torch.Generator().manual_seed(seed))
    t = torch.rand(2, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        conds = [p.encode_prompts(prompts(twin)) for p in (built, loaded)]
        v_built, v_loaded = (p.velocity(z, t, c) for p, c in zip((built, loaded), conds))
    assert built.latent_shape == (4, 3, 2, 2) and v_built.shape == z.shape and v_built.abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(*conds)) and torch.equal(v_built, v_loaded)
    assert torch.equal(built.schedule(6), loaded.schedule(6))
    assert_folder_plans_as_twin(twin, path, (32, 48), frames=5, guidance_scale=6.0)


def test_what_the_family_refuses_names_the_field():
    with pytest.raises(ValueError, match=r"policy.num_frames must be 4 k \+ 1"):
        build_policy(config(family="hunyuan_video15", num_frames=8))
    with pytest.raises(ValueError, match="policy.resolution must be a multiple of 16"):
        build_policy(config(family="hunyuan_video15", resolution=40))
    rescaled = build("hunyuan_video15")
    rescaled.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    with pytest.raises(ValueError, match="guidance_rescale 0"):
        build_policy(config(family="hunyuan_video15"), pipeline=rescaled)
    meanflow = build("hunyuan_video15_i2v")
    meanflow.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match="use_meanflow"):
        build_policy(config(family="hunyuan_video15_i2v"), pipeline=meanflow)
    policy = build_policy(config(family="hunyuan_video15_i2v"))
    with pytest.raises(ValueError, match="'a cat' has 0 condition image"):
        policy.encode_prompts(["a cat"])


# the twin's 32 px x 9 frames, and a wide clip of another length (image-to-video: the pipeline's own 16:9 bucket)
SHAPES = {"hunyuan_video15": {"resolution": [32, 48], "num_frames": 5}, "hunyuan_video15_i2v": {"num_frames": 5}}


@by_twin
@pytest.mark.parametrize("wide", [False, True], ids=["32px_9f", "wide_5f"])
def test_velocity_schedule_and_decode_are_the_pipelines(twin, wide, rng_seed):
    """The pipeline's own 4-step run (one prompt per call, CFG 6 with the empty negative; image-to-video with the
    policy's first frame as a PIL image) ends where the policy's Euler ODE on its times and velocity ends; the
    times are the pipeline's sigmas (shift 5); the policy's decode is the pipeline's. The pipeline's padding (ByT5's
    256 columns, text-to-video's 729 zero image tokens) is cut to 32 and 8 here, only to keep its run quick: those
    columns are masked out either way, and the policy drops them."""
    seed = rng_seed % 10_000
    pipe = build(twin)
    pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens = 32, 8
    policy = lora_policy(twin, seed, pipe, **(SHAPES[twin] if wide else {}))
    height, width = policy.resolution
    sampled = exact_size_prompts(twin, height, width)
    times = policy.schedule(4)
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cond = policy.encode_prompts(sampled)
        x = z
        for k in range(4):
            x = x + (times[k + 1] - times[k]) * policy.velocity(x, times[k].expand(2), cond)
        for i, prompt in enumerate(sampled):
            if TWINS[twin]:
                pixels = (prompt.images[0] * 255).round().byte().permute(1, 2, 0).numpy()
                size = {"image": Image.fromarray(pixels)}
            else:
                size = {"height": height, "width": width}
            out = pipe(prompt=[str(prompt)], negative_prompt=[""], num_frames=policy.num_frames, num_inference_steps=4,
                       latents=z[i:i + 1].clone(), output_type="latent", **size).frames
            assert torch.equal(times, pipe.scheduler.sigmas.float())
            torch.testing.assert_close(out, x[i:i + 1], rtol=1e-4, atol=2e-5)
        assert (x - z).abs().mean() > 0.1  # the run moved
        video = pipe.vae.decode(x[:1] / pipe.vae.config.scaling_factor, return_dict=False)[0]
        expected = pipe.video_processor.postprocess_video(video, output_type="pt")
        torch.testing.assert_close(policy.decode(x[:1]), expected, rtol=1e-5, atol=1e-5)
    assert expected.shape == (1, policy.num_frames, 3, height, width)


def test_sde_log_prob_is_flow_grpo_on_the_family_sigmas(hunyuan_twin_dirs, rng_seed):
    """float64: the rollout samples at the family scheduler's sigmas (the pipeline's linspace, shift 5), records the
    policy's velocity at each (z_k, t_k), and each step's log-prob is Flow-GRPO's SDE density (noise level a:
    std a sqrt(t / (1 - t)), t = 1 taking t_1; mean z + (std^2 / 2t dt) z + (1 + std^2 (1 - t) / 2t) v dt; averaged
    over the latent's elements) of the next latent; the scheduler's own step is that mean at noise level 0 (Euler)."""
    module = module_for("hunyuan_video15", hunyuan_twin_dirs["hunyuan_video15"], rng_seed % 10_000, dtype="float64")
    policy, a = module.policy, module.sampling.noise_level
    scheduler = copy.deepcopy(policy._pipeline.scheduler)
    scheduler.set_timesteps(sigmas=list(policy.scheduler_kwargs(4)["sigmas"]))
    traj, cond, *_ = module.sampler.rollout_and_score(prompts("hunyuan_video15"), [0, 1], step=0,
                                                      reward=module.reward_fn)
    sigmas = scheduler.sigmas.double()
    assert torch.equal(traj.times.float(), scheduler.sigmas.float())
    n = traj.latents.shape[1]
    with torch.no_grad():
        for k in module.trained_steps:
            z, x, v = traj.latents[k], traj.latents[k + 1], traj.velocities[k]
            torch.testing.assert_close(v, policy.velocity(z, traj.times[k].expand(n), cond), rtol=1e-10, atol=1e-12)
            t, dt = sigmas[k], sigmas[k + 1] - sigmas[k]
            std = a * torch.sqrt(t / (1 - (sigmas[1] if t == 1 else t)))
            mean = z * (1 + std**2 / (2 * t) * dt) + v * (1 + std**2 * (1 - t) / (2 * t)) * dt
            scale = std * torch.sqrt(-dt)
            log_prob = -((x - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
            torch.testing.assert_close(traj.log_probs[k], log_prob.flatten(1).mean(1), rtol=1e-10, atol=1e-10)
            stepper = copy.deepcopy(scheduler)  # the pipeline's ODE step at k (it steps in float32)
            euler = stepper.step(v, stepper.timesteps[k], z, return_dict=False)[0]
            torch.testing.assert_close(euler, z + dt * v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("twin,jagg_frac,window_size", [("hunyuan_video15", 0.0, 3), ("hunyuan_video15", 1.0, 2),
                                                         ("hunyuan_video15_i2v", 1.0, 2)],
                         ids=["t2v_exact_grpo", "t2v_jagg_w2", "i2v_jagg_w2"])
def test_update_equals_handwritten_per_step_grpo(twin, jagg_frac, window_size, hunyuan_twin_dirs, rng_seed):
    """float64, CFG on: jagg_frac 0 and JAGG on W = 2 windows give the per-step GRPO step (< 1e-10), and the first
    update's ratio is exactly 1."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(twin, hunyuan_twin_dirs[twin], seed, dtype="float64", jagg_frac=jagg_frac,
                        window_size=window_size, optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None)
    assert module.policy.guided
    error = handwritten_update_error(module, prompts(twin), lr, fit)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    full = [w for w in module.windows if len(w.steps) == window_size]
    assert full and all(w.routed == bool(jagg_frac) for w in full)
    assert error < 1e-10


@by_twin
def test_lora_export_loads_exactly_in_diffusers_and_peft(twin, hunyuan_twin_dirs, tmp_path, rng_seed):
    """The adapter written by ``save_adapter`` (as `jagg fit`'s export) loads into a fresh twin's transformer with
    diffusers' ``load_lora_adapter`` and with ``PeftModel.from_pretrained``: every LoRA weight and the velocity
    exactly equal to the trained policy's (0.0 difference)."""
    seed = rng_seed % 10_000
    policy = build_policy(config(pretrained=str(hunyuan_twin_dirs[twin]), seed=seed))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    final = save_adapter(policy, tmp_path / "final")
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    t = torch.rand(2, generator=torch.Generator().manual_seed(seed + 1))
    fresh = build(twin).transformer
    fresh.load_lora_adapter(str(final / "diffusers"), use_safetensors=True)
    peft = PeftModel.from_pretrained(build(twin).transformer, str(final / "peft")).base_model.model
    trained = lora_weights(policy.transformer)
    for loaded in (fresh, peft):
        weights = lora_weights(loaded)
        assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in trained)
    assert_loaded_velocity_is_the_trained(policy, (fresh, peft), z, t, policy.encode_prompts(prompts(twin)))


@by_twin
def test_full_weight_export_loads_exactly_in_the_pipeline(twin, hunyuan_twin_dirs, tmp_path, rng_seed):
    """``trainable: full``: after a gradient step on every weight, the consolidated export loads as
    ``<Pipeline>.from_pretrained(base, transformer=HunyuanVideo15Transformer3DModel.from_pretrained(export))`` with
    every weight and the velocity exactly the trained policy's."""
    seed = rng_seed % 10_000
    base = hunyuan_twin_dirs[twin]
    policy = build_policy(config(pretrained=str(base), family=twin, trainable="full", lora_rank=32, lora_alpha=64,
                                 lora_targets=None))
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    t = torch.rand(2, generator=torch.Generator().manual_seed(seed + 1))
    cond = policy.encode_prompts(prompts(twin))
    policy.velocity(z, t, cond).square().mean().backward()
    with torch.no_grad():
        for p in policy.lora_parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    export = save_transformer(policy, tmp_path / "export", max_shard_size=4_000_000)
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(export)
    pipe = type(policy._pipeline).from_pretrained(base, transformer=transformer)
    loaded = build_policy(config(pretrained=str(base), family=twin, trainable="full", lora_rank=32, lora_alpha=64,
                                 lora_targets=None), pipeline=pipe)
    trained, exported = policy.transformer.state_dict(), pipe.transformer.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(v, trained[k]) for k, v in exported.items())
    with torch.no_grad():
        assert torch.equal(loaded.velocity(z, t, cond), policy.velocity(z, t, cond))
