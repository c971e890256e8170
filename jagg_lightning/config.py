"""The configuration sections of :class:`jagg_lightning.module.JAGGModule` and their checks.

Every check runs when a section is built (or when the module is constructed, for checks that span sections),
before any model exists: a bad value fails with a message naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from jagg_lightning.grpo import KL_CONVENTIONS, MULTI_REWARD
from jagg_lightning.jagg import ROUTING_SCORES
from jagg_lightning.sde import CPS_LOG_PROBS


ESTIMATORS = ("paper", "control_variate")


def check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def one_of(names) -> str:
    """'a', 'b' or 'c'."""
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass
class SamplingConfig:
    """Rollouts. ``group_size`` K samples per prompt; the first ``trained_steps`` steps get a loss term
    (default all but the last, nearly clean one); ``step_kind`` is the stochastic step of trained steps;
    ``ode_after_trained`` samples the rest with Euler. ``shift`` None = the model's.

    ``cps_log_prob``: "squared_error" (Flow-GRPO's CPS -mean((x - mu)^2)) or "gaussian" (the true density).
    SDE window (Flow-GRPO-Fast / MixGRPO): with ``sde_window_size`` set, only that many consecutive steps
    are stochastic (``step_kind``) and trained, every other step is ODE; the window lies inside
    ``sde_window_range`` = [lo, hi) and its start is drawn per rollout (``sde_window_schedule`` "random")
    or slides by ``sde_window_stride`` every ``sde_window_shift_every`` rollouts ("progressive", MixGRPO).
    ``window_fraction``: the share of JAGG windows trained per rollout, drawn at random (DanceGRPO's
    ``timestep_fraction`` at window granularity). ``train_guidance_scale`` overrides ``policy.guidance_scale``
    in rollouts and training; 1.0 = no guidance (Flow-GRPO's CFG-free training; evaluation keeps
    ``evaluation.guidance_scale``)."""

    num_steps: int = 10
    group_size: int = 4
    noise_level: float = 0.7
    step_kind: Literal["sde", "sde_constant", "cps"] = "sde"
    trained_steps: int | None = None
    ode_after_trained: bool = False
    shift: float | None = None
    rollout_batch_size: int = 8
    seed: int = 0
    cps_log_prob: Literal["squared_error", "gaussian"] = "squared_error"
    sde_window_size: int | None = None
    sde_window_range: list[int] | None = None
    sde_window_schedule: Literal["random", "progressive"] = "random"
    sde_window_shift_every: int = 25
    sde_window_stride: int = 1
    window_fraction: float = 1.0
    train_guidance_scale: float | None = None

    def __post_init__(self):
        check_ints(self, "sampling", "num_steps", "group_size", "rollout_batch_size", "trained_steps", "seed",
                    "sde_window_size", "sde_window_shift_every", "sde_window_stride")
        check(self.num_steps >= 2, "sampling.num_steps", ">= 2", self.num_steps)
        check(self.group_size >= 2, "sampling.group_size", ">= 2 (GRPO normalises inside a group)", self.group_size)
        check(0 < self.noise_level <= 2, "sampling.noise_level", "in (0, 2] (trained steps need a density)",
              self.noise_level)
        check(self.step_kind in ("sde", "sde_constant", "cps"), "sampling.step_kind", "'sde', 'sde_constant' or 'cps'",
              self.step_kind)
        check(self.num_trained >= 1 and self.num_trained <= self.num_steps, "sampling.trained_steps",
              f"in [1, num_steps={self.num_steps}]", self.trained_steps)
        check(self.step_kind != "cps" or self.num_trained < self.num_steps, "sampling.trained_steps",
              f"< num_steps={self.num_steps} with step_kind cps (its last step is deterministic)", self.trained_steps)
        check(self.rollout_batch_size >= 1, "sampling.rollout_batch_size", ">= 1", self.rollout_batch_size)
        check(self.shift is None or self.shift > 0, "sampling.shift", "> 0 or null", self.shift)
        check(self.cps_log_prob in CPS_LOG_PROBS, "sampling.cps_log_prob", "'squared_error' or 'gaussian'",
              self.cps_log_prob)
        check(0.0 < self.window_fraction <= 1.0, "sampling.window_fraction", "in (0, 1]", self.window_fraction)
        check(self.train_guidance_scale is None or self.train_guidance_scale >= 1.0, "sampling.train_guidance_scale",
              ">= 1.0 (1.0 = no guidance) or null", self.train_guidance_scale)
        self._check_sde_window()

    def _check_sde_window(self) -> None:
        if self.sde_window_size is None:
            check(self.sde_window_range is None, "sampling.sde_window_range", "null without sampling.sde_window_size",
                  self.sde_window_range)
            return
        check(self.sde_window_size >= 1, "sampling.sde_window_size", ">= 1 or null", self.sde_window_size)
        check(self.trained_steps is None, "sampling.trained_steps", "null with sampling.sde_window_size (the window "
              "is what is trained)", self.trained_steps)
        if self.sde_window_range is None:
            self.sde_window_range = [0, self.num_steps - 1]
        last = self.num_steps - 1 if self.step_kind == "cps" else self.num_steps
        ok = len(self.sde_window_range) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                      for x in self.sde_window_range)
        ok = ok and 0 <= self.sde_window_range[0]
        ok = ok and self.sde_window_range[1] <= last and self.sde_window_range[1] - self.sde_window_range[0] >= self.sde_window_size
        check(ok, "sampling.sde_window_range", f"[lo, hi] (integers) with 0 <= lo, hi <= {last} (num_steps"
              f"{' - 1: a CPS step into t = 0 is deterministic' if self.step_kind == 'cps' else ''}) and "
              f"hi - lo >= sde_window_size={self.sde_window_size}", self.sde_window_range)
        check(self.sde_window_schedule in ("random", "progressive"), "sampling.sde_window_schedule",
              "'random' or 'progressive'", self.sde_window_schedule)
        check(self.sde_window_shift_every >= 1, "sampling.sde_window_shift_every", ">= 1", self.sde_window_shift_every)
        check(self.sde_window_stride >= 1, "sampling.sde_window_stride", ">= 1", self.sde_window_stride)

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


@dataclass
class GRPOConfig:
    """The GRPO update: PPO clip range, KL weight beta (0 = no reference pass), advantage clip and
    normalisation, inner epochs over each rollout, samples per micro-batch, micro-batches per optimizer
    step (None = one step per inner epoch) and the gradient-norm clip (None = off).

    ``adv_std``: "global" (Flow-GRPO's default ``sample.global_std``: each group's mean, the std of every
    reward of the step over all processes) or "group" (the group's own std, DanceGRPO).
    ``kl_convention``: "flow_grpo" divides the KL by 2 sigma_k^2 (Flow-GRPO), "exact" by 2 s_k^2.
    ``std_ddof``: 0 (np.std, Flow-GRPO) or 1 (unbiased, DanceGRPO) for the advantage std; ``adv_eps`` is
    added to it. ``skip_zero_advantage``: with kl_beta 0, samples whose advantage is exactly 0 (a group
    of equal rewards) get no forward or backward; the update is the same. ``multi_reward`` (several rewards,
    ``WeightedReward``): "weighted_sum" group-normalises the weighted sum of the rewards; "per_reward"
    group-normalises each reward on its own and sums the weighted advantages (``grpo.combined_advantages``)."""

    clip_range: float = 1e-4
    kl_beta: float = 0.0
    adv_clip: float = 5.0
    adv_std: Literal["group", "global"] = "global"
    inner_epochs: int = 1
    train_batch_size: int = 8
    micro_batches_per_update: int | None = None
    max_grad_norm: float | None = 1.0
    kl_convention: Literal["flow_grpo", "exact"] = "flow_grpo"
    std_ddof: int = 0
    adv_eps: float = 1e-4
    skip_zero_advantage: bool = True
    multi_reward: Literal["weighted_sum", "per_reward"] = "weighted_sum"

    def __post_init__(self):
        check_ints(self, "grpo", "inner_epochs", "train_batch_size", "micro_batches_per_update", "std_ddof")
        check(self.clip_range > 0, "grpo.clip_range", "> 0", self.clip_range)
        check(self.kl_beta >= 0, "grpo.kl_beta", ">= 0", self.kl_beta)
        check(self.adv_clip > 0, "grpo.adv_clip", "> 0", self.adv_clip)
        check(self.adv_std in ("group", "global"), "grpo.adv_std", "'group' or 'global'", self.adv_std)
        check(self.inner_epochs >= 1, "grpo.inner_epochs", ">= 1", self.inner_epochs)
        check(self.train_batch_size >= 1, "grpo.train_batch_size", ">= 1", self.train_batch_size)
        check(self.micro_batches_per_update is None or self.micro_batches_per_update >= 1,
              "grpo.micro_batches_per_update", ">= 1 or null", self.micro_batches_per_update)
        check(self.max_grad_norm is None or self.max_grad_norm > 0, "grpo.max_grad_norm", "> 0 or null",
              self.max_grad_norm)
        check(self.kl_convention in KL_CONVENTIONS, "grpo.kl_convention", "'flow_grpo' or 'exact'", self.kl_convention)
        check(self.std_ddof in (0, 1), "grpo.std_ddof", "0 (np.std) or 1 (unbiased)", self.std_ddof)
        check(self.adv_eps > 0, "grpo.adv_eps", "> 0", self.adv_eps)
        check(self.multi_reward in MULTI_REWARD, "grpo.multi_reward", "'weighted_sum' (normalise the weighted sum of "
              "the rewards) or 'per_reward' (normalise each reward, then sum the weighted advantages)", self.multi_reward)


@dataclass
class JAGGConfig:
    """Windows of ``window_size`` trained steps (``chained``: neighbours share an anchor); the
    ``jagg_frac`` share with the smallest ``routing`` score use JAGG (``residual``: the
    velocity-interpolation residual; ``cosine``: 1 - cos(v_k - v_a, v_b - v_a), the published rule; ``random``:
    a uniform draw seeded by (seed, step), the baseline; a window above ``score_limit`` stays exact);
    ``estimator``: ``paper`` (the two-anchor interpolation) or ``control_variate`` (unbiased: a routed window
    also gets its exact gradient with probability ``control_p`` and the estimate becomes
    JAGG + (B / p)(exact - JAGG), B ~ Bernoulli(p) seeded by (seed, step), docs/method.md §8);
    ``low_memory`` runs the two anchors as two passes;
    ``cache_interior`` reuses the rollout's velocities for interior steps while theta = theta_old.

    ``fused_rollout`` (on-policy fused mode, docs/method.md §7): the rollout runs every step that will get a
    backward WITH grad and keeps its graph; as each rollout micro-batch ends it is decoded, scored, its
    groups' advantages taken, its windows routed (on its own velocities), and ONE backward runs over the
    kept graphs -- no forward is repeated. Needs one optimizer step per rollout and whole groups per
    rollout micro-batch. ``fused_exact_interior``: also keep the interior steps of windows that may stay
    exact (else those are re-run after the micro-batch, as unfused). ``fused_samples``: keep graphs for
    only that many samples of each rollout micro-batch (the rest are updated unfused): the memory knob.
    ``memory_budget_mb``: the activation memory one gradient pass may use; the update then picks batched
    or split anchor passes and how many samples share a pass (measured per sample, see
    :func:`jagg_lightning.passes.pass_plan`), instead of ``low_memory`` alone. ``interpolate_reference`` (an
    approximation, off by default): with kl_beta > 0 the reference velocity of a routed window's interior
    step is interpolated from its anchors', v_ref,k ~ (1 - alpha_k) v_ref,a + alpha_k v_ref,b, instead of
    a forward with the adapter off (error measured in benchmarks/kl_reference.py)."""

    window_size: int = 4
    jagg_frac: float = 0.5
    chained: bool = False
    score_limit: float | None = None
    low_memory: bool = False
    cache_interior: bool = True
    routing: Literal["residual", "cosine", "random"] = "residual"
    estimator: Literal["paper", "control_variate"] = "paper"
    control_p: float = 0.5
    fused_rollout: bool = False
    fused_exact_interior: bool = True
    fused_samples: int | None = None
    memory_budget_mb: float | None = None
    interpolate_reference: bool = False

    def __post_init__(self):
        check_ints(self, "jagg", "window_size")
        check(self.window_size >= 2, "jagg.window_size", ">= 2", self.window_size)
        check(0.0 <= self.jagg_frac <= 1.0, "jagg.jagg_frac", "in [0, 1]", self.jagg_frac)
        check(self.score_limit is None or self.score_limit >= 0, "jagg.score_limit", ">= 0 or null", self.score_limit)
        check(self.routing in ROUTING_SCORES, "jagg.routing", one_of(ROUTING_SCORES), self.routing)
        check(self.routing != "random" or self.score_limit is None, "jagg.score_limit", "null with jagg.routing "
              "'random' (a uniform draw says nothing about a window's linearity)", self.score_limit)
        check(self.estimator in ESTIMATORS, "jagg.estimator", one_of(ESTIMATORS), self.estimator)
        check(isinstance(self.control_p, (int, float)) and not isinstance(self.control_p, bool)
              and 0.0 < self.control_p <= 1.0, "jagg.control_p", "in (0, 1] (the probability that a routed window "
              "also gets its exact gradient)", self.control_p)
        check(self.estimator != "control_variate" or not self.interpolate_reference, "jagg.interpolate_reference",
              "false with jagg.estimator 'control_variate' (the unbiased estimate needs the true reference at every "
              "step)", self.interpolate_reference)
        check_ints(self, "jagg", "fused_samples")
        check(self.fused_samples is None or self.fused_samples >= 1, "jagg.fused_samples", ">= 1 or null",
              self.fused_samples)
        check(self.memory_budget_mb is None or self.memory_budget_mb > 0, "jagg.memory_budget_mb", "> 0 or null",
              self.memory_budget_mb)


@dataclass
class EvalConfig:
    """``validate`` / ``test`` / ``predict`` (and ``val_check_interval`` during fit): deterministic ODE (Euler)
    sampling with ``num_steps`` steps and classifier-free guidance ``guidance_scale`` (null = the policy's),
    ``samples_per_prompt`` images per prompt whose noise depends on (seed, prompt index, sample) only, so
    every evaluation sees the same noise; the first ``grid_prompts`` prompts form the logged sample grid."""

    num_steps: int = 20
    guidance_scale: float | None = None
    samples_per_prompt: int = 1
    seed: int = 0
    grid_prompts: int = 8

    def __post_init__(self):
        check_ints(self, "evaluation", "num_steps", "samples_per_prompt", "seed", "grid_prompts")
        check(self.num_steps >= 1, "evaluation.num_steps", ">= 1", self.num_steps)
        check(self.guidance_scale is None or self.guidance_scale >= 1.0, "evaluation.guidance_scale",
              ">= 1.0 (1.0 = off) or null (the policy's)", self.guidance_scale)
        check(self.samples_per_prompt >= 1, "evaluation.samples_per_prompt", ">= 1", self.samples_per_prompt)
        check(self.grid_prompts >= 0, "evaluation.grid_prompts", ">= 0 (0 = no grid)", self.grid_prompts)


def check_sections(sampling: SamplingConfig, grpo: GRPOConfig, jagg: JAGGConfig) -> None:
    """The checks that span sections (each section checks its own fields when built)."""
    trained_name = "sampling.sde_window_size" if sampling.sde_window_size is not None else "sampling.trained_steps"
    check(jagg.window_size <= sampling.num_trained, "jagg.window_size",
          f"<= {trained_name} ({sampling.num_trained})", jagg.window_size)
    if jagg.fused_rollout:
        check_fused(sampling, grpo)


def check_fused(s: SamplingConfig, g: GRPOConfig) -> None:
    """Refuse, with the reason, the settings under which a fused update would not equal the unfused one."""
    why = "jagg.fused_rollout runs the update inside the rollout"
    check(g.inner_epochs == 1, "grpo.inner_epochs", f"1 with jagg.fused_rollout ({why}: one optimizer step per "
          "rollout, on theta_old)", g.inner_epochs)
    check(g.micro_batches_per_update is None, "grpo.micro_batches_per_update", f"null with jagg.fused_rollout "
          f"({why}: every micro-batch belongs to the one update)", g.micro_batches_per_update)
    check(s.rollout_batch_size % s.group_size == 0, "sampling.rollout_batch_size", "a multiple of "
          f"sampling.group_size ({s.group_size}) with jagg.fused_rollout (a micro-batch's advantages are taken as "
          "soon as it ends, so it must hold whole groups)", s.rollout_batch_size)
    check(g.adv_std == "group", "grpo.adv_std", "'group' with jagg.fused_rollout (a global std needs every "
          "reward of the rollout before the first backward)", g.adv_std)


# trainer.precision -> the policy.dtype it needs ("true" precisions cast the module; None = any dtype)
# 16-mixed is refused: its loss scaler unscales inside optimizer.step, after the manual gradient clipping
PRECISIONS = {"32-true": None, "bf16-mixed": None, "bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "None": "32-true"}


def check_precision(precision, dtype: str | None) -> str:
    """Refuse Lightning precisions the module cannot honour; "-true" ones must match ``policy.dtype`` (the
    frozen weights), since LoRA weights and optimizer state stay float32 under every precision."""
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    check(name != "16-mixed", "trainer.precision", "bf16-mixed rather than 16-mixed (float16 loss scaling does not "
          "compose with the manual gradient clipping)", precision)
    check(name in PRECISIONS, "trainer.precision", f"one of {sorted(PRECISIONS)}", precision)
    needed = PRECISIONS[name]
    dtype = dtype or "float32"
    check(needed is None or dtype == needed, "model.policy.dtype",
          f"{needed!r} with trainer.precision {name} (it casts the frozen weights; or use bf16-mixed / 32-true)",
          dtype)
    return name


def check_ints(config, section: str, *names: str) -> None:
    """Integer fields must be integers (or null where they default to null): 2.5 steps is a typo, not a value."""
    for name in names:
        value = getattr(config, name)
        check(value is None or (isinstance(value, int) and not isinstance(value, bool)), f"{section}.{name}",
              "an integer", value)


def default_optimizer(params):
    """``model.optimizer: null``: AdamW, lr 1e-4, weight decay 1e-4 (Flow-GRPO's SD3 setting)."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


def as_config(cls, value):
    """A private copy of a config dataclass from None (defaults), a dict (e.g. hyper-parameters of a
    checkpoint) or an instance (the signature's default instances are shared)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return dataclasses.replace(value)


def check_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        lr = group.get("lr", 0)
        lr = float(lr) if not isinstance(lr, Tensor) else float(lr.item())
        check(lr > 0, "optimizer lr (optimizer.init_args.lr)", "> 0", lr)


def check_optimizer(optimizer):
    """Build the optimizer factory's optimizer on a throw-away parameter, so that its own checks and ours (the
    learning rates) run before any model exists; returns the factory."""
    try:
        probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
    except ValueError as err:
        raise ValueError(f"optimizer lr (optimizer.init_args.lr) must be > 0 and valid: {err}") from err
    check_learning_rates(probe)
    return optimizer
