"""The objective interface: what a scored rollout becomes as a loss (docs/architecture.md, "How to add an objective").

An objective owns three things, and nothing outside its file knows them:

* its **checks** (:meth:`Objective.check`): the settings of the other sections it cannot honour, refused before any
  model is built with a message naming the field;
* its **update** (:meth:`Objective.updater`): the part that takes one training step from the rollout to the
  optimizer steps -- which sampler runs, which forwards and backwards the loss needs, what is logged -- returning the
  :class:`~jagg_lightning.training.update.StepReport` the module logs. GRPO's is today's
  :class:`~jagg_lightning.training.update.Updater` unchanged; the forward-process objectives share
  :class:`~jagg_lightning.objectives.forward_process.ForwardProcessUpdater` and differ only in their per-point loss;
* its **state** beyond the weights (a lagging theta_old): the update's ``objective_state`` / ``load_objective_state``,
  kept in the checkpoint's ``jagg`` section.

The module's ``training_step`` reads the same for every objective: plan -> ``updater.step`` (rollout -> rewards ->
advantages -> update) -> record. A new objective is one file here with an :class:`Objective` subclass and its entry
in ``objectives/__init__.py``'s :data:`~jagg_lightning.objectives.OBJECTIVES`; ``objective.name`` then accepts it.
Plain torch: no Lightning here.
"""

from __future__ import annotations

from typing import ClassVar

from jagg_lightning.config.objective import ObjectiveConfig


class Objective:
    """A training objective. Subclasses set :attr:`name` and build their update."""

    name: ClassVar[str] = ""
    # whether its update routes windows of the rollout's SDE steps (GRPO), which RoutingStats plots per timestep; a
    # forward-process objective trains noise levels of the clean samples instead
    routes_sde_windows: ClassVar[bool] = True

    def __init__(self, config: ObjectiveConfig):
        self.config = config

    def check(self, sampling, grpo, jagg) -> None:
        """Refuse, naming the field, what this objective cannot honour in the other sections (none by default)."""

    def updater(self, policy, sampling, grpo, jagg, memory, sampler):
        """The part whose ``step(prompts, indices, step, plan, reward, hooks)`` makes one training step."""
        raise NotImplementedError
