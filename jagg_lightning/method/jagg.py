"""JAGG: Jacobian-aggregated window gradients over the trained steps of a trajectory.

With g_k = dL_k/dv_k and J_k = dv_theta(z_k, t_k)/dtheta the exact policy gradient is
sum_k J_k^T g_k: one transformer backward per trained step. Over a window a..b with
alpha_k = (t_a - t_k) / (t_a - t_b), JAGG uses J_k ~ (1 - alpha_k) J_a + alpha_k J_b, so

    sum_{k=a..b} J_k^T g_k  ~  J_a^T G_a + J_b^T G_b,
    G_a = sum_k (1 - alpha_k) g_k,    G_b = sum_k alpha_k g_k,

which is the gradient of <v(z_a, t_a), G_a> + <v(z_b, t_b), G_b> with G held fixed: ONE forward
with grad over both anchors (batched) and ONE backward replace W forwards and W backwards.

The engine (:func:`accumulate_gradients`) generalises this to any mix of windows: every step that
gets a backward ("pass step": an anchor of a routed window, or any step of an exact window) carries an
upstream tensor U_k = g_k + (the G contributions of routed windows' interior steps). Interior g_k come
from a no-grad forward or, while theta is still the rollout's theta, from the rollout's recorded
velocities. Chained windows share anchors, and a shared anchor gets one backward, not two.
How a routed window's interiors enter is an estimator's choice (:class:`InteriorTerms`, ``estimators/``): the
paper's interpolation by default; the control variate (``Window.correction`` c = B/p) turns a drawn window's
estimate into JAGG + c (exact - JAGG), its interiors getting passes of their own. See docs/method.md for the exactness proof and the cost model. Plain torch: no Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from jagg_lightning.utils.batching import batch_concat

VelocityFn = Callable[[Tensor, Tensor, Any], Tensor]
"""v(z [n, ...], t [n], cond) -> velocity [n, ...]; ``cond`` is batch-first (tensor or tuple of tensors)."""

StepLossFn = Callable[[int, Tensor], Tensor]
"""(sampling step k, velocity [B, ...]) -> scalar: step k's share of the objective being minimised."""


@dataclass
class Window:
    """A run of consecutive sampling steps; its anchors are the first and last step."""

    steps: tuple[int, ...]
    score: float = 0.0  # routing score (residual, 1 - cosine or a seeded uniform): lower is more linear
    routed: bool = False  # True: JAGG (anchor backward only); False: exact per-step backward
    segment: int = 0  # which network's run of steps it lies in (Wan2.2's experts: 0 high noise, 1 low); routed apart
    correction: float = 0.0  # control variate c = B/p of a routed window (0: the paper's estimate alone)

    @property
    def anchors(self) -> tuple[int, int]:
        return self.steps[0], self.steps[-1]

    @property
    def interior(self) -> tuple[int, ...]:
        return self.steps[1:-1]


@dataclass
class WindowRecord:
    """What the engine did for one window, counted, not assumed."""

    steps: tuple[int, ...]
    score: float
    routed: bool
    grad_forwards: int = 0
    nograd_forwards: int = 0
    backwards: int = 0
    cached_steps: int = 0  # interior steps whose velocity came from the rollout cache
    fused_steps: int = 0  # pass steps whose forward with grad was the rollout's own (fused mode): no extra forward
    segment: int = 0  # the window's network (Wan2.2's expert), as Window.segment
    correction: float = 0.0  # as Window.correction: > 0 when its interiors got their exact passes too


def plan_windows(steps: Sequence[int], window_size: int, chained: bool = False,
                 breaks: Sequence[int] = ()) -> list[Window]:
    """Cut consecutive trained ``steps`` into windows of ``window_size`` steps.

    Disjoint windows tile the steps; chained windows overlap by one step (b of one window is a of the
    next). What is left at the end is a shorter tail window, always run exact by :func:`route_windows`.
    ``breaks``: steps where another network takes over (Wan2.2's low-noise expert); the steps are cut there
    first and each run is tiled on its own, so no window straddles a break (its tail stays exact, and
    chained windows share no anchor across it); ``Window.segment`` counts the breaks before the window.
    """
    steps = list(steps)
    cuts = sorted({int(b) for b in breaks if steps and steps[0] < int(b) <= steps[-1]})
    if cuts:
        plan_windows(steps, window_size)  # the same checks as without breaks
        windows = []
        for seg, (lo, hi) in enumerate(zip([steps[0]] + cuts, cuts + [steps[-1] + 1])):
            run = [k for k in steps if lo <= k < hi]
            # a run shorter than W is one short window, run exact like any tail
            part = plan_windows(run, window_size, chained) if len(run) >= window_size else [Window(tuple(run))]
            for w in part:
                w.segment = seg
            windows += part
        return windows
    if window_size < 2:
        raise ValueError(f"window_size must be >= 2, got {window_size}")
    if window_size > len(steps):
        raise ValueError(f"window_size must be <= the number of trained steps ({len(steps)}), got {window_size}")
    if any(b - a != 1 for a, b in zip(steps, steps[1:])):
        raise ValueError(f"trained steps must be consecutive, got {steps}")
    stride = window_size - 1 if chained else window_size
    windows, start = [], 0
    while start < len(steps):
        chunk = steps[start : start + window_size]
        if chained and len(chunk) == 1 and windows:
            break  # the last anchor already closes the previous window
        windows.append(Window(tuple(chunk)))
        start += stride
    return windows


def alphas(times: Tensor, steps: Sequence[int]) -> Tensor:
    """alpha_k = (t_a - t_k) / (t_a - t_b) for the window's steps (float64)."""
    t = times.to(torch.float64)[list(steps)]
    return (t[0] - t) / (t[0] - t[-1])


def weighted_sum(g: Sequence[Tensor], weights) -> Tensor:
    """sum_k w_k g_k, each weight cast to g_k's dtype (weights: a tensor or floats; no host read of a tensor): with
    :func:`interpolation_terms`' weights, G_a = sum_k (1 - alpha_k) g_k and G_b = sum_k alpha_k g_k."""
    return sum((w.to(gk.dtype) if isinstance(w, Tensor) else w) * gk for gk, w in zip(g, weights))


@dataclass
class InteriorTerms:
    """How a routed window's interior steps enter its gradient -- an estimator's fold weights
    (:mod:`jagg_lightning.method.estimators`): interior step i's g_k is added into the anchors' upstream U_a with weight
    ``to_a[i]`` and into U_b with ``to_b[i]``; with ``own`` != 0 each interior step also gets a pass of its own, of
    upstream ``own`` g_k (its g_k then comes from that pass, not from the cache or a no-grad forward)."""

    to_a: Sequence  # [W - 2] weights: a tensor or floats
    to_b: Sequence
    own: float = 0.0


def interpolation_terms(alpha: Tensor) -> InteriorTerms:
    """The paper's fold weights: J_k ~ (1 - alpha_k) J_a + alpha_k J_b, so g_k joins G_a with 1 - alpha_k and G_b
    with alpha_k (``alpha`` [W - 2]: the interior steps' alpha_k); no pass of their own."""
    return InteriorTerms(1 - alpha, alpha)


InteriorTermsFn = Callable[[Window, Tensor], InteriorTerms]
"""(routed window, its interior steps' alpha_k [W - 2]) -> their :class:`InteriorTerms` (an estimator's)."""


@dataclass
class _Engine:
    velocity_fn: VelocityFn
    latents: Tensor  # [S + 1, B, ...]
    times: Tensor  # [S + 1]
    cond: Any
    step_loss: StepLossFn
    backward: Callable[[Tensor], None]
    upstream: dict[int, Tensor] = field(default_factory=dict)
    own_scale: dict[int, float] = field(default_factory=dict)  # control variate: an interior's exact term c g_k
    folds: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # k -> (anchor, weight of g_k) on its pass

    def own_gradient(self, k: int, v: Tensor) -> Tensor:
        """g_k = dL_k/dv_k at the (detached) velocity ``v``."""
        leaf = v.detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(self.step_loss(k, leaf), leaf)
        return g

    def time_batch(self, k: int) -> Tensor:
        return self.times[k].expand(self.latents.shape[1])

    def add_upstream(self, k: int, g: Tensor) -> None:
        self.upstream[k] = g if k not in self.upstream else self.upstream[k] + g

    def objective(self, k: int, v_k: Tensor) -> Tensor:
        """<v_k, U_k> with U_k = g_k + the folded interior contributions (held fixed)."""
        with torch.enable_grad():
            g = self.own_gradient(k, v_k)
            for anchor, weight in self.folds.pop(k, ()):  # (1 - c) of a drawn interior's G_a / G_b share
                self.add_upstream(anchor, weight * g)
            if k in self.own_scale:
                g = self.own_scale.pop(k) * g
            u = g + self.upstream.pop(k, 0)
            return (v_k.to(u.dtype) * u).sum()

    def grad_pass(self, steps: Sequence[int], batched: bool = True) -> int:
        """ONE backward of sum_k <v_k, U_k> over ``steps``, after one forward with grad over them batched
        (``batched``) or one forward per step, each of the caller's batch shape. Returns the forwards made."""
        with torch.enable_grad():
            if batched:
                z = torch.cat([self.latents[k] for k in steps])
                t = torch.cat([self.time_batch(k) for k in steps])
                v = self.velocity_fn(z, t, batch_concat([self.cond] * len(steps))).chunk(len(steps))
            else:
                v = [self.velocity_fn(self.latents[k], self.time_batch(k), self.cond) for k in steps]
            total = sum(self.objective(k, v_k) for k, v_k in zip(steps, v))
        self.backward(total)
        return 1 if batched else len(steps)


def accumulate_gradients(
    velocity_fn: VelocityFn,
    latents: Tensor,
    times: Tensor,
    cond: Any,
    step_loss: StepLossFn,
    windows: Sequence[Window],
    cached_velocities: Tensor | None = None,
    low_memory: bool = False,
    backward: Callable[[Tensor], None] | None = None,
    graphs: dict[int, Tensor] | None = None,
    batch_anchors: bool = True,
    interior_terms: InteriorTermsFn | None = None,
) -> list[WindowRecord]:
    """Accumulate d(sum_k step_loss(k, v_k))/dtheta into ``.grad`` over all ``windows``.

    Exact windows: one forward with grad and one backward per step. Routed windows: the interior
    g_k (no-grad forward, or ``cached_velocities[k]`` -- valid only while theta equals the rollout's
    theta) fold into the anchors' G_a/G_b; then the anchors not yet done by a chained neighbour get one
    batched forward with grad and ONE backward (two single passes with ``low_memory``).

    ``latents`` is [S + 1, B, ...] (z_0 .. z_S), ``times`` [S + 1]; ``cond`` is batch-first for B
    samples. ``backward`` defaults to ``Tensor.backward`` (Lightning passes ``manual_backward``).

    ``graphs`` (the fused on-policy mode): velocities WITH their autograd graph, kept by the rollout
    for some steps (theta = theta_old, so they equal a fresh forward). A pass step found there needs no
    forward; all of them share ONE backward, after the other passes. Unused entries (interior steps of a
    window that was routed) are simply dropped by the caller.
    ``batch_anchors`` False: a routed window's anchors still share ONE backward, but each gets its own forward
    of the batch shape of ``latents`` -- at theta_old the rollout's, so the rollout's velocities are reproduced bit
    for bit (a batched forward of twice the rows need not: a matmul kernel is picked by the shape and rounds its
    own way -- the tiny SD3's AdaLN linears change kernel between 10 and 11 rows on a CPU: 1-2 ulp of log-prob).
    ``interior_terms``: the estimator's fold weights (:class:`InteriorTerms`; default the paper's,
    :func:`interpolation_terms`); a window whose interiors get passes of their own (the control variate's drawn
    windows) runs them first.
    Returns one :class:`WindowRecord` per window with the passes it actually made.
    """
    interior_terms = interior_terms or (lambda window, alpha: interpolation_terms(alpha))
    engine = _Engine(velocity_fn, latents, times, cond, step_loss, backward or Tensor.backward)
    records = [WindowRecord(w.steps, w.score, w.routed, segment=w.segment, correction=w.correction) for w in windows]
    graphs = graphs or {}
    fused: list = [None, None]  # the fused terms' sum and the record that owns their one backward

    def run_passes(rec: WindowRecord, todo: list[int], joint: bool) -> None:
        """Pass steps ``todo``: kept graphs join the fused backward; the rest get one pass (``joint``) or one each."""
        for k in [k for k in todo if k in graphs]:  # the rollout's own forward: fold into the joint backward
            term = engine.objective(k, graphs[k])
            with torch.enable_grad():  # the caller may be the (no-grad) rollout
                fused[0] = term if fused[0] is None else fused[0] + term
            fused[1] = fused[1] or rec
            rec.fused_steps += 1
        todo = [k for k in todo if k not in graphs]
        for steps in [todo] if joint and len(todo) > 1 and not low_memory else [[k] for k in todo]:
            rec.grad_forwards += engine.grad_pass(steps, batched=batch_anchors)
            rec.backwards += 1

    # 1. Interior steps of routed windows, by the estimator's terms: g_k from the cache or a no-grad forward, folded
    #    into G_a/G_b; or (own != 0: the control variate's drawn windows) each interior gets its own pass with
    #    U_k = own g_k and folds its weighted share into the anchors from that pass's g_k (no extra forward).
    for w, rec in zip(windows, records):
        if not w.routed or len(w.steps) <= 2:
            continue
        terms = interior_terms(w, alphas(times, w.steps)[1:-1])
        a, b = w.anchors
        if terms.own:
            for k, to_a, to_b in zip(w.interior, terms.to_a, terms.to_b):
                engine.own_scale[k] = terms.own
                if to_a or to_b:
                    engine.folds[k] = [(a, to_a), (b, to_b)]
            run_passes(rec, list(w.interior), joint=False)
            continue
        interior_g = []
        for k in w.interior:
            if cached_velocities is not None:
                v_k = cached_velocities[k]
                rec.cached_steps += 1
            else:
                with torch.no_grad():
                    v_k = velocity_fn(latents[k], engine.time_batch(k), cond)
                rec.nograd_forwards += 1
            interior_g.append(engine.own_gradient(k, v_k))
        # the anchors' own g_a, g_b (alpha 0 and 1) join in their own pass
        engine.add_upstream(a, weighted_sum(interior_g, terms.to_a))
        engine.add_upstream(b, weighted_sum(interior_g, terms.to_b))

    # 2. Backward passes; a step shared by chained windows is done once, by the first window.
    done: set[int] = set()
    for w, rec in zip(windows, records):
        todo = [k for k in (w.anchors if w.routed else w.steps) if k not in done]
        done.update(todo)
        run_passes(rec, todo, joint=w.routed)
    if fused[0] is not None:
        engine.backward(fused[0])
        fused[1].backwards += 1
    return records


@dataclass
class WindowGradientCheck:
    """Exact vs JAGG gradient of one window: cosine (1 when both are zero) and relative error
    ||jagg - exact|| / ||exact|| (0 when both are zero)."""

    steps: tuple[int, ...]
    score: float
    routed: bool
    cosine: float
    rel_error: float


def flat_gradient(
    velocity_fn: VelocityFn,
    params: Sequence[Tensor],
    latents: Tensor,
    times: Tensor,
    cond: Any,
    step_loss: StepLossFn,
    windows: Sequence[Window],
    cached_velocities: Tensor | None = None,
    interior_terms: InteriorTermsFn | None = None,
) -> Tensor:
    """d(sum_k step_loss(k, v_k))/dparams over ``windows`` as :func:`accumulate_gradients` makes it (with the
    estimator's ``interior_terms``), flattened in float64 and collected with ``torch.autograd.grad`` (``.grad`` is
    left untouched)."""
    params = list(params)
    total = [torch.zeros_like(p) for p in params]

    def collect(objective: Tensor) -> None:
        for buf, g in zip(total, torch.autograd.grad(objective, params, allow_unused=True)):
            if g is not None:
                buf += g

    accumulate_gradients(velocity_fn, latents, times, cond, step_loss, windows,
                         cached_velocities=cached_velocities, backward=collect, interior_terms=interior_terms)
    return torch.cat([t.flatten().double() for t in total])


def gradient_agreement(approx: Tensor, exact: Tensor) -> tuple[float, float]:
    """(cosine, ||approx - exact|| / ||exact||) of two flat gradients; (1, 0) when both are zero (they
    agree exactly, e.g. every sample clipped)."""
    norm, approx_norm = exact.norm(), approx.norm()
    if norm == 0 and approx_norm == 0:
        return 1.0, 0.0
    cosine = float(torch.dot(exact, approx) / (norm * approx_norm).clamp_min(1e-300))
    return cosine, float((approx - exact).norm() / norm.clamp_min(1e-300))


def check_window_gradients(
    velocity_fn: VelocityFn,
    params: Sequence[Tensor],
    latents: Tensor,
    times: Tensor,
    cond: Any,
    step_loss: StepLossFn,
    windows: Sequence[Window],
) -> list[WindowGradientCheck]:
    """For every window of >= 2 steps, its exact gradient sum_k J_k^T g_k and its JAGG gradient
    J_a^T G_a + J_b^T G_b at the current theta (interiors recomputed, no cache).

    Gradients are collected with ``torch.autograd.grad``: ``.grad``, the weights and every RNG stream
    are left exactly as they were.
    """
    params = list(params)

    def gradient(window: Window) -> Tensor:
        return flat_gradient(velocity_fn, params, latents, times, cond, step_loss, [window])

    checks = []
    with torch.random.fork_rng():
        for w in windows:
            if len(w.steps) < 2:
                continue
            exact = gradient(Window(w.steps, w.score, routed=False))
            approx = gradient(Window(w.steps, w.score, routed=True))
            checks.append(WindowGradientCheck(w.steps, w.score, w.routed, *gradient_agreement(approx, exact)))
    return checks
