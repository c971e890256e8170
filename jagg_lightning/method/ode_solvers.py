"""The rollout's deterministic tail after the trained steps (``sampling.ode_solver`` / ``sampling.ode_steps``):
Euler, or DPM-Solver++(2M) in its flow-matching form with one velocity per step (MixGRPO-Flash's cheaper rollout).

Rectified flow z_t = (1 - t) x + t eps: alpha_t = 1 - t, sigma_t = t, log-SNR lambda_t = log((1 - t) / t), and the
data prediction x_hat = z - t v. DPM-Solver++ (Lu et al. 2022) from t to t_next, h = lambda_next - lambda:

    first order:  z_next = (t_next / t) z - (1 - t_next)(e^-h - 1) x_hat       (= the Euler step z + (t_next - t) v)
    2M:           z_next = (t_next / t) z - (1 - t_next)(e^-h - 1) (x_hat + (x_hat - x_hat_prev) / (2 r)),
                  r = (lambda - lambda_prev) / h

(diffusers' ``DPMSolverMultistepScheduler`` with ``use_flow_sigmas``, ``prediction_type="flow_prediction"``,
``algorithm_type="dpmsolver++"``, ``solver_order=2``, midpoint). The first step of a run of ODE steps (no history:
the step before was stochastic, or there was none) and the step into t = 0 (lambda = +inf: diffusers'
``lower_order_final`` with ``final_sigmas_type="zero"``) are first order, taken as the Euler step itself. So a tail
of 2 steps is Euler; from 3 steps on, every middle step is second order.

The tail's grid (:func:`tail_times`): n + 1 times from t_T (the time after the last trained step, unchanged) to 0,
at equal spacing in the step INDEX of the rollout's own schedule between T and S, interpolated linearly between its
times where the index is fractional. When n divides S - T the tail takes every (S - T) / n-th time of the schedule
(n = S - T: the schedule itself), so it keeps the family's shifted spacing without knowing its shift.

Plain torch: no Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import torch
from torch import Tensor

from jagg_lightning.utils.checks import check, one_of

ODE_SOLVERS = ("euler", "dpmpp_2m")


def tail_times(times: Tensor, start: int, steps: int) -> Tensor:
    """``times[:start + 1]`` (t_0 .. t_start, unchanged) followed by ``steps`` steps from t_start to 0: the points at
    index start + j (S - start) / steps of ``times`` (length S + 1), linear between neighbours (module docstring)."""
    last = len(times) - 1
    if not 0 <= start < last or steps < 1:
        raise ValueError(f"a tail of {steps} steps from step {start} of a {last}-step schedule")
    points = []
    for j in range(1, steps + 1):
        lo, rem = divmod(j * (last - start), steps)
        lo += start
        if rem == 0:
            points.append(times[lo])
        else:  # in float64, then the schedule's dtype
            a, b = times[lo].double(), times[lo + 1].double()
            points.append((a + (b - a) * (rem / steps)).to(times.dtype))
    return torch.cat([times[: start + 1], torch.stack(points)])


def ode_tail(times: Tensor, step_kinds: Sequence[str], trained: int, ode_steps: int | None) -> tuple[Tensor, list[str]]:
    """The rollout's (times, step kinds): as given, or with ``ode_steps`` set the first ``trained`` steps unchanged and
    the ODE tail after them on :func:`tail_times`'s grid (every kind after ``trained`` must be "ode")."""
    if ode_steps is None:
        return times, list(step_kinds)
    if any(kind != "ode" for kind in step_kinds[trained:]):
        raise ValueError(f"sampling.ode_steps replaces the ODE tail after the first {trained} steps, but the steps "
                         f"after them are {list(step_kinds[trained:])}")
    return tail_times(times, trained, ode_steps), list(step_kinds[:trained]) + ["ode"] * ode_steps


def _log_snr(t: float) -> float:
    return math.log((1.0 - t) / t)


class ODEStepper:
    """The deterministic steps of a trajectory batch on the grid ``times`` under ``solver`` (:data:`ODE_SOLVERS`):
    ``step(k, ...)`` after each ODE step k, ``reset`` after each stochastic step and before a new batch (a multistep
    history never crosses a stochastic step). Its coefficients are Python floats: one host read of ``times``, none
    for Euler."""

    def __init__(self, solver: str, times: Tensor):
        if solver not in ODE_SOLVERS:
            raise ValueError(f"ode solver must be one of {ODE_SOLVERS}, got {solver!r}")
        self.solver = solver
        self.times = None if solver == "euler" else [float(t) for t in times.tolist()]
        self.history: tuple[Tensor, float] | None = None  # (x_hat, t) of the previous ODE step

    def reset(self) -> None:
        self.history = None

    def step(self, k: int, z: Tensor, v: Tensor, euler: Tensor) -> Tensor:
        """z_{k+1} of ODE step k from z_k at velocity ``v``; ``euler`` is the Euler step's z_{k+1}
        (``sde.step_distribution``'s "ode" mean: returned as it is where the step is first order)."""
        if self.solver == "euler":
            return euler
        t, t_next = self.times[k], self.times[k + 1]
        x_hat = z - t * v
        previous, self.history = self.history, (x_hat, t)
        if previous is None or t_next <= 0 or previous[1] >= 1:  # first order (module docstring)
            return euler
        x_prev, t_prev = previous
        lam = _log_snr(t)
        h = _log_snr(t_next) - lam
        r = (lam - _log_snr(t_prev)) / h
        coef = (1.0 - t_next) * (math.exp(-h) - 1.0)
        return (t_next / t) * z - coef * x_hat - (0.5 * coef / r) * (x_hat - x_prev)


def check_ode_tail(s) -> None:
    """``sampling.ode_solver`` and ``sampling.ode_steps`` of the ``SamplingConfig`` ``s`` (a message names the field and
    its range)."""
    check(s.ode_solver in ODE_SOLVERS, "sampling.ode_solver", one_of(ODE_SOLVERS), s.ode_solver)
    tail = s.ode_after_trained and s.sde_window_size is None
    why = ("sampling.ode_after_trained true and no sampling.sde_window_size (the tail after the trained steps; "
           "an SDE window's ODE steps stay Euler on the schedule)")
    check(s.ode_solver == "euler" or tail, "sampling.ode_solver", f"'euler' unless {why}", s.ode_solver)
    if s.ode_steps is None:
        return
    check(tail, "sampling.ode_steps", f"null unless {why}", s.ode_steps)
    left = s.num_steps - s.num_trained
    allowed = f"in [1, {left}] (num_steps - trained_steps: the grid's tail at most) or null" if left else (
        "null when every step is trained (no tail)")
    check(1 <= s.ode_steps <= left, "sampling.ode_steps", allowed, s.ode_steps)
