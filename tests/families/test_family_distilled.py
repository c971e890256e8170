"""Step-distilled models (FLUX.2 [klein] 4B / 9B, Z-Image-Turbo): guidance baked in, few steps. The policy does
what the family pipeline does with them, refuses a guidance it would ignore, and a trajectory too short for the
JAGG window is a configuration error before any model is built. Also: every new family's transformer has blocks
for FSDP2 to shard."""

from pathlib import Path

import pytest
import torch

from jagg_lightning.cli import cli_main
from jagg_lightning.policies import build_policy
from jagg_lightning.policies.flux2 import build_tiny_flux2_pipeline
from jagg_lightning.policies.z_image import build_tiny_z_image_pipeline
from jagg_lightning.models.compiling import transformer_blocks

from helpers import randomize_lora_b, tiny_policy_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog"]


def klein_policy(seed, pipe, guidance=1.0):
    config = tiny_policy_config(family="flux2", lora_targets=None, max_sequence_length=32, seed=seed,
                                guidance_scale=guidance)
    return build_policy(config, pipeline=pipe)


def test_distilled_klein_is_one_forward_as_its_pipeline(rng_seed):
    """is_distilled: the pipeline ignores guidance_scale (no CFG, one forward); the policy's velocity is the one
    its Euler step takes, and the distilled flag travels through save_pretrained / model_index.json."""
    seed = rng_seed % 10_000
    pipe = build_tiny_flux2_pipeline(0, distilled=True)
    policy = klein_policy(seed, pipe)
    assert policy.distilled and not policy.guided
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    z = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
    calls = []
    policy.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        v = policy.velocity(z, torch.ones(2), policy.encode_prompts(PROMPTS))
        out = pipe(prompt=list(PROMPTS), num_inference_steps=1, latents=z, height=32, width=32, guidance_scale=4.0,
                   output_type="latent", max_sequence_length=32).images
    assert len(calls) == 2  # one forward each: the policy's and the pipeline's (its CFG branch is skipped)
    torch.testing.assert_close(z - policy.latents_from_pipeline_output(out), v, rtol=1e-4, atol=1e-5)


def test_distilled_klein_refuses_a_guidance_it_would_ignore(tmp_path):
    pipe = build_tiny_flux2_pipeline(0, distilled=True)
    pipe.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"policy\.guidance_scale must be 1\.0 for a step-distilled FLUX\.2"):
        build_policy(tiny_policy_config(pretrained=str(tmp_path), lora_targets=None, guidance_scale=4.0))
    assert build_policy(tiny_policy_config(pretrained=str(tmp_path), lora_targets=None)).distilled


@pytest.mark.parametrize("preset,steps,window", [("z_image_turbo.yaml", "4", "4"), ("flux2_klein.yaml", "4", "5")])
def test_too_short_trajectory_for_the_window_is_a_config_error(preset, steps, window, monkeypatch, capsys):
    """A distilled model's few steps: a JAGG window longer than the trained steps stops the run before any
    model is built (the CLI's usage error), naming jagg.window_size and the trained-step count it must fit."""
    monkeypatch.chdir(ROOT)
    args = ["--config", f"configs/{preset}", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--model.reward", "jpeg_compressibility", "--model.sampling.num_steps", steps,
            "--model.sampling.sde_window_size", "null", "--model.sampling.sde_window_range", "null",
            "--model.jagg.window_size", window]
    with pytest.raises(SystemExit):
        cli_main(args, run=False)
    trained = int(steps) - 1  # all but the last step
    assert f"model.jagg.window_size must be <= model.sampling.trained_steps ({trained}), got {window}" in capsys.readouterr().err


@pytest.mark.parametrize("build", [build_tiny_flux2_pipeline, build_tiny_z_image_pipeline], ids=["flux2", "z_image"])
def test_fsdp2_finds_every_block(build):
    """FSDP2 shards per block: every LoRA target inside the transformer's repeated blocks is found (Z-Image's
    blocks are ``layers`` plus ``noise_refiner`` / ``context_refiner``, not ``*blocks``)."""
    transformer = build(0, torch.float32).transformer
    blocks = transformer_blocks(transformer)
    expected = {"flux2": 2, "z_image": 3}["flux2" if build is build_tiny_flux2_pipeline else "z_image"]
    assert len(blocks) == expected
    inside = {id(m) for b in blocks for m in b.modules()}
    linears = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside]
    assert any("attn" in n or "attention" in n for n in linears)
