"""Wan image-to-video on its tiny offline twins -- Wan2.1 I2V (``wan_i2v``: the first frame's VAE latent with its
mask channels beside the sampled latent, CLIP image tokens) and Wan2.2 TI2V-5B's ``expand_timesteps`` mode
(``wan22_ti2v``: the first latent frame is the image's, the SDE samples the rest): detection, round trip,
``WanImageToVideoPipeline.__call__``'s own steps and schedule with ``image=`` the same first frame (square and
non-square), exact first update, GRPO/JAGG gradients against the hand-written per-step reference in float64, and
`jagg fit` on the shipped edits writing an adapter the pipeline's ``load_lora_weights`` loads exactly (the Wan2.1
run scored with ``FirstFrameConsistency``)."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from peft import PeftModel

from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.policies import build_policy, detect_family
from jagg_lightning.policies.wan_i2v import build_tiny_wan_i2v_pipeline
from jagg_lightning.utils.batching import batch_slice

from family_cases import tiny_fit_args
from helpers import handwritten_update_error, nonzero_advantages, randomize_lora_b
from plan_checks import assert_folder_plans_as_twin
from wan_i2v_twins import PROMPTS, TWINS, build, config, module_for, pipeline_latents, save_tiny_clip

ROOT = Path(__file__).resolve().parents[2]
by_twin = pytest.mark.parametrize("twin", list(TWINS))


@pytest.fixture(scope="module")
def twin_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v_twins")
    for twin in TWINS:
        build(twin).save_pretrained(root / twin)
    return {twin: root / twin for twin in TWINS}


def lora_policy(twin, seed, pipe=None, **kw):
    policy = build_policy(config(seed=seed, family=twin, **kw), pipeline=pipe if pipe is not None else build(twin))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    return policy


def fit(module):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))


@by_twin
def test_detection_and_roundtrip(twin, twin_dirs, rng_seed):
    """The saved twin is detected from model_index.json (one pipeline class: ``expand_timesteps`` picks TI2V) and
    loads through from_pretrained to the same velocity, condition and schedule."""
    seed = rng_seed % 10_000
    path = str(twin_dirs[twin])
    assert detect_family(config(pretrained=path)).name == twin
    loaded = build_policy(config(pretrained=path, seed=seed))
    built = lora_policy(twin, seed)
    randomize_lora_b(loaded.transformer, torch.Generator().manual_seed(seed))
    assert type(loaded) is type(built) and loaded.family == twin and loaded.condition_images == (1, 1)
    z = torch.randn(2, *built.latent_shape, generator=torch.Generator().manual_seed(seed))
    t = torch.rand(2, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        v_built, v_loaded = (p.velocity(z, t, p.encode_prompts(PROMPTS)) for p in (built, loaded))
    assert built.latent_shape == ((8, 2, 2, 2) if TWINS[twin] else (4, 3, 4, 4))  # TI2V: the first frame not sampled
    assert v_built.shape == z.shape and v_built.abs().sum() > 0
    assert torch.equal(v_built, v_loaded) and torch.equal(built.schedule(6), loaded.schedule(6))


@by_twin
def test_jagg_plan_reads_the_saved_twin_as_the_twin(twin, twin_dirs):
    """`jagg plan` on the saved folder (its JSON files: the CLIP encoder's tokens, the TI2V VAE's 16x) plans what the
    twin on meta plans, on a wide clip of 5 frames."""
    assert_folder_plans_as_twin(twin, twin_dirs[twin], (32, 64), frames=5, max_sequence_length=512)


def test_what_the_families_refuse_names_the_field():
    i2v, ti2v = build("wan_i2v"), build("wan22_ti2v")
    with pytest.raises(ValueError, match="policy.max_sequence_length must be 512"):
        build_policy(config(family="wan_i2v", max_sequence_length=8), pipeline=i2v)
    with pytest.raises(ValueError, match="name policy.family: wan22_ti2v"):
        build_policy(config(family="wan_i2v"), pipeline=ti2v)
    with pytest.raises(ValueError, match="use policy.family wan_i2v"):
        build_policy(config(family="wan22_ti2v"), pipeline=i2v)
    with pytest.raises(ValueError, match=r"policy.num_frames must be >= 5 for wan22_ti2v"):
        build_policy(config(family="wan22_ti2v", num_frames=1), pipeline=ti2v)
    policy = build_policy(config(family="wan22_ti2v"), pipeline=ti2v)
    with pytest.raises(ValueError, match="'a cat' has 0 condition image"):
        policy.encode_prompts(["a cat"])


# the twin's 32 px x 9 frames, and a wide clip of 5 frames (a multiple of 32 per side: the TI2V VAE's 16x x 2x2 patches)
SHAPES = pytest.mark.parametrize("shape", [{}, {"resolution": [32, 64], "num_frames": 5}], ids=["32px_9f", "32x64_5f"])


@by_twin
@SHAPES
def test_velocity_and_schedule_are_the_pipelines(twin, shape, rng_seed):
    """WanImageToVideoPipeline's own 4-step Euler run on each prompt with ``image=`` its fitted first frame: the
    times are its sigmas and v_k = (z_{k+1} - z_k) / (t_{k+1} - t_k) on the sampled frames is the policy's
    v(z_k, t_k) -- same prompts, condition latent and mask, CLIP image tokens, per-token timesteps (TI2V), CFG. TI2V:
    the pipeline's output starts with the policy's condition frame."""
    seed = rng_seed % 10_000
    pipe = build(twin)
    if not TWINS[twin]:  # the pipeline's CLIP processor, given the same [0, 1] pixels, is told so (as the policy does)
        pipe.image_processor.do_rescale = False
    policy = lora_policy(twin, seed, pipe, **shape)
    times = policy.schedule(4)
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS)
        for i, prompt in enumerate(PROMPTS):
            seen, out = pipeline_latents(pipe, policy, z[i:i + 1], prompt, 4, guidance_scale=5.0)
            assert torch.equal(times, pipe.scheduler.sigmas.float())
            for k in range(4):
                v = policy.velocity(seen[k], times[k].expand(1), batch_slice(cond, slice(i, i + 1)))
                implied = (seen[k + 1] - seen[k]) / (times[k + 1] - times[k])
                assert v.abs().mean() > 0
                torch.testing.assert_close(v, implied, rtol=1e-4, atol=2e-5)
            if TWINS[twin]:  # the image's latent over the first frame, the sampled frames behind it
                assert torch.equal(out[:, :, :1], cond[-1][i:i + 1]) and torch.equal(out[:, :, 1:], seen[-1])
        videos = policy.decode_samples(z, PROMPTS)
    assert videos.shape == (2, policy.num_frames, 3, *policy.resolution)


def test_two_experts_follow_the_pipeline(rng_seed):
    """Wan2.2 I2V-A14B's shape (two experts, no CLIP image tokens, boundary 0.9): each step through its expert with its
    scale, as the pipeline's 4-step run (step 0 on ``transformer``, steps 1-3 on ``transformer_2``)."""
    seed = rng_seed % 10_000
    pipe = build_tiny_wan_i2v_pipeline(0, two_experts=True)
    policy = build_policy(config(seed=seed, family="wan_i2v", guidance_scale_2=3.0), pipeline=pipe)
    for expert in policy.experts:
        randomize_lora_b(expert, torch.Generator().manual_seed(seed))
    times = policy.schedule(4)
    assert policy.expert_index(times[:-1]) == [0, 1, 1, 1] and policy.image_encoder is None
    z = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS[:1])
        seen, _ = pipeline_latents(pipe, policy, z, PROMPTS[0], 4, guidance_scale=5.0, guidance_scale_2=3.0)
        for k in range(4):
            implied = (seen[k + 1] - seen[k]) / (times[k + 1] - times[k])
            v = policy.velocity(seen[k], times[k].expand(1), cond)
            torch.testing.assert_close(v, implied, rtol=1e-4, atol=2e-5)


@by_twin
def test_first_update_ratio_is_one_with_cfg(twin, twin_dirs, rng_seed):
    module = module_for(twin, twin_dirs[twin], rng_seed % 10_000)
    assert module.policy.guided
    assert module.sampler.activation_bytes() > 0  # memory.budget_mb's probe pass carries a condition image
    fit(module)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)


@by_twin
@pytest.mark.parametrize("jagg_frac,window_size,shape", [(0.0, 3, None),
                                                         (1.0, 2, {"resolution": [32, 64], "num_frames": 5})],
                         ids=["exact_grpo", "jagg_w2_32x64_5f"])
def test_update_equals_handwritten_per_step_grpo(twin, twin_dirs, jagg_frac, window_size, shape, rng_seed):
    """float64, CFG on: jagg_frac 0 and JAGG on W = 2 windows give the per-step GRPO step (< 1e-10)."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(twin, twin_dirs[twin], seed, dtype="float64", jagg_frac=jagg_frac, window_size=window_size,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, shape=shape)
    error = handwritten_update_error(module, PROMPTS, lr, fit, lambda adv: nonzero_advantages(adv, seed))
    full = [w for w in module.windows if len(w.steps) == window_size]
    assert full and all(w.routed == bool(jagg_frac) for w in full)
    assert error < 1e-10


@pytest.mark.slow
@by_twin
def test_jagg_fit_writes_an_adapter_the_pipeline_loads(twin, twin_dirs, tmp_path, rng_seed):
    """`jagg fit` with the family's tiny config on the saved twin (detected), the shipped edits' images as first frames,
    a wide clip; the Wan2.1 run scored with FirstFrameConsistency beside JPEG compressibility. The adapter loaded with
    ``WanImageToVideoPipeline.load_lora_weights`` (and PeftModel) reproduces the trained velocity, and the pipeline's
    own step with it is the policy's."""
    seed = str(rng_seed % 10_000)
    tiny = ROOT / ("configs/wan22_ti2v_tiny.yaml" if TWINS[twin] else "configs/wan_i2v_tiny.yaml")
    args = [*tiny_fit_args(tiny, seed, twin_dirs[twin], tmp_path, "configs/prompts/edits"),
            "--model.policy.resolution", "[32, 64]", "--model.policy.num_frames", "5"]
    if not TWINS[twin]:
        clip = str(save_tiny_clip(tmp_path / "clip"))
        args += ["--model.reward", json.dumps({"class_path": "jagg_lightning.rewards.WeightedReward", "init_args": {
            "rewards": [{"class_path": "jagg_lightning.rewards.FrameReward",
                         "init_args": {"reward": "jpeg_compressibility", "frames": 2}},
                        {"class_path": "jagg_lightning.rewards.FirstFrameConsistency",
                         "init_args": {"model_path": clip}}],
            "weights": [1.0, 10.0]}})]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy, final = cli.model.policy, tmp_path / "lora" / "final"
    assert policy.family == twin and policy.guided and policy.resolution == (32, 64)
    if not TWINS[twin]:
        consistency = cli.trainer.callback_metrics["train/reward/first_frame_consistency"]
        assert -1 <= float(consistency) <= 1 and float(consistency) != 0

    gen = torch.Generator().manual_seed(int(seed))
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    pipe = build(twin)
    pipe.load_lora_weights(str(final / "diffusers"))
    fresh = PeftModel.from_pretrained(build(twin).transformer, str(final / "peft")).base_model.model
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS)
        expected = policy.velocity(z, t, cond)
        own = policy.transformer
        for loaded in (pipe.transformer, fresh):
            policy.transformer = loaded
            try:
                torch.testing.assert_close(policy.velocity(z, t, cond), expected, rtol=1e-5, atol=1e-6)
            finally:
                policy.transformer = own
        with policy.adapter_disabled():
            assert not torch.allclose(policy.velocity(z, t, cond), expected, rtol=1e-4, atol=1e-5)
        if not TWINS[twin]:
            pipe.image_processor.do_rescale = False
        seen, _ = pipeline_latents(pipe, policy, z[:1], PROMPTS[0], 1, policy.config.guidance_scale)
        v = policy.velocity(z[:1], torch.ones(1), batch_slice(cond, slice(0, 1)))
        torch.testing.assert_close(seen[0] - seen[1], v, rtol=1e-4, atol=2e-5)  # one Euler step from t = 1
