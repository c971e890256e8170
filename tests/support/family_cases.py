"""The tiny twin of every model family the per-family tests run on (tests/families/test_families.py), and the
module and `jagg fit` arguments those tests build on a saved twin.

To test a new family, add a ``FamilyCase`` here (its twin builder, guidance values and tiny `jagg fit`
config, and how its guidance and schedule behave): every test of tests/families/test_families.py then runs on it.
Qwen-Image and Qwen-Image-Edit are not ``FamilyCase``s: their own files, tests/families/test_family_qwen_image.py and
test_family_qwen_image_edit.py, repeat the same checks (see docs/model_families.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.models.conditions import ConditionedPrompt, condition_pixels
from jagg_lightning.policies.flux import build_tiny_flux_pipeline
from jagg_lightning.policies.flux2 import build_tiny_flux2_pipeline
from jagg_lightning.policies.flux2_dev import build_tiny_flux2_dev_pipeline
from jagg_lightning.policies.flux_kontext import build_tiny_flux_kontext_pipeline
from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline
from jagg_lightning.policies.z_image import build_tiny_z_image_pipeline

from helpers import float64_reward, randomize_lora_b, tiny_policy_config


@dataclass(frozen=True)
class FamilyCase:
    name: str  # test id
    family: str  # what detection must answer for the saved twin
    policy_class: str
    build: Callable[[int, torch.dtype], object]  # (seed, dtype) -> a real random pipeline of the family
    guidance: tuple[float, float]  # guidance_scale (off, on)
    overrides: dict = field(default_factory=dict)  # PolicyConfig fields for the twin
    call_kwargs: dict = field(default_factory=dict)  # extra pipeline __call__ arguments
    # a conditioned family (editing, image-to-video): its prompts carry a source image each, and its pipeline's
    # __call__ takes the sources as (prompts, height, width) -> these extra arguments
    source_kwargs: Callable[[list, int, int], dict] | None = None
    prompts_file: str = "configs/prompts/tiny.txt"  # what its `jagg fit` test trains on
    training: bool = True  # run the training tests (plain SD3 has its own in test_module / test_checkpoint_export)
    tiny_config: str = "configs/tiny.yaml"  # the family's `jagg fit` config for its twin (test_jagg_fit_...)
    cfg: bool = True  # guidance on means a second (negative) branch; False: embedded guidance, one forward
    dynamic_shift: bool = False  # the schedule follows the resolution (the scheduler's dynamic shift)
    # the pipeline __call__'s guidance_scale for the policy's (Z-Image: the pipeline's w is the library's g - 1)
    pipeline_guidance: Callable[[float], float] = lambda g: g

    @property
    def prompts(self) -> list:
        return CONDITIONED_PROMPTS if self.source_kwargs else PROMPTS

    def pipeline_kwargs(self, prompts, height: int, width: int) -> dict:
        """The extra __call__ arguments of the family pipeline for ``prompts`` at that size."""
        return self.call_kwargs | (self.source_kwargs(prompts, height, width) if self.source_kwargs else {})

    def config(self, **kw):
        return tiny_policy_config(**(self.overrides | kw))

    def __str__(self) -> str:
        return self.name


CASES = [
    FamilyCase("sd3", "sd3", "SD3Policy", lambda seed, dtype: build_tiny_sd3_pipeline(seed, dtype), (1.0, 4.0),
               training=False),
    FamilyCase("sd35", "sd3", "SD3Policy", lambda seed, dtype: build_tiny_sd3_pipeline(seed, dtype, sd35=True),
               (1.0, 4.0), tiny_config="configs/sd35_tiny.yaml"),
    # FLUX: its own Flow-GRPO targets (null), embedded guidance 1.0 vs 3.5, one forward either way
    FamilyCase("flux", "flux", "FluxPolicy", lambda seed, dtype: build_tiny_flux_pipeline(seed, dtype), (1.0, 3.5),
               overrides={"lora_targets": None}, tiny_config="configs/flux_tiny.yaml", cfg=False, dynamic_shift=True),
    # FLUX.2 [klein] base: true CFG with "" as the negative, Qwen3 prompts (32 tokens hold the chat template)
    # FLUX.1 Kontext: FLUX's twin, the source's tokens after the latent's; its __call__ at the policy's size exactly
    FamilyCase("flux_kontext", "flux_kontext", "FluxKontextPolicy",
               lambda seed, dtype: build_tiny_flux_kontext_pipeline(seed, dtype), (1.0, 3.5),
               overrides={"lora_targets": None}, tiny_config="configs/flux_kontext_tiny.yaml", cfg=False,
               dynamic_shift=True, source_kwargs=lambda prompts, h, w: {
                   "image": condition_pixels(prompts, h, w), "_auto_resize": False, "max_area": h * w},
               prompts_file="configs/prompts/edits"),
    FamilyCase("flux2", "flux2", "Flux2Policy", lambda seed, dtype: build_tiny_flux2_pipeline(seed, dtype), (1.0, 4.0),
               overrides={"lora_targets": None, "max_sequence_length": 32}, tiny_config="configs/flux2_tiny.yaml",
               dynamic_shift=True),
    # FLUX.2 [dev]: embedded guidance 1.0 vs 4.0 (one forward either way), Mistral-3 prompts behind a PixtralProcessor
    # (64 tokens hold the chat template with the pipeline's system message)
    FamilyCase("flux2_dev", "flux2_dev", "Flux2DevPolicy",
               lambda seed, dtype: build_tiny_flux2_dev_pipeline(seed, dtype), (1.0, 4.0),
               overrides={"lora_targets": None, "max_sequence_length": 64}, tiny_config="configs/flux2_dev_tiny.yaml",
               cfg=False, dynamic_shift=True),
    # Z-Image: CFG written pos + w (pos - neg) by the pipeline, so its guidance_scale is the policy's minus 1
    FamilyCase("z_image", "z_image", "ZImagePolicy", lambda seed, dtype: build_tiny_z_image_pipeline(seed, dtype),
               (1.0, 4.0), overrides={"lora_targets": None, "max_sequence_length": 32},
               tiny_config="configs/z_image_tiny.yaml", pipeline_guidance=lambda g: g - 1),
]

TRAINING_CASES = [case for case in CASES if case.training]


ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue dog"]
# with a source image each (non-square, so fitting it to the sampled size crops): the conditioned families' prompts
_sources = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(2024))
CONDITIONED_PROMPTS = [ConditionedPrompt(f"make it {color}", [image]) for color, image in zip(("red", "blue"), _sources)]


def fitted_prompts(height: int, width: int) -> list:
    """CONDITIONED_PROMPTS with their images already fitted to (height, width) and on the 8-bit grid, so a pipeline
    that takes a PIL image and resizes it to that size sees the very pixels the policy does."""
    pixels = (condition_pixels(CONDITIONED_PROMPTS, height, width) * 255).round() / 255
    return [ConditionedPrompt(str(p), [image]) for p, image in zip(CONDITIONED_PROMPTS, pixels)]


def module_for(case, path, seed, guidance=None, dtype="float32", jagg_frac=0.5, window_size=2, optimizer=None,
               resolution=None, reward=None, **grpo):
    """``reward`` default: the tests' reward at the run's precision (``helpers.float64_reward``)."""
    policy = case.config(pretrained=str(path), dtype=dtype, resolution=resolution,
                         guidance_scale=case.guidance[0] if guidance is None else guidance)
    module = JAGGModule(
        policy, SamplingConfig(num_steps=4, group_size=2, rollout_batch_size=4),
        GRPOConfig(**({"train_batch_size": 4} | grpo)), JAGGConfig(window_size=window_size, jagg_frac=jagg_frac),
        optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)),
        reward=float64_reward(dtype) if reward is None else reward,
        seed=seed,
    )
    module.configure_model()
    randomize_lora_b(module.policy.transformer, torch.Generator().manual_seed(seed))
    return module


def tiny_fit_args(config, seed: str, pretrained, tmp_path, prompts_file: str = "configs/prompts/tiny.txt") -> list[str]:
    """`jagg fit` arguments: a family's tiny config on its saved twin (detected from model_index.json), 4 sampling
    steps, groups of 2, W = 2, 2 steps, the adapter exported under ``tmp_path / "lora"``."""
    return ["--config", str(config), "--seed_everything", seed, "--model.seed", seed,
            "--model.policy.family", "null", "--model.policy.pretrained", str(pretrained),
            "--model.sampling.num_steps", "4", "--model.sampling.group_size", "2", "--model.jagg.window_size", "2",
            "--data.prompts_file", str(ROOT / prompts_file), "--trainer.max_steps", "2",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
            "--trainer.default_root_dir", str(tmp_path), "--lora_export.dirpath", str(tmp_path / "lora")]
