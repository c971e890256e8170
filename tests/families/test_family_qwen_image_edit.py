"""The Qwen-Image-Edit family on its tiny offline twin: a real QwenImageEditPipeline (Qwen2.5-VL with its vision tower
behind a Qwen2VLProcessor), the policy against the pipeline's own __call__ with the same source, JAGG exactness, and
`jagg fit` writing an adapter the pipeline loads."""

import copy
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.grpo import group_advantages
from jagg_lightning.models.conditions import ConditionedPrompt, condition_pixels
from jagg_lightning.policies import FAMILIES, PolicyConfig, build_policy, detect_family
from jagg_lightning.policies.qwen_image import QWEN_IMAGE_LORA_TARGETS
from jagg_lightning.policies.qwen_image_edit import QwenImageEditPolicy, build_tiny_qwen_image_edit_pipeline

from family_cases import CONDITIONED_PROMPTS as PROMPTS, tiny_fit_args
from helpers import MeanIntensity, exact_per_step_gradient, nonzero_advantages, randomize_lora_b, rel_error
from plan_checks import assert_folder_plans_as_twin

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
TALL = [96, 64]  # each side a multiple of the twin's 32 (16x VAE, 2x2 packing)
TINY_AREA = 128 * 128


@pytest.fixture
def small_sources(monkeypatch):
    """The pipeline sends every source to its encoders at about 1024 x 1024 pixels (a literal in ``__call__``; on the
    twin 1-3 s of VAE per source); here diffusers' ``calculate_dimensions`` answers for 128 x 128 instead, to the
    pipeline and to the policy alike (both call it). The real area: test_source_size_is_the_pipelines."""
    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(TINY_AREA, ratio))


def edit_config(**overrides) -> PolicyConfig:
    kw = dict(family="qwen_image_edit", lora_rank=4, lora_alpha=8, lora_targets=QWEN_IMAGE_LORA_TARGETS + ["proj_out"],
              guidance_scale=4.0, negative_prompt=" ", resolution=64)
    return PolicyConfig(**(kw | overrides))


@pytest.fixture(scope="session")
def twin_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_image_edit_twin")
    build_tiny_qwen_image_edit_pipeline(seed=0).save_pretrained(path)
    return path


def sources(pipe, prompts, height, width):
    """Each prompt's source as the 8-bit image a user hands the pipeline: fitted to the sampled size."""
    return pipe.image_processor.numpy_to_pil(pipe.image_processor.pt_to_numpy(condition_pixels(prompts, height, width)))


def run_pipeline(pipe, prompts, latents, guidance, steps, resolution, record=None, **kw):
    """``QwenImageEditPipeline.__call__`` once per prompt (its documented use: one source image), from the given
    packed latents; ``record`` collects the timesteps of the first call."""
    height, width = resolution
    out = []
    for i, (prompt, image) in enumerate(zip(prompts, sources(pipe, prompts, height, width))):
        def on_step(p, k, t, kwargs):
            if record is not None and i == 0:
                record.append(t.detach().clone())
            return {}

        out.append(pipe(image=image, prompt=str(prompt), negative_prompt=" " if guidance > 1 else None,
                        true_cfg_scale=guidance, height=height, width=width, num_inference_steps=steps,
                        latents=latents[i:i + 1].clone(), output_type="latent", callback_on_step_end=on_step,
                        **kw).images)
    return torch.cat(out)


def policy_ode(policy, z, steps, prompts=PROMPTS):
    times, cond = policy.schedule(steps), policy.encode_prompts(prompts)
    with torch.no_grad():
        for k in range(steps):
            z = z + policy.velocity(z, times[k].expand(z.shape[0]), cond) * (times[k + 1] - times[k])
    return z


# ---------------------------------------------------------------------------------------------- the twin
def test_jagg_plan_reads_the_saved_twin_as_the_twin(twin_dir):
    """`jagg plan` on the saved folder (its JSON files: the processor's patching, the 16x VAE) plans what the twin on
    meta plans, tall: the same source grid, vision tokens, traced activations and rows."""
    assert_folder_plans_as_twin("qwen_image_edit", twin_dir, tuple(TALL), guidance_scale=4.0)


def test_twin_round_trips_and_the_vision_tower_reads_the_source(twin_dir, small_sources, rng_seed):
    """Detection from the saved twin's model_index.json; its processor's tokenizer spells the template's system prefix
    in the 64 tokens the pipeline drops; built and loaded twins give the same velocity; the prompt embeddings (not
    only the source tokens) change with the source: Qwen2.5-VL's vision tower sees it."""
    config = edit_config(pretrained=str(twin_dir), family=None, lora_targets=None)
    assert detect_family(config).name == "qwen_image_edit"
    loaded = build_policy(config)
    assert type(loaded).__name__ == "QwenImageEditPolicy" and loaded.pipeline_class.__name__ == "QwenImageEditPipeline"
    assert loaded.transformer.peft_config["default"].target_modules == set(QWEN_IMAGE_LORA_TARGETS)
    pipe = loaded._pipeline
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    ids = pipe.processor.tokenizer(prefix).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 64 and pipe.tokenizer.decode(ids) == prefix

    built = build_policy(edit_config(), pipeline=build_tiny_qwen_image_edit_pipeline(0))
    loaded = build_policy(edit_config(pretrained=str(twin_dir)))
    for policy in (built, loaded):
        randomize_lora_b(policy.transformer, torch.Generator().manual_seed(rng_seed))
    gen = torch.Generator().manual_seed(rng_seed)
    z, t = torch.randn(2, *built.latent_shape, generator=gen), torch.rand(2, generator=gen)
    cond = built.encode_prompts(PROMPTS)
    with torch.no_grad():
        v = built.velocity(z, t, cond)
        assert torch.equal(v, loaded.velocity(z, t, loaded.encode_prompts(PROMPTS))) and v.abs().sum() > 0
    other = built.encode_prompts([ConditionedPrompt(p, [torch.rand(3, 40, 56, generator=gen)]) for p in PROMPTS])
    assert all(a.shape == b.shape and not torch.equal(a, b) for a, b in zip((cond[0], cond[-1]), (other[0], other[-1])))


# ------------------------------------------------------------------------------- policy vs the pipeline
@pytest.mark.parametrize("resolution,steps", [(64, 3), (TALL, 8)])
def test_sampling_times_are_the_pipelines_scheduler_timesteps(resolution, steps, small_sources):
    """mu of the dynamic shift from the latent's own token count (not the source's), as the pipeline."""
    policy = QwenImageEditPolicy(edit_config(resolution=resolution, guidance_scale=1.0))
    seen = []
    run_pipeline(policy._pipeline, PROMPTS[:1], torch.randn(1, *policy.latent_shape), 1.0, steps, policy.resolution,
                 record=seen)
    times = policy.schedule(steps)
    assert torch.equal(times[:-1] * 1000, torch.stack(seen)) and torch.equal(times, policy._pipeline.scheduler.sigmas)


@pytest.mark.parametrize("guidance,resolution", [(4.0, 64), (4.0, TALL), (1.0, TALL[::-1])],
                         ids=["cfg_on", "cfg_on_96x64", "cfg_off_64x96"])
def test_policy_samples_what_the_pipeline_samples(guidance, resolution, small_sources, rng_seed):
    """Same packed noise and source: the policy's Euler ODE (two steps) on its times and velocity is the pipeline's
    denoising loop -- the source through the VL encoder with the prompt and the negative, its latent tokens after the
    latent's, both grids in img_shapes, true CFG and its rescale -- square, tall and wide."""
    policy = QwenImageEditPolicy(edit_config(guidance_scale=guidance, resolution=resolution))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(rng_seed))  # the pipeline runs the adapter too
    assert policy.source_grid != policy.grid  # the source has its own token count and grid
    z0 = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(rng_seed))
    ours = policy_ode(policy, z0, 2)
    assert (ours - z0).abs().mean() > 0
    torch.testing.assert_close(ours, run_pipeline(policy._pipeline, PROMPTS, z0, guidance, 2, policy.resolution),
                               rtol=1e-5, atol=1e-5)
    assert policy.decode(ours).shape == (len(PROMPTS), 3, *policy.resolution)


class Stop(Exception):
    pass


@pytest.mark.parametrize("resolution", [64, TALL])
def test_source_size_is_the_pipelines_at_its_own_area(resolution):
    """Without the small-source patch: the pipeline's VL encoder and VAE get the source at ``policy.source_size``
    (about a megapixel at the sampled aspect ratio) -- stopped before its VAE runs, the one slow part."""
    policy = QwenImageEditPolicy(edit_config(resolution=resolution))
    pipe, seen = policy._pipeline, {}
    encode = pipe.encode_prompt

    def spy_encode(*args, image=None, **kwargs):
        seen["vl"] = image.size[::-1]  # PIL: (width, height)
        return encode(*args, image=image, **kwargs)

    def spy_latents(image, *args, **kwargs):
        seen["vae"] = tuple(image.shape[-2:])
        raise Stop

    pipe.encode_prompt, pipe.prepare_latents = spy_encode, spy_latents
    with pytest.raises(Stop):
        run_pipeline(pipe, PROMPTS[:1], torch.randn(1, *policy.latent_shape), 4.0, 2, policy.resolution)
    assert seen == {"vl": policy.source_size, "vae": policy.source_size}
    assert abs(policy.source_size[0] * policy.source_size[1] / 1024**2 - 1) < 0.05


# ------------------------------------------------------------------------------ the module and the exports
def edit_module(seed, jagg_frac=0.5, window_size=2, optimizer=None, grpo=None, reward="jpeg_compressibility",
                **policy) -> JAGGModule:
    module = JAGGModule(
        edit_config(**policy), SamplingConfig(num_steps=STEPS, group_size=2, noise_level=1.0, rollout_batch_size=4),
        GRPOConfig(**({"train_batch_size": 4} | (grpo or {}))),
        JAGGConfig(window_size=window_size, jagg_frac=jagg_frac),
        optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-2)), reward=reward, seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def fit(module):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=list(PROMPTS), batch_size=2, shuffle=False))


def test_first_update_ratio_is_one(small_sources, rng_seed):
    # no zero-advantage skip: it would repack a micro-batch smaller than the rollout's (tied rewards)
    module = edit_module(rng_seed % 10_000, grpo={"skip_zero_advantage": False})
    assert isinstance(module.policy, FAMILIES["qwen_image_edit"].policy_class()) and module.policy.guided
    assert torch.equal(module.sampler.times, module.policy.schedule(STEPS))
    fit(module)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)
    assert any(r.routed for r in module.window_records) and any(r.backwards > 0 for r in module.window_records)


@pytest.mark.parametrize("jagg_frac,window_size,resolution", [(0.0, 3, 64), (1.0, 2, TALL)],
                         ids=["exact_grpo", "jagg_w2_96x64"])
def test_update_equals_handwritten_per_step_grpo(jagg_frac, window_size, resolution, small_sources, rng_seed):
    """float64, true CFG on: one training step with jagg_frac 0 (windows of 3, all exact) and with JAGG on W = 2
    windows is the plain SGD step on the hand-written per-step GRPO gradient through the source-conditioned velocity."""
    seed, lr = rng_seed % 10_000, 0.5
    module = edit_module(seed, jagg_frac, window_size, lambda p: torch.optim.SGD(p, lr=lr), {"max_grad_norm": None},
                         reward=MeanIntensity(), dtype="float64", resolution=resolution)
    reference = copy.deepcopy(module)
    before = [p.detach().clone() for p in module.policy.lora_parameters()]
    fit(module)
    assert all(w.routed == (jagg_frac == 1.0) for w in module.windows if len(w.steps) == window_size)
    update = [p.detach() - b for p, b in zip(module.policy.lora_parameters(), before)]

    traj, cond, _, rewards, _ = reference.sampler.rollout_and_score(list(PROMPTS), [0, 1], step=0,
                                                                    reward=reference.reward_fn)
    assert cond[-1].dtype == torch.float64 and cond[-1].shape[1] == reference.policy.source_grid[0] * \
        reference.policy.source_grid[1]  # the source's tokens ride in the condition, per sample
    adv = nonzero_advantages(group_advantages(rewards.view(-1, 2)).flatten(), seed)
    grads = exact_per_step_gradient(reference.policy, traj, cond, adv, reference.trained_steps, noise_level=1.0)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    assert rel_error(update, [-lr * g for g in grads]) < 1e-10


@contextmanager
def transformer_of(policy, transformer):
    own, policy.transformer = policy.transformer, transformer
    try:
        yield policy
    finally:
        policy.transformer = own


@pytest.mark.slow
def test_jagg_fit_with_the_tiny_config_writes_an_adapter_the_pipeline_loads(twin_dir, tmp_path, small_sources,
                                                                             rng_seed):
    """`jagg fit` with configs/qwen_image_edit_tiny.yaml on the shipped edits folder and the saved twin (detected),
    at a tall size; a fresh ``QwenImageEditPipeline`` with ``load_lora_weights`` gives the trained velocity and its
    own __call__ samples what the trained policy samples."""
    from diffusers import QwenImageEditPipeline

    seed = str(rng_seed % 10_000)
    args = tiny_fit_args(ROOT / "configs/qwen_image_edit_tiny.yaml", seed, twin_dir, tmp_path, "configs/prompts/edits")
    cli = cli_main([*args, "--model.policy.resolution", str(TALL)], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy = cli.model.policy
    assert type(policy).__name__ == "QwenImageEditPolicy" and policy.guided and policy.resolution == tuple(TALL)

    gen = torch.Generator().manual_seed(int(seed))
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    cond = policy.encode_prompts(PROMPTS)
    pipe = QwenImageEditPipeline.from_pretrained(twin_dir)
    with torch.no_grad():
        expected = policy.velocity(z, t, cond)
        with transformer_of(policy, pipe.transformer):
            base = policy.velocity(z, t, cond)
        pipe.load_lora_weights(str(tmp_path / "lora" / "final" / "diffusers"))
        with transformer_of(policy, pipe.transformer):
            loaded = policy.velocity(z, t, cond)
    assert not torch.allclose(base, expected, rtol=1e-4, atol=1e-5)  # training moved the adapter
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run_pipeline(pipe, PROMPTS, z, 4.0, 2, policy.resolution), policy_ode(policy, z, 2),
                               rtol=1e-5, atol=1e-5)
