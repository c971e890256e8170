"""LTX-2 image-to-audio+video (``ltx2_i2v``) on its tiny offline twin: detection, round trip and the plan of the saved
folder; the first frame as ``LTX2ImageToVideoPipeline`` conditions on it (the image's normalised VAE latent packed
into the first frame's tokens, held at timestep 0 while the other tokens and the audio are stepped), the pipeline's
velocity and decode; the float64 JAGG update against the hand-written per-step reference; the LoRA export loading
bit for bit in the image-to-video pipeline and peft. (What the family shares with text-to-video -- the schedule, the
SDE, the full-weight export, gradient checkpointing -- is tested on ``ltx2``: tests/families/test_family_ltx2.py.)"""

import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline
from peft import PeftModel
from PIL import Image

from jagg_lightning.memory_plan.models import model_spec
from jagg_lightning.models.adapters import save_adapter
from jagg_lightning.policies import build_policy, detect_family

from family_cases import CONDITIONED_PROMPTS, fitted_prompts
from helpers import assert_loaded_velocity_is_the_trained, handwritten_update_error, randomize_lora_b
from ltx2_twins import (PLAIN_CFG, build, config, fit, ltx2_i2v_twin_dir, ltx2_twin_dir,  # noqa: F401 (fixtures)
                        module_for)
from plan_checks import assert_folder_plans_as_twin

FLOAT64_UPDATE_TOLERANCE = 3e-7  # LTX-2's float32 RoPE and RMSNorm variance (test_family_ltx2.py says why)


def i2v_policy(seed, pipe=None, **kw):
    """The image-to-video twin's policy (on ``pipe``, or on a fresh twin) with both LoRA factors nonzero."""
    policy = build_policy(config(seed=seed, family="ltx2_i2v", **kw), pipeline=pipe if pipe is not None else
                          build(i2v=True))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    return policy


def test_detection_roundtrip_and_plan(ltx2_i2v_twin_dir, rng_seed):
    """The saved twin is detected as ``ltx2_i2v`` from its model_index.json and loads to the velocity of the twin
    built in memory; the first frame's 4 x 4 tokens are not in the SDE's latent; ``jagg plan`` reads the folder as the
    twin."""
    seed = rng_seed % 10_000
    path = str(ltx2_i2v_twin_dir)
    assert detect_family(config(pretrained=path)).name == "ltx2_i2v"
    loaded, built = build_policy(config(pretrained=path, seed=seed)), i2v_policy(seed)
    randomize_lora_b(loaded.transformer, torch.Generator().manual_seed(seed))
    assert type(loaded).__name__ == "LTX2I2VPolicy" and loaded.pipeline_class is LTX2ImageToVideoPipeline
    assert built.condition_images == (1, 1) and built.latent_shape == (48 - 16 + 9, 8)
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *built.latent_shape, generator=gen), torch.rand(2, generator=gen)
    with torch.no_grad():
        conds = [p.encode_prompts(CONDITIONED_PROMPTS) for p in (built, loaded)]
        v_built, v_loaded = (p.velocity(z, t, c) for p, c in zip((built, loaded), conds))
    assert all(torch.equal(a, b) for a, b in zip(*conds)) and torch.equal(v_built, v_loaded)
    assert v_built.shape == z.shape and v_built.abs().sum() > 0
    assert_folder_plans_as_twin("ltx2_i2v", path, (32, 64), frames=17, guidance_scale=3.0, max_sequence_length=16)


def test_the_text_to_video_folder_runs_as_image_to_video_when_named(ltx2_twin_dir):
    """LTX-2's one checkpoint, whose model_index.json says LTX2Pipeline, loads as ``ltx2_i2v`` when
    ``policy.family`` names it, and ``jagg plan`` plans it as that family."""
    named = config(pretrained=str(ltx2_twin_dir), family="ltx2_i2v")
    policy = build_policy(named)
    assert type(policy).__name__ == "LTX2I2VPolicy" and policy.latent_shape == (48 - 16 + 9, 8)
    assert model_spec(named).family == "ltx2_i2v" and model_spec(config(pretrained=str(ltx2_twin_dir))).family == "ltx2"


def test_a_clip_of_one_latent_frame_is_refused():
    with pytest.raises(ValueError, match=r"policy.num_frames must be >= 5 for ltx2_i2v"):
        build_policy(config(family="ltx2_i2v", num_frames=1))


@pytest.mark.parametrize("shape", [{}, {"resolution": [32, 64], "num_frames": 17}], ids=["32px_9f", "32x64_17f"])
def test_first_frame_velocity_and_decode_are_the_pipelines(shape, rng_seed):
    """LTX2ImageToVideoPipeline's own 4-step run from its own noise (CFG on both streams, its further guidance terms
    off, no H.264 re-compression of the image): at every step the transformer sees the policy's first-frame tokens
    (the image's VAE mode, normalised, packed) before the sampled ones, at timestep 0 against t elsewhere, and the
    policy's v(z_k, t_k) on the sampled video tokens and the audio is the implied (z_{k+1} - z_k) / (t_{k+1} - t_k);
    a 2-step run's frames and waveform are the policy's decode_samples / decode_audio of its own 2 Euler steps."""
    seed = rng_seed % 10_000
    pipe = build(i2v=True)
    policy = i2v_policy(seed, pipe, **shape)
    height, width = policy.resolution
    prompts, held, times = fitted_prompts(height, width), policy.held_tokens, policy.schedule(4)
    images = [Image.fromarray((p.images[0] * 255).round().byte().permute(1, 2, 0).numpy()) for p in prompts]
    seen = []

    def record(module, args, kwargs):  # the conditional half of the pipeline's [negative, positive] batch
        half = len(kwargs["hidden_states"]) // 2
        seen.append((kwargs["hidden_states"][half:].clone(), kwargs["audio_hidden_states"][half:].clone(),
                     kwargs["timestep"][half:].clone()))

    call = dict(prompt=[str(p) for p in prompts], image=images, height=height, width=width,
                num_frames=policy.num_frames, guidance_scale=3.0, audio_guidance_scale=3.0, max_sequence_length=16,
                image_crf=0, **PLAIN_CFG)
    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        pipe(**call, num_inference_steps=4, generator=torch.Generator().manual_seed(seed), output_type="latent")
        hook.remove()
        cond = policy.encode_prompts(prompts)
        first = cond[-1]
        assert len(seen) == 4 and first.shape == (2, held, 8)
        states = [torch.cat([video[:, held:], audio], dim=1) for video, audio, _ in seen]
        for k, (video, _, timestep) in enumerate(seen):
            torch.testing.assert_close(video[:, :held], first, rtol=0, atol=1e-6)  # the image's, held clean
            expected = torch.cat([torch.zeros(2, held), (1000 * times[k]).expand(2, video.shape[1] - held)], dim=1)
            torch.testing.assert_close(timestep.float(), expected, rtol=1e-6, atol=1e-4)
        for k in range(3):
            v = policy.velocity(states[k], times[k].expand(2), cond)
            implied = (states[k + 1] - states[k]) / (times[k + 1] - times[k])
            assert v.abs().mean() > 0
            torch.testing.assert_close(v, implied, rtol=1e-4, atol=2e-5)
        seen.clear()
        hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
        video, audio = pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
                            output_type="pt", return_dict=False)
        hook.remove()
        two, final = policy.schedule(2), torch.cat([seen[0][0][:, held:], seen[0][1]], dim=1)
        for k in range(2):
            final = final + (two[k + 1] - two[k]) * policy.velocity(final, two[k].expand(2), cond)
        frames = policy.decode_samples(final, prompts)
    assert frames.shape == video.shape == (2, policy.num_frames, 3, height, width)
    torch.testing.assert_close(frames, video, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(policy.decode_audio(final), audio.float(), rtol=1e-4, atol=1e-4)


def test_jagg_update_equals_handwritten_per_step_grpo(ltx2_i2v_twin_dir, rng_seed):
    """float64, CFG on, JAGG on W = 2 windows: the per-step GRPO step (within ``FLOAT64_UPDATE_TOLERANCE``), the
    first frame held in every velocity of the rollout, the update and the reference."""
    seed, lr = rng_seed % 10_000, 0.5
    module = module_for(ltx2_i2v_twin_dir, seed, dtype="float64", jagg_frac=1.0, window_size=2,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr), max_grad_norm=None)
    assert module.policy.family == "ltx2_i2v"
    error = handwritten_update_error(module, CONDITIONED_PROMPTS, lr, lambda m: fit(m, prompts=CONDITIONED_PROMPTS))
    assert any(w.routed for w in module.windows) and error < FLOAT64_UPDATE_TOLERANCE


def test_lora_export_loads_exactly_in_the_pipeline_and_peft(ltx2_i2v_twin_dir, tmp_path, rng_seed):
    """The adapter ``save_adapter`` writes (as `jagg fit`'s export) loads with LTX2ImageToVideoPipeline's
    ``load_lora_weights`` and with ``PeftModel.from_pretrained``: the velocity exactly the trained policy's."""
    seed = rng_seed % 10_000
    policy = build_policy(config(pretrained=str(ltx2_i2v_twin_dir), seed=seed))
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    final = save_adapter(policy, tmp_path / "final")
    gen = torch.Generator().manual_seed(seed)
    z, t = torch.randn(2, *policy.latent_shape, generator=gen), torch.rand(2, generator=gen)
    pipe = build(i2v=True)
    pipe.load_lora_weights(str(final / "diffusers"))
    fresh = PeftModel.from_pretrained(build(i2v=True).transformer, str(final / "peft")).base_model.model
    assert_loaded_velocity_is_the_trained(policy, (pipe.transformer, fresh), z, t,
                                          policy.encode_prompts(CONDITIONED_PROMPTS))
