"""The LTX-2 tiny twins the LTX-2 tests run on (a real ``LTX2Pipeline`` built offline, saved once per session by the
``ltx2_twin_dir`` fixture: a test file imports it; the same parts as an ``LTX2ImageToVideoPipeline``, by
``ltx2_i2v_twin_dir``), and the modules they build on them."""

import lightning as L
import pytest
import torch

from jagg_lightning.data import PromptDataModule
from jagg_lightning.policies import build_policy
from jagg_lightning.policies.ltx2 import build_tiny_ltx2_pipeline

from helpers import randomize_lora_b, tiny_policy_config
from video_module import video_module

PROMPTS = ["a red cat", "a blue dog"]
# the pipeline __call__ arguments that turn its further guidance terms off (the policy samples plain CFG on both
# streams: LTX2Policy's docstring)
PLAIN_CFG = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                 audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None)


def build(dtype=torch.float32, i2v=False):
    return build_tiny_ltx2_pipeline(0, dtype, i2v=i2v)


@pytest.fixture(scope="session")
def ltx2_twin_dir(tmp_path_factory):
    """The twin (seed 0, float32) saved with ``save_pretrained``, once per session."""
    path = tmp_path_factory.mktemp("ltx2_twin") / "ltx2"
    build().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ltx2_i2v_twin_dir(tmp_path_factory):
    """The image-to-video twin (seed 0, float32) saved with ``save_pretrained``, once per session."""
    path = tmp_path_factory.mktemp("ltx2_i2v_twin") / "ltx2_i2v"
    build(i2v=True).save_pretrained(path)
    return path


def config(**kw):
    # resolution and frames named: a saved twin loads as a real pipeline would, at 512 x 768 and 121 frames by default
    return tiny_policy_config(**({"lora_targets": None, "max_sequence_length": 16, "guidance_scale": 3.0,
                                  "resolution": 32, "num_frames": 9} | kw))


def module_for(path, seed, **kw):
    """video_module on the twin's config."""
    return video_module(config, path, seed, **kw)


def lora_policy(seed, pipe=None, **kw):
    """The twin's policy (built in memory, or on ``pipe``) with both LoRA factors nonzero."""
    policy = build_policy(config(seed=seed, family="ltx2", **kw), pipeline=pipe if pipe is not None else build())
    randomize_lora_b(policy.transformer, torch.Generator().manual_seed(seed))
    return policy


def fit(module, steps=1, prompts=PROMPTS):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, PromptDataModule(prompts=prompts, batch_size=2, shuffle=False))
