"""Full-parameter training (``policy.trainable: full``): which transformer weights train, their master dtype,
and how FSDP2 shards them. Plain torch, no Lightning.

The published JAGG Qwen-Image recipe (and DanceGRPO, Flow-GRPO's ``use_lora=False``) trains every weight with
float32 master weights and bf16 compute. Here:

* the whole transformer is held in the master dtype (float32; float64 with a float64 policy), trained or not:
  a frozen subset in another dtype would mix dtypes inside one block;
* ``trainable_modules`` patterns pick the modules whose parameters train (null: all);
* without sharding the forward runs in the master dtype (inputs the text encoders made in ``policy.dtype``
  are up-cast by a pre-forward hook, a lossless cast); under FSDP2 each block computes in ``policy.dtype``
  (``MixedPrecisionPolicy``: parameters all-gathered in the compute dtype, gradients reduced in float32), so
  the optimizer (AdamW) and its state see only the float32 master shards.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from jagg_lightning.utils.dtypes import compute_dtype

TRAINABLE = ("lora", "full")
LORA_ONLY = ("lora_rank", "lora_alpha", "lora_targets", "adapter")


def check_trainable(config, config_class) -> None:
    """``policy.trainable`` and the fields that go with it (before any model is built)."""
    if config.trainable not in TRAINABLE:
        raise ValueError(f"policy.trainable must be 'lora' or 'full', got {config.trainable!r}")
    if not isinstance(config.reference_offload, bool):
        raise ValueError(f"policy.reference_offload must be true or false, got {config.reference_offload!r}")
    patterns = config.trainable_modules
    if patterns is not None and (isinstance(patterns, str) or not patterns
                                 or not all(isinstance(p, str) and p for p in patterns)):
        raise ValueError("policy.trainable_modules must be a non-empty list of module-name patterns or null (every "
                         f"weight), got {patterns!r}")
    if config.trainable == "lora":
        if patterns is not None:
            raise ValueError(f"policy.trainable_modules must be null with policy.trainable 'lora' (it selects the "
                             f"modules trained in full; LoRA targets are policy.lora_targets), got {patterns!r}")
        return
    # a LoRA option given to a full fine-tune is a config mistake, not something to ignore silently (a value
    # equal to its default cannot be told from an unset one)
    defaults = {f: getattr(config_class, f) for f in LORA_ONLY if hasattr(config_class, f)}
    defaults["lora_targets"] = None
    for name in LORA_ONLY:
        if getattr(config, name) != defaults[name]:
            raise ValueError(f"policy.{name} must be left at its default ({defaults[name]!r}) with policy.trainable "
                             f"'full' (there is no adapter), got {getattr(config, name)!r}")


def train_in_full(networks: dict[str, nn.Module], patterns: list[str] | None, dtype: torch.dtype) -> None:
    """``policy.trainable: full``: every one of ``networks`` (``Policy.trained_networks()``) trains its own weights
    (those of the modules ``patterns`` name; all when null), held in float32 masters (:func:`make_trainable`)."""
    for network in networks.values():
        make_trainable(network, patterns, dtype)


def module_matches(name: str, pattern: str) -> bool:
    """A module name matches a pattern equal to it, to one of its dotted suffixes (as peft's target_modules:
    ``attn`` matches ``transformer_blocks.0.attn``) or an fnmatch pattern of the whole name."""
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def make_trainable(transformer: nn.Module, patterns: list[str] | None, dtype: torch.dtype) -> None:
    """Cast ``transformer`` to its master dtype and let the parameters of the modules ``patterns`` name (all
    when null) train; a pattern that matches no module fails, naming it."""
    master = compute_dtype(dtype)  # float32 master weights whatever the compute dtype; float64 stays float64
    nn.Module.to(transformer, master)  # (diffusers' own .to warns about fp32-kept modules: none here)
    transformer.requires_grad_(patterns is None)
    transformer.train(False)  # dropout off: a rollout and its update must see the same function
    if patterns is not None:
        modules = [(n, m) for n, m in transformer.named_modules() if n]
        for pattern in patterns:
            hits = [m for n, m in modules if module_matches(n, pattern)]
            if not hits or not any(p.numel() for m in hits for p in m.parameters()):
                raise ValueError(f"policy.trainable_modules: {pattern!r} matches no module with weights of "
                                 f"{type(transformer).__name__} (e.g. {[n for n, _ in modules[:4]]})")
            for m in hits:
                m.requires_grad_(True)
    if master != dtype:
        transformer.register_forward_pre_hook(_upcast_inputs, with_kwargs=True)


def _upcast_inputs(module, args, kwargs):
    """Floating inputs of lower precision than the weights (the text encoders' bf16 embeddings) are cast up."""
    dtype = next(module.parameters()).dtype

    def up(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.finfo(x.dtype).bits < torch.finfo(dtype).bits:
            return x.to(dtype)
        return x

    return tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}


def fsdp_options(compute: torch.dtype, cpu_offload: bool = False, full: bool = True) -> dict:
    """``fully_shard`` keyword arguments: with full FT a mixed-precision policy (compute in ``compute``,
    gradients reduced in float32) when the master dtype differs; FSDP2's CPU offload when asked."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options = {}
    if full and compute_dtype(compute) != compute:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return options
