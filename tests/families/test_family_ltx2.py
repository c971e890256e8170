"""LTX-2 text-to-audio+video on its tiny offline twin: detection, round trip, the pipeline's dynamic-shift schedule,
the pipeline's video AND audio velocity at every step (CFG, RoPE over a non-square clip), its decode of frames and
sound, the SDE step and log-prob against the family's scheduler, the exact first update, the float64 GRPO / JAGG
updates against the hand-written per-step reference, the LoRA and full-weight exports loading bit for bit in
``LTX2Pipeline``, ``LTX2VideoTransformer3DModel`` and peft, and gradient checkpointing. (DDP and FSDP2:
tests/distributed/test_distributed_ltx2.py.)"""

import copy
from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
from peft import PeftModel

from jagg_lightning.cli import cli_main
from jagg_lightning.models.export import save_transformer
from jagg_lightning.policies import PolicyConfig, build_policy, detect_family

from family_cases import tiny_fit_args
from helpers import (assert_loaded_velocity_is_the_trained, checkpointed_gradient_error, handwritten_update_error,
                     randomize_lora_b)
from ltx2_twins import (PLAIN_CFG, PROMPTS, build, config, fit, lora_policy, ltx2_twin_dir,  # noqa: F401 (the fixture)
                        module_for)

ROOT = Path(__file__).resolve().parents[2]
# The float64 update's bound, not the 1e-10 of the other families: diffusers computes parts of LTX-2's transformer in
# float32 whatever the dtype -- ``apply_split_rotary_emb`` / ``apply_interleaved_rotary_emb`` cast q and k with
# ``.float()`` (RoPE), diffusers' ``RMSNorm`` takes its variance in float32 -- and no config or dtype argument turns
# that off (``rope_double_precision`` only builds the frequency grid in float64, then casts it to float32). The
# engine's and the reference's gradients, equal in exact arithmetic, pass those casts with float64 differences that
# become float32 roundings: 5.7e-9 .. 8.3e-8 relative over 88 seeds (median 2.8e-8, about float32's unit roundoff);
# with every float32 cast of a float64 tensor made a no-op (an experiment, not shipped) 3e-10 .. 1.1e-9.
FLOAT64_UPDATE_TOLERANCE = 3e-7


def test_detection_and_roundtrip(ltx2_twin_dir, rng_seed):
    seed = rng_seed % 10_000
    assert detect_family(config(pretrained=str(ltx2_twin_dir))).name == "ltx2"
    loaded = build_policy(config(pretrained=str(ltx2_twin_dir), seed=seed))
    built = build_policy(config(seed=seed, family="ltx2"), pipeline=build())
    assert type(loaded).__name__ == "LTX2Policy" and loaded.pipeline_class is LTX2Pipeline
    for policy in (built, loaded):
        randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *built.latent_shape, generator=gen), torch.rand(2, generator=gen)
    with torch.no_grad():
        v_built, v_loaded = (p.velocity(z, t, p.encode_prompts(PROMPTS)) for p in (built, loaded))
    # 3 x 4 x 4 video tokens, then 9 audio tokens (9 frames at 24 fps = 0.375 s of 25 audio latents a second)
    assert built.latent_shape == (48 + 9, 8) and v_built.shape == z.shape and v_built.abs().sum() > 0
    assert torch.equal(v_built, v_loaded) and torch.equal(built.schedule(6), loaded.schedule(6))


def test_bad_frames_and_resolution_fail_naming_the_field():
    with pytest.raises(ValueError, match=r"policy.num_frames must be 4 k \+ 1"):
        build_policy(config(family="ltx2", num_frames=8))
    with pytest.raises(ValueError, match="policy.resolution must be a multiple of 8"):
        build_policy(config(family="ltx2", resolution=36))


@pytest.mark.parametrize("num_steps", [3, 8])
def test_schedule_is_the_pipelines_dynamic_shift(ltx2_twin_dir, num_steps):
    """The times are the sigmas LTX2Pipeline's own __call__ sets (linspace sigmas, mu from the video token count,
    the scheduler's terminal stretch), at the native size and at a 4x larger clip (another mu)."""
    native = build_policy(config(pretrained=str(ltx2_twin_dir))).schedule(num_steps)
    for resolution in (32, [64, 64]):
        policy = build_policy(config(pretrained=str(ltx2_twin_dir), resolution=resolution))
        pipe = build()
        height, width = policy.resolution
        pipe(prompt=PROMPTS[:1], num_inference_steps=num_steps, height=height, width=width, num_frames=9,
             output_type="latent", max_sequence_length=4, guidance_scale=1.0, audio_guidance_scale=1.0, **PLAIN_CFG)
        times = policy.schedule(num_steps)
        assert times.dtype == torch.float32 and times.shape == (num_steps + 1,) and times[0] == 1 and times[-1] == 0
        assert torch.equal(times, pipe.scheduler.sigmas.float())
        assert torch.equal(times, native) == (resolution == 32)


# the twin's 32 px x 9 frames, and a wide clip of another length (rows, columns, frames and audio length all differ;
# LTX2Pipeline takes sides that are multiples of 32)
SHAPES = pytest.mark.parametrize("shape", [{}, {"resolution": [32, 64], "num_frames": 17}], ids=["32px_9f", "32x64_17f"])


@SHAPES
def test_velocity_and_decode_are_the_pipelines(shape, rng_seed):
    """LTX2Pipeline's own 4-step run (CFG on both streams, its further guidance terms off): the joint state the
    transformer sees at each step is the policy's latent, and the policy's v(z_k, t_k) is the implied
    (z_{k+1} - z_k) / (t_{k+1} - t_k) -- video and audio tokens; a 2-step run's frames and waveform are the
    policy's decode / decode_audio of its own 2 Euler steps."""
    seed = rng_seed % 10_000
    pipe = build()
    policy = lora_policy(seed, pipe, **shape)
    height, width = policy.resolution
    times, n_video = policy.schedule(4), policy.video_tokens
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    seen = []

    def record(module, args, kwargs):  # the conditional half of the pipeline's [negative, positive] batch
        half = len(kwargs["hidden_states"]) // 2
        seen.append(torch.cat([kwargs["hidden_states"][half:], kwargs["audio_hidden_states"][half:]], dim=1).clone())

    call = dict(prompt=list(PROMPTS), height=height, width=width, num_frames=policy.num_frames, guidance_scale=3.0,
                audio_guidance_scale=3.0, max_sequence_length=16, **PLAIN_CFG)
    # the pipeline normalises given audio latents with the audio VAE's statistics: hand it z's audio denormalised
    stats = pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std
    audio_in = z[:, n_video:] * stats[1] + stats[0]
    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        pipe(**call, num_inference_steps=4, latents=z[:, :n_video].clone(), audio_latents=audio_in.clone(),
             output_type="latent")
        hook.remove()
        assert len(seen) == 4
        torch.testing.assert_close(seen[0], z, rtol=0, atol=1e-5)
        cond = policy.encode_prompts(PROMPTS)
        for k in range(3):
            v = policy.velocity(seen[k], times[k].expand(2), cond)
            implied = (seen[k + 1] - seen[k]) / (times[k + 1] - times[k])
            assert v[:, :n_video].abs().mean() > 0 and v[:, n_video:].abs().mean() > 0
            torch.testing.assert_close(v, implied, rtol=1e-4, atol=2e-5)
        video, audio = pipe(**call, num_inference_steps=2, latents=z[:, :n_video].clone(),
                            audio_latents=audio_in.clone(), output_type="pt", return_dict=False)
        two = policy.schedule(2)
        final = z
        for k in range(2):
            final = final + (two[k + 1] - two[k]) * policy.velocity(final, two[k].expand(2), cond)
        frames = policy.decode(final)
    assert frames.shape == video.shape == (2, policy.num_frames, 3, height, width)
    torch.testing.assert_close(frames, video, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(policy.decode_audio(final), audio.float(), rtol=1e-4, atol=1e-4)


def test_sde_step_and_log_prob_follow_flow_grpo_on_the_schedulers_sigmas(ltx2_twin_dir, rng_seed):
    """A rollout's recorded velocities, steps and log-probs are Flow-GRPO's SDE on the family scheduler's sigmas:
    mu_k = z_k + [v + sigma_k^2 / (2 t) (z_k + (1 - t) v)] dt, s_k = sigma_k sqrt(-dt), log-prob the Gaussian's mean
    over the joint latent; without noise the mean is the scheduler's own Euler step."""
    module = module_for(ltx2_twin_dir, rng_seed % 10_000, dtype="float64", num_steps=4)
    sampler, policy, a = module.sampler, module.policy, module.sampling.noise_level
    traj, cond = sampler.trajectories(PROMPTS, [0, 1], step=0)
    scheduler = copy.deepcopy(policy.scheduler)
    scheduler.set_timesteps(**policy.scheduler_kwargs(4))
    assert torch.equal(traj.times.float(), scheduler.sigmas.float())
    for k in module.trained_steps:
        z, t, t_next = traj.latents[k], traj.times[k], traj.times[k + 1]
        with torch.no_grad():
            v = policy.velocity(z, t.expand(len(z)), cond, sampler.guidance).double()
        torch.testing.assert_close(traj.velocities[k].double(), v, rtol=1e-10, atol=1e-12)
        dt = t_next - t
        sigma = a * torch.sqrt(t / (1 - (t_next if t >= 1 else t)))
        mean = z + (v + sigma**2 / (2 * t) * (z + (1 - t) * v)) * dt
        std = sigma * torch.sqrt(-dt)
        logp = (-((traj.latents[k + 1] - mean) ** 2) / (2 * std**2) - torch.log(std)
                - 0.5 * torch.log(torch.tensor(2 * torch.pi, dtype=std.dtype))).flatten(1).mean(1)
        torch.testing.assert_close(traj.log_probs[k].double(), logp, rtol=1e-10, atol=1e-10)
        scheduler._step_index = k  # the scheduler's own Euler step at step k (it keeps its position privately)
        euler = scheduler.step(v, scheduler.timesteps[k], z, return_dict=False)[0]
        torch.testing.assert_close(euler, z + v * dt, rtol=1e-6, atol=1e-6)


def test_first_update_ratio_is_one_with_cfg(ltx2_twin_dir, rng_seed):
    module = module_for(ltx2_twin_dir, rng_seed % 10_000, num_steps=6)
    assert module.policy.guided
    fit(module)
    assert module.first_update_ratio_deviation == 0.0 and not module.first_update_ratio_off
    assert {k for r in module.window_records for k in r.steps} == set(module.plan.trained_steps)


@pytest.mark.parametrize("jagg_frac,window_size,shape", [(0.0, 3, None), (1.0, 2, None),
                                                         (1.0, 2, {"resolution": [32, 64], "num_frames": 5})],
                         ids=["exact_grpo", "jagg_w2", "jagg_w2_32x64_5f"])
def test_update_equals_handwritten_per_step_grpo(ltx2_twin_dir, jagg_frac, window_size, shape, rng_seed):
    """float64, CFG on: jagg_frac 0 and JAGG on W = 2 windows give the per-step GRPO step (within
    ``FLOAT64_UPDATE_TOLERANCE``: the float32 parts of diffusers' LTX-2 forward, above); also on a wide clip of 5
    frames."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(ltx2_twin_dir, seed, dtype="float64", jagg_frac=jagg_frac, window_size=window_size,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None, shape=shape)
    error = handwritten_update_error(module, PROMPTS, lr, fit)
    full = [w for w in module.windows if len(w.steps) == window_size]
    assert full and all(w.routed == bool(jagg_frac) for w in full)
    assert error < FLOAT64_UPDATE_TOLERANCE


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
    assert_loaded_velocity_is_the_trained(policy, (pipe.transformer, fresh), z, t, cond)


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
    assert checkpointed_gradient_error(policy, z, t, policy.encode_prompts(PROMPTS)) < 1e-5
