"""The tiny twin of every model family the per-family tests run on (tests/test_families.py).

To test a new family, add a ``FamilyCase`` here (its twin builder, guidance values and tiny `jagg fit`
config): every test of tests/test_families.py then runs on it. Qwen-Image is not a ``FamilyCase``: its
own file, tests/test_family_qwen_image.py, repeats the same checks (see docs/model_families.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from jagg_lightning.policies.flux import build_tiny_flux_pipeline
from jagg_lightning.policies.sd3 import build_tiny_sd3_pipeline

from helpers import tiny_policy_config


@dataclass(frozen=True)
class FamilyCase:
    name: str  # test id
    family: str  # what detection must answer for the saved twin
    policy_class: str
    build: Callable[[int, torch.dtype], object]  # (seed, dtype) -> a real random pipeline of the family
    guidance: tuple[float, float]  # guidance_scale (off, on)
    overrides: dict = field(default_factory=dict)  # PolicyConfig fields for the twin
    call_kwargs: dict = field(default_factory=dict)  # extra pipeline __call__ arguments
    training: bool = True  # run the training tests (plain SD3 has its own in test_module / test_checkpoint_export)
    tiny_config: str = "configs/tiny.yaml"  # the family's `jagg fit` config for its twin (test_jagg_fit_...)

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
               overrides={"lora_targets": None}, tiny_config="configs/flux_tiny.yaml"),
]

TRAINING_CASES = [case for case in CASES if case.training]
