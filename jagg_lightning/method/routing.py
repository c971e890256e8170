"""Routing: which windows JAGG estimates and which run exact (``jagg.routing``, ``jagg.jagg_frac``).

Each window gets a linearity score from quantities the rollout already has (lower is more linear): the velocity
interpolation residual (ours), the published cosine rule, or a seeded uniform draw (the baseline); the
``jagg_frac`` share of full windows with the smallest scores is routed to JAGG, the rest (and short tails) stay
exact. docs/method.md §6 compares the rules. Plain torch: no Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from jagg_lightning.method.jagg import Window, alphas


def interpolation_residual(velocities: Tensor, times: Tensor, steps: Sequence[int]) -> Tensor:
    """Routing score of a window: mean over interior k and samples of ||v_k - lerp_t(v_a, v_b)|| / ||v_k||.

    ``velocities`` are the rollout's recorded velocities [S, B, ...] (no extra pass); 0 for W = 2.
    A 0-d float64 tensor on the velocities' device (no host read).
    """
    steps = list(steps)
    if len(steps) <= 2:
        return velocities.new_zeros((), dtype=torch.float64)
    alpha = alphas(times, steps)
    v = velocities[steps].to(torch.float64).flatten(2)  # [W, B, D]
    interp = (1 - alpha)[:, None, None] * v[0] + alpha[:, None, None] * v[-1]
    residual = (v - interp).norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-12)
    return residual[1:-1].mean()


def cosine_score(velocities: Tensor, times: Tensor, steps: Sequence[int]) -> Tensor:
    """The published routing rule's score: 1 - mean over interior k and samples of cos(v_k - v_a, v_b - v_a).

    Each cosine is between the flattened per-sample vectors v_k - v_a and v_b - v_a (the recorded
    velocities after guidance); 1 when v_k moves along the chord from v_a to v_b (whatever the pace),
    so the score is in [0, 2], 0 for W = 2 and lower is more linear. ``times`` is unused: the angle
    does not depend on alpha_k. A 0-d float64 tensor (no host read).
    """
    steps = list(steps)
    if len(steps) <= 2:
        return velocities.new_zeros((), dtype=torch.float64)
    v = velocities[steps].to(torch.float64).flatten(2)  # [W, B, D]
    chord = v[-1] - v[0]
    offset = v[1:-1] - v[0]
    cos = (offset * chord).sum(-1) / (offset.norm(dim=-1) * chord.norm(dim=-1)).clamp_min(1e-300)
    return 1.0 - cos.mean()


def random_score(velocities: Tensor, times: Tensor, steps: Sequence[int],
                 generator: torch.Generator | None = None) -> Tensor:
    """The baseline rule: a uniform draw in [0, 1) from ``generator`` (seeded by the caller from the run's seed
    and step, so every process draws alike and the global RNG is untouched); the velocities are unused."""
    if generator is None:
        raise ValueError("jagg.routing 'random' needs a generator seeded by the step (Updater.route passes one)")
    return torch.rand((), generator=generator, dtype=torch.float64).to(velocities.device)


ROUTING_SCORES: dict[str, Callable[..., Tensor]] = {"residual": interpolation_residual, "cosine": cosine_score,
                                                     "random": random_score}


def routing_score(rule: str, velocities: Tensor, times: Tensor, steps: Sequence[int],
                  generator: torch.Generator | None = None) -> Tensor:
    """The score of ``rule`` (``residual``, ``cosine`` or ``random``: ``generator`` draws it) for one window
    (0-d tensor); lower is more linear."""
    if rule not in ROUTING_SCORES:
        raise ValueError(f"jagg.routing must be one of {sorted(ROUTING_SCORES)}, got {rule!r}")
    drawn = {"generator": generator} if rule == "random" else {}
    return ROUTING_SCORES[rule](velocities, times, steps, **drawn)


def route_windows(
    windows: list[Window],
    scores: Sequence[float],
    jagg_frac: float,
    window_size: int,
    score_limit: float | None = None,
) -> list[Window]:
    """Route the ``jagg_frac`` share of full-size windows with the smallest score to JAGG.

    Short tail windows stay exact; a window whose score exceeds ``score_limit`` stays exact.
    jagg_frac = 0 routes nothing (exact GRPO); 1 routes every eligible window. Windows of different
    ``segment`` (different networks: their residuals are not comparable) are ranked apart, each segment
    routing its own ``jagg_frac`` share.
    """
    if len({w.segment for w in windows}) > 1:
        for seg in sorted({w.segment for w in windows}):
            part = [(w, s) for w, s in zip(windows, scores, strict=True) if w.segment == seg]
            route_windows([w for w, _ in part], [s for _, s in part], jagg_frac, window_size, score_limit)
        return windows
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be in [0, 1], got {jagg_frac}")
    for w, s in zip(windows, scores, strict=True):
        w.score, w.routed = float(s), False
    eligible = [w for w in windows if len(w.steps) == window_size]
    count = routed_count(jagg_frac, len(eligible))
    for w in sorted(eligible, key=lambda w: w.score)[:count]:
        if score_limit is None or w.score <= score_limit:
            w.routed = True
    return windows


def routed_count(jagg_frac: float, eligible: int) -> int:
    """How many of ``eligible`` full-size windows :func:`route_windows` routes: ``jagg_frac`` x ``eligible`` rounded
    half up (0.5 of 1 window is 1, 0.4 of 1 is 0)."""
    return int(jagg_frac * eligible + 0.5)


def rounding_note(jagg_frac: float, windows: Sequence[Window], window_size: int) -> str | None:
    """One line when a ``jagg_frac`` strictly between 0 and 1 rounds to every or to no full-size window of a rollout
    of ``windows`` (each network's segment rounded apart, as :func:`route_windows` does): the run is then all JAGG or
    exact GRPO, whatever the fraction reads. None when the fraction is kept in part, or is 0 or 1 (meant so)."""
    if not 0.0 < jagg_frac < 1.0:
        return None
    per_segment = [sum(len(w.steps) == window_size for w in windows if w.segment == seg)
                   for seg in sorted({w.segment for w in windows})] or [0]
    routed = [routed_count(jagg_frac, n) for n in per_segment]
    total, kept = sum(per_segment), sum(routed)
    if 0 < kept < total:
        return None
    what = "every" if kept == total and total else "no"
    rounding = ", ".join(f"{jagg_frac:g} x {n} = {jagg_frac * n:g} rounds (half up) to {routed_count(jagg_frac, n)}"
                         for n in per_segment)
    effect = "as jagg_frac 1 would" if what == "every" else "exact GRPO, as jagg_frac 0 would"
    return (f"jagg: model.jagg.jagg_frac {jagg_frac:g} routes {what} full-size window to JAGG ({effect}): "
            f"{total} per rollout (window_size {window_size}), {rounding}; a smaller model.jagg.window_size gives "
            "more windows to share out")
