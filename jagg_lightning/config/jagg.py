"""``model.jagg``: the window gradient (`JAGGConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jagg_lightning.method.estimators import ESTIMATORS
from jagg_lightning.method.routing import ROUTING_SCORES
from jagg_lightning.utils.checks import check, check_ints, one_of


@dataclass
class JAGGConfig:
    """The window gradient: which windows of trained steps JAGG replaces, and how.

    The trained steps are cut into windows of `window_size` steps with anchors a and b. Over a routed window the
    per-step Jacobians are interpolated between the anchors' (docs/method.md §3), so one backward through both
    anchors replaces W:

        sum_k J_k^T g_k  ~  J_a^T G_a + J_b^T G_b,   G_a = sum_k (1 - alpha_k) g_k,   G_b = sum_k alpha_k g_k,

    alpha_k = (t_a - t_k) / (t_a - t_b). The `jagg_frac` share of the windows with the smallest `routing` score
    take it; the others keep their exact per-step gradients. The fused mode (`fused_rollout`, docs/method.md §7)
    runs the update inside the rollout: every step that will get a backward runs WITH grad and keeps its graph; as
    each rollout micro-batch ends it is decoded, scored, its groups' advantages taken, its windows routed (on its
    own velocities), and ONE backward runs over the kept graphs -- no forward is repeated. What it keeps:
    `MemoryConfig`.

    Deprecated (each still works, with one line naming its new key; `jagg_lightning.config.old_keys`): `low_memory`
    (`memory.anchors: split`), `memory_budget_mb` (`memory.budget_mb`), `fused_samples` (`memory.fused_samples`),
    `fused_exact_interior` (`memory.fused_interior_graphs`).

    Attributes:
        window_size: W trained steps per window, an integer >= 2 and <= the trained steps.
        jagg_frac: The share of the full windows routed to JAGG (smallest score first), in [0, 1]; 0 = exact GRPO.
        chained: Neighbouring windows share an anchor (one anchor pass fewer per window).
        score_limit: A window whose routing score exceeds it stays exact, >= 0; null = no limit. Null with
            `routing: random`.
        window_fraction: The share of the JAGG windows trained per rollout, in (0, 1]: max(1, int(fraction x
            windows)) drawn from (`model.seed`, global step) (DanceGRPO's `timestep_fraction`, by window).
        cache_interior: Reuse the rollout's velocities for a window's interior steps while theta = theta_old.
        routing: The window score: `residual` (the velocity-interpolation residual r_w), `cosine` (1 - cos(v_k -
            v_a, v_b - v_a), the published rule) or `random` (a uniform draw seeded by (`model.seed`, step), the
            baseline; docs/method.md §6).
        estimator: A routed window's gradient: `paper` (the two-anchor interpolation) or `control_variate`
            (unbiased: with probability `control_p` the window also gets its exact gradient and the estimate
            becomes JAGG + (B / p)(exact - JAGG), B ~ Bernoulli(p) seeded by (`model.seed`, step); docs/method.md
            §8). Not with `interpolate_reference`.
        control_p: With `estimator: control_variate`: the probability p that a routed window also gets its exact
            gradient, in (0, 1]; 1 = exact GRPO's gradient.
        fused_rollout: The on-policy fused mode: each rollout micro-batch is updated as soon as it is sampled, from
            the graphs the rollout kept; no forward is repeated. Needs `grpo.inner_epochs` 1,
            `grpo.micro_batches_per_update` null, `grpo.adv_std: group` and `sampling.rollout_batch_size` a
            multiple of `sampling.group_size`.
        interpolate_reference: An approximation, off by default: with `grpo.kl_beta` > 0 the reference velocity of
            a routed window's interior step is interpolated from its anchors', v_ref,k ~ (1 - alpha_k) v_ref,a +
            alpha_k v_ref,b, instead of a forward with the adapter off (error: benchmarks/kl_reference.py).
        low_memory: Deprecated: use `memory.anchors: split`.
        memory_budget_mb: Deprecated: use `memory.budget_mb`.
        fused_samples: Deprecated: use `memory.fused_samples`.
        fused_exact_interior: Deprecated: use `memory.fused_interior_graphs`.
    """

    window_size: int = 4
    jagg_frac: float = 0.5
    chained: bool = False
    score_limit: float | None = None
    window_fraction: float = 1.0
    cache_interior: bool = True
    routing: Literal["residual", "cosine", "random"] = "residual"
    estimator: str = "paper"  # a name of estimators.ESTIMATORS
    control_p: float = 0.5
    fused_rollout: bool = False
    interpolate_reference: bool = False
    low_memory: bool | None = None  # deprecated: memory.anchors
    memory_budget_mb: float | None = None  # deprecated: memory.budget_mb
    fused_samples: int | None = None  # deprecated: memory.fused_samples
    fused_exact_interior: bool | None = None  # deprecated: memory.fused_interior_graphs

    def __post_init__(self):
        check_ints(self, "jagg", "window_size")
        check(self.window_size >= 2, "jagg.window_size", ">= 2", self.window_size)
        check(0.0 <= self.jagg_frac <= 1.0, "jagg.jagg_frac", "in [0, 1]", self.jagg_frac)
        check(self.score_limit is None or self.score_limit >= 0, "jagg.score_limit", ">= 0 or null", self.score_limit)
        check(self.routing in ROUTING_SCORES, "jagg.routing", one_of(ROUTING_SCORES), self.routing)
        check(self.routing != "random" or self.score_limit is None, "jagg.score_limit", "null with jagg.routing "
              "'random' (a uniform draw says nothing about a window's linearity)", self.score_limit)
        check(self.estimator in ESTIMATORS, "jagg.estimator", one_of(ESTIMATORS), self.estimator)
        ESTIMATORS[self.estimator].check_config(self)
        check(isinstance(self.control_p, (int, float)) and not isinstance(self.control_p, bool)
              and 0.0 < self.control_p <= 1.0, "jagg.control_p", "in (0, 1] (the probability that a routed window "
              "also gets its exact gradient)", self.control_p)
        check(0.0 < self.window_fraction <= 1.0, "jagg.window_fraction", "in (0, 1]", self.window_fraction)
        check_ints(self, "jagg", "fused_samples")
        check(self.fused_samples is None or self.fused_samples >= 1, "jagg.fused_samples", ">= 1 or null "
              "(deprecated: memory.fused_samples)", self.fused_samples)
        check(self.memory_budget_mb is None or self.memory_budget_mb > 0, "jagg.memory_budget_mb", "> 0 or null "
              "(deprecated: memory.budget_mb)", self.memory_budget_mb)
