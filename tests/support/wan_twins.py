"""The Wan2.1 and Wan2.2 (two experts) tiny twins the Wan tests run on, and the modules they build on them."""

import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.policies import PolicyConfig
from jagg_lightning.policies.wan import build_tiny_wan_pipeline
from jagg_lightning.rewards import FrameReward

from helpers import float64_reward, tiny_policy_config
from video_module import video_module

TWINS = {"wan21": False, "wan22": True}  # name -> two experts


def build(twin, dtype=torch.float32):
    return build_tiny_wan_pipeline(0, dtype, two_experts=TWINS[twin])


def config(**kw):
    # guidance_scale_2 differs from guidance_scale: a wrong expert's scale shows
    # resolution and frames named: a saved twin loads as a real pipeline would, at 480 px and 81 frames by default
    return tiny_policy_config(**({"lora_targets": None, "max_sequence_length": 8, "guidance_scale": 5.0,
                                  "resolution": 32, "num_frames": 9,
                                  "guidance_scale_2": 3.0} | kw))


def module_for(twin, path, seed, make_config=None, **kw):
    """video_module on these twins' config (``make_config``: the image-to-video twins pass theirs); ``twin`` names
    the family for the callers, the saved twin at ``path`` says it."""
    return video_module(make_config or config, path, seed, **kw)


# the Wan2.2 twin trained in full, smaller: 16 px, 5 frames
WAN = {"max_sequence_length": 8, "guidance_scale": 5.0, "guidance_scale_2": 3.0, "resolution": 16, "num_frames": 5}


def full_module(seed, **policy):
    return JAGGModule(
        PolicyConfig(**({"family": "wan22", "trainable": "full", "dtype": "float64"} | WAN | policy)),
        SamplingConfig(num_steps=3, group_size=2, rollout_batch_size=2),  # sigmas 1 | 0.75, 0.003
        GRPOConfig(train_batch_size=2, max_grad_norm=None, kl_beta=0.3),
        JAGGConfig(window_size=2, jagg_frac=0.0),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        reward=FrameReward(float64_reward("float64"), frames=3),
        seed=seed,
    )
