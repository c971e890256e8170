"""What a checkpoint and the hyper-parameters hold beyond Lightning's own state, as plain data (so
``torch.load(weights_only=True)`` and ``yaml.safe_load`` read them): the LoRA-only state dict, the ``jagg``
section (adapter identity, EMA, rollout counter, RNG streams) and rebuildable optimizer / scheduler factories.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import random
import sys

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from jagg_lightning.models.adapters import adapter_identity, identity_mismatch


def plain(value):
    """Dataclasses to dicts, containers recursively; anything else that is not plain data becomes its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


NOT_REBUILDABLE = "not rebuildable"


def describe_callable(fn, default) -> dict | str | None:
    """Plain-data record of an optimizer / scheduler factory: null for the default, class path + init args
    for ``functools.partial(cls, ...)``; anything else is recorded by name only."""
    if fn is None or fn is default:
        return None
    if isinstance(fn, functools.partial) and isinstance(fn.func, type) and not fn.args:
        return {"class_path": f"{fn.func.__module__}.{fn.func.__qualname__}", "init_args": plain(fn.keywords)}
    return f"{NOT_REBUILDABLE}: {getattr(fn, '__qualname__', repr(fn))}"


def rebuild_callable(field: str, value):
    """The factory from what :func:`describe_callable` recorded (or the callable itself)."""
    if value is None or callable(value):
        return value
    if isinstance(value, dict) and set(value) <= {"class_path", "init_args"}:
        cls = _import_class(value["class_path"], field)
        return functools.partial(cls, **(value.get("init_args") or {}))
    # only training needs it: warn and fall back rather than refuse to load a checkpoint for sampling
    rank_zero_warn(
        f"{field}: the checkpoint records {value!r}, which cannot be rebuilt from hyper-parameters; using the "
        f"default. Pass {field}=... to load_from_checkpoint to train on with your own."
    )
    return None


def _import_class(path: str, field: str) -> type:
    module_name, _, name = str(path).rpartition(".")
    if module_name not in sys.modules and not module_name.startswith("jagg_lightning."):  # a checkpoint is data
        raise ValueError(f"{field}: the checkpoint names {path!r}; import {module_name} first if you trust it")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{field}: cannot import {path!r} ({err})") from err


def _python_rng_state_to_list(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng_state_from_list(state: list):
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _numpy_rng_state_to_list(state) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_rng_state_from_list(state: list):
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def rng_state() -> dict:
    """Every RNG stream, as plain data (``weights_only`` loads it)."""
    return {
        "torch": torch.get_rng_state(),
        "python": _python_rng_state_to_list(random.getstate()),
        "numpy": _numpy_rng_state_to_list(np.random.get_state()),
    }


def jagg_section(policy, ema, rollouts: int, rng: dict | None = None) -> dict:
    """The checkpoint's ``jagg`` section: adapter identity, EMA shadow, rollouts so far and every RNG stream
    (``rng``: the streams as a step found them, for a checkpoint written on an exception inside that step)."""
    return {"adapter": adapter_identity(policy), "ema": None if ema is None else ema.state_dict(),
            "rollouts": rollouts, "rng": rng or rng_state()}


class CheckpointMismatchError(ValueError):
    """A checkpoint written for another adapter (base model, family, LoRA rank or targets); the CLI shows it as one
    ``jagg: error:`` line naming ``ckpt_path`` (the checkpoint's path, when the Trainer loading it says)."""

    def __init__(self, message: str, ckpt_path: str | None = None):
        super().__init__(message)
        self.ckpt_path = ckpt_path


def check_checkpoint_adapter(checkpoint: dict, policy, trainable: set[str], ckpt_path: str | None = None) -> None:
    """Refuse a checkpoint whose adapter is not this policy's (identity, when recorded, and the LoRA keys)."""
    saved = checkpoint.get("jagg", {}).get("adapter")
    if saved is not None:  # checkpoints from before identities were recorded load on the key check below
        mismatch = identity_mismatch(saved, adapter_identity(policy))
        if mismatch:
            raise CheckpointMismatchError(
                "the checkpoint's adapter does not match this module's (model.policy): " + "; ".join(mismatch), ckpt_path)
    missing = trainable - set(checkpoint["state_dict"])
    if missing:
        raise CheckpointMismatchError(
            f"the checkpoint lacks {len(missing)} LoRA weights (e.g. {sorted(missing)[0]}): was it written with "
            "the same policy.lora_targets / lora_rank?", ckpt_path)


def restore_rng(rng: dict | None) -> None:
    """Set every RNG stream a checkpoint's ``jagg`` section recorded (none: leave them)."""
    if rng:
        torch.set_rng_state(rng["torch"])
        random.setstate(_python_rng_state_from_list(rng["python"]))
        np.random.set_state(_numpy_rng_state_from_list(rng["numpy"]))


def trainable_keys_only(result, trainable: set[str], strict: bool):
    """The outcome of loading a checkpoint that holds only the trainable (LoRA) weights: the frozen weights
    (rebuilt from ``policy``) are not reported missing (Lightning would print every one of them); missing
    trainable weights are, and fail when ``strict``, as do unexpected keys."""
    missing = [k for k in result.missing_keys if k in trainable]
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"LoRA checkpoint does not fit: missing {missing[:3]}, unexpected "
                           f"{result.unexpected_keys[:3]}")
    return result._replace(missing_keys=missing, unexpected_keys=list(result.unexpected_keys))  # a NamedTuple
