"""``model.memory``: what the update's gradient passes may hold (`MemoryConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from jagg_lightning.utils.checks import check, check_ints, one_of

ANCHOR_PASSES = ("auto", "batched", "split")


@dataclass
class MemoryConfig:
    """What the update's gradient passes may hold in activation memory.

    Each field means one thing, and none changes the gradient: only how the passes are laid out and what that
    trades (docs/method.md §5 and §7). Not here: `jagg.cache_interior` (the rollout records the velocities in any
    case -- routing reads them -- so reusing them saves forwards, not memory).

    Attributes:
        budget_mb: The activation memory ONE gradient pass may keep -- and, in the fused mode, the kept graphs of
            one rollout micro-batch -- in MiB, > 0, measured per sample (`Sampler.activation_bytes`); it sets how
            many samples share a pass (`passes.pass_plan`). Null: no limit (all of a micro-batch's samples in one
            pass).
        anchors: How a JAGG window's two anchors run: `batched` (one forward of both, one backward: about twice
            one step's activations), `split` (one forward each, still one backward per window in the fused mode, two
            passes otherwise: exact GRPO's peak), `auto` (batched without a budget; under one, the layout with fewer
            passes).
        fused_samples: Fused mode: how many samples of each rollout micro-batch keep their graphs, >= 1 (the rest
            are updated unfused, their anchors re-run); null: as many as `budget_mb` holds, all without a budget.
        fused_interior_graphs: Fused mode: also keep the graphs of interior steps of windows that may stay exact
            (`jagg_frac` < 1, a `score_limit`) or be corrected by the estimator; false re-runs those after the
            micro-batch, as unfused.
    """

    budget_mb: float | None = None
    anchors: str = "auto"
    fused_samples: int | None = None
    fused_interior_graphs: bool = True

    def __post_init__(self):
        check(self.budget_mb is None or (isinstance(self.budget_mb, (int, float)) and not isinstance(self.budget_mb, bool)
                                         and self.budget_mb > 0), "memory.budget_mb", "> 0 (MiB) or null", self.budget_mb)
        check(self.anchors in ANCHOR_PASSES, "memory.anchors", one_of(ANCHOR_PASSES), self.anchors)
        check_ints(self, "memory", "fused_samples")
        check(self.fused_samples is None or self.fused_samples >= 1, "memory.fused_samples", ">= 1 or null",
              self.fused_samples)
        check(isinstance(self.fused_interior_graphs, bool), "memory.fused_interior_graphs", "true or false",
              self.fused_interior_graphs)
