"""JAGGModule: GRPO fine-tuning of a LoRA DiT where JAGG replaces most per-step backward passes.

``training_step`` (manual optimization), one direction of data flow:

    prompts -> rollout (no grad, SDE, per-sample seeds) -> decode -> reward -> group advantages
            -> routing (residual of the recorded velocities) -> for each update: JAGG window
               gradients per micro-batch -> gradient clipping -> optimizer step -> scheduler step

The interior-velocity cache is used only while theta is still the rollout's theta (before the first
optimizer step after a rollout). Callbacks read :attr:`JAGGModule.window_records` and
:attr:`JAGGModule.windows`; they never reach into rollout internals.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from jagg_lightning.adapters import adapter_identity, identity_mismatch
from jagg_lightning.batching import batch_slice
from jagg_lightning.grpo import KL_CONVENTIONS, StepRecord, group_advantages, step_loss
from jagg_lightning.ema import LoRAEMA
from jagg_lightning.jagg import (
    Window,
    WindowGradientCheck,
    WindowRecord,
    accumulate_gradients,
    alphas,
    check_window_gradients,
    ROUTING_SCORES,
    plan_windows,
    route_windows,
    routing_score,
)
from jagg_lightning.policies import Policy, PolicyConfig, build_policy
from jagg_lightning.rewards import Reward, build_reward, describe_reward
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.strategies import shard_transformer
from jagg_lightning.rollout import (
    Trajectory,
    choose_windows,
    sample_generators,
    sample_seed,
    sample_trajectories,
    sde_window_start,
)
from jagg_lightning.sde import CPS_LOG_PROBS


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
        _check_ints(self, "sampling", "num_steps", "group_size", "rollout_batch_size", "trained_steps", "seed",
                    "sde_window_size", "sde_window_shift_every", "sde_window_stride")
        _check(self.num_steps >= 2, "sampling.num_steps", ">= 2", self.num_steps)
        _check(self.group_size >= 2, "sampling.group_size", ">= 2 (GRPO normalises inside a group)", self.group_size)
        _check(0 < self.noise_level <= 2, "sampling.noise_level", "in (0, 2] (trained steps need a density)",
               self.noise_level)
        _check(self.step_kind in ("sde", "sde_constant", "cps"), "sampling.step_kind", "'sde', 'sde_constant' or 'cps'",
               self.step_kind)
        _check(self.num_trained >= 1 and self.num_trained <= self.num_steps, "sampling.trained_steps",
               f"in [1, num_steps={self.num_steps}]", self.trained_steps)
        _check(self.step_kind != "cps" or self.num_trained < self.num_steps, "sampling.trained_steps",
               f"< num_steps={self.num_steps} with step_kind cps (its last step is deterministic)", self.trained_steps)
        _check(self.rollout_batch_size >= 1, "sampling.rollout_batch_size", ">= 1", self.rollout_batch_size)
        _check(self.shift is None or self.shift > 0, "sampling.shift", "> 0 or null", self.shift)
        _check(self.cps_log_prob in CPS_LOG_PROBS, "sampling.cps_log_prob", "'squared_error' or 'gaussian'",
               self.cps_log_prob)
        _check(0.0 < self.window_fraction <= 1.0, "sampling.window_fraction", "in (0, 1]", self.window_fraction)
        _check(self.train_guidance_scale is None or self.train_guidance_scale >= 1.0, "sampling.train_guidance_scale",
               ">= 1.0 (1.0 = no guidance) or null", self.train_guidance_scale)
        self._check_sde_window()

    def _check_sde_window(self) -> None:
        if self.sde_window_size is None:
            _check(self.sde_window_range is None, "sampling.sde_window_range", "null without sampling.sde_window_size",
                   self.sde_window_range)
            return
        _check(self.sde_window_size >= 1, "sampling.sde_window_size", ">= 1 or null", self.sde_window_size)
        _check(self.trained_steps is None, "sampling.trained_steps", "null with sampling.sde_window_size (the window "
               "is what is trained)", self.trained_steps)
        if self.sde_window_range is None:
            self.sde_window_range = [0, self.num_steps - 1]
        last = self.num_steps - 1 if self.step_kind == "cps" else self.num_steps
        ok = len(self.sde_window_range) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                      for x in self.sde_window_range)
        ok = ok and 0 <= self.sde_window_range[0]
        ok = ok and self.sde_window_range[1] <= last and self.sde_window_range[1] - self.sde_window_range[0] >= self.sde_window_size
        _check(ok, "sampling.sde_window_range", f"[lo, hi] (integers) with 0 <= lo, hi <= {last} (num_steps"
               f"{' - 1: a CPS step into t = 0 is deterministic' if self.step_kind == 'cps' else ''}) and "
               f"hi - lo >= sde_window_size={self.sde_window_size}", self.sde_window_range)
        _check(self.sde_window_schedule in ("random", "progressive"), "sampling.sde_window_schedule",
               "'random' or 'progressive'", self.sde_window_schedule)
        _check(self.sde_window_shift_every >= 1, "sampling.sde_window_shift_every", ">= 1", self.sde_window_shift_every)
        _check(self.sde_window_stride >= 1, "sampling.sde_window_stride", ">= 1", self.sde_window_stride)

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
    of equal rewards) get no forward or backward; the update is the same."""

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

    def __post_init__(self):
        _check_ints(self, "grpo", "inner_epochs", "train_batch_size", "micro_batches_per_update", "std_ddof")
        _check(self.clip_range > 0, "grpo.clip_range", "> 0", self.clip_range)
        _check(self.kl_beta >= 0, "grpo.kl_beta", ">= 0", self.kl_beta)
        _check(self.adv_clip > 0, "grpo.adv_clip", "> 0", self.adv_clip)
        _check(self.adv_std in ("group", "global"), "grpo.adv_std", "'group' or 'global'", self.adv_std)
        _check(self.inner_epochs >= 1, "grpo.inner_epochs", ">= 1", self.inner_epochs)
        _check(self.train_batch_size >= 1, "grpo.train_batch_size", ">= 1", self.train_batch_size)
        _check(self.micro_batches_per_update is None or self.micro_batches_per_update >= 1,
               "grpo.micro_batches_per_update", ">= 1 or null", self.micro_batches_per_update)
        _check(self.max_grad_norm is None or self.max_grad_norm > 0, "grpo.max_grad_norm", "> 0 or null",
               self.max_grad_norm)
        _check(self.kl_convention in KL_CONVENTIONS, "grpo.kl_convention", "'flow_grpo' or 'exact'", self.kl_convention)
        _check(self.std_ddof in (0, 1), "grpo.std_ddof", "0 (np.std) or 1 (unbiased)", self.std_ddof)
        _check(self.adv_eps > 0, "grpo.adv_eps", "> 0", self.adv_eps)


@dataclass
class JAGGConfig:
    """Windows of ``window_size`` trained steps (``chained``: neighbours share an anchor); the
    ``jagg_frac`` share with the smallest ``routing`` score use JAGG (``residual``: the
    velocity-interpolation residual; ``cosine``: 1 - cos(v_k - v_a, v_b - v_a), the published rule; a
    window above ``score_limit`` stays exact); ``low_memory`` runs the two anchors as two passes;
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
    :meth:`JAGGModule.pass_plan`), instead of ``low_memory`` alone. ``interpolate_reference`` (an
    approximation, off by default): with kl_beta > 0 the reference velocity of a routed window's interior
    step is interpolated from its anchors', v_ref,k ~ (1 - alpha_k) v_ref,a + alpha_k v_ref,b, instead of
    a forward with the adapter off (error measured in benchmarks/kl_reference.py)."""

    window_size: int = 4
    jagg_frac: float = 0.5
    chained: bool = False
    score_limit: float | None = None
    low_memory: bool = False
    cache_interior: bool = True
    routing: Literal["residual", "cosine"] = "residual"
    fused_rollout: bool = False
    fused_exact_interior: bool = True
    fused_samples: int | None = None
    memory_budget_mb: float | None = None
    interpolate_reference: bool = False

    def __post_init__(self):
        _check_ints(self, "jagg", "window_size")
        _check(self.window_size >= 2, "jagg.window_size", ">= 2", self.window_size)
        _check(0.0 <= self.jagg_frac <= 1.0, "jagg.jagg_frac", "in [0, 1]", self.jagg_frac)
        _check(self.score_limit is None or self.score_limit >= 0, "jagg.score_limit", ">= 0 or null", self.score_limit)
        _check(self.routing in ROUTING_SCORES, "jagg.routing", " or ".join(map(repr, ROUTING_SCORES)), self.routing)
        _check_ints(self, "jagg", "fused_samples")
        _check(self.fused_samples is None or self.fused_samples >= 1, "jagg.fused_samples", ">= 1 or null",
               self.fused_samples)
        _check(self.memory_budget_mb is None or self.memory_budget_mb > 0, "jagg.memory_budget_mb", "> 0 or null",
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
        _check_ints(self, "evaluation", "num_steps", "samples_per_prompt", "seed", "grid_prompts")
        _check(self.num_steps >= 1, "evaluation.num_steps", ">= 1", self.num_steps)
        _check(self.guidance_scale is None or self.guidance_scale >= 1.0, "evaluation.guidance_scale",
               ">= 1.0 (1.0 = off) or null (the policy's)", self.guidance_scale)
        _check(self.samples_per_prompt >= 1, "evaluation.samples_per_prompt", ">= 1", self.samples_per_prompt)
        _check(self.grid_prompts >= 0, "evaluation.grid_prompts", ">= 0 (0 = no grid)", self.grid_prompts)


EVAL_STEP = -1  # the "global step" that seeds evaluation noise: the same at every evaluation


# trainer.precision -> the policy.dtype it needs ("true" precisions cast the module; None = any dtype)
# 16-mixed is refused: its loss scaler unscales inside optimizer.step, after the manual gradient clipping
PRECISIONS = {"32-true": None, "bf16-mixed": None, "bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true", "None": "32-true"}


def check_precision(precision, dtype: str | None) -> str:
    """Refuse Lightning precisions the module cannot honour; "-true" ones must match ``policy.dtype`` (the
    frozen weights), since LoRA weights and optimizer state stay float32 under every precision."""
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    _check(name != "16-mixed", "trainer.precision", "bf16-mixed rather than 16-mixed (float16 loss scaling does not "
           "compose with the manual gradient clipping)", precision)
    _check(name in PRECISIONS, "trainer.precision", f"one of {sorted(PRECISIONS)}", precision)
    needed = PRECISIONS[name]
    dtype = dtype or "float32"
    _check(needed is None or dtype == needed, "model.policy.dtype",
           f"{needed!r} with trainer.precision {name} (it casts the frozen weights; or use bf16-mixed / 32-true)",
           dtype)
    return name


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def unpack_prompt_batch(batch) -> tuple[list[str], list[int]]:
    """The data contract: a batch is ``{"prompt": [str, ...], "index": [int, ...]}`` (what a DataLoader over
    :class:`jagg_lightning.data.PromptDataset` yields); the index seeds that prompt's noise."""
    if not (isinstance(batch, dict) and "prompt" in batch and "index" in batch):
        got = type(batch).__name__
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], str):
            got = "a list of strings"
        raise TypeError(
            f"JAGGModule batches must be dicts {{'prompt': [str], 'index': [int]}} (each prompt's index seeds its "
            f"noise), got {got}: wrap your prompts in jagg_lightning.data.PromptDataset(prompts) or use "
            "PromptDataModule"
        )
    prompts, indices = list(batch["prompt"]), [int(i) for i in batch["index"]]
    if len(prompts) != len(indices) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"a batch needs one str prompt per index, got {len(prompts)} prompts, {len(indices)} indices")
    return prompts, indices


def _check_ints(config, section: str, *names: str) -> None:
    """Integer fields must be integers (or null where they default to null): 2.5 steps is a typo, not a value."""
    for name in names:
        value = getattr(config, name)
        _check(value is None or (isinstance(value, int) and not isinstance(value, bool)), f"{section}.{name}",
               "an integer", value)


def _full_precision_defaults(step):
    """Lightning's "-true" half precisions make half the default dtype inside the step; the SDE and GRPO math
    creates tensors without a dtype and must stay float32 (float64 with a float64 policy)."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self._sde_dtype)
        try:
            return step(self, *args, **kwargs)
        finally:
            torch.set_default_dtype(previous)

    return wrapper


@dataclass
class RolloutPlan:
    """What one rollout samples and trains, drawn from (seed, global step) only: the same on every process."""

    step_kinds: list[str]  # per sampling step: "sde" / "cps" inside the stochastic steps, "ode" elsewhere
    stochastic_steps: list[int]  # the SDE window (or the first num_trained steps)
    windows: list[Window] = field(default_factory=list)  # the JAGG windows trained (after window_fraction)

    @property
    def trained_steps(self) -> list[int]:
        return sorted({k for w in self.windows for k in w.steps})


@dataclass
class RolloutBatch:
    """What one training step's rollout produced, kept until the next step for diagnostics."""

    trajectory: Trajectory
    cond: tuple
    advantages: Tensor
    ref_velocities: Tensor | None


def default_optimizer(params):
    """``model.optimizer: null``: AdamW, lr 1e-4, weight decay 1e-4 (Flow-GRPO's SD3 setting)."""
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)


class JAGGModule(L.LightningModule):
    """GRPO with JAGG window gradients on a LoRA-adapted flow-matching transformer (manual optimization).

    Drop it into any ``Trainer``: ``Trainer(max_steps=...).fit(JAGGModule(...), PromptDataModule(...))``.
    ``__init__`` only validates; the policy (``policies/``, any supported family) is built in
    :meth:`configure_model`, which the Trainer and ``load_from_checkpoint`` call (call it yourself to use
    ``module.policy`` outside a Trainer).

    Checkpoints hold only the trainable LoRA weights (plus optimizer, scheduler, EMA and RNG states,
    and Lightning's counters); the frozen weights are rebuilt from ``policy`` on load.
    """

    strict_loading = False  # checkpoints carry only the LoRA weights

    def __init__(
        self,
        # typed without `| None` (None is still accepted): the CLI then prints the full sections and shows
        # the dataclasses' own error messages instead of "does not validate against any of the Union subtypes"
        policy: PolicyConfig = PolicyConfig(),
        sampling: SamplingConfig = SamplingConfig(),
        grpo: GRPOConfig = GRPOConfig(),
        jagg: JAGGConfig = JAGGConfig(),
        reward: str | Reward = "jpeg_compressibility",
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        ema_decay: float | None = None,
        reward_workers: int = 0,
        evaluation: EvalConfig = EvalConfig(),
    ):
        super().__init__()
        self.automatic_optimization = False
        self.policy_config = _as_config(PolicyConfig, policy)
        self.sampling = _as_config(SamplingConfig, sampling)
        self.grpo = _as_config(GRPOConfig, grpo)
        self.jagg = _as_config(JAGGConfig, jagg)
        self.evaluation = _as_config(EvalConfig, evaluation)
        # Everything that can be checked is checked before any model is built.
        trained_name = "sampling.sde_window_size" if self.sampling.sde_window_size is not None else "sampling.trained_steps"
        _check(self.jagg.window_size <= self.sampling.num_trained, "jagg.window_size",
               f"<= {trained_name} ({self.sampling.num_trained})", self.jagg.window_size)
        if self.jagg.fused_rollout:
            self.check_fused()
        optimizer = _rebuild_callable("optimizer", optimizer) or default_optimizer
        lr_scheduler = _rebuild_callable("lr_scheduler", lr_scheduler)
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        try:  # a throw-away parameter: the optimizer's own checks and ours run before any model exists
            probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
        except ValueError as err:
            raise ValueError(f"optimizer lr (optimizer.init_args.lr) must be > 0 and valid: {err}") from err
        _check_learning_rates(probe)
        _check(ema_decay is None or 0.0 < ema_decay < 1.0, "ema_decay", "in (0, 1) or null", ema_decay)
        _check(reward_workers >= 0, "reward_workers", ">= 0 (0 scores in the training thread)", reward_workers)
        self.reward_workers = reward_workers
        self._pool: ThreadPoolExecutor | None = None
        self.reward_fn = build_reward(reward)
        if _given_hyperparameters.get() is not None:
            self.save_hyperparameters()  # LightningCLI hands over its own config: plain data, re-instantiable
        else:  # plain data only (yaml.safe_load, weights_only=True); the reward as class path + init args
            self.save_hyperparameters({
                "policy": _plain(self.policy_config), "sampling": _plain(self.sampling), "grpo": _plain(self.grpo),
                "jagg": _plain(self.jagg), "reward": describe_reward(self.reward_fn),
                "optimizer": describe_callable(optimizer, default_optimizer),
                "lr_scheduler": describe_callable(lr_scheduler, None), "ema_decay": ema_decay,
                "reward_workers": reward_workers, "evaluation": _plain(self.evaluation),
            })

        # the policy and the EMA of its LoRA are built in configure_model; windows need only the config
        self.ema_decay = ema_decay
        self.ema: LoRAEMA | None = None
        self._ema_restored = False  # set when a checkpoint's EMA state is loaded
        self.rollouts_done = 0  # training steps (rollouts) so far; global_step counts optimizer steps
        self.exact_backwards = 0  # backward passes exact GRPO would have made in the last training step
        self._schedules: dict[tuple, Tensor] = {}
        self.trained_steps = self.sampling.trainable_steps  # every step a rollout may train
        self.plan = self.plan_rollout(0)  # of the last rollout (callbacks read it, and ``windows``)
        self.windows: list[Window] = self.plan.windows
        self.skipped_samples = 0  # zero-advantage samples given no pass in the last training step
        self._ratio_warned = False
        self.window_records: list[WindowRecord] = []  # of the last training step, all micro-batches
        self.first_update_ratio_deviation = float("nan")  # max |log rho| in the first update of the last step
        self.first_update_ratio_off = False  # that deviation exceeds float noise (a warning was raised)
        self.last_rollout: RolloutBatch | None = None
        self._eval_sums: dict[str, Tensor] = {}  # component -> [sum, count] over this process's eval samples
        self._eval_grid: list[Tensor] = []
        self.gradient_all_reduces = 0  # in the last training step: one per optimizer update under DDP
        self.reference_forwards = 0  # adapter-off forwards (of a micro-batch) in the last training step
        self._sharded = False  # FSDP2 applied by configure_model
        self._activation_bytes: dict[float, int] = {}  # per guidance scale: see activation_bytes()

    def _trainable_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def inference_weights(self):
        """Context in which the policy holds the weights to export or sample with (EMA when enabled)."""
        return self.ema.applied() if self.ema is not None else nullcontext()

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        """Build (or load) the policy -- here rather than in ``__init__`` so that a strategy can wrap or
        shard it as it is created. Idempotent: the Trainer calls it for every fit/validate/predict."""
        if "policy" not in self._modules:
            self.policy: Policy = build_policy(self.policy_config)
            if self.policy_config.gradient_checkpointing:
                self.policy.enable_gradient_checkpointing()
        mesh = self._device_mesh  # set by ModelParallelStrategy (FSDP2Strategy) before this hook
        if mesh is not None and not self._sharded:
            # FSDP2: one unit per transformer block; the parameters become DTensor shards, so an EMA made
            # before this point would track the old tensors (nothing has trained yet: rebuild it)
            shard_transformer(self.policy.transformer, mesh["data_parallel"])
            self._sharded, self.ema = True, None
        if self.ema_decay is not None and self.ema is None:
            self.ema = LoRAEMA(self._trainable_named_parameters(), self.ema_decay)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "policy":
                raise AttributeError(
                    "JAGGModule.policy is built in configure_model(): the Trainer calls it; outside a Trainer "
                    "call module.configure_model() first"
                ) from None
            raise

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.policy.lora_parameters())
        _check_learning_rates(optimizer)
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.lr_scheduler_factory(optimizer)}

    def schedule(self, num_steps: int | None = None) -> Tensor:
        """The sampling times t_0 = 1 > ... > t_S = 0 (default: the rollout's ``num_steps``): the family
        pipeline's own scheduler sigmas at the policy's resolution, or a static ``sampling.shift``."""
        num_steps = num_steps or self.sampling.num_steps
        key = (num_steps, self.sampling.shift)
        if key not in self._schedules:
            self._schedules[key] = self.policy.schedule(num_steps, self.sampling.shift)
        return self._schedules[key]

    @property
    def times(self) -> Tensor:
        return self.schedule()

    @property
    def step_kinds(self) -> list[str]:
        """The step kinds of the last planned rollout."""
        return self.plan.step_kinds

    def plan_rollout(self, step: int, rollout: int | None = None) -> RolloutPlan:
        """Step kinds, SDE window and trained JAGG windows of the rollout at ``step`` (seeded, rank-free);
        ``rollout``: how many rollouts came before (the progressive SDE window counts them; default step)."""
        s = self.sampling
        if s.sde_window_size is None:
            stochastic = list(range(s.num_trained))
            after = "ode" if s.ode_after_trained else s.step_kind
            kinds = [s.step_kind if k < s.num_trained else after for k in range(s.num_steps)]
        else:
            start = sde_window_start(s.seed, step, s.sde_window_size, s.sde_window_range, s.sde_window_schedule,
                                     s.sde_window_shift_every, s.sde_window_stride, rollout)
            stochastic = list(range(start, start + s.sde_window_size))
            kinds = [s.step_kind if k in stochastic else "ode" for k in range(s.num_steps)]
        windows = plan_windows(stochastic, self.jagg.window_size, self.jagg.chained)
        chosen = choose_windows(len(windows), s.window_fraction, s.seed, step)
        return RolloutPlan(kinds, stochastic, [windows[i] for i in chosen])

    def training_guidance(self):
        """Guidance of rollouts and training (``sampling.train_guidance_scale``; 1.0 = CFG-free); evaluation
        uses ``evaluation.guidance_scale``."""
        return self._guidance(self.sampling.train_guidance_scale)

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def rollout(self, prompts: list[str], prompt_indices: list[int], step: int,
                on_micro_batch=None, step_kinds: list[str] | None = None, reference_steps: list[int] = (),
                cond: tuple | None = None, **graph_options) -> tuple[Trajectory, tuple]:
        """K samples per prompt (prompt-major): the trajectory and the per-sample condition.

        ``step_kinds`` default: those of :meth:`plan_rollout` at ``step``. With kl_beta > 0 the reference
        velocity (adapter off) of every ``reference_steps`` step is taken inside the rollout, on the same
        z and t (``traj.ref_velocities``). ``cond``: :meth:`encode` of the prompts, if already made.
        ``graph_options``: the fused mode's ``grad_steps``, ``grad_samples`` and ``on_graph``
        (:func:`sample_trajectories`)."""
        K = self.sampling.group_size
        cond = self.encode(prompts) if cond is None else cond
        traj = sample_trajectories(
            self.policy.velocity, cond, sample_generators(self.sampling.seed, step, prompt_indices, K),
            self.policy.latent_shape, self.times, step_kinds or self.plan_rollout(step).step_kinds,
            self.sampling.noise_level, self.sampling.rollout_batch_size, self.device, self._sde_dtype,
            on_micro_batch, self.sampling.cps_log_prob,
            reference_fn=self.reference_velocity if self.grpo.kl_beta > 0 and reference_steps else None,
            reference_steps=set(reference_steps), **graph_options,
        )
        return traj, cond

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple:
        """The per-sample condition of a rollout: each prompt's embeddings repeated K times (prompt-major)."""
        K = self.sampling.group_size
        return tuple(c.repeat_interleave(K, dim=0) for c in self.policy.encode_prompts(prompts))

    @torch.no_grad()
    def reference_velocity(self, z: Tensor, t: Tensor, cond) -> Tensor:
        """The reference policy's velocity: the policy with its adapter off (counted: ``train/passes/reference_forward``)."""
        self.reference_forwards += 1
        with self.policy.adapter_disabled():
            return self.policy.velocity(z, t, cond)

    @property
    def _sde_dtype(self) -> torch.dtype:
        return torch.float64 if self.policy_config.dtype == "float64" else torch.float32

    @torch.no_grad()
    def rollout_and_score(self, prompts: list[str], prompt_indices: list[int], step: int,
                          step_kinds: list[str] | None = None, reference_steps: list[int] = ()):
        """The rollout with every micro-batch decoded as soon as it is sampled and scored -- in a thread
        pool when ``reward_workers`` > 0, so scoring overlaps the next micro-batch's sampling.

        Returns (trajectory, condition, per-sample prompts, rewards [N], {component: scores [N]}).
        """
        sample_prompts = [p for p in prompts for _ in range(self.sampling.group_size)]
        pending: list[Future] = []

        def score_micro_batch(part: slice, final: Tensor, _traj: Trajectory) -> None:
            images = self.policy.decode(final)
            if self.reward_workers:
                pending.append(self._reward_pool().submit(self.score, images, sample_prompts[part]))
            else:
                done: Future = Future()
                done.set_result(self.score(images, sample_prompts[part]))
                pending.append(done)

        traj, cond = self.rollout(prompts, prompt_indices, step, score_micro_batch, step_kinds, reference_steps)
        results = [f.result() for f in pending]
        rewards = torch.cat([total for total, _ in results])
        components = {name: torch.cat([c[name] for _, c in results]) for name in results[0][1]}
        return traj, cond, sample_prompts, rewards, components

    def score(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """The reward's total and components; a failure is re-raised naming the reward."""
        try:
            return self.reward_fn.score_with_components(images, prompts)
        except Exception as err:
            if isinstance(err, RewardError) or str(err).startswith("reward "):  # already names the reward
                raise
            raise RewardError(f"reward {self.reward_fn.name} ({type(self.reward_fn).__name__}) failed while scoring "
                              f"{len(prompts)} images: {type(err).__name__}: {err}") from err

    def _reward_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.reward_workers, thread_name_prefix="jagg-reward")
        return self._pool

    def teardown(self, stage: str) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @torch.no_grad()
    def reference_velocities(self, traj: Trajectory, cond: tuple, steps: list[int] | None = None) -> Tensor | None:
        """v with the adapter off at every trained step (default: the last plan's), zeros elsewhere, as a
        separate pass over a finished trajectory (training takes them inside the rollout instead; this is
        the independent check); theta-independent, so once per rollout."""
        if self.grpo.kl_beta == 0:
            return None
        out = torch.zeros_like(traj.velocities)
        for k in self.plan.trained_steps if steps is None else steps:
            self._reference_at_step(traj, cond, k, out)
        return out

    @torch.no_grad()
    def _reference_at_step(self, traj: Trajectory, cond: tuple, k: int, out: Tensor) -> None:
        """out[k] = the reference velocity at step k of the finished ``traj``, in rollout-sized passes."""
        size = self.sampling.rollout_batch_size
        for i in range(0, out.shape[1], size):
            z = traj.latents[k, i : i + size]
            out[k, i : i + size] = self.reference_velocity(z, traj.times[k].expand(z.shape[0]),
                                                           batch_slice(cond, slice(i, i + size)))

    def route(self, traj: Trajectory, windows: list[Window] | None = None) -> list[Window]:
        """Score every window (default: ``self.windows``) from the recorded velocities (``jagg.routing``;
        mean over all samples of all processes), route."""
        windows = self.windows if windows is None else windows
        scores = torch.stack([routing_score(self.jagg.routing, traj.velocities, traj.times, w.steps)
                              for w in windows]).to(self.device)
        if self._trainer is not None:
            # every process must route alike: under DDP the backward calls (and their all-reduces) must match
            scores = self.trainer.strategy.reduce(scores, reduce_op="mean")
        return route_windows(windows, scores.tolist(), self.jagg.jagg_frac, self.jagg.window_size,
                             self.jagg.score_limit)

    # ------------------------------------------------------------------ update
    def step_loss_fn(self, mb: Trajectory, advantages: Tensor, ref_v: Tensor | None, scale: float, stats: list):
        """(k, v) -> this micro-batch's step-k share of the objective; appends (k, stats) to ``stats``."""
        kind, g = self.sampling.step_kind, self.grpo
        times = mb.times.tolist()  # one host read per micro-batch, not two per step

        def loss_of_step(k: int, v: Tensor) -> Tensor:
            record = StepRecord(
                mb.latents[k], mb.latents[k + 1], times[k], times[k + 1], mb.log_probs[k],
                advantages, None if ref_v is None else ref_v[k],
            )
            loss, st = step_loss(v, record, kind, self.sampling.noise_level, g.clip_range, g.kl_beta,
                                 self.sampling.cps_log_prob, g.kl_convention)
            stats.append((k, st))
            return loss.mean() * scale

        return loss_of_step

    def backward_samples(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int,
                         windows: list[Window], use_cache: bool, stats: list) -> list[WindowRecord]:
        """The engine over ``mb``'s samples, in passes of as many samples as ``jagg.memory_budget_mb`` allows
        (:meth:`pass_plan`); each sample's loss is scaled by 1 / (update_size * trained steps)."""
        size, split_anchors = self.pass_plan(advantages.shape[0], windows)
        records = []
        for start in range(0, advantages.shape[0], size):
            rows = slice(start, start + size)
            records += self.engine_pass(mb.select(rows), advantages[rows], batch_slice(cond, rows), update_size,
                                        windows, use_cache, stats, low_memory=split_anchors)
        return records

    def engine_pass(self, mb: Trajectory, advantages: Tensor, cond: tuple, update_size: int, windows: list[Window],
                    use_cache: bool, stats: list, low_memory: bool, graphs: dict[int, Tensor] | None = None):
        """One :func:`accumulate_gradients` call over all of ``mb``'s samples. ``use_cache``: theta is still the
        rollout's theta_old; the anchors then take one forward each, of the rollout's batch shape (with one
        backward), so the recomputed log-probs are the rollout's bit for bit (ratio exactly 1)."""
        scale = advantages.shape[0] / (update_size * len(self.plan.trained_steps))
        loss_of_step = self.step_loss_fn(mb, advantages, mb.ref_velocities, scale, stats)
        return accumulate_gradients(
            self.policy.velocity, mb.latents, mb.times, cond, loss_of_step, windows,
            cached_velocities=mb.velocities if (use_cache and self.jagg.cache_interior) else None,
            low_memory=low_memory, backward=self.manual_backward, graphs=graphs, batch_anchors=not use_cache,
        )

    # ------------------------------------------------------------------ memory budget
    def activation_bytes(self, samples: int = 1) -> int:
        """Bytes autograd keeps for the backward of ONE sample's forward with grad (the velocity at the
        current guidance: with CFG both branches), measured once by counting the tensors saved for
        backward (frozen weights excluded, shared storage counted once): the unit of
        ``jagg.memory_budget_mb``. Activations grow linearly with the samples in a pass (``samples`` > 1
        measures a pass of that many, uncached)."""
        if samples > 1:
            return self._measure_activation_bytes(samples)
        key = float(self.policy.config.guidance_scale)
        if key not in self._activation_bytes:
            self._activation_bytes[key] = self._measure_activation_bytes(1)
        return self._activation_bytes[key]

    def _measure_activation_bytes(self, samples: int) -> int:
        weights = {p.untyped_storage().data_ptr() for p in self.policy.parameters()}
        seen: dict[int, int] = {}

        def pack(t: Tensor):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        cond = tuple(c[:1].repeat_interleave(samples, dim=0) for c in self.encode(["a"]))
        z = torch.randn(samples, *self.policy.latent_shape, generator=torch.Generator().manual_seed(0))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.policy.velocity(z.to(self.device), torch.full((samples,), 0.5, device=self.device), cond)
        return sum(seen.values())

    def pass_plan(self, samples: int, windows: list[Window]) -> tuple[int, bool]:
        """(samples per pass, split anchors) for ``samples`` over the routed ``windows`` under
        ``jagg.memory_budget_mb``.

        A pass over n samples of one step keeps n a bytes (a = :meth:`activation_bytes`); a batched anchor
        pass keeps 2 n a. Two plans fit the budget B: batched anchors on c_b = B // 2a samples a pass, or
        split anchors on c_s = B // a; with R routed windows and E exact steps they make
        (R + E) ceil(n / c_b) and (2R + E) ceil(n / c_s) passes. The plan with fewer passes wins (batched
        on a tie; split when c_b < 1). A budget below one sample's pass still runs one sample at a time.
        Without a budget: all samples, ``jagg.low_memory``."""
        budget = self.jagg.memory_budget_mb
        if budget is None:
            return samples, self.jagg.low_memory
        per_sample, limit = max(self.activation_bytes(), 1), int(budget * 2**20)
        routed = sum(1 for w in windows if w.routed)
        exact = len({k for w in windows if not w.routed for k in w.steps})
        batched, split = min(samples, limit // (2 * per_sample)), max(1, min(samples, limit // per_sample))
        if batched >= 1 and (routed + exact) * -(-samples // batched) <= (2 * routed + exact) * -(-samples // split):
            return batched, False
        return split, True

    def fused_samples(self, kept_steps: int) -> int | None:
        """Samples of each rollout micro-batch whose graphs the fused mode keeps: ``jagg.fused_samples``, else
        as many as ``memory_budget_mb`` holds for ``kept_steps`` graphs (at least 1), else all (None)."""
        if self.jagg.fused_samples is not None or self.jagg.memory_budget_mb is None:
            return self.jagg.fused_samples
        return max(1, int(self.jagg.memory_budget_mb * 2**20) // (max(kept_steps, 1) * max(self.activation_bytes(), 1)))

    def drop_zero_advantage(self, group: list[Tensor], advantages: Tensor) -> list[Tensor]:
        """The micro-batches of one update without the samples whose advantage is exactly 0, repacked into
        micro-batches of ``train_batch_size`` (when kl_beta = 0 they contribute nothing, so the update,
        which keeps its full-size normalisation, is the same). Every process makes as many micro-batches as
        the process with the most under a sharded strategy -- a short one pads with single zero-advantage
        samples (zero gradient) -- so the collectives inside the passes (FSDP's all-gathers) stay matched."""
        if not self.grpo.skip_zero_advantage or self.grpo.kl_beta > 0:
            return group
        index = torch.cat(group)
        nonzero = advantages[index] != 0
        keep, zero = index[nonzero], index[~nonzero]
        kept = list(keep.split(self.grpo.train_batch_size)) if len(keep) else []
        count = torch.tensor(len(kept), device=self.device)
        # DDP backward stays local (one gradient all-reduce per update, zeros for a rank without passes);
        # a sharded model (FSDP2) gathers its weights inside every pass, so there the counts must match
        if self._trainer is not None and self.trainer.world_size > 1 and self._ddp_model() is None:
            count = self.all_gather(count).max()
        padding = int(count) - len(kept)
        kept += [zero[i : i + 1] for i in range(padding)]
        self.skipped_samples += len(zero) - padding
        return kept

    @_full_precision_defaults
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        with self.training_guidance():
            return self._training_step(batch, batch_idx)

    def _training_step(self, batch: dict, batch_idx: int) -> Tensor:
        prompts, indices = unpack_prompt_batch(batch)
        step = self.global_step
        self.plan = plan = self.plan_rollout(step, self.rollouts_done)
        self.windows = plan.windows
        self.skipped_samples = 0
        self.gradient_all_reduces = 0
        self.reference_forwards = 0
        if self.jagg.fused_rollout:
            traj, cond, rewards, components, advantages, records, first_update_stats = self._fused_update(
                prompts, indices, step)
            stats, micro_batches = [], -(-rewards.shape[0] // self.sampling.rollout_batch_size)
        else:
            taken = self.reference_steps(plan.windows)
            traj, cond, _, rewards, components = self.rollout_and_score(prompts, indices, step, plan.step_kinds,
                                                                        sorted(taken))
            advantages = self.advantages(rewards)
            self.route(traj, plan.windows)
            self.complete_reference(traj, cond, plan.windows, taken)
            records, stats, first_update_stats, micro_batches = self._update(traj, cond, advantages, step)

        self.window_records = records
        self.last_rollout = RolloutBatch(traj, cond, advantages, traj.ref_velocities)
        self._check_first_update_ratio(first_update_stats)
        self._log_step(rewards, stats + first_update_stats, records, micro_batches)
        # every component under its own name, a single reward too (as well as train/reward_mean)
        self.log_dict({f"train/reward/{n}": c.mean().float() for n, c in components.items()},
                      batch_size=rewards.shape[0])
        self.rollouts_done += 1
        return rewards.mean()

    def advantages(self, rewards: Tensor) -> Tensor:
        """Group advantages of rewards [N] laid out prompt-major (``grpo`` settings; global std over all processes)."""
        return group_advantages(rewards.view(-1, self.sampling.group_size), self.grpo.adv_std, self.grpo.adv_eps,
                                self.grpo.adv_clip, self.grpo.std_ddof, all_reduce=self._all_reduce_sum).flatten()

    def _update(self, traj: Trajectory, cond: tuple, advantages: Tensor, step: int):
        """The unfused update: ``inner_epochs`` passes over shuffled micro-batches of the finished rollout."""
        num = advantages.shape[0]
        shuffle = torch.Generator().manual_seed(sample_seed(self.sampling.seed, step, -1))
        records: list[WindowRecord] = []
        stats: list = []
        first_update_stats: list = []
        theta_is_old = True
        for _ in range(self.grpo.inner_epochs):
            micro = torch.randperm(num, generator=shuffle).to(self.device).split(self.grpo.train_batch_size)
            per_update = self.grpo.micro_batches_per_update or len(micro)
            for start in range(0, len(micro), per_update):
                group = micro[start : start + per_update]
                update_size = sum(len(m) for m in group)
                group = self.drop_zero_advantage(group, advantages)
                with self._local_backward():
                    for index in group:
                        # this micro-batch's share of d(mean loss over the update)/dtheta
                        records += self.backward_samples(traj.select(index), advantages[index], batch_slice(cond, index),
                                                         update_size, self.plan.windows, theta_is_old,
                                                         first_update_stats if theta_is_old else stats)
                self._optimizer_step()
                theta_is_old = False
        return records, stats, first_update_stats, self.grpo.inner_epochs * len(micro)

    def _optimizer_step(self) -> None:
        """All-reduce (once), clip, step, EMA, scheduler: what follows the backward passes of one update."""
        optimizer = self.optimizers()
        if all(p.grad is None for p in self.policy.lora_parameters()):
            # every sample skipped (zero advantage): the zero gradient the optimizer would have seen
            for p in self.policy.lora_parameters():
                p.grad = torch.zeros_like(p)
        self._all_reduce_gradients()
        if self.grpo.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.grpo.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    # ------------------------------------------------------------------ fused on-policy update
    def fused_graph_steps(self, windows: list[Window]) -> set[int]:
        """The steps whose graph the fused rollout keeps: every step that may get a backward, known before
        routing (:meth:`pass_steps_before_routing`; interiors with ``fused_exact_interior``)."""
        return self.pass_steps_before_routing(windows, self.jagg.fused_exact_interior)

    def reference_steps(self, windows: list[Window]) -> set[int]:
        """The steps whose KL reference the rollout takes: every trained step, or with
        ``interpolate_reference`` only those that get a backward whatever the routing (the rest are
        interpolated or taken by :meth:`complete_reference` once the windows are routed)."""
        if not self.jagg.interpolate_reference:
            return {k for w in windows for k in w.steps}
        return self.pass_steps_before_routing(windows, interiors=False)

    def pass_steps_before_routing(self, windows: list[Window], interiors: bool) -> set[int]:
        """Steps that get a backward whatever the routing decides -- anchors (routed or exact) and every step
        of a window exact for certain (a short tail, or ``jagg_frac`` routing none) -- plus, with
        ``interiors``, the interiors of windows that may stay exact (``jagg_frac`` < 1 or a ``score_limit``)."""
        j = self.jagg
        full = [w for w in windows if len(w.steps) == j.window_size]
        routed_count = int(j.jagg_frac * len(full) + 0.5)
        all_routed = routed_count == len(full) and j.score_limit is None
        keep: set[int] = set()
        for w in windows:
            if len(w.steps) < j.window_size or routed_count == 0:
                keep.update(w.steps)  # exact for certain
            else:
                keep.update(w.anchors)
                if interiors and not all_routed:
                    keep.update(w.interior)
        return keep

    @torch.no_grad()
    def complete_reference(self, traj: Trajectory, cond: tuple, windows: list[Window], taken: set[int]) -> None:
        """Fill in, once the windows are routed, the reference velocities the rollout did not take
        (``interpolate_reference``): a routed window's interior steps are interpolated from its anchors'
        (alpha_k of the window), an exact window's are taken with the adapter off. In place."""
        ref = traj.ref_velocities
        if ref is None:
            return
        for w in windows:
            missing = [k for k in w.interior if k not in taken]
            if missing and w.routed:
                alpha = alphas(traj.times, w.steps)
                a, b = w.anchors
                for i, k in enumerate(w.steps):
                    if k in missing:
                        ref[k] = (1 - alpha[i]).to(ref.dtype) * ref[a] + alpha[i].to(ref.dtype) * ref[b]
            else:
                for k in missing:
                    self._reference_at_step(traj, cond, k, ref)

    def check_fused(self) -> None:
        """Refuse, with the reason, the settings under which a fused update would not equal the unfused one."""
        s, g = self.sampling, self.grpo
        why = "jagg.fused_rollout runs the update inside the rollout"
        _check(g.inner_epochs == 1, "grpo.inner_epochs", f"1 with jagg.fused_rollout ({why}: one optimizer step per "
               "rollout, on theta_old)", g.inner_epochs)
        _check(g.micro_batches_per_update is None, "grpo.micro_batches_per_update", f"null with jagg.fused_rollout "
               f"({why}: every micro-batch belongs to the one update)", g.micro_batches_per_update)
        _check(s.rollout_batch_size % s.group_size == 0, "sampling.rollout_batch_size", "a multiple of "
               f"sampling.group_size ({s.group_size}) with jagg.fused_rollout (a micro-batch's advantages are taken as "
               "soon as it ends, so it must hold whole groups)", s.rollout_batch_size)
        _check(g.adv_std == "group", "grpo.adv_std", "'group' with jagg.fused_rollout (a global std needs every "
               "reward of the rollout before the first backward)", g.adv_std)

    def _fused_update(self, prompts: list[str], indices: list[int], step: int):
        """Rollout and update in one pass (``jagg.fused_rollout``; see :meth:`fused_graph_steps`).

        As each rollout micro-batch of n samples (whole groups) ends: decode, score, advantages, route its
        windows on its own recorded velocities (mean over the processes), fold the interior g_k from
        those velocities into the anchors and run ONE backward over the kept graphs (scaled by
        n / (N * trained steps), as the unfused update); samples beyond ``fused_samples`` go through the
        unfused engine (interiors from the cache), then the graphs are freed.
        """
        plan, K = self.plan, self.sampling.group_size
        sample_prompts = [p for p in prompts for _ in range(K)]
        num = len(sample_prompts)
        graphs: dict[int, Tensor] = {}
        rewards, components, advantages = [], [], []
        records: list[WindowRecord] = []
        stats: list = []
        cond = self.encode(prompts)
        graph_steps = self.fused_graph_steps(plan.windows)
        graph_samples = self.fused_samples(len(graph_steps))

        def update_micro_batch(part: slice, final: Tensor, traj: Trajectory) -> None:
            total, comps = self.score(self.policy.decode(final), sample_prompts[part])
            adv = self.advantages(total)  # group std (check_fused): this micro-batch's groups alone
            rewards.append(total), components.append(comps), advantages.append(adv)
            mb, mb_cond = traj.select(part), batch_slice(cond, part)  # views: a completed reference is the trajectory's
            windows = self.route(mb, plan.windows)
            self.complete_reference(mb, mb_cond, windows, taken)
            n = adv.shape[0]
            kept = n if graph_samples is None else min(graph_samples, n)
            if self.grpo.skip_zero_advantage and self.grpo.kl_beta == 0 and not bool(adv.any()):
                graphs.clear()  # all groups tied: a zero gradient, no backward (its forwards were the rollout's)
                self.skipped_samples += n
                return
            with self._local_backward():
                rows = slice(0, kept)
                records.extend(self.engine_pass(mb.select(rows), adv[rows], batch_slice(mb_cond, rows), num, windows,
                                                True, stats, self.jagg.low_memory, graphs))
                if kept < n:  # the samples without kept graphs: the unfused engine, interiors from the cache
                    rows = slice(kept, n)
                    records.extend(self.backward_samples(mb.select(rows), adv[rows], batch_slice(mb_cond, rows), num,
                                                         windows, True, stats))
            graphs.clear()

        taken = self.reference_steps(plan.windows)
        traj, cond = self.rollout(prompts, indices, step, update_micro_batch, plan.step_kinds, sorted(taken),
                                  cond=cond, grad_steps=graph_steps, grad_samples=graph_samples, on_graph=graphs.__setitem__)
        self._optimizer_step()
        components = {name: torch.cat([c[name] for c in components]) for name in components[0]}
        return traj, cond, torch.cat(rewards), components, torch.cat(advantages), records, stats

    def _log_step(self, rewards: Tensor, stats: list, records: list[WindowRecord], micro_batches: int) -> None:
        def mean_of(attr):
            if not stats:  # every sample skipped (zero advantage)
                return torch.tensor(float("nan"))
            return torch.stack([getattr(st, attr).float().mean() for _, st in stats]).mean()

        routed = [r for r in records if r.routed]
        # what exact GRPO makes of each pass kind (callbacks read it: records alone cannot tell micro-batches
        # from the parts a memory budget or fused_samples splits them into)
        self.exact_backwards = exact_passes = len(self.plan.trained_steps) * micro_batches
        values = {
            "reward_mean": rewards.mean(),
            "reward_std": rewards.std(),
            "policy_loss": mean_of("policy_loss"),
            "kl": mean_of("kl"),
            "approx_kl": mean_of("approx_kl"),
            "clip_frac": mean_of("clipped"),
            "ratio_mean": mean_of("ratio"),
            "routed_frac": torch.tensor(sum(w.routed for w in self.windows) / len(self.windows)),
            "ratio_dev_first_update": torch.tensor(self.first_update_ratio_deviation),
            "ratio_first_update_off": torch.tensor(float(self.first_update_ratio_off)),
            "skipped_samples": torch.tensor(float(self.skipped_samples)),
            "passes/backward": torch.tensor(float(sum(r.backwards for r in records))),
            "passes/grad_forward": torch.tensor(float(sum(r.grad_forwards for r in records))),
            "passes/nograd_forward": torch.tensor(float(sum(r.nograd_forwards for r in records))),
            "passes/fused_forward": torch.tensor(float(sum(r.fused_steps for r in records))),
            "passes/reference_forward": torch.tensor(float(self.reference_forwards)),
            "passes/exact_backward": torch.tensor(float(exact_passes)),
            "passes/routed_windows": torch.tensor(float(len(routed))),
            "passes/grad_all_reduce": torch.tensor(float(self.gradient_all_reduces)),
        }
        self.log_dict({f"train/{k}": v.float() for k, v in values.items()}, batch_size=rewards.shape[0])
        self.log("reward", rewards.mean().float(), prog_bar=True, batch_size=rewards.shape[0], logger=False)


    def _check_first_update_ratio(self, first_update_stats: list) -> None:
        """Warn (once) when the first update's ratio deviates from 1 by more than float noise.

        On the first update theta = theta_old, so every log-prob is recomputed from the same weights on
        the same inputs, and log rho differs from 0 only where the forward rounds differently than in the
        rollout: samples at other batch positions, a pass shrunk by ``jagg.memory_budget_mb`` or a last
        micro-batch shrunk by the zero-advantage skip (JAGG's anchors take one forward each on the first
        update, so they keep the rollout's batch shape). That noise is a few ulps of the log-prob: the bound is
        4 eps (1 + |log pi_old|) per sample (eps of the SDE dtype). A ``train_batch_size`` other than
        ``rollout_batch_size`` is the systematic, fixable cause Flow-GRPO's README warns of: in float32
        any deviation is then reported. Deviations are measured on log rho (exp would round a drift
        below eps / 2 to exactly 1).
        """
        s, g = self.sampling, self.grpo
        other_shape = g.train_batch_size != s.rollout_batch_size and not self.jagg.fused_rollout
        strict = other_shape and self._sde_dtype == torch.float32
        eps = torch.finfo(self._sde_dtype).eps
        tolerance = 0.0 if strict else 4 * eps
        if first_update_stats:  # two numbers read back to the host per training step, not two per step and micro-batch
            log_ratio = torch.cat([st.log_ratio.abs().flatten() for _, st in first_update_stats])
            old = torch.cat([st.old_log_prob.abs().flatten() for _, st in first_update_stats])
            deviation, off = torch.stack([log_ratio.max(), (log_ratio > tolerance * (1 + old)).any().to(log_ratio)]).tolist()
        else:
            deviation, off = 0.0, 0.0
        self.first_update_ratio_deviation, self.first_update_ratio_off = deviation, bool(off)
        if not self.first_update_ratio_off or self._ratio_warned:
            return
        self._ratio_warned = True
        if other_shape:
            cause = (f"grpo.train_batch_size ({g.train_batch_size}) differs from sampling.rollout_batch_size "
                     f"({s.rollout_batch_size}): in float32 the transformer's kernels round differently for another "
                     "batch shape, so the recomputed log-probs differ from the rollout's (Flow-GRPO's README warns of "
                     "the same). Set both to the same value, or train in float64, for rho = 1 to float noise")
        else:
            cause = ("that is beyond float noise (4 eps (1 + |log pi_old|)) with matching batch sizes, so the forward itself is "
                     "not reproducible (nondeterministic kernels), or the weights changed between the rollout and the "
                     "first update")
        rank_zero_warn(f"The importance ratio of the first update after a rollout deviates from 1 (max |log rho| "
                       f"{self.first_update_ratio_deviation:.3g}): {cause}. Logged as train/ratio_dev_first_update.")

    # ------------------------------------------------------------------ evaluation
    @contextmanager
    def _guidance(self, scale: float | None):
        """The policy with classifier-free guidance ``scale`` (None = unchanged) for the duration."""
        if scale is None:
            yield
            return
        previous = self.policy.config.guidance_scale
        self.policy.config.guidance_scale = float(scale)
        try:
            yield
        finally:
            self.policy.config.guidance_scale = previous

    @torch.no_grad()
    def generate(self, prompts: list[str], prompt_indices: list[int]) -> Tensor:
        """``evaluation.samples_per_prompt`` images per prompt (prompt-major) [N, 3, H, W] in [0, 1]: ODE
        sampling with ``evaluation.num_steps`` steps and guidance, with the inference (EMA) weights."""
        ev = self.evaluation
        with self._guidance(ev.guidance_scale), self.inference_weights():
            cond = tuple(c.repeat_interleave(ev.samples_per_prompt, dim=0) for c in self.policy.encode_prompts(prompts))
            traj = sample_trajectories(
                self.policy.velocity, cond, sample_generators(ev.seed, EVAL_STEP, prompt_indices, ev.samples_per_prompt),
                self.policy.latent_shape, self.schedule(ev.num_steps), ["ode"] * ev.num_steps, 0.0,
                self.sampling.rollout_batch_size, self.device, self._sde_dtype,
            )
            return self.policy.decode(traj.latents[-1])

    def on_validation_epoch_start(self) -> None:
        self._eval_sums, self._eval_grid = {}, []

    on_test_epoch_start = on_validation_epoch_start

    @_full_precision_defaults
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        prompts, indices = unpack_prompt_batch(batch)
        images = self.generate(prompts, indices)
        sample_prompts = [p for p in prompts for _ in range(self.evaluation.samples_per_prompt)]
        total, components = self.score(images, sample_prompts)
        for name, scores in {"reward_mean": total, **{f"reward/{n}": c for n, c in components.items()}}.items():
            acc = self._eval_sums.setdefault(name, torch.zeros(2, dtype=torch.float64, device=self.device))
            acc += torch.stack([scores.double().sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)]).to(acc)
        wanted = self.evaluation.grid_prompts * self.evaluation.samples_per_prompt - sum(len(g) for g in self._eval_grid)
        if wanted > 0:
            self._eval_grid.append(images[:wanted].cpu())

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("test" if self.trainer.testing else "val")

    on_test_epoch_end = on_validation_epoch_end

    def _log_evaluation(self, stage: str) -> None:
        """Means over every sample of every process (sums and counts all-reduced), and the sample grid."""
        if self.trainer.sanity_checking or not self._eval_sums:
            return
        names = sorted(self._eval_sums)
        sums = torch.stack([self._eval_sums[n] for n in names])
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        self.log_dict({f"{stage}/{n}": (s[0] / s[1]).float() for n, s in zip(names, sums)}, sync_dist=False)
        from jagg_lightning.callbacks.routing import log_dir

        directory = log_dir(self.trainer) / "samples"  # on every process: trainer.log_dir broadcasts
        if self._eval_grid and self.trainer.is_global_zero:
            from jagg_lightning.callbacks.images import log_image
            from jagg_lightning.callbacks.samples import image_grid
            from jagg_lightning.io import atomic_write
            from PIL import Image

            images = torch.cat(self._eval_grid)
            per_row = self.evaluation.samples_per_prompt
            grid = image_grid([list(images[i : i + per_row]) for i in range(0, len(images), per_row)])
            path = directory / f"{stage}_step_{self.global_step:06d}.png"
            atomic_write(path, lambda tmp: Image.fromarray(grid).save(tmp, format="PNG"))
            log_image(self.trainer, f"{stage}/samples", grid, self.global_step)

    @_full_precision_defaults
    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        """{"prompt", "index", "sample", "images" [N, 3, H, W] in [0, 1]} for a batch of prompts."""
        prompts, indices = unpack_prompt_batch(batch)
        per = self.evaluation.samples_per_prompt
        return {"prompt": [p for p in prompts for _ in range(per)], "index": [i for i in indices for _ in range(per)],
                "sample": [s for _ in prompts for s in range(per)], "images": self.generate(prompts, indices).cpu()}

    # ------------------------------------------------------------------ data parallel
    def _ddp_model(self) -> DistributedDataParallel | None:
        model = self._trainer.strategy.model if self._trainer is not None else None
        return model if isinstance(model, DistributedDataParallel) else None

    def _local_backward(self):
        """Context for an update's backward calls: DDP's reducer (which would all-reduce on every backward;
        JAGG makes several per update) stays off, and ``_all_reduce_gradients`` makes the one all-reduce.
        (Lightning's DDP forward redirection already keeps the forward from arming the reducer.)"""
        return self.trainer.strategy.block_backward_sync() if self._ddp_model() is not None else nullcontext()

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum over the data-parallel processes (one collective; identity on one process)."""
        if self._trainer is None or self.trainer.world_size == 1 or not dist.is_initialized():
            return tensor
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def _all_reduce_gradients(self) -> None:
        """Under DDP: average the LoRA gradients over the processes with ONE all-reduce of their flat
        concatenation (a parameter without a gradient contributes zeros, so every rank sends the same size)."""
        if self._ddp_model() is None:
            return
        params = self.policy.lora_parameters()
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype) for p in params])
        self._all_reduce_sum(flat).div_(self.trainer.world_size)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).to(p.dtype)
        self.gradient_all_reduces += 1

    # ------------------------------------------------------------------ diagnostics
    def check_window_gradients(self, max_samples: int | None = None) -> list[WindowGradientCheck]:
        """Exact vs JAGG gradient of every window on the last rollout's first ``max_samples`` samples,
        at the current theta. Leaves weights, ``.grad``, optimizer state and RNG streams untouched."""
        if self.last_rollout is None:
            return []
        batch = self.last_rollout
        index = torch.arange(batch.advantages.shape[0], device=batch.advantages.device)[:max_samples]
        mb = batch.trajectory.select(index)
        ref = None if batch.ref_velocities is None else batch.ref_velocities[:, index]
        loss_of_step = self.step_loss_fn(mb, batch.advantages[index], ref, 1.0 / len(self.plan.trained_steps), [])
        with self.training_guidance():  # the rollout's condition layout
            return check_window_gradients(
                self.policy.velocity, [p for _, p in self._trainable_named_parameters()], mb.latents, mb.times,
                batch_slice(batch.cond, index), loss_of_step, self.plan.windows,
            )

    # ------------------------------------------------------------------ precision
    def setup(self, stage: str) -> None:
        check_precision(self.trainer.precision, self.policy_config.dtype)
        if self.jagg.fused_rollout and stage == "fit" and isinstance(self.trainer.strategy, ModelParallelStrategy):
            raise ValueError("jagg.fused_rollout must be false under a sharded strategy (FSDP2): the kept graphs "
                             "would hold every block's gathered weights until the micro-batch ends; not supported yet")

    def to(self, *args, **kwargs):
        """Moves devices; a floating dtype is ignored. Precision plugins ("bf16-true", "16-true", "64-true") cast
        the whole module: the frozen weights already hold ``policy.dtype`` (paired with the precision by
        :func:`check_precision`) and the LoRA weights -- hence the optimizer state -- stay float32."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        return self if device is None else super().to(device=device, non_blocking=non_blocking)

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Checkpoints hold only the LoRA weights: the frozen weights (rebuilt from ``policy``) are not reported
        missing (Lightning would print every one of them); missing LoRA weights are, and fail when ``strict``."""
        from torch.nn.modules.module import _IncompatibleKeys

        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trainable = {n for n, _ in self._trainable_named_parameters()}
        missing = [k for k in result.missing_keys if k in trainable]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"LoRA checkpoint does not fit: missing {missing[:3]}, unexpected "
                               f"{result.unexpected_keys[:3]}")
        return _IncompatibleKeys(missing, list(result.unexpected_keys))

    def on_fit_start(self) -> None:
        if self.ema is None:
            return
        if self.global_step == 0 and not self._ema_restored:
            # a new run: the average starts from the weights training starts with (also a LoRA the user
            # loaded or set after configure_model), on their device
            self.ema.reset()
        else:  # resumed: the restored shadow follows the parameters' device
            self.ema.shadow = {n: t.to(self.ema.params[n].device) for n, t in self.ema.shadow.items()}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {n for n, _ in self._trainable_named_parameters()}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        if "hyper_parameters" in checkpoint:  # plain data only, so weights_only=True can load it
            checkpoint["hyper_parameters"] = _plain(dict(checkpoint["hyper_parameters"]))
        checkpoint["jagg"] = {
            "adapter": adapter_identity(self.policy),
            "ema": None if self.ema is None else self.ema.state_dict(),
            "rollouts": self.rollouts_done,
            "rng": {
                "torch": torch.get_rng_state(),
                "python": _python_rng_state_to_list(random.getstate()),
                "numpy": _numpy_rng_state_to_list(np.random.get_state()),
            },
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("jagg", {}).get("adapter")
        if saved is not None:  # checkpoints from before identities were recorded load on the key check below
            mismatch = identity_mismatch(saved, adapter_identity(self.policy))
            if mismatch:
                raise ValueError("checkpoint adapter does not match this module's (model.policy): " + "; ".join(mismatch))
        trainable = {n for n, _ in self._trainable_named_parameters()}
        missing = trainable - set(checkpoint["state_dict"])
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} LoRA weights (e.g. {sorted(missing)[0]}): was it written with "
                "the same policy.lora_targets / lora_rank?"
            )
        extra = checkpoint.get("jagg", {})
        self.rollouts_done = int(extra.get("rollouts", checkpoint.get("global_step", 0)))
        if self.ema is not None and extra.get("ema") is not None:
            self.ema.load_state_dict(extra["ema"])
            self._ema_restored = True
        rng = extra.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(_python_rng_state_from_list(rng["python"]))
            np.random.set_state(_numpy_rng_state_from_list(rng["numpy"]))


def _as_config(cls, value):
    """A private copy of a config dataclass from None (defaults), a dict (e.g. hyper-parameters of a
    checkpoint) or an instance (the signature's default instances are shared)."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return dataclasses.replace(value)


NOT_REBUILDABLE = "not rebuildable"


def describe_callable(fn, default) -> dict | str | None:
    """Plain-data record of an optimizer / scheduler factory: null for the default, class path + init args
    for ``functools.partial(cls, ...)``; anything else is recorded by name only."""
    if fn is None or fn is default:
        return None
    if isinstance(fn, functools.partial) and isinstance(fn.func, type) and not fn.args:
        return {"class_path": f"{fn.func.__module__}.{fn.func.__qualname__}", "init_args": _plain(fn.keywords)}
    return f"{NOT_REBUILDABLE}: {getattr(fn, '__qualname__', repr(fn))}"


def _rebuild_callable(field: str, value):
    """The factory from what :func:`describe_callable` recorded (or the callable itself)."""
    if value is None or callable(value):
        return value
    if isinstance(value, dict) and set(value) <= {"class_path", "init_args"}:
        cls = _import_class(value["class_path"], field)
        return functools.partial(cls, **(value.get("init_args") or {}))
    # only training needs it: warn and fall back rather than refuse to load a checkpoint for sampling
    rank_zero_warn(
        f"{field}: the checkpoint records {value!r}, which cannot be rebuilt from hyper-parameters; using the "
        f"default. Pass {field}=... to load_from_checkpoint to train on with your own."
    )
    return None


def _import_class(path: str, field: str) -> type:
    import importlib

    module_name, _, name = str(path).rpartition(".")
    if module_name not in sys.modules and not module_name.startswith("jagg_lightning."):  # a checkpoint is data
        raise ValueError(f"{field}: the checkpoint names {path!r}; import {module_name} first if you trust it")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{field}: cannot import {path!r} ({err})") from err


def _plain(value):
    """Dataclasses to dicts, containers recursively; anything else that is not plain data becomes its repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _python_rng_state_to_list(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng_state_from_list(state: list):
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def _numpy_rng_state_to_list(state) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_rng_state_from_list(state: list):
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def _check_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        lr = group.get("lr", 0)
        lr = float(lr) if not isinstance(lr, Tensor) else float(lr.item())
        _check(lr > 0, "optimizer lr (optimizer.init_args.lr)", "> 0", lr)
