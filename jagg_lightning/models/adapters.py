"""The LoRA adapter: attaching it to the trained networks (:func:`attach_lora`, from ``policy.adapter`` when given) and
its on-disk layout, the one place that knows how a trained LoRA is written and read back.

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
                                      (``policy.extra_lora_modules()``: Wan2.2's ``transformer_2``);
                                      ``policy.adapter`` reads them back beside ``peft/`` / ``diffusers/``
                                      (:func:`read_adapters`)

Every export is built in a temporary directory and renamed into place (:mod:`jagg_lightning.faults.io`): a failed or killed
write never leaves half an adapter, and the previous one stays where it was.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from jagg_lightning.faults.io import atomic_directory, readable_path
from jagg_lightning.models.export import full_identity
from jagg_lightning.utils.assets import find_local
from jagg_lightning.utils.checks import PolicyBuildError
from jagg_lightning.utils.dtypes import compute_dtype
from jagg_lightning.utils.sharding import full_tensor

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


ADAPTER_WEIGHTS = {PEFT_DIR: "adapter_model.safetensors", DIFFUSERS_DIR: "pytorch_lora_weights.safetensors"}


def adapter_format(path: str | Path, field: str = "policy.adapter") -> tuple[str, Path]:
    """("peft" | "diffusers", the folder holding its weights) for an export folder (``.../lora/final``: its
    ``peft/`` is read), a ``peft/`` folder, a ``diffusers/`` folder or a diffusers ``.safetensors`` file (read where
    a killed export left it: :func:`~jagg_lightning.faults.io.readable_path`)."""
    path = readable_path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return DIFFUSERS_DIR, path.parent
    for kind, folder in ((PEFT_DIR, path / PEFT_DIR), (DIFFUSERS_DIR, path / DIFFUSERS_DIR), (PEFT_DIR, path),
                         (DIFFUSERS_DIR, path)):
        if (folder / ADAPTER_WEIGHTS[kind]).is_file():
            return kind, folder
    raise FileNotFoundError(f"{field}: {str(path)!r} holds no LoRA adapter (expected peft/adapter_model.safetensors "
                            "or diffusers/pytorch_lora_weights.safetensors, as LoRAExport writes them)")


def adapter_files(path: str | Path, field: str = "policy.adapter") -> tuple[str, dict[str, Path]]:
    """("peft" | "diffusers", {network: its weights file}) of an exported adapter: ``transformer``'s (the file
    :func:`adapter_format` finds) and, where the folder sits in an export's layout (named ``peft`` or
    ``diffusers``), each further network's from the sibling ``<kind>_<name>/`` (Wan2.2's ``transformer_2``)."""
    kind, folder = adapter_format(path, field)
    path = readable_path(path)
    files = {"transformer": path if path.is_file() else folder / ADAPTER_WEIGHTS[kind]}
    if folder.name == kind:
        for sibling in sorted(folder.parent.glob(kind + "_*")):
            if (sibling / ADAPTER_WEIGHTS[kind]).is_file():
                files[sibling.name[len(kind) + 1:]] = sibling / ADAPTER_WEIGHTS[kind]
    return kind, files


def read_adapter(path: str | Path, field: str = "policy.adapter") -> tuple[dict, dict[str, torch.Tensor]]:
    """(its shape {"r", "lora_alpha", "target_modules"}, its weights named as :func:`lora_state_dict` names them)
    of an exported adapter's ``transformer`` part in PEFT or diffusers format (see :func:`adapter_format`)."""
    kind, files = adapter_files(path, field)
    return read_lora_file(kind, files["transformer"], field)


def read_adapters(path: str | Path, field: str = "policy.adapter") -> dict[str, tuple[dict, dict[str, torch.Tensor]]]:
    """:func:`read_adapter` for every network the export holds (:func:`adapter_files`): {network: (shape, weights)}."""
    kind, files = adapter_files(path, field)
    return {name: read_lora_file(kind, file, field) for name, file in files.items()}


def read_lora_file(kind: str, file: Path, field: str = "policy.adapter") -> tuple[dict, dict[str, torch.Tensor]]:
    """One network's LoRA file (``peft``: with its ``adapter_config.json``; ``diffusers``: its metadata)."""
    from safetensors import safe_open

    folder = file.parent
    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            weights = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # a truncated or foreign file: name it, whatever the reader's error
        raise ValueError(f"{field}: cannot read {str(file)!r}: {type(err).__name__}: {err}") from None
    prefix = PEFT_KEY_PREFIX if kind == PEFT_DIR else "transformer."
    weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    if not weights:
        raise ValueError(f"{field}: {str(file)!r} holds no transformer LoRA weights")
    if kind == PEFT_DIR and (folder / "adapter_config.json").is_file():
        shape = json.loads((folder / "adapter_config.json").read_text())
    elif "lora_adapter_metadata" in metadata:  # what diffusers' save_lora_weights records
        shape = json.loads(metadata["lora_adapter_metadata"])
        shape = {k.removeprefix("transformer."): v for k, v in shape.items()}
    else:  # no metadata: diffusers' own assumption, alpha = rank
        rank = next(v.shape[0] for k, v in weights.items() if "lora_A" in k)
        shape = {"r": rank, "lora_alpha": rank}
    targets = shape.get("target_modules") or sorted({k.split(".lora_")[0] for k in weights})
    shape = {"r": int(shape["r"]), "lora_alpha": float(shape["lora_alpha"]),
             "target_modules": sorted(targets) if isinstance(targets, (list, tuple, set)) else targets}
    return shape, weights


def load_adapter_weights(transformer, weights: dict[str, torch.Tensor], field: str = "policy.adapter") -> None:
    """Copy ``weights`` (:func:`read_adapter`) into the transformer's LoRA; every LoRA weight must be given and
    every given weight must fit, or ValueError naming ``field``."""
    own = lora_state_dict(transformer)
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    wrong = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(f"{field}: the adapter does not fit this model's LoRA: {len(missing)} missing "
                         f"{missing[:2]}, {len(unexpected)} unexpected {unexpected[:2]}, {len(wrong)} of another "
                         f"shape {wrong[:2]} (is it for this base model?)")
    params = dict(transformer.named_parameters())
    by_key = {}
    for name, param in params.items():  # peft names parameters "<module>.lora_A.default.weight"
        key = name.replace(".default.", ".")
        if key in weights:
            by_key[key] = param
    assert set(by_key) == set(weights), "peft parameter naming changed"
    with torch.no_grad():
        for key, param in by_key.items():
            param.copy_(weights[key].to(param.dtype))


def add_lora(policy, network: nn.Module, shape: dict, seed: int, dtype: torch.dtype) -> None:
    """A peft LoRA of ``shape`` ({"r", "lora_alpha", "target_modules"}) on ``network``, gaussian A (seeded), B = 0,
    its weights float32 (float64 with float64)."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    targets = shape["target_modules"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            network.add_adapter(LoraConfig(r=shape["r"], lora_alpha=shape["lora_alpha"], init_lora_weights="gaussian",
                                           target_modules=targets))
        except ValueError:  # peft's NoMatchingPeftModuleError and its kin
            names = [n for n, m in network.named_modules() if isinstance(m, nn.Linear)]
            raise PolicyBuildError(f"policy.lora_targets {targets!r} match no layer of the {policy.family} "
                                   f"transformer (its layers are named like {', '.join(names[-3:])})") from None
    cast_training_params(network, dtype=compute_dtype(dtype))


def attach_lora(policy, networks: dict[str, nn.Module], dtype: torch.dtype) -> list[str]:
    """Give each of ``networks`` (``Policy.trained_networks()``) its peft LoRA: of ``policy.adapter``'s shape and
    weights when the config names one, else of ``lora_rank`` / ``lora_alpha`` / ``lora_targets`` (null: the family's
    default targets), seeded seed + 1 for ``transformer``, + 2 for ``transformer_2``. Returns the effective
    ``target_modules`` of ``transformer``'s LoRA."""
    config = policy.config
    targets = list(config.lora_targets if config.lora_targets is not None else policy.default_lora_targets)
    shape = {"r": config.lora_rank, "lora_alpha": config.lora_alpha, "target_modules": targets}
    adapters = read_policy_adapters(policy, config.adapter, networks) if config.adapter is not None else {}
    for i, (name, network) in enumerate(networks.items()):
        add_lora(policy, network, adapters[name][0] if adapters else shape, config.seed + 1 + i, dtype)
        if adapters:  # an exported adapter: each network's own shape, then its weights
            try:
                load_adapter_weights(network, adapters[name][1])
            except ValueError as err:
                raise PolicyBuildError(str(err) if name == "transformer" else f"{err} [{name}]") from None
    return adapters["transformer"][0]["target_modules"] if adapters else targets


def read_policy_adapters(policy, path: str, networks: dict[str, nn.Module]) -> dict:
    """``policy.adapter``: {network: (shape, weights)} for exactly the networks ``policy`` trains."""
    try:
        adapters = read_adapters(find_local(path) or path)
    except (ValueError, FileNotFoundError) as err:
        raise PolicyBuildError(str(err)) from None
    if set(adapters) != set(networks):
        raise PolicyBuildError(policy.adapter_mismatch(path, adapters, networks))
    return adapters
