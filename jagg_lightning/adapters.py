"""The adapter's on-disk layout: the one place that knows how a trained LoRA is written.

An export directory holds

    peft/adapter_config.json          the peft ``LoraConfig`` (r, lora_alpha, target_modules)
    peft/adapter_model.safetensors    keys ``base_model.model.<module>.lora_{A,B}.weight``, as
                                      ``PeftModel.save_pretrained`` writes them, so
                                      ``PeftModel.from_pretrained(transformer, dir/"peft")`` loads them
    diffusers/pytorch_lora_weights.safetensors
                                      written by ``policy.pipeline_class.save_lora_weights`` with the
                                      adapter metadata (keys ``transformer.<module>...``): read by
                                      ``pipeline.load_lora_weights(dir/"diffusers")`` and
                                      ``transformer.load_lora_adapter(dir/"diffusers", use_safetensors=True)``
                                      at scale alpha/r (without the metadata diffusers assumes alpha = r)
    adapter.json                      the adapter's identity (family, base model, rank, alpha, targets)
    peft_<name>/ diffusers_<name>/    the same for each further adapted network of the policy
                                      (``policy.extra_lora_modules()``: Wan2.2's ``transformer_2``)

Every export is built in a temporary directory and renamed into place: a crash never leaves half an adapter.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from jagg_lightning.io import atomic_directory
from jagg_lightning.sharding import full_tensor

PEFT_DIR = "peft"
DIFFUSERS_DIR = "diffusers"
IDENTITY_FILE = "adapter.json"
PEFT_KEY_PREFIX = "base_model.model."  # what PeftModel puts in front of the wrapped model's module names


def lora_state_dict(transformer) -> dict[str, torch.Tensor]:
    """The adapter's weights in PEFT naming relative to the transformer (no adapter name), whole contiguous
    CPU copies. Under FSDP2 this gathers the shards: call it on every rank."""
    from peft.utils import get_peft_model_state_dict

    return {k: full_tensor(v.detach()).to("cpu", copy=True).contiguous()
            for k, v in get_peft_model_state_dict(transformer).items()}


def adapter_identity(policy) -> dict:
    """What a LoRA checkpoint only fits: the family, the base model and the adapter's shape (plain data)."""
    config = policy.config
    if getattr(config, "trainable", "lora") == "full":  # no adapter: what the trained weights are
        from jagg_lightning.export import full_identity

        return full_identity(policy)
    lora = policy.transformer.peft_config["default"]  # what the adapter really is, whatever the config calls it
    pretrained = getattr(config, "pretrained", None)
    base = pretrained if pretrained is not None else f"tiny-random(seed={getattr(config, 'seed', 0)})"
    return {
        "family": str(getattr(policy, "family", "sd3")),
        "base_model": str(base),
        "lora_rank": int(lora.r),
        "lora_alpha": float(lora.lora_alpha),
        "lora_targets": sorted(str(t) for t in lora.target_modules),
    }


def identity_mismatch(saved: dict, current: dict) -> list[str]:
    """Fields of ``saved`` that differ from ``current``, as "field: saved X, this module Y" lines."""
    return [f"{k}: checkpoint {saved[k]!r}, this module {current.get(k)!r}" for k in saved if saved[k] != current.get(k)]


def save_adapter(policy, target: str | Path, step: int | None = None,
                 weights: dict[str, torch.Tensor] | None = None,
                 extra_weights: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write the policy's current adapter in both formats (see the module docstring) under ``target``;
    ``step`` (the trainer's global step) is recorded in ``adapter.json``. ``weights``: the
    :func:`lora_state_dict` to write, if already gathered (under FSDP2 every rank gathers, one writes).
    A policy with further adapted networks (``policy.extra_lora_modules()``, e.g. Wan2.2's ``transformer_2``)
    gets ``peft_<name>/`` and ``diffusers_<name>/`` beside them (``extra_weights[name]`` if gathered); the
    family's docs say how its pipeline loads them."""
    extra = policy.extra_lora_modules() if hasattr(policy, "extra_lora_modules") else {}
    extra_weights = extra_weights or {}
    with atomic_directory(target) as tmp:
        _write_lora(policy, policy.transformer, tmp, "", weights)
        for name, module in extra.items():
            _write_lora(policy, module, tmp, "_" + name, extra_weights.get(name))
        identity = adapter_identity(policy) | ({} if step is None else {"global_step": int(step)})
        (tmp / IDENTITY_FILE).write_text(json.dumps(identity, indent=2) + "\n")
    return Path(target)


def _write_lora(policy, transformer, tmp: Path, suffix: str, weights: dict[str, torch.Tensor] | None) -> None:
    """One adapted network's adapter as ``peft<suffix>/`` and ``diffusers<suffix>/``."""
    config = copy.deepcopy(transformer.peft_config["default"])
    if getattr(policy.config, "pretrained", None) is not None:
        config.base_model_name_or_path = str(policy.config.pretrained)
    weights = lora_state_dict(transformer) if weights is None else weights
    peft_dir = tmp / (PEFT_DIR + suffix)
    config.save_pretrained(str(peft_dir))
    save_file({PEFT_KEY_PREFIX + k: v for k, v in weights.items()}, str(peft_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    policy.pipeline_class.save_lora_weights(
        str(tmp / (DIFFUSERS_DIR + suffix)), transformer_lora_layers=weights, transformer_lora_adapter_metadata=metadata
    )
