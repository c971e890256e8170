"""Rewards: one file per scorer, all following :class:`Reward` (images in [0, 1], prompts -> scores [B]).

The JPEG rewards need no weights, the digits reward ships its own and the OCR reward uses the models inside
its wheel; they are registered by name. Model-based rewards take local paths and are configured by
``class_path`` (they import their heavy dependencies only when built), as is :class:`RemoteReward`, a
reward scored by a ``jagg serve-reward`` server.
"""

import sys

from jagg_lightning.rewards.aesthetic import AestheticReward
from jagg_lightning.rewards.base import Reward, check_images, to_pil
from jagg_lightning.rewards.clipscore import CLIPScoreReward
from jagg_lightning.rewards.digits import DigitReward
from jagg_lightning.rewards.hpsv2 import HPSv2Reward
from jagg_lightning.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from jagg_lightning.rewards.monitor import MONITOR_PREFIX, MonitoredReward
from jagg_lightning.rewards.ocr import OcrReward
from jagg_lightning.rewards.pickscore import PickScoreReward
from jagg_lightning.rewards.remote import RemoteReward
from jagg_lightning.rewards.video import FrameReward, TemporalConsistency
from jagg_lightning.rewards.weighted import WeightedReward, component_weights

REWARDS: dict[str, type[Reward]] = {
    cls.name: cls for cls in (JpegCompressibility, JpegIncompressibility, DigitReward, OcrReward, TemporalConsistency)}


def build_reward(reward: str | Reward | dict) -> Reward:
    """A reward by registered name, the given instance, or rebuilt from :meth:`Reward.describe`'s record
    (``{"class_path", "init_args"}``); unknown names fail with the allowed ones."""
    if isinstance(reward, Reward):
        return reward
    if isinstance(reward, dict):
        return _rebuild(reward)
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)} (or a Reward class_path), got {reward!r}")
    return REWARDS[reward]()


def describe_reward(reward: Reward) -> str | dict:
    """What the hyper-parameters record: the registered name of a default-built reward, else its description."""
    described = reward.describe()
    if reward.name in REWARDS and type(reward) is REWARDS[reward.name] and not described.get("init_args"):
        return reward.name
    return described


def _rebuild(described: dict) -> Reward:
    import importlib

    path = described.get("class_path", "?")
    if "not_rebuildable" in described or "init_args" not in described:
        raise ValueError(
            f"reward: the checkpoint records reward {path} but cannot rebuild it "
            f"({described.get('not_rebuildable', 'no init_args recorded')}); pass reward=... to load_from_checkpoint"
        )
    module_name, _, name = path.rpartition(".")
    if module_name not in sys.modules and not module_name.startswith("jagg_lightning."):
        raise ValueError(f"reward: the checkpoint names {path!r}; import {module_name} first if you trust it")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"reward: cannot import {path!r} recorded in the checkpoint ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise ValueError(f"reward: {path!r} is not a jagg_lightning.rewards.Reward subclass")
    args = {k: _rebuild_arg(v) for k, v in described["init_args"].items()}
    return cls(**args)


def _rebuild_arg(value):
    if isinstance(value, dict) and "class_path" in value:
        return _rebuild(value)
    if isinstance(value, list):
        return [_rebuild_arg(v) for v in value]
    return value


__all__ = ["REWARDS", "AestheticReward", "CLIPScoreReward", "DigitReward", "FrameReward", "HPSv2Reward",
           "JpegCompressibility", "JpegIncompressibility", "MONITOR_PREFIX", "MonitoredReward", "OcrReward",
           "PickScoreReward", "RemoteReward", "Reward", "TemporalConsistency", "WeightedReward", "build_reward",
           "check_images", "component_weights", "describe_reward", "to_pil"]
