"""The unbiased control variate (``jagg.estimator: control_variate``, docs/method.md §8).

With probability p (``jagg.control_p``) a routed window also gets its exact per-step gradient, and its estimate
becomes JAGG + c (exact - JAGG) with c = B / p, B ~ Bernoulli(p): unbiased, E[c] = 1. A drawn window's interior
steps get passes of their own with upstream c g_k, and (1 - c) of their G_a / G_b share folds into the anchors from
that pass's g_k (no extra forward); an undrawn window is the paper's estimate. Expected pass steps per window
2 + p (W - 2); error variance (1 - p) / p ||exact - JAGG||^2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from jagg_lightning.method.estimators.base import Estimator
from jagg_lightning.method.jagg import InteriorTerms, Window, interpolation_terms
from jagg_lightning.utils.checks import check


def draw_corrections(windows: Sequence[Window], p: float | None, generator: torch.Generator | None = None) -> None:
    """The control variate's draws, in place: each routed window with an interior gets c = B/p, B ~ Bernoulli(p)
    from ``generator`` (one uniform per window, routed or not, so a window's draw does not depend on the
    routing of the others); ``p`` None resets every c to 0 (the paper's estimate)."""
    if p is not None and not 0.0 < p <= 1.0:
        raise ValueError(f"jagg.control_p must be in (0, 1], got {p}")
    for w in windows:
        drawn = p is not None and float(torch.rand((), generator=generator, dtype=torch.float64)) < p
        w.correction = 1.0 / p if drawn and w.routed and len(w.steps) > 2 else 0.0


class ControlVariateEstimator(Estimator):
    name = "control_variate"
    may_pass_interiors = True  # a drawn window's interiors get their exact passes

    def __init__(self, p: float = 0.5):
        self.p = p

    @classmethod
    def from_config(cls, jagg) -> ControlVariateEstimator:
        return cls(jagg.control_p)

    @classmethod
    def check_config(cls, jagg) -> None:
        check(not jagg.interpolate_reference, "jagg.interpolate_reference", "false with jagg.estimator "
              "'control_variate' (the unbiased estimate needs the true reference at every step)",
              jagg.interpolate_reference)

    def draw(self, windows: Sequence[Window], generator: torch.Generator) -> None:
        draw_corrections(windows, self.p, generator)

    def interior_terms(self, window: Window, alpha: Tensor) -> InteriorTerms:
        c = window.correction
        if not c:
            return interpolation_terms(alpha)
        al = alpha.tolist()
        return InteriorTerms([(1 - c) * (1 - a) for a in al], [(1 - c) * a for a in al], own=c)
