"""Rewards: one file per scorer, all following :class:`Reward` (images in [0, 1], prompts -> scores [B])."""

from jagg_lightning.rewards.base import Reward, check_images
from jagg_lightning.rewards.jpeg import JpegCompressibility, JpegIncompressibility

REWARDS: dict[str, type[Reward]] = {cls.name: cls for cls in (JpegCompressibility, JpegIncompressibility)}


def build_reward(reward: str | Reward) -> Reward:
    """A reward by registered name, or the given instance; unknown names fail with the allowed ones."""
    if isinstance(reward, Reward):
        return reward
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)} (or a Reward instance / class_path), got {reward!r}")
    return REWARDS[reward]()


__all__ = ["REWARDS", "JpegCompressibility", "JpegIncompressibility", "Reward", "build_reward", "check_images"]
