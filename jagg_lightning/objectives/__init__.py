"""Objectives behind one interface (``objectives/base.py``), one file each, chosen by ``objective.name``: what a
scored rollout becomes as a loss. "grpo" (the default, :class:`~jagg_lightning.training.update.Updater`), "flow_dppo"
(Flow-DPPO: GRPO's update with a divergence mask for the clip), "nft" (DiffusionNFT), "awm" (Advantage Weighted
Matching) and "dgpo" (Direct Group Preference Optimization), the last three sharing the forward-process update
(``forward_process.py``).

To add one, write ``objectives/<name>.py`` with an :class:`Objective` subclass and add it to :data:`OBJECTIVES`.
An objective may import ``method/``, ``config/`` and ``training/`` (GRPO's ``Updater`` and the rollout) and what
they may; ``module.py`` builds it, nothing below imports it.
"""

from __future__ import annotations

from jagg_lightning.config.objective import ObjectiveConfig
from jagg_lightning.objectives.awm import AWMObjective
from jagg_lightning.objectives.base import Objective
from jagg_lightning.objectives.dgpo import DGPOObjective
from jagg_lightning.objectives.flow_dppo import FlowDPPOObjective
from jagg_lightning.objectives.forward_process import ForwardProcessObjective, ForwardProcessUpdater, MatchingPoint
from jagg_lightning.objectives.grpo import GRPOObjective
from jagg_lightning.objectives.nft import NFTObjective

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (GRPOObjective, NFTObjective, AWMObjective,
                                                                     DGPOObjective, FlowDPPOObjective)}


def build_objective(config: ObjectiveConfig, sampling=None, grpo=None, jagg=None) -> Objective:
    """The objective ``config.name`` names; given the other sections, checked against them first
    (:meth:`Objective.check`: a message naming the field)."""
    objective = OBJECTIVES[config.name](config)
    if sampling is not None:
        objective.check(sampling, grpo, jagg)
    return objective


__all__ = ["OBJECTIVES", "AWMObjective", "DGPOObjective", "FlowDPPOObjective", "ForwardProcessObjective",
           "ForwardProcessUpdater", "GRPOObjective", "MatchingPoint", "NFTObjective", "Objective", "build_objective"]
