"""How a bad value is refused: one message naming the field, the allowed range and the value given; and the checks
of what the Trainer brings (its precision, the optimizer factory). A leaf: the config sections, the estimators,
the module and the CLI all use it."""

from __future__ import annotations

import torch
from torch import Tensor


class PolicyBuildError(ValueError):
    """A configuration value that only the model can refute (LoRA targets, an adapter that does not fit): the
    CLI shows it as one ``jagg: error:`` line."""


def check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def one_of(names) -> str:
    """'a', 'b' or 'c'."""
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_ints(config, section: str, *names: str) -> None:
    """Integer fields must be integers (or null where they default to null): 2.5 steps is a typo, not a value."""
    for name in names:
        value = getattr(config, name)
        check(value is None or (isinstance(value, int) and not isinstance(value, bool)), f"{section}.{name}",
              "an integer", value)


# trainer.precision -> the policy.dtype it needs ("true" precisions cast the module; None = any dtype)
# 16-mixed is refused: its loss scaler unscales inside optimizer.step, after the manual gradient clipping
PRECISIONS = {"32-true": None, "bf16-mixed": None, "bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "None": "32-true"}


def check_precision(precision, dtype: str | None) -> str:
    """Refuse Lightning precisions the module cannot honour; "-true" ones must match ``policy.dtype`` (the
    frozen weights), since LoRA weights and optimizer state stay float32 under every precision."""
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    check(name != "16-mixed", "trainer.precision", "bf16-mixed rather than 16-mixed (float16 loss scaling does not "
          "compose with the manual gradient clipping)", precision)
    check(name in PRECISIONS, "trainer.precision", f"one of {sorted(PRECISIONS)}", precision)
    needed = PRECISIONS[name]
    dtype = dtype or "float32"
    check(needed is None or dtype == needed, "model.policy.dtype",
          f"{needed!r} with trainer.precision {name} (it casts the frozen weights; or use bf16-mixed / 32-true)",
          dtype)
    return name


def check_strategy(strategy, sharded_class: type, stage: str, jagg, policy) -> None:
    """Refuse what the Trainer's ``strategy`` cannot run: the fused mode (``jagg.fused_rollout``) when fitting under
    FSDP2 (a ``sharded_class``, Lightning's ``ModelParallelStrategy``), and ``policy.compile`` under FSDP2 or context
    parallelism (a strategy with a ``context_parallel``)."""
    sharded = isinstance(strategy, sharded_class)
    if jagg.fused_rollout and stage == "fit" and sharded:
        raise ValueError("jagg.fused_rollout must be false under a sharded strategy (FSDP2): the kept graphs "
                         "would hold every block's gathered weights until the micro-batch ends; not supported yet")
    context = getattr(strategy, "context_parallel", None) is not None
    check(policy.compile is None or not (sharded or context), "policy.compile", "null under FSDP2 or context "
          "parallelism (both wrap or hook the transformer's blocks after they are compiled; not supported yet)",
          policy.compile)


def default_optimizer(params):
    """``model.optimizer: null``: AdamW, lr 1e-4, weight decay 1e-4 (Flow-GRPO's SD3 setting)."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


def check_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        lr = group.get("lr", 0)
        lr = float(lr) if not isinstance(lr, Tensor) else float(lr.item())
        check(lr > 0, "optimizer lr (optimizer.init_args.lr)", "> 0", lr)


def check_optimizer(optimizer):
    """Build the optimizer factory's optimizer on a throw-away parameter, so that its own checks and ours (the
    learning rates) run before any model exists; returns the factory."""
    try:
        probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
    except ValueError as err:
        raise ValueError(f"optimizer lr (optimizer.init_args.lr) must be > 0 and valid: {err}") from err
    check_learning_rates(probe)
    return optimizer
