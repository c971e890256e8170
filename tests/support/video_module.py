"""The module every video twin's tests train (Wan, Wan image-to-video, HunyuanVideo 1.5, LTX-2): 4 steps, groups of
2, an image reward scored on 3 frames, every trained network's LoRA B randomised."""

import torch

from jagg_lightning import GRPOConfig, JAGGConfig, JAGGModule, SamplingConfig
from jagg_lightning.rewards import FrameReward

from helpers import float64_reward, randomize_lora_b


def video_module(make_config, path, seed, dtype="float32", jagg_frac=0.5, window_size=2, num_steps=4, optimizer=None,
                 shape=None, reward=None, **grpo):
    """A JAGGModule on the twin saved at ``path`` (its family detected). ``make_config``: the twins' PolicyConfig
    builder; ``shape``: PolicyConfig overrides of the twin's size (``resolution``, ``num_frames``); ``reward``: an
    image reward scored on 3 frames (default: JPEG compressibility at the run's precision); ``grpo``: GRPOConfig
    fields."""
    module = JAGGModule(
        make_config(pretrained=str(path), dtype=dtype, **(shape or {})),
        SamplingConfig(num_steps=num_steps, group_size=2, rollout_batch_size=4),
        GRPOConfig(**({"train_batch_size": 4, "skip_zero_advantage": False} | grpo)),
        JAGGConfig(window_size=window_size, jagg_frac=jagg_frac),
        optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)),
        reward=FrameReward(reward or float64_reward(dtype), frames=3),  # image rewards score videos through FrameReward
        seed=seed,
    )
    module.configure_model()
    for network in getattr(module.policy, "experts", [module.policy.transformer]):  # Wan2.2: both experts
        randomize_lora_b(network, torch.Generator().manual_seed(seed))
    return module
