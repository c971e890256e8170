"""The reward registry: names a config may give (``reward: digits``), and rebuilding a reward from the record the
hyper-parameters keep (:meth:`Reward.describe`). A name maps to its class's path, imported when the reward is built,
so this module imports no reward: :class:`~jagg_lightning.rewards.video.FrameReward`, which builds the reward it
wraps by name, imports it."""

from __future__ import annotations

import importlib
import sys

from jagg_lightning.rewards.base import CallableReward, Reward

# name -> class path of the rewards that need no arguments (model-based rewards are configured by class_path)
REWARD_CLASSES = {
    "jpeg_compressibility": "jagg_lightning.rewards.jpeg.JpegCompressibility",
    "jpeg_incompressibility": "jagg_lightning.rewards.jpeg.JpegIncompressibility",
    "digits": "jagg_lightning.rewards.digits.DigitReward",
    "geneval": "jagg_lightning.rewards.geneval.GenEvalReward",
    "ocr": "jagg_lightning.rewards.ocr.OcrReward",
    "temporal_consistency": "jagg_lightning.rewards.video.TemporalConsistency",
}


def reward_class(name: str) -> type[Reward]:
    """The class registered as ``name``."""
    module_name, _, class_name = REWARD_CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


def build_reward(reward) -> Reward:
    """A reward by registered name, the given instance, a plain callable ``fn(images, prompts) -> scores``
    (wrapped: :class:`~jagg_lightning.rewards.base.CallableReward`), or rebuilt from :meth:`Reward.describe`'s
    record (``{"class_path", "init_args"}``); unknown names fail with the allowed ones."""
    if isinstance(reward, Reward):
        return reward
    if isinstance(reward, dict):
        return _rebuild(reward)
    if callable(reward) and not isinstance(reward, (str, type)):
        return CallableReward(reward)
    if reward not in REWARD_CLASSES:
        raise ValueError(f"reward must be one of {sorted(REWARD_CLASSES)} (or a Reward class_path), got {reward!r}")
    return reward_class(reward)()


def describe_reward(reward: Reward) -> str | dict:
    """What the hyper-parameters record: the registered name of a default-built reward, else its description."""
    described = reward.describe()
    if reward.name in REWARD_CLASSES and type(reward) is reward_class(reward.name) and not described.get("init_args"):
        return reward.name
    return described


def _rebuild(described: dict) -> Reward:
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
