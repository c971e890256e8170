"""The family interface: detection, schedules equal to the family pipeline's, construction in configure_model."""

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.data import PromptDataModule
from jagg_lightning.policies import FAMILIES, PolicyConfig, build_policy, detect_family
from jagg_lightning.policies.checks import check_policy
from jagg_lightning.policies.sd3 import SD3Policy, build_tiny_sd3_pipeline

from helpers import randomize_lora_b, tiny_policy_config


@pytest.fixture(scope="session")
def saved_sd3(tmp_path_factory):
    path = tmp_path_factory.mktemp("families") / "sd3"
    build_tiny_sd3_pipeline(0).save_pretrained(path)
    return path


def test_detection_picks_the_family_of_a_saved_pipeline(saved_sd3):
    assert detect_family(PolicyConfig(pretrained=str(saved_sd3))).name == "sd3"
    assert type(build_policy(tiny_policy_config(pretrained=str(saved_sd3)))) is SD3Policy
    assert detect_family(PolicyConfig()).name == "sd3"  # no pretrained: the tiny SD3


def test_unsupported_pipeline_class_names_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError, match="KandinskyPipeline") as info:
        detect_family(PolicyConfig(pretrained=str(tmp_path)))
    for family in FAMILIES.values():
        assert family.name in str(info.value) and all(c in str(info.value) for c in family.pipeline_classes)
    with pytest.raises(ValueError, match=r"policy\.family must be one of"):
        check_policy(PolicyConfig(family="kandinsky"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"policy\.pretrained must be"):
        detect_family(PolicyConfig(pretrained=str(tmp_path / "empty")))


@pytest.mark.parametrize("num_steps,shift", [(10, None), (6, None), (4, 2.0)])
def test_schedule_equals_the_pipeline_scheduler(num_steps, shift):
    """The times the engine samples at are the sigmas the family pipeline's own __call__ sets."""
    pipe = build_tiny_sd3_pipeline(0)
    policy = SD3Policy(tiny_policy_config(), pipeline=build_tiny_sd3_pipeline(0))
    if shift is not None:  # a static shift override acts like a pipeline whose scheduler has that shift
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=shift)
    height, width = policy.resolution
    pipe(["a cat"], num_inference_steps=num_steps, height=height, width=width,
         guidance_scale=1.0, output_type="latent", max_sequence_length=4)
    times = policy.schedule(num_steps, shift)
    assert times.dtype == torch.float32 and times.shape == (num_steps + 1,)
    assert torch.equal(times, pipe.scheduler.sigmas.float())
    assert torch.equal(times[:-1] * 1000, pipe.scheduler.timesteps.float())


def small_module(seed, **kw):
    return JAGGModule(tiny_policy_config(), SamplingConfig(num_steps=4, group_size=2),
                      GRPOConfig(train_batch_size=4), JAGGConfig(window_size=2, jagg_frac=0.5),
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **kw, seed=seed)


def test_init_only_validates_and_configure_model_builds_once(rng_seed):
    module = small_module(rng_seed % 1000, ema_decay=0.9)
    assert "policy" not in module._modules and module.ema is None
    with pytest.raises(AttributeError, match="configure_model"):
        module.policy  # noqa: B018
    module.configure_model()
    policy = module.policy
    module.configure_model()
    assert module.policy is policy and module.ema is not None
    assert set(module.ema.shadow) == {n for n, p in module.named_parameters() if p.requires_grad}


def test_load_from_checkpoint_builds_the_policy_and_restores_the_lora(tmp_path, rng_seed):
    seed = rng_seed % 1000
    module = small_module(seed)
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=["a cat", "a dog"], batch_size=2))
    trainer.save_checkpoint(tmp_path / "m.ckpt", weights_only=True)
    loaded = JAGGModule.load_from_checkpoint(tmp_path / "m.ckpt", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                                             weights_only=True)
    fresh = small_module(seed)
    fresh.configure_model()
    trained = dict(module.named_parameters())
    lora = [n for n, p in loaded.named_parameters() if p.requires_grad]
    assert lora and all(torch.equal(dict(loaded.named_parameters())[n], trained[n]) for n in lora)
    assert any(not torch.equal(dict(fresh.named_parameters())[n], trained[n]) for n in lora)


@pytest.mark.parametrize("family", ["sd3", "flux", "flux2", "flux2_dev", "qwen_image", "qwen_image_edit", "z_image", "wan",
                                    "wan22_ti2v"])
def test_a_resolution_the_family_cannot_take_is_refused_before_any_model_is_built(family, tmp_path, rng_seed):
    """From the saved folder's JSON files alone (the config check, no model), with the multiple diffusers' own pipeline
    implies (its VAE scale factor x the 2x2 patches every family uses), and the same words as the build's check."""
    rng = torch.Generator().manual_seed(rng_seed)
    cls = FAMILIES[family].policy_class()
    pipeline = cls.build_tiny_pipeline(rng_seed % 1000)
    pipeline.save_pretrained(tmp_path)
    multiple = 2 * (getattr(pipeline, "vae_scale_factor_spatial", None) or pipeline.vae_scale_factor)
    k, off = (int(v) for v in (torch.randint(1, 64, (1,), generator=rng), torch.randint(1, multiple, (1,), generator=rng)))
    bad = multiple * k + off
    message = rf"policy\.resolution must be a multiple of {multiple} per side .*got {bad}"
    with pytest.raises(ValueError, match=message):
        check_policy(PolicyConfig(pretrained=str(tmp_path), resolution=bad))
    check_policy(PolicyConfig(pretrained=str(tmp_path), resolution=multiple * k))  # a good one passes the check
    check_policy(PolicyConfig(pretrained=str(tmp_path), resolution=[multiple * k, multiple]))  # and a good pair
    with pytest.raises(ValueError, match=message):  # the build's own check (a hub id is only checked there)
        build_policy(tiny_policy_config(resolution=bad, family=family, lora_targets=None), pipeline=pipeline)
    if family != "z_image":  # the built-in twin (pretrained null) too, before it is built (z_image: at its build)
        with pytest.raises(ValueError, match=message):
            check_policy(PolicyConfig(family=family, resolution=bad))
        check_policy(PolicyConfig(family=family, resolution=multiple * k))
    pair = rf"policy\.resolution must be a multiple of {multiple} per side .*got \[{multiple * k}, {bad}\]"
    with pytest.raises(ValueError, match=pair):  # one bad side of [height, width] is enough: the width here
        check_policy(PolicyConfig(pretrained=str(tmp_path), resolution=[multiple * k, bad]))


def test_flux2_dev_twin_reads_the_prompt_and_refuses_a_negative_prompt():
    """FLUX.2 [dev]'s twin: the pipeline's chat template with its system message leaves room in the twin's 64 tokens
    for every prompt of configs/prompts/tiny.txt (a byte-per-token tokenizer would truncate them all away), so
    prompts give different conditions; its guidance is embedded, so a negative prompt (never read) is refused."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    pipe = FAMILIES["flux2_dev"].policy_class().build_tiny_pipeline(0)
    prompts = (Path(__file__).resolve().parents[2] / "configs/prompts/tiny.txt").read_text().split("\n")
    lengths = pipe.tokenizer.apply_chat_template(format_input([p for p in prompts if p], pipe.system_message),
                                                 tokenize=True, return_dict=True, padding=True)["attention_mask"].sum(1)
    assert 30 < lengths.min() and lengths.max() <= 64
    with pytest.raises(ValueError, match=r"policy\.negative_prompt: FLUX\.2 \[dev\]'s guidance is embedded"):
        build_policy(tiny_policy_config(family="flux2_dev", lora_targets=None, negative_prompt="blurry"), pipeline=pipe)
    policy = build_policy(tiny_policy_config(family="flux2_dev", lora_targets=None, max_sequence_length=64),
                          pipeline=pipe)
    red, blue = policy.encode_prompts(["a red cat", "a blue dog"])[0]
    assert not policy.guided and red.shape == (64, 3 * 16) and not torch.allclose(red, blue)
