"""Window estimators behind one interface (``estimators/base.py``), one file each, chosen by ``jagg.estimator``.

To add one, write ``estimators/<name>.py`` with an :class:`Estimator` subclass and add it to :data:`ESTIMATORS`.
"""

from __future__ import annotations

from jagg_lightning.method.estimators.base import Estimator
from jagg_lightning.method.estimators.control_variate import ControlVariateEstimator, draw_corrections
from jagg_lightning.method.estimators.paper import PaperEstimator

ESTIMATORS: dict[str, type[Estimator]] = {cls.name: cls for cls in (PaperEstimator, ControlVariateEstimator)}


def build_estimator(jagg) -> Estimator:
    """The estimator ``jagg.estimator`` names, built from the ``jagg`` section."""
    return ESTIMATORS[jagg.estimator].from_config(jagg)


__all__ = ["ESTIMATORS", "ControlVariateEstimator", "Estimator", "PaperEstimator", "build_estimator", "draw_corrections"]
