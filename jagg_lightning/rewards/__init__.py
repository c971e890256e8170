"""Rewards: one file per scorer, all following :class:`Reward` (images in [0, 1], prompts -> scores [B]).

The JPEG rewards need no weights, the digits reward ships its own, the OCR reward uses the models inside
its wheel and GenEval's rules read the scenes test bed exactly by default; they are registered by name. Model-based rewards take local paths and are configured by
``class_path`` (they import their heavy dependencies only when built), as is :class:`RemoteReward`, a
reward scored by a ``jagg serve-reward`` server. :class:`EditFidelity` and :class:`FirstFrameConsistency` read the
condition images conditioned prompts carry (image editing, image-to-video).

The names below are imported on first use (PEP 562): ``jagg serve-reward --help`` imports no torch. A new reward
goes here, one file; rewards may import only ``utils/`` and ``models/`` (conditioned prompts), never the training
step that scores with them.
"""

import importlib

# public name -> the module defining it
_PUBLIC = {
    "AestheticReward": "aesthetic", "CallableReward": "base", "Reward": "base", "check_images": "base", "to_pil": "base",
    "CLIPScoreReward": "clipscore", "EditFidelity": "conditioned", "FirstFrameConsistency": "conditioned",
    "DigitReward": "digits", "FlowGRPOServerReward": "flow_grpo_server", "GenEvalReward": "geneval",
    "HPSv2Reward": "hpsv2", "HPSv3Reward": "hpsv3", "ImageRewardReward": "imagereward",
    "JpegCompressibility": "jpeg", "JpegIncompressibility": "jpeg", "MONITOR_PREFIX": "monitor",
    "MonitoredReward": "monitor", "OcrReward": "ocr", "PickScoreReward": "pickscore",
    "REWARD_CLASSES": "registry", "build_reward": "registry", "describe_reward": "registry",
    "reward_class": "registry", "RemoteReward": "remote", "FrameReward": "video", "TemporalConsistency": "video",
    "VLMJudgeReward": "vlm_judge",
    "WeightedReward": "weighted", "component_weights": "weighted",
}

__all__ = sorted([*_PUBLIC, "REWARDS"])


def __getattr__(name: str):
    if name == "REWARDS":  # registered name -> class (imports every registered reward's module)
        from jagg_lightning.rewards.registry import REWARD_CLASSES, reward_class

        value = {n: reward_class(n) for n in REWARD_CLASSES}
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def import_all() -> None:
    """Import every reward above: the CLI does, so that jsonargparse knows each ``Reward`` subclass (``jagg fit
    --help`` lists them; a config's ``class_path`` resolves among them)."""
    for name in _PUBLIC:
        __getattr__(name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
