"""``jagg plan``: the memory of one training step per device before anything is allocated -- a meta-device model from
the family's config.json (:mod:`.models`), activations traced in a ``FakeTensorMode`` under saved-tensor hooks
(:mod:`.trace`), laid out as the update's passes (:mod:`.plan`), what to change (:mod:`.advice`), the table
and its JSON (:mod:`.table`). Plain torch, no Lightning; the command itself is :mod:`jagg_lightning.cli.plan`. It may import ``utils/``,
``method/``, ``models/``, ``config/``, ``policies/`` and ``training/`` (the pass plan), never ``module.py``."""

from jagg_lightning.memory_plan.advice import advise
from jagg_lightning.memory_plan.plan import MemoryPlan, Setup, plan_memory
from jagg_lightning.memory_plan.table import as_json, render

__all__ = ["MemoryPlan", "Setup", "advise", "as_json", "plan_memory", "render"]
