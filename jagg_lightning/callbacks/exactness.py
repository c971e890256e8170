"""Is JAGG still accurate on *your* model? Every N training steps, on one micro-batch of the last
rollout, compare every window's exact gradient sum_k J_k^T g_k with its JAGG gradient
J_a^T G_a + J_b^T G_b at the current weights.

It changes nothing the training uses: gradients come from ``torch.autograd.grad`` (``.grad`` untouched),
the weights, the optimizer state and every RNG stream stay as they were.

Cost per check, for a micro-batch of m samples and T trained steps: T forwards with grad and T
backward passes for the exact side, plus per window one batched anchor forward/backward and W - 2
no-grad forwards for the JAGG side -- about one exact GRPO micro-batch update and a bit more. Under Flow-DPPO
(``objective.name: flow_dppo``) it also logs ``exactness/mask_agreement``: how often its asymmetric mask at a routed
window's interpolated means equals the exact per-step mask (W no-grad forwards per routed window more).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from jagg_lightning.method.jagg import WindowGradientCheck


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation (average ranks for ties); NaN with fewer than 3 points or a constant side."""
    if len(x) < 3:
        return float("nan")

    def ranks(values):
        t = torch.tensor(values, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(t), dtype=torch.float64)
        for v in t.unique():  # ties share their mean rank
            tied = t == v
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = rx.norm() * ry.norm()
    return float(rx @ ry / denom) if denom > 0 else float("nan")


class ExactnessDiagnostics(L.Callback):
    """Every N training steps, each window's JAGG gradient against its exact one on the last rollout.

    Args:
        every_n_steps: Training steps between checks, >= 1.
        max_samples: The micro-batch size of a check (the last rollout's first samples), >= 1; null = all.
        min_cosine: Warn when a routed window's gradient cosine falls below it, in [-1, 1].
    """

    def __init__(self, every_n_steps: int = 10, max_samples: int | None = 2, min_cosine: float = 0.9):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"ExactnessDiagnostics.every_n_steps must be >= 1, got {every_n_steps}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"ExactnessDiagnostics.max_samples must be >= 1 or null, got {max_samples}")
        if not -1.0 <= min_cosine <= 1.0:
            raise ValueError(f"ExactnessDiagnostics.min_cosine must be in [-1, 1], got {min_cosine}")
        self.every_n_steps, self.max_samples, self.min_cosine = every_n_steps, max_samples, min_cosine
        self.history: list[list[WindowGradientCheck]] = []
        self._step = 0

    def mask_agreement(self, pl_module) -> float | None:
        """Flow-DPPO's mask at the routed windows' interpolated means against the exact per-step mask: the share of
        (interior step, sample) pairs that agree (``FlowDPPOUpdater.mask_agreement``); None for other objectives."""
        measure = getattr(pl_module.updater, "mask_agreement", None)
        if measure is None or pl_module.last_rollout is None:
            return None
        return measure(pl_module.last_rollout, pl_module.plan.windows, self.max_samples)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step += 1
        if (self._step - 1) % self.every_n_steps:
            return
        checks = pl_module.check_window_gradients(self.max_samples)
        if not checks:
            return
        self.history.append(checks)
        every = [c for step in self.history for c in step if len(c.steps) > 2]
        values = {f"exactness/cos_w{i}": c.cosine for i, c in enumerate(checks)}
        values |= {f"exactness/rel_err_w{i}": c.rel_error for i, c in enumerate(checks)}
        values["exactness/cos_min"] = min(c.cosine for c in checks)
        values["exactness/score_error_spearman"] = spearman([c.score for c in every], [c.rel_error for c in every])
        agreement = self.mask_agreement(pl_module)
        if agreement is not None:
            values["exactness/mask_agreement"] = agreement
        # rare metrics go straight to the loggers: self.log would drop them between log_every_n_steps
        for logger in trainer.loggers:
            logger.log_metrics({k: float(v) for k, v in values.items()}, step=trainer.global_step)
        for c in checks:
            if c.routed and c.cosine < self.min_cosine:
                rank_zero_warn(
                    f"JAGG window {c.steps} (residual {c.score:.3g}) is routed but its gradient cosine with the exact "
                    f"gradient is {c.cosine:.3f} < min_cosine {self.min_cosine}: lower jagg.jagg_frac or set "
                    "jagg.score_limit"
                )
