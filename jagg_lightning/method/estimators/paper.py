"""The paper's estimate (``jagg.estimator: paper``): the two-anchor interpolation of the Jacobians.

J_k ~ (1 - alpha_k) J_a + alpha_k J_b, so the interior g_k fold into G_a = sum_k (1 - alpha_k) g_k and
G_b = sum_k alpha_k g_k, and ONE joint backward over the two anchors replaces W backward passes. No draws; the
interiors never get a pass of their own.
"""

from __future__ import annotations

from torch import Tensor

from jagg_lightning.method.estimators.base import Estimator
from jagg_lightning.method.jagg import InteriorTerms, Window, interpolation_terms


class PaperEstimator(Estimator):
    name = "paper"

    def interior_terms(self, window: Window, alpha: Tensor) -> InteriorTerms:
        return interpolation_terms(alpha)
