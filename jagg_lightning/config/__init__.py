"""The configuration sections of ``JAGGModule`` (``model.*``), one module each, and the checks across sections.

Every check runs when a section is built (or when the module is constructed, for checks that span sections),
before any model exists: a bad value fails with a message naming the field and the allowed range.

Each section's docstring is the one description of its fields: Google style (a short first line, the prose and
math of the section, then ``Attributes:`` with one entry per field), read by ``jagg fit --help`` (jsonargparse) and
by the API reference (mkdocstrings). docs/configuration.md tables every field (tests/cli/test_help.py holds the
three together). Every name stays importable from here (``from jagg_lightning.config import GRPOConfig``). A
renamed key and the root seed's streams: ``old_keys.py``. It may import ``utils/``, ``method/`` (the step kinds,
estimators and GRPO variants its checks name) and ``models/`` (the compile and full fine-tune options); no I/O,
no Lightning.
"""

from __future__ import annotations

import dataclasses

from jagg_lightning.config.evaluation import EvalConfig
from jagg_lightning.config.grpo import GRPOConfig
from jagg_lightning.config.jagg import JAGGConfig
from jagg_lightning.config.memory import ANCHOR_PASSES, MemoryConfig
from jagg_lightning.config.objective import ObjectiveConfig
from jagg_lightning.config.policy import PolicyConfig, check_resolution_field, image_size
from jagg_lightning.config.sampling import SamplingConfig
from jagg_lightning.method.grpo import check_variants
from jagg_lightning.utils.checks import check

__all__ = ["ANCHOR_PASSES", "EvalConfig", "GRPOConfig", "JAGGConfig", "MemoryConfig", "ObjectiveConfig", "PolicyConfig",
           "SamplingConfig", "as_config", "check_fused", "check_resolution_field", "check_sections", "image_size"]


def check_sections(sampling: SamplingConfig, grpo: GRPOConfig, jagg: JAGGConfig) -> None:
    """The checks that span sections (each section checks its own fields when built)."""
    trained_name = "sampling.sde_window_size" if sampling.sde_window_size is not None else "sampling.trained_steps"
    check(jagg.window_size <= sampling.num_trained or sampling.num_trained == 1, "jagg.window_size",
          f"<= {trained_name} ({sampling.num_trained})", jagg.window_size)  # 1 step: its own exact window
    if jagg.fused_rollout:
        check_fused(sampling, grpo)
    check_variants(grpo, sampling.step_kind, sampling.cps_log_prob)
    if sampling.sde_window_draw == "group":  # per-row trained steps: the unfused update groups rows by their step
        why = "with sampling.sde_window_draw 'group' (each group trains its own step)"
        check(not jagg.fused_rollout, "jagg.fused_rollout", f"false {why}", jagg.fused_rollout)
        check(grpo.kl_beta == 0, "grpo.kl_beta", f"0 {why}: the KL reference is taken per rollout step", grpo.kl_beta)


def check_fused(s: SamplingConfig, g: GRPOConfig) -> None:
    """Refuse, with the reason, the settings under which a fused update would not equal the unfused one."""
    why = "jagg.fused_rollout runs the update inside the rollout"
    check(g.inner_epochs == 1, "grpo.inner_epochs", f"1 with jagg.fused_rollout ({why}: one optimizer step per "
          "rollout, on theta_old)", g.inner_epochs)
    check(g.micro_batches_per_update is None, "grpo.micro_batches_per_update", f"null with jagg.fused_rollout "
          f"({why}: every micro-batch belongs to the one update)", g.micro_batches_per_update)
    check(s.rollout_batch_size % s.group_size == 0, "sampling.rollout_batch_size", "a multiple of "
          f"sampling.group_size ({s.group_size}) with jagg.fused_rollout (a micro-batch's advantages are taken as "
          "soon as it ends, so it must hold whole groups)", s.rollout_batch_size)
    check(g.adv_std == "group", "grpo.adv_std", "'group' with jagg.fused_rollout (a global std needs every "
          "reward of the rollout before the first backward)", g.adv_std)


def as_config(cls, value):
    """A private copy of a config dataclass from None (defaults), a dict (e.g. hyper-parameters of a
    checkpoint) or an instance (the signature's default instances are shared)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return dataclasses.replace(value)
