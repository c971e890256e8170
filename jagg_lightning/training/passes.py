"""Which steps get a gradient pass, which take the KL reference in the rollout, which keep their graph in the
fused mode, and how the passes are laid out under a memory budget. Plain functions of the ``jagg`` and ``memory``
config sections and the windows; the activation size comes in as a callable (measured once, only when a budget
asks for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jagg_lightning.method.estimators import ESTIMATORS
from jagg_lightning.method.jagg import Window

if TYPE_CHECKING:
    from jagg_lightning.config import JAGGConfig, MemoryConfig

ActivationBytes = Callable[[], int]
"""Bytes autograd keeps for ONE sample's forward with grad (:meth:`jagg_lightning.training.sampler.Sampler.activation_bytes`)."""


def pass_steps_before_routing(windows: list[Window], jagg: JAGGConfig, interiors: bool) -> set[int]:
    """Steps that get a backward whatever the routing decides -- anchors (routed or exact) and every step
    of a window exact for certain (a short tail, or ``jagg_frac`` routing none) -- plus, with
    ``interiors``, the interiors of windows that may stay exact (``jagg_frac`` < 1 or a ``score_limit``) or may
    be given passes by the estimator (``jagg.estimator``: the control variate's draws)."""
    j = jagg
    full = [w for w in windows if len(w.steps) == j.window_size]
    routed_count = int(j.jagg_frac * len(full) + 0.5)
    all_routed = routed_count == len(full) and j.score_limit is None and not ESTIMATORS[j.estimator].may_pass_interiors
    keep: set[int] = set()
    for w in windows:
        if len(w.steps) < j.window_size or routed_count == 0:
            keep.update(w.steps)  # exact for certain
        else:
            keep.update(w.anchors)
            if interiors and not all_routed:
                keep.update(w.interior)
    return keep


def reference_steps(windows: list[Window], jagg: JAGGConfig) -> set[int]:
    """The steps whose KL reference the rollout takes: every trained step, or with
    ``interpolate_reference`` only those that get a backward whatever the routing (the rest are
    interpolated or taken by :meth:`jagg_lightning.training.update.Updater.complete_reference` once the windows are
    routed)."""
    if not jagg.interpolate_reference:
        return {k for w in windows for k in w.steps}
    return pass_steps_before_routing(windows, jagg, interiors=False)


def fused_graph_steps(windows: list[Window], jagg: JAGGConfig, memory: MemoryConfig) -> set[int]:
    """The steps whose graph the fused rollout keeps: every step that may get a backward, known before
    routing (:func:`pass_steps_before_routing`; interiors with ``memory.fused_interior_graphs``)."""
    return pass_steps_before_routing(windows, jagg, memory.fused_interior_graphs)


def pass_plan(samples: int, windows: list[Window], memory: MemoryConfig,
              activation_bytes: ActivationBytes) -> tuple[int, bool]:
    """(samples per pass, split anchors) for ``samples`` over the routed ``windows`` under ``memory.budget_mb``.

    A pass over n samples of one step keeps n a bytes (a = ``activation_bytes()``); a batched anchor
    pass keeps 2 n a. Two plans fit the budget B: batched anchors on c_b = B // 2a samples a pass, or
    split anchors on c_s = B // a; with R routed windows and E exact steps they make
    (R + E) ceil(n / c_b) and (2R + E) ceil(n / c_s) passes. ``memory.anchors: auto``: the plan with fewer passes
    wins (batched on a tie; split when c_b < 1); ``batched`` / ``split``: that plan. A budget below one sample's
    pass still runs one sample at a time. Without a budget: all samples, batched unless ``anchors: split``."""
    budget, anchors = memory.budget_mb, memory.anchors
    if budget is None:
        return samples, anchors == "split"
    per_sample, limit = max(activation_bytes(), 1), int(budget * 2**20)
    routed = sum(1 for w in windows if w.routed)
    exact = len({k for w in windows if not w.routed for k in w.steps})
    batched, split = min(samples, limit // (2 * per_sample)), max(1, min(samples, limit // per_sample))
    if anchors == "batched":
        return max(1, batched), False
    if anchors == "auto" and batched >= 1 and (
            (routed + exact) * -(-samples // batched) <= (2 * routed + exact) * -(-samples // split)):
        return batched, False
    return split, True


def fused_samples(kept_steps: int, memory: MemoryConfig, activation_bytes: ActivationBytes) -> int | None:
    """Samples of each rollout micro-batch whose graphs the fused mode keeps: ``memory.fused_samples``, else
    as many as ``memory.budget_mb`` holds for ``kept_steps`` graphs (at least 1), else all (None)."""
    if memory.fused_samples is not None or memory.budget_mb is None:
        return memory.fused_samples
    return max(1, int(memory.budget_mb * 2**20) // (max(kept_steps, 1) * max(activation_bytes(), 1)))
