"""The config sections live in ``jagg_lightning/config/`` (one module each); every name users, configs and the
package import keeps its path: ``jagg_lightning.config.<name>`` and, for the sections, ``jagg_lightning.<name>``."""

import importlib

import pytest

import jagg_lightning
import jagg_lightning.config as config

SECTIONS = ("PolicyConfig", "SamplingConfig", "GRPOConfig", "JAGGConfig", "MemoryConfig", "EvalConfig")
# what the package, its tests and benchmarks import from jagg_lightning.config besides the sections
HELPERS = ("ANCHOR_PASSES", "as_config", "check_fused", "check_resolution_field", "check_sections", "image_size")


def test_every_name_keeps_its_import_path():
    assert set(SECTIONS + HELPERS) <= set(config.__all__)
    for name in SECTIONS + HELPERS:
        value = getattr(importlib.import_module("jagg_lightning.config"), name)
        assert value is getattr(config, name)
    for name in SECTIONS:  # the package root's lazy names are the same classes
        assert getattr(jagg_lightning, name) is getattr(config, name), name
        assert getattr(config, name).__module__.startswith("jagg_lightning.config."), name


def test_a_section_built_from_a_checkpoints_dict_is_checked_as_before():
    """``as_config`` (how a checkpoint's hyper-parameters become sections) still runs each section's own checks."""
    section = config.as_config(config.GRPOConfig, {"clip_range": 2e-4})
    assert section.clip_range == 2e-4 and section.kl_beta == 0.0
    with pytest.raises(ValueError, match="jagg.window_size"):
        config.as_config(config.JAGGConfig, {"window_size": 1})
