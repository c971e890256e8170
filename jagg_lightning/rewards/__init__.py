"""Rewards: one file per scorer, all following :class:`Reward` (images in [0, 1], prompts -> scores [B]).

The JPEG rewards need no weights, the digits reward ships its own and the OCR reward uses the models inside
its wheel; they are registered by name. Model-based rewards take local paths and are configured by
``class_path`` (they import their heavy dependencies only when built), as is :class:`RemoteReward`, a
reward scored by a ``jagg serve-reward`` server.
"""

from jagg_lightning.rewards.aesthetic import AestheticReward
from jagg_lightning.rewards.base import CallableReward, Reward, check_images, to_pil
from jagg_lightning.rewards.clipscore import CLIPScoreReward
from jagg_lightning.rewards.digits import DigitReward
from jagg_lightning.rewards.hpsv2 import HPSv2Reward
from jagg_lightning.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from jagg_lightning.rewards.monitor import MONITOR_PREFIX, MonitoredReward
from jagg_lightning.rewards.ocr import OcrReward
from jagg_lightning.rewards.pickscore import PickScoreReward
from jagg_lightning.rewards.registry import REWARD_CLASSES, build_reward, describe_reward, reward_class
from jagg_lightning.rewards.remote import RemoteReward
from jagg_lightning.rewards.video import FrameReward, TemporalConsistency
from jagg_lightning.rewards.weighted import WeightedReward, component_weights

REWARDS: dict[str, type[Reward]] = {name: reward_class(name) for name in REWARD_CLASSES}


__all__ = ["REWARDS", "AestheticReward", "CLIPScoreReward", "CallableReward", "DigitReward", "FrameReward", "HPSv2Reward",
           "JpegCompressibility", "JpegIncompressibility", "MONITOR_PREFIX", "MonitoredReward", "OcrReward",
           "PickScoreReward", "REWARD_CLASSES", "RemoteReward", "Reward", "TemporalConsistency", "WeightedReward",
           "build_reward", "check_images", "component_weights", "describe_reward", "reward_class", "to_pil"]
