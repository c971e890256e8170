"""``model.sampling``: the rollouts (`SamplingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jagg_lightning.method.ode_solvers import check_ode_tail
from jagg_lightning.method.sde import CPS_LOG_PROBS, STEP_KINDS, TRAINABLE_STEP_KINDS
from jagg_lightning.method.sde_window import check_sde_window
from jagg_lightning.utils.checks import check, check_ints, one_of


@dataclass
class SamplingConfig:
    """Rollouts: how each prompt's group of samples is drawn, and which steps are trained.

    Each prompt gets `group_size` samples of `num_steps` steps. The trained steps are stochastic (`step_kind`, with
    a log-density per step); by default they are the first `trained_steps`, or, with an SDE window
    (Flow-GRPO-Fast / MixGRPO), `sde_window_size` consecutive steps inside `sde_window_range` = [lo, hi) whose
    start is drawn per rollout ("random") or slides ("progressive"); every other step is deterministic (ODE).
    After the trained steps the rollout's tail may run as an ODE with its own solver and steps
    (`jagg_lightning.method.ode_solvers`).

    Deprecated (each still works, with one line naming its new key; `jagg_lightning.config.old_keys`): `seed` (the
    rollout stream of `model.seed`), `window_fraction` (`jagg.window_fraction`).

    Attributes:
        num_steps: Sampling steps per trajectory, an integer >= 2.
        group_size: K samples per prompt (a GRPO group), an integer >= 2 (GRPO normalises inside a group).
        noise_level: The SDE noise level a, in (0, 2] (0.7 SD3, 0.9 FLUX): trained steps need a density.
        step_kind: The stochastic step of the trained steps: `sde`, `sde_constant` (sigma = noise_level at every t,
            DanceGRPO's eta), `sde_linear` (sigma = noise_level x t, Flash-GRPO's sigmas[1] t) or `cps`.
        trained_steps: The first n steps get a loss term, in [1, num_steps] (< num_steps with `cps`: its last step
            is deterministic); null = all but the last, nearly clean one. Null with an SDE window.
        ode_after_trained: Sample the steps after the trained ones as an ODE (the rollout's tail; evaluation is
            Euler on its own grid whatever this says).
        ode_solver: The tail's solver: `euler`, or `dpmpp_2m` (DPM-Solver++(2M) in its flow-matching form); not
            `euler` only with `ode_after_trained` and no SDE window.
        ode_steps: The tail's steps (its transformer evaluations), in [1, num_steps - trained steps]; null = the
            schedule's remaining steps. Only with `ode_after_trained` and no SDE window.
        shift: The schedule shift, > 0; null = the model scheduler's.
        rollout_batch_size: Samples per sampling forward, an integer >= 1 (does not change the samples).
        seed: Deprecated: use `model.seed` (a nonzero value still seeds the rollout stream, with a deprecation line;
            0 here means the module's root seed).
        cps_log_prob: The CPS log-probability: `squared_error` (Flow-GRPO's -mean((x - mu)^2)) or `gaussian` (the
            true density).
        sde_window_size: The SDE window: only this many consecutive steps are stochastic and trained, an integer
            >= 1 and <= hi - lo; null = off.
        sde_window_range: [lo, hi]: the window lies in steps lo ... hi - 1, 0 <= lo, hi <= num_steps (num_steps - 1
            with `cps`); null = [0, num_steps - 1] with a window.
        sde_window_schedule: `random` (the window's start uniform in [lo, hi - size], drawn per rollout from
            (seed, global step), the same on every process) or `progressive` (MixGRPO's slide).
        sde_window_shift_every: `progressive`: rollouts (training steps, not optimizer steps) between moves, >= 1.
        sde_window_stride: `progressive`: steps per move, >= 1; the window stays at hi - size once there.
        train_guidance_scale: The guidance of rollouts and training, >= 1; null = `policy.guidance_scale`; 1.0 =
            CFG-free (Flow-GRPO's CFG-free training; evaluation keeps `evaluation.guidance_scale`).
        window_fraction: Deprecated: use `jagg.window_fraction` (a value given moves there, with a deprecation
            line).
        sde_window_draw: `rollout` (one window start per rollout for every sample) or `group` (with
            `sde_window_size` 1 and the `random` schedule, each prompt draws its own step from (seed, global step,
            prompt index): Flash-GRPO's iso-temporal groups; unfused only, `grpo.kl_beta` 0).
    """

    num_steps: int = 10
    group_size: int = 4
    noise_level: float = 0.7
    step_kind: str = "sde"  # a trainable kind of sde.STEP_KINDS
    trained_steps: int | None = None
    ode_after_trained: bool = False
    ode_solver: str = "euler"  # a name of ode_solvers.ODE_SOLVERS
    ode_steps: int | None = None
    shift: float | None = None
    rollout_batch_size: int = 8
    seed: int = 0  # deprecated: model.seed (0 here: the module's root seed)
    cps_log_prob: Literal["squared_error", "gaussian"] = "squared_error"
    sde_window_size: int | None = None
    sde_window_range: list[int] | None = None
    sde_window_schedule: Literal["random", "progressive"] = "random"
    sde_window_shift_every: int = 25
    sde_window_stride: int = 1
    train_guidance_scale: float | None = None
    window_fraction: float | None = None  # deprecated: jagg.window_fraction
    sde_window_draw: Literal["rollout", "group"] = "rollout"

    def __post_init__(self):
        check_ints(self, "sampling", "num_steps", "group_size", "rollout_batch_size", "trained_steps", "seed",
                    "sde_window_size", "sde_window_shift_every", "sde_window_stride", "ode_steps")
        check(self.num_steps >= 2, "sampling.num_steps", ">= 2", self.num_steps)
        check(self.group_size >= 2, "sampling.group_size", ">= 2 (GRPO normalises inside a group)", self.group_size)
        check(0 < self.noise_level <= 2, "sampling.noise_level", "in (0, 2] (trained steps need a density)",
              self.noise_level)
        check(self.step_kind in TRAINABLE_STEP_KINDS, "sampling.step_kind", one_of(TRAINABLE_STEP_KINDS), self.step_kind)
        check(self.num_trained >= 1 and self.num_trained <= self.num_steps, "sampling.trained_steps",
              f"in [1, num_steps={self.num_steps}]", self.trained_steps)
        into_zero = STEP_KINDS[self.step_kind].deterministic_into_zero  # CPS: its last step has no density
        check(not into_zero or self.num_trained < self.num_steps, "sampling.trained_steps",
              f"< num_steps={self.num_steps} with step_kind {self.step_kind} (its last step is deterministic)",
              self.trained_steps)
        check(self.rollout_batch_size >= 1, "sampling.rollout_batch_size", ">= 1", self.rollout_batch_size)
        check(self.shift is None or self.shift > 0, "sampling.shift", "> 0 or null", self.shift)
        check(self.cps_log_prob in CPS_LOG_PROBS, "sampling.cps_log_prob", "'squared_error' or 'gaussian'",
              self.cps_log_prob)
        check(self.window_fraction is None or 0.0 < self.window_fraction <= 1.0, "sampling.window_fraction",
              "in (0, 1] (deprecated: jagg.window_fraction)", self.window_fraction)
        check(self.train_guidance_scale is None or self.train_guidance_scale >= 1.0, "sampling.train_guidance_scale",
              ">= 1.0 (1.0 = no guidance) or null", self.train_guidance_scale)
        check_sde_window(self)
        check_ode_tail(self)

    @property
    def num_trained(self) -> int:
        """Steps trained per rollout (before ``window_fraction``): the SDE window, or ``trained_steps``."""
        if self.sde_window_size is not None:
            return self.sde_window_size
        return self.num_steps - 1 if self.trained_steps is None else self.trained_steps

    @property
    def trainable_steps(self) -> list[int]:
        """Every step some rollout may train: the window range, or the first ``num_trained`` steps."""
        if self.sde_window_size is not None:
            return list(range(*self.sde_window_range))
        return list(range(self.num_trained))
