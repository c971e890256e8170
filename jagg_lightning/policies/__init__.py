"""Model families behind one policy interface (``base.Policy``), one file per family.

A family is chosen by ``policy.family`` or detected from the pipeline's ``model_index.json``
(``_class_name``, and where two families share a class, a value one requires: ``WanImageToVideoPipeline`` with
``expand_timesteps`` is ``wan22_ti2v``); with neither (no ``pretrained``) the tiny SD3 twin is built. To add a
family, write ``policies/<name>.py`` (see ``base.py``) and add one ``register_family`` line below. The checks of a
policy config that read this registry and the files it names: ``checks.py``. It may import ``utils/``,
``models/`` and ``config/``; no Lightning.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from jagg_lightning.config import PolicyConfig
from jagg_lightning.policies.base import Policy
from jagg_lightning.utils.assets import find_local


@dataclass(frozen=True)
class Family:
    """A registered model family: its ``policy.family`` name, the pipeline classes detected as it and its policy class
    (imported on first use, so listing the families imports no diffusers model)."""

    name: str
    pipeline_classes: tuple[str, ...]  # model_index.json ``_class_name`` values this family trains
    module: str
    policy: str  # class name inside ``module``
    # model_index.json values this family needs besides the class (Wan2.2 TI2V: expand_timesteps), as (key, value)
    requires: tuple[tuple[str, object], ...] = ()

    def matches(self, class_name: str, index: dict | None) -> bool:
        return class_name in self.pipeline_classes and all((index or {}).get(k) == v for k, v in self.requires)

    def policy_class(self) -> type[Policy]:
        return getattr(importlib.import_module(self.module), self.policy)


FAMILIES: dict[str, Family] = {}


def register_family(name: str, pipeline_classes: tuple[str, ...], module: str, policy: str,
                    requires: dict | None = None) -> None:
    """Add a family: ``policy.family: <name>`` then trains ``module``'s ``policy`` class, and a pipeline whose
    ``model_index.json`` ``_class_name`` is one of ``pipeline_classes`` (and that holds every ``requires`` key with
    its value) is detected as it."""
    FAMILIES[name] = Family(name, tuple(pipeline_classes), module, policy, tuple((requires or {}).items()))


register_family("sd3", ("StableDiffusion3Pipeline",), "jagg_lightning.policies.sd3", "SD3Policy")
register_family("flux", ("FluxPipeline",), "jagg_lightning.policies.flux", "FluxPolicy")
register_family("flux_kontext", ("FluxKontextPipeline",), "jagg_lightning.policies.flux_kontext",
                "FluxKontextPolicy")
register_family("qwen_image", ("QwenImagePipeline",), "jagg_lightning.policies.qwen_image", "QwenImagePolicy")
register_family("qwen_image_edit", ("QwenImageEditPipeline",), "jagg_lightning.policies.qwen_image_edit",
                "QwenImageEditPolicy")
register_family("flux2", ("Flux2KleinPipeline",), "jagg_lightning.policies.flux2", "Flux2Policy")
register_family("flux2_dev", ("Flux2Pipeline",), "jagg_lightning.policies.flux2_dev", "Flux2DevPolicy")
register_family("z_image", ("ZImagePipeline",), "jagg_lightning.policies.z_image", "ZImagePolicy")
register_family("wan", ("WanPipeline",), "jagg_lightning.policies.wan", "WanPolicy")
register_family("wan22", (), "jagg_lightning.policies.wan", "Wan22TinyPolicy")  # the two-expert tiny twin
register_family("wan_i2v", ("WanImageToVideoPipeline",), "jagg_lightning.policies.wan_i2v", "WanI2VPolicy")
register_family("wan22_ti2v", ("WanImageToVideoPipeline",), "jagg_lightning.policies.wan_i2v", "Wan22TI2VPolicy",
                requires={"expand_timesteps": True})  # the same pipeline class in its TI2V mode
register_family("ltx2", ("LTX2Pipeline",), "jagg_lightning.policies.ltx2", "LTX2Policy")
register_family("ltx2_i2v", ("LTX2ImageToVideoPipeline",), "jagg_lightning.policies.ltx2", "LTX2I2VPolicy")
register_family("hunyuan_video15", ("HunyuanVideo15Pipeline",), "jagg_lightning.policies.hunyuan_video15",
                "HunyuanVideo15Policy")
register_family("hunyuan_video15_i2v", ("HunyuanVideo15ImageToVideoPipeline",),
                "jagg_lightning.policies.hunyuan_video15", "HunyuanVideo15I2VPolicy")


def _supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.pipeline_classes)})" for f in FAMILIES.values())


def check_family(name: str) -> None:
    if name not in FAMILIES:
        raise ValueError(f"policy.family must be one of {sorted(FAMILIES)} or null (detect), got {name!r}")


def pipeline_index(pretrained: str) -> dict:
    """A local pipeline directory's model_index.json, or a hub id's (fetched alone)."""
    pretrained = str(find_local(pretrained) or pretrained)  # shipped names, package-relative paths
    index = Path(pretrained) / "model_index.json"
    if index.is_file():
        return json.loads(index.read_text())
    if Path(pretrained).exists():
        raise ValueError(f"policy.pretrained must be a diffusers pipeline directory with model_index.json, got {pretrained!r}")
    from diffusers import DiffusionPipeline

    return dict(DiffusionPipeline.load_config(pretrained))


def pipeline_class_name(pretrained: str) -> str:
    """``_class_name`` of a local pipeline directory's model_index.json, or of a hub id's (fetched alone)."""
    return pipeline_index(pretrained)["_class_name"]


def family_for_pipeline_class(class_name: str, index: dict | None = None) -> Family:
    """The family of a pipeline class; ``index`` (model_index.json, or a pipeline's config) picks among the families
    of one class by what they require (WanImageToVideoPipeline: ``expand_timesteps`` -> wan22_ti2v)."""
    candidates = sorted(FAMILIES.values(), key=lambda f: not f.requires)  # the more specific first
    for family in candidates:
        if family.matches(class_name, index):
            return family
    raise ValueError(
        f"pipeline class {class_name!r} is not supported; supported: {_supported()} "
        "(or name one with policy.family)"
    )


def detect_family(config: PolicyConfig) -> Family:
    """``config.family`` if given, else the family of ``config.pretrained``'s pipeline class, else sd3."""
    if config.family is not None:
        check_family(config.family)
        return FAMILIES[config.family]
    if config.pretrained is None:
        return FAMILIES["sd3"]
    index = pipeline_index(config.pretrained)
    return family_for_pipeline_class(index["_class_name"], index)


def policy_class(config: PolicyConfig) -> type[Policy]:
    return detect_family(config).policy_class()


def build_policy(config: PolicyConfig, pipeline=None) -> Policy:
    """Construct (or load) the policy of ``config``'s family."""
    if pipeline is not None and config.family is None:
        cls = family_for_pipeline_class(type(pipeline).__name__, dict(pipeline.config)).policy_class()
    else:
        cls = policy_class(config)
    return cls(config, pipeline)


def __getattr__(name: str):
    # family classes without importing every family (and its diffusers classes) up front
    for family in FAMILIES.values():
        if name == family.policy:
            return family.policy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FAMILIES", "Family", "Policy", "PolicyConfig", "build_policy", "check_family", "detect_family", "family_for_pipeline_class", "pipeline_index", "policy_class", "register_family"]
