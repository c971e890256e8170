"""Config keys renamed by the second shape pass (issue 27), and the run's one root seed.

Each old key keeps working for now: a value it is given moves to its new key, with one deprecation line naming that
key (users have configs on disk, and checkpoints record the old keys in their hyper-parameters). A value equal to
the old key's default counts as not given: a checkpoint's hyper-parameters hold every key, said or not. Drop an
entry of :data:`OLD_KEYS` (and its field) when the key goes.

Seeds (docs/configuration.md, "Seeds"): ``model.seed`` is the run's root; every stream is drawn from it with a
tag of its own (:func:`jagg_lightning.training.rollout.sample_seed`), so the streams never collide. ``policy.seed`` and
``sampling.seed`` (deprecated) still seed their own stream when given; ``evaluation.seed`` (null: the root) fixes
the evaluation noise apart from the run's seed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

from jagg_lightning.utils.checks import check


class JAGGDeprecationWarning(FutureWarning):
    """A config key that was renamed; the message names its new key (the ``jagg`` command prints it on one line)."""


@dataclass(frozen=True)
class OldKey:
    section: str  # the section object's name: policy, sampling, jagg
    field: str
    default: object  # its default before the rename: a restored checkpoint's value that says nothing
    new: str  # the key that replaces it, as a user writes it under model.


OLD_KEYS = (
    OldKey("policy", "seed", 0, "seed"),
    OldKey("sampling", "seed", 0, "seed"),
    OldKey("sampling", "window_fraction", 1.0, "jagg.window_fraction"),
    OldKey("jagg", "low_memory", False, "memory.anchors"),
    OldKey("jagg", "memory_budget_mb", None, "memory.budget_mb"),
    OldKey("jagg", "fused_samples", None, "memory.fused_samples"),
    OldKey("jagg", "fused_exact_interior", True, "memory.fused_interior_graphs"),
)


def given_old_keys(sections: dict) -> list[OldKey]:
    """The old keys that ``sections`` ({"policy": PolicyConfig, "sampling": ..., "jagg": ...}) give a value."""
    return [k for k in OLD_KEYS if getattr(sections[k.section], k.field) not in (None, k.default)]


def move_old_keys(policy, sampling, jagg, memory) -> None:
    """Move every old key's value to its new key (in place), one :class:`JAGGDeprecationWarning` per key given.

    Seeds stay where they are (:func:`resolve_seeds` reads them). ``jagg.low_memory: true`` becomes
    ``memory.anchors: split`` (under a memory budget, where it used to decide only the fused mode's kept graphs,
    it now splits every pass: the same gradient, never more memory). Both an old key and its new one given,
    differently: refused, naming both."""
    sections = {"policy": policy, "sampling": sampling, "jagg": jagg}
    for key in given_old_keys(sections):
        old, value = f"{key.section}.{key.field}", getattr(sections[key.section], key.field)
        if key.new == "seed":
            warnings.warn(f"model.{old} is deprecated: use model.{key.new} ({value!r} still seeds its own stream; "
                          "docs/configuration.md, Seeds)", JAGGDeprecationWarning, stacklevel=3)
            continue
        target, field = key.new.split(".")
        new_section = {"jagg": jagg, "memory": memory}[target]
        moved = "split" if key.field == "low_memory" else value  # true: its default (false) says nothing
        current, default = getattr(new_section, field), {f.name: f.default for f in fields(new_section)}[field]
        check(current in (default, moved), f"model.{key.new}", f"left unset when the deprecated model.{old} is given "
              f"(model.{old} = {value!r}); give only model.{key.new}", current)
        warnings.warn(f"model.{old} is deprecated: use model.{key.new} (set to {moved!r})", JAGGDeprecationWarning,
                      stacklevel=3)
        setattr(new_section, field, moved)
        setattr(sections[key.section], key.field, None)


def resolve_seeds(root: int, policy, sampling, evaluation) -> None:
    """Every stream's seed from the root ``model.seed`` (in place): the policy's (tiny weights, LoRA init) and the
    rollout's (noise, plan, routing, control draws, update shuffle) unless their deprecated keys give one; the
    evaluation's unless ``evaluation.seed`` does."""
    check(isinstance(root, int) and not isinstance(root, bool), "model.seed", "an integer", root)
    policy.seed = policy.seed or root
    sampling.seed = sampling.seed or root
    evaluation.seed = root if evaluation.seed is None else evaluation.seed
