"""The HunyuanVideo 1.5 tiny twins (text-to-video and image-to-video), saved once per test session by the shared
``hunyuan_twin_dirs`` fixture (import it into a test module to use it), and the modules the tests build on them."""

import pytest
import torch

from jagg_lightning.policies.hunyuan_video15 import build_tiny_hunyuan_video15_pipeline

from family_cases import CONDITIONED_PROMPTS, fitted_prompts
from helpers import tiny_policy_config
from video_module import video_module

TWINS = {"hunyuan_video15": False, "hunyuan_video15_i2v": True}  # family -> image-to-video
# one prompt quotes text: its glyphs reach ByT5 (the other's ByT5 entries are zeros with a zero mask)
TEXT_PROMPTS = ["a red cat", 'a sign that says "hi"']


def prompts(twin) -> list:
    """The twin's two prompts: image-to-video's carry the random non-square 40 x 56 sources (fitting crops them)."""
    return CONDITIONED_PROMPTS if TWINS[twin] else TEXT_PROMPTS


def exact_size_prompts(twin, height: int, width: int) -> list:
    """The prompts with their images already fitted to (height, width) and on the 8-bit grid, so the pipeline, which
    takes a PIL image and picks its size from it, sees the very pixels the policy does."""
    return fitted_prompts(height, width) if TWINS[twin] else TEXT_PROMPTS


def build(twin, dtype=torch.float32):
    return build_tiny_hunyuan_video15_pipeline(0, dtype, i2v=TWINS[twin])


def config(**kw):
    # resolution and frames named: a saved twin loads as a real pipeline would, at 480 x 848 and 121 frames by default
    return tiny_policy_config(**({"lora_targets": None, "max_sequence_length": 16, "guidance_scale": 6.0,
                                  "resolution": 32, "num_frames": 9} | kw))


@pytest.fixture(scope="session")
def hunyuan_twin_dirs(tmp_path_factory):
    """Both twins (seed 0, float32), saved once per session with ``save_pretrained``."""
    root = tmp_path_factory.mktemp("hunyuan_video15_twins")
    for twin in TWINS:
        build(twin).save_pretrained(root / twin)
    return {twin: root / twin for twin in TWINS}


def module_for(twin, path, seed, **kw):
    """video_module on these twins' config (the saved twin at ``path`` says which family)."""
    return video_module(config, path, seed, **kw)
