"""Wan2.1 and Wan2.2 (two experts) text-to-video on their tiny offline twins: detection, round trip, the
flow-shift schedule, the pipeline's velocity at every step (both experts), exact first update, GRPO/JAGG
gradients against hand-written per-step references in float64, windows that never straddle the expert switch,
and `jagg fit` writing adapters that ``WanPipeline.load_lora_weights`` loads into both experts."""

from pathlib import Path

import lightning as L
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from peft import PeftModel

from jagg_lightning.cli import cli_main
from jagg_lightning.data import PromptDataModule
from jagg_lightning.method.jagg import plan_windows
from jagg_lightning.policies import build_policy, detect_family

from helpers import checkpointed_gradient_error, handwritten_update_error, nonzero_advantages, randomize_lora_b
from family_cases import tiny_fit_args
from wan_twins import TWINS, build, config, module_for

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog"]
by_twin = pytest.mark.parametrize("twin", list(TWINS))


@pytest.fixture(scope="module")
def twin_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_twins")
    for twin in TWINS:
        build(twin).save_pretrained(root / twin)
    return {twin: root / twin for twin in TWINS}


def fit(module, steps=1):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))


def lora_policy(twin, seed, pipe=None, **kw):
    policy = build_policy(config(seed=seed, family="wan", **kw), pipeline=pipe if pipe is not None else build(twin))
    for expert in policy.experts:
        randomize_lora_b(expert, torch.Generator().manual_seed(seed))
    return policy


@by_twin
def test_detection_and_roundtrip(twin, twin_dirs, rng_seed):
    seed = rng_seed % 10_000
    path = str(twin_dirs[twin])
    assert detect_family(config(pretrained=path)).name == "wan"
    loaded = build_policy(config(pretrained=path, seed=seed))
    built = build_policy(config(seed=seed, family="wan"), pipeline=build(twin))
    assert type(loaded).__name__ == "WanPolicy" and len(loaded.experts) == len(built.experts) == 1 + TWINS[twin]
    for policy in (built, loaded):
        for expert in policy.experts:
            randomize_lora_b(expert, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, *built.latent_shape, generator=gen)
    t = torch.tensor([0.95, 0.3])  # Wan2.2: one sample per expert
    with torch.no_grad():
        v_built, v_loaded = (p.velocity(z, t, p.encode_prompts(PROMPTS)) for p in (built, loaded))
    assert built.latent_shape == (4, 3, 4, 4) and v_built.shape == z.shape and v_built.abs().sum() > 0
    assert torch.equal(v_built, v_loaded) and torch.equal(built.schedule(6), loaded.schedule(6))


def test_bad_frames_and_guidance_fail_naming_the_field():
    with pytest.raises(ValueError, match=r"policy.num_frames must be 4 k \+ 1"):
        build_policy(config(family="wan", num_frames=8))
    with pytest.raises(ValueError, match="policy.guidance_scale_2 must be >= 1.0"):
        config(guidance_scale_2=0.5)


@pytest.mark.parametrize("num_steps", [3, 10])
def test_schedule_is_flow_matching_at_the_flow_shift(twin_dirs, num_steps):
    """The twin's pipeline samples with FlowMatchEulerDiscreteScheduler(shift 3); a released pipeline ships UniPC
    with flow_shift: the policy then samples the flow-matching sigmas at that shift."""
    policy = build_policy(config(pretrained=str(twin_dirs["wan21"])))
    times = policy.schedule(num_steps)
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(num_steps)
    assert times.dtype == torch.float32 and times[0] == 1 and times[-1] == 0
    assert torch.equal(times, reference.sigmas)
    pipe = build("wan21")
    pipe(prompt=PROMPTS[:1], num_inference_steps=num_steps, height=32, width=32, num_frames=9, output_type="latent",
         max_sequence_length=4)
    assert torch.equal(times, pipe.scheduler.sigmas.float())

    released = build("wan21")
    released.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    at_5 = FlowMatchEulerDiscreteScheduler(shift=5.0)
    at_5.set_timesteps(num_steps)
    assert torch.equal(build_policy(config(family="wan"), pipeline=released).schedule(num_steps), at_5.sigmas)


# the twin's 32 px x 9 frames, and a wide clip of another length (rows, columns and frames all differ)
SHAPES = pytest.mark.parametrize("shape", [{}, {"resolution": [32, 48], "num_frames": 5}], ids=["32px_9f", "32x48_5f"])


@by_twin
@SHAPES
def test_velocity_is_the_pipelines_at_every_step(twin, shape, rng_seed):
    """WanPipeline's own 4-step Euler run (flow-matching scheduler): v_k = (z_{k+1} - z_k) / (t_{k+1} - t_k) is
    the policy's v(z_k, t_k) -- same UMT5 prompts, layout, timestep, CFG; Wan2.2: the expert and its scale; at the
    twin's size and at a wide clip of 5 frames (its 3-D RoPE)."""
    seed = rng_seed % 10_000
    pipe = build(twin)
    policy = lora_policy(twin, seed, pipe, **shape)
    height, width = policy.resolution
    times = policy.schedule(4)
    if TWINS[twin]:
        assert policy.expert_starts(times) == (1,)  # sigmas 1 | 0.857, 0.6, 0.003 around boundary 0.875
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(2, *policy.latent_shape, generator=gen)
    seen = [z]
    with torch.no_grad():
        pipe(prompt=list(PROMPTS), num_inference_steps=4, latents=z.clone(), height=height, width=width,
             num_frames=policy.num_frames, guidance_scale=5.0, guidance_scale_2=3.0 if TWINS[twin] else None, output_type="latent",
             max_sequence_length=8, callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {})
        cond = policy.encode_prompts(PROMPTS)
        for k in range(4):
            v = policy.velocity(seen[k], times[k].expand(2), cond)
            implied = (seen[k + 1] - seen[k]) / (times[k + 1] - times[k])
            assert v.abs().mean() > 0
            torch.testing.assert_close(v, implied, rtol=1e-4, atol=2e-5)
        video = pipe(prompt=list(PROMPTS), num_inference_steps=1, latents=z.clone(), height=height, width=width,
                     num_frames=policy.num_frames, output_type="pt", max_sequence_length=8).frames
    assert policy.decode(z).shape == video.shape == (2, policy.num_frames, 3, height, width)


def test_mixed_expert_batch_routes_each_sample_and_trains_both(rng_seed):
    """A batch with times on both sides of the boundary (batched anchors) equals each sample alone, and the
    gradient reaches both experts' LoRA."""
    seed = rng_seed % 10_000
    policy = lora_policy("wan22", seed)
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(3, *policy.latent_shape, generator=gen), torch.tensor([0.95, 0.3, 0.9])
    cond = policy.encode_prompts(PROMPTS + ["a cat"])
    assert policy.high_noise(t).tolist() == [True, False, True]
    v = policy.velocity(z, t, cond)
    with torch.no_grad():
        alone = torch.cat([policy.velocity(z[i:i + 1], t[i:i + 1], tuple(c[i:i + 1] for c in cond)) for i in range(3)])
    # float32: another batch shape may round differently (a few ulps); a sample sent to the wrong expert is O(1) off
    torch.testing.assert_close(v.detach(), alone, rtol=1e-4, atol=2e-5)
    v.square().sum().backward()
    for expert in policy.experts:
        assert sum(float(p.grad.abs().sum()) for p in expert.parameters() if p.grad is not None) > 0


def test_windows_are_cut_at_the_expert_switch():
    windows = plan_windows(list(range(7)), 4, breaks=(3,))
    assert [(w.steps, w.segment) for w in windows] == [((0, 1, 2), 0), ((3, 4, 5, 6), 1)]
    chained = plan_windows(list(range(9)), 3, chained=True, breaks=(4,))
    assert [w.steps for w in chained] == [(0, 1, 2), (2, 3), (4, 5, 6), (6, 7, 8)]
    assert [w.steps for w in plan_windows(list(range(6)), 2, breaks=(0, 9))] == [(0, 1), (2, 3), (4, 5)]


@by_twin
def test_first_update_ratio_is_one_with_cfg(twin, twin_dirs, rng_seed):
    module = module_for(twin, twin_dirs[twin], rng_seed % 10_000, num_steps=6)
    assert module.policy.guided
    fit(module)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)
    assert {r.segment for r in module.window_records} == ({0, 1} if TWINS[twin] else {0})


@by_twin
@pytest.mark.parametrize("jagg_frac,window_size,shape", [(0.0, 3, None), (1.0, 2, None),
                                                         (1.0, 2, {"resolution": [32, 48], "num_frames": 5})],
                         ids=["exact_grpo", "jagg_w2", "jagg_w2_32x48_5f"])
def test_update_equals_handwritten_per_step_grpo(twin, twin_dirs, jagg_frac, window_size, shape, rng_seed):
    """float64, CFG on: jagg_frac 0 and JAGG on W = 2 windows give the per-step GRPO step (< 1e-10); also on a
    wide clip of 5 frames."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(twin, twin_dirs[twin], seed, dtype="float64", jagg_frac=jagg_frac, window_size=window_size,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, shape=shape)
    assert handwritten_update_error(module, PROMPTS, lr, fit, lambda adv: nonzero_advantages(adv, seed)) < 1e-10


def test_jagg_never_runs_across_the_expert_switch(twin_dirs, rng_seed):
    """Wan2.2, 8 steps, W = 4, everything routed: each window's steps use one expert; a window that would
    straddle the switch is cut into an exact short one; each expert routes its own windows."""
    module = module_for("wan22", twin_dirs["wan22"], rng_seed % 10_000, jagg_frac=1.0, window_size=4, num_steps=8)
    fit(module)
    times = module.sampler.times
    for r in module.window_records:
        experts = set(module.policy.high_noise(times[list(r.steps)]).tolist())
        assert len(experts) == 1 and r.segment == (0 if experts == {True} else 1)
        assert r.routed == (len(r.steps) == 4)
        assert r.backwards == (1 if r.routed else len(r.steps))  # counted by the engine, not assumed
    assert [r.steps for r in module.window_records] == [(0, 1, 2), (3, 4, 5, 6)]


def test_routing_stats_per_expert(twin_dirs, tmp_path, rng_seed):
    """Wan2.2, 8 steps (switch at step 3), W = 3, everything routed: the high-noise expert's one window is routed
    (3 backward passes -> 1), the low-noise expert's (3, 4, 5) routed and its tail (6) exact (4 -> 2); each
    expert's values come from its own windows and records. Wan2.1 (one network) logs only ``routing/*``."""
    from PIL import Image

    from jagg_lightning.callbacks import RoutingStats

    seed = rng_seed % 10_000
    logged = {}
    for twin in TWINS:
        module = module_for(twin, twin_dirs[twin], seed, jagg_frac=1.0, window_size=3, num_steps=8)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / twin,
                            callbacks=[RoutingStats(plot=TWINS[twin])])
        trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
        logged[twin] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("routing/")}
    base = {"routed_share", "score_q10", "score_q50", "score_q90", "backward_saved", "backward_saved_frac"}
    assert set(logged["wan21"]) == {f"routing/{k}" for k in base}
    wan22 = logged["wan22"]
    assert set(wan22) == {f"routing/{p}{k}" for p in ("", "high_noise/", "low_noise/") for k in base}
    assert module.policy.expert_names == ("high_noise", "low_noise")
    assert [(r.steps, r.routed, r.backwards) for r in module.window_records] == [
        ((0, 1, 2), True, 1), ((3, 4, 5), True, 1), ((6,), False, 1)]
    assert wan22["routing/high_noise/routed_share"] == 1.0 and wan22["routing/low_noise/routed_share"] == 0.5
    assert wan22["routing/high_noise/backward_saved"] == 2.0 and wan22["routing/low_noise/backward_saved"] == 2.0
    assert wan22["routing/backward_saved"] == 4.0
    assert wan22["routing/high_noise/backward_saved_frac"] == pytest.approx(2 / 3)
    assert wan22["routing/low_noise/backward_saved_frac"] == pytest.approx(2 / 4)
    high = [r.score for r in module.window_records if r.steps[0] == 0]
    assert wan22["routing/high_noise/score_q50"] == pytest.approx(high[0])
    with Image.open(tmp_path / "wan22" / "routing.png") as img:
        assert img.format == "PNG"


@by_twin
def test_jagg_fit_writes_adapters_wan_pipeline_loads(twin, twin_dirs, tmp_path, rng_seed):
    """`jagg fit` with configs/wan(22)_tiny.yaml on the saved twin; WanPipeline.load_lora_weights (Wan2.2: also
    ``load_into_transformer_2=True``) and PeftModel reproduce the trained velocity on both experts."""
    seed = str(rng_seed % 10_000)
    tiny = "configs/wan22_tiny.yaml" if TWINS[twin] else "configs/wan_tiny.yaml"
    args = tiny_fit_args(ROOT / tiny, seed, twin_dirs[twin], tmp_path)
    cli = cli_main([*args, "--model.policy.resolution", "[32, 48]", "--model.policy.num_frames", "5"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    policy, final = cli.model.policy, tmp_path / "lora" / "final"
    assert policy.family == "wan" and policy.guided and policy.latent_shape == (4, 2, 4, 6)

    gen = torch.Generator().manual_seed(int(seed))
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.tensor([0.95, 0.3])
    cond = policy.encode_prompts(PROMPTS)
    pipe = build(twin)
    pipe.load_lora_weights(str(final / "diffusers"))
    if TWINS[twin]:
        pipe.load_lora_weights(str(final / "diffusers_transformer_2"), load_into_transformer_2=True)
    fresh = [PeftModel.from_pretrained(build(twin).transformer, str(final / "peft")).base_model.model]
    if TWINS[twin]:
        fresh.append(PeftModel.from_pretrained(build(twin).transformer_2, str(final / "peft_transformer_2")).base_model.model)
    with torch.no_grad():
        expected = policy.velocity(z, t, cond)
        for experts in ([pipe.transformer, pipe.transformer_2], fresh + [None]):
            own = policy.transformer, policy.transformer_2
            policy.transformer, policy.transformer_2 = experts[0], experts[1] if TWINS[twin] else None
            try:
                torch.testing.assert_close(policy.velocity(z, t, cond), expected, rtol=1e-5, atol=1e-6)
            finally:
                policy.transformer, policy.transformer_2 = own
        with policy.adapter_disabled():
            assert not torch.allclose(policy.velocity(z, t, cond), expected, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_keeps_both_experts_gradients(rng_seed):
    seed = rng_seed % 10_000
    policy = lora_policy("wan22", seed)
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.tensor([0.95, 0.3])
    assert len(policy.experts) == 2  # both experts checkpointed
    assert checkpointed_gradient_error(policy, z, t, policy.encode_prompts(PROMPTS)) < 1e-5



def test_sample_videos_and_predictions_are_gifs(twin_dirs, tmp_path, rng_seed, capsys):
    """SampleImages writes the adapter off | on grid of a video family as an animated GIF (also to TensorBoard);
    `jagg predict`'s writer writes one GIF per video; both at the clip's true aspect (a wide 32 x 48 clip)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from PIL import Image

    from jagg_lightning.callbacks import SampleImages
    from jagg_lightning.callbacks.predictions import PredictionImages

    module = module_for("wan21", twin_dirs["wan21"], rng_seed % 10_000, shape={"resolution": [32, 48]})
    samples = SampleImages(prompts=PROMPTS, every_n_steps=1, num_steps=2, dirpath=str(tmp_path / "samples"))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path / "tb")),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[samples, writer := PredictionImages(str(tmp_path / "pred"))])
    trainer.fit(module, PromptDataModule(prompts=PROMPTS, batch_size=2, shuffle=False))
    gif = Image.open(samples.written[0])
    assert samples.last_grid.shape == (9, 64, 96, 3)  # 9 frames of 2 prompts x off|on at 32 x 48 px
    assert samples.written[0].suffix == ".gif" and gif.n_frames == 9 and min(gif.size) > 64  # upscaled, labelled
    assert gif.size[0] > 96 * 3 and gif.size[1] > 64 * 3  # (width, height): upscaled x 3, the aspect kept
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").rglob("*"))
    trainer.predict(module, PromptDataModule(prompts=PROMPTS, predict_prompts=PROMPTS, batch_size=2, shuffle=False),
                    return_predictions=False)
    written = sorted((tmp_path / "pred").glob("*.gif"))
    assert len(written) == 2 * module.evaluation.samples_per_prompt and Image.open(written[0]).n_frames == 9
    assert not list((tmp_path / "pred").glob("*.png"))
    # the closing line names what is there: videos as GIFs, by the first and last file's name
    said = f"wrote {len(written)} videos (animated GIF: {written[0].name} … {written[-1].name}) to {tmp_path / 'pred'}/"
    assert said in capsys.readouterr().out and writer.message().startswith(f"jagg predict: {said}")
    assert Image.open(written[0]).size == (48, 32)  # one video at its own size, width x height
