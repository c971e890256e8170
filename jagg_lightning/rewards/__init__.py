"""Rewards: one file per scorer, all following :class:`Reward` (images in [0, 1], prompts -> scores [B]).

The JPEG rewards need no weights and are registered by name; model-based rewards take local paths and
are configured by ``class_path`` (they import their heavy dependencies only when built).
"""

from jagg_lightning.rewards.aesthetic import AestheticReward
from jagg_lightning.rewards.base import Reward, check_images, to_pil
from jagg_lightning.rewards.clipscore import CLIPScoreReward
from jagg_lightning.rewards.hpsv2 import HPSv2Reward
from jagg_lightning.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from jagg_lightning.rewards.pickscore import PickScoreReward
from jagg_lightning.rewards.weighted import WeightedReward

REWARDS: dict[str, type[Reward]] = {cls.name: cls for cls in (JpegCompressibility, JpegIncompressibility)}


def build_reward(reward: str | Reward) -> Reward:
    """A reward by registered name, or the given instance; unknown names fail with the allowed ones."""
    if isinstance(reward, Reward):
        return reward
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)} (or a Reward class_path), got {reward!r}")
    return REWARDS[reward]()


__all__ = ["REWARDS", "AestheticReward", "CLIPScoreReward", "HPSv2Reward", "JpegCompressibility",
           "JpegIncompressibility", "PickScoreReward", "Reward", "WeightedReward", "build_reward", "check_images",
           "to_pil"]
