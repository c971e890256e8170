"""The estimator interface: how a routed JAGG window's gradient is estimated (docs/method.md §3, §8).

An estimator owns three things, and nothing outside its file knows them:

* its **draws** (:meth:`Estimator.draw`): per-window randomness, taken once the windows are routed, from a generator
  the update seeds by (seed, step, micro-batch), so every process draws alike; stored on the window
  (``Window.correction``) and in its ``WindowRecord``;
* its **fold weights** (:meth:`Estimator.interior_terms`): with what weight each interior step's upstream gradient
  g_k enters the anchors' composite gradients, and whether the interior step gets a pass of its own
  (:class:`~jagg_lightning.method.jagg.InteriorTerms`, read by the engine, :func:`~jagg_lightning.method.jagg.accumulate_gradients`);
* its **pass plan** (:attr:`Estimator.may_pass_interiors`): whether a routed window's interiors may get passes, known
  before routing -- so the rollout takes their KL reference and, in the fused mode, keeps their graphs.

A new estimator is one file here with an :class:`Estimator` subclass, plus its entry in ``estimators/__init__.py``'s
registry; ``jagg.estimator`` then accepts its name (docs/architecture.md, "How to add an estimator").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from jagg_lightning.method.jagg import InteriorTerms, Window


class Estimator:
    """A routed window's gradient estimate. Subclasses set :attr:`name` and override what differs."""

    name: str = ""
    may_pass_interiors: bool = False  # a routed window's interior steps may get passes of their own

    @classmethod
    def from_config(cls, jagg) -> Estimator:
        """The estimator of a ``jagg`` config section (its own fields read here)."""
        return cls()

    @classmethod
    def check_config(cls, jagg) -> None:
        """Refuse, naming the field, the ``jagg`` settings this estimator cannot honour (none by default)."""

    def draw(self, windows: Sequence[Window], generator: torch.Generator) -> None:
        """Its draws for the routed ``windows``, in place (``Window.correction``); none by default."""
        for w in windows:
            w.correction = 0.0

    def interior_terms(self, window: Window, alpha: Tensor) -> InteriorTerms:
        """How the routed ``window``'s interior steps (``alpha`` [W - 2], their alpha_k) enter the gradient."""
        raise NotImplementedError
