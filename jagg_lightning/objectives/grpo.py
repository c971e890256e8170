"""GRPO (Flow-GRPO's clipped-ratio policy gradient over the SDE steps, with JAGG windows): the default objective.

Its update is :class:`~jagg_lightning.training.update.Updater`, unchanged: the ``grpo``, ``jagg`` and ``memory`` sections
configure it (docs/method.md §2 - §8).
"""

from __future__ import annotations

from jagg_lightning.objectives.base import Objective
from jagg_lightning.training.update import Updater


class GRPOObjective(Objective):
    name = "grpo"

    def updater(self, policy, sampling, grpo, jagg, memory, sampler) -> Updater:
        return Updater(policy, sampling, grpo, jagg, memory, sampler)
