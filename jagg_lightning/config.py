"""The configuration sections of :class:`jagg_lightning.module.JAGGModule` and their checks.

Every check runs when a section is built (or when the module is constructed, for checks that span sections),
before any model exists: a bad value fails with a message naming the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from jagg_lightning.checks import check, check_ints, one_of
from jagg_lightning.compiling import COMPILE_MODES
from jagg_lightning.dtypes import DTYPES
from jagg_lightning.estimators import ESTIMATORS
from jagg_lightning.full_finetune import check_trainable
from jagg_lightning.grpo import KL_CONVENTIONS, MULTI_REWARD, check_variant_fields, check_variants
from jagg_lightning.ode_solvers import check_ode_tail
from jagg_lightning.routing import ROUTING_SCORES
from jagg_lightning.sde import CPS_LOG_PROBS, STEP_KINDS, TRAINABLE_STEP_KINDS
from jagg_lightning.sde_window import check_sde_window


@dataclass
class PolicyConfig:
    """What to load and how to adapt it.

    family: the model family ("sd3", "flux", ...); None = detected from the pipeline's model_index.json
        (``_class_name``), or "sd3" when ``pretrained`` is None.
    pretrained: local directory or hub id of the family's pipeline; None builds the family's tiny model.
    lora_rank / lora_alpha / lora_targets: the peft LoRA; lora_targets None = the family's default
        (Flow-GRPO's targets for that family).
    guidance_scale: the family's guidance: CFG for SD3 (1.0 = off: a forward of n rows, not one of 2n), the
        embedded distilled guidance for FLUX.1-dev.
    resolution: the image size in pixels: ``[height, width]``, or one integer for a square; None = the family's
        native size (:func:`image_size`). Each side must be a multiple of the VAE factor times the patch side.
    dtype: dtype of the frozen weights; LoRA weights and SDE math stay float32 (float64 if chosen).
    gradient_checkpointing: recompute each transformer block's activations in backward (diffusers'
        non-reentrant checkpointing): less activation memory, about one extra block forward per backward.
    trainable: "lora" (a peft LoRA on the frozen transformer) or "full" (every transformer weight trained, Wan2.2's
        two experts' both; float32 master weights; ``dtype`` is then the compute dtype, see docs/full_finetuning.md).
    trainable_modules: with "full", module-name patterns (a name, a dotted suffix of one, or an fnmatch
        pattern) to train only those modules in full; null = every weight. Each must match some module.
    reference_offload: with "full" and kl_beta > 0, keep the frozen KL reference copy on the CPU between uses.
    num_frames: video families only (Wan): frames per video, 4 k + 1; None = the family's default (81; the twin 9).
        An image family refuses any other value than None or 1.
    guidance_scale_2: two-expert video families only (Wan2.2): the low-noise expert's CFG; None = guidance_scale.
    adapter: an exported LoRA (``LoRAExport``'s folder, its ``peft/`` or ``diffusers/`` part) to start from:
        its rank, alpha and targets replace lora_rank / lora_alpha / lora_targets (evaluate, sample or train on);
        Wan2.2: ``transformer_2`` loads the ``peft_transformer_2/`` or ``diffusers_transformer_2/`` part beside it.
    seed: a policy built on its own: the tiny model's init (seed) and the LoRA init (seed + 1, + 2 for Wan2.2's
        ``transformer_2``). In a ``JAGGModule`` deprecated: ``model.seed`` (0 here means that root seed).
    compile: null (eager) or "repeated_blocks": each trained network's repeated block compiled once after the LoRA
        is injected (:mod:`jagg_lightning.compiling`; a policy built on its own: ``compiling.compile_policy``).

    The checks here read nothing but the fields. The family name, the local paths (``pretrained``, ``adapter``:
    found from any directory, :mod:`jagg_lightning.assets`; ``pretrained: digits`` is the shipped test bed) and what a
    pipeline folder's files say are checked by :func:`jagg_lightning.policy_checks.check_policy`, which
    ``JAGGModule`` calls with its other checks, before any model is built.
    """

    pretrained: str | None = None
    family: str | None = None
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: list[str] | None = None
    guidance_scale: float = 4.5
    negative_prompt: str = ""
    max_sequence_length: int = 128
    resolution: int | list[int] | None = None
    dtype: str = "float32"
    load_t5: bool = True
    seed: int = 0  # deprecated in a JAGGModule: model.seed
    gradient_checkpointing: bool = False
    trainable: str = "lora"
    trainable_modules: list[str] | None = None
    reference_offload: bool = False
    num_frames: int | None = None
    guidance_scale_2: float | None = None
    adapter: str | None = None
    compile: str | None = None

    def __post_init__(self):
        def integer(name, value, allowed, ok):
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"policy.{name} must be {allowed}, got {value!r}")

        integer("lora_rank", self.lora_rank, "an integer >= 1", lambda v: v >= 1)
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)) or not self.lora_alpha > 0:
            raise ValueError(f"policy.lora_alpha must be a number > 0, got {self.lora_alpha!r}")
        if not isinstance(self.guidance_scale, (int, float)) or self.guidance_scale < 1.0:
            raise ValueError(f"policy.guidance_scale must be >= 1.0 (1.0 = off), got {self.guidance_scale!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"policy.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        integer("max_sequence_length", self.max_sequence_length, "an integer >= 1", lambda v: v >= 1)
        if self.resolution is not None:  # the multiple of VAE factor x patch size is checked against the model
            check_resolution_field(self.resolution)
        integer("seed", self.seed, "an integer", lambda v: True)
        if self.num_frames is not None:  # the 4 k + 1 rule is the VAE's, checked by the family
            integer("num_frames", self.num_frames, "an integer >= 1 or null", lambda v: v >= 1)
        if self.guidance_scale_2 is not None and (isinstance(self.guidance_scale_2, bool) or not isinstance(
                self.guidance_scale_2, (int, float)) or self.guidance_scale_2 < 1.0):
            raise ValueError(f"policy.guidance_scale_2 must be >= 1.0 or null, got {self.guidance_scale_2!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"policy.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")
        if self.lora_targets is not None and (isinstance(self.lora_targets, str) or not self.lora_targets or not all(
                isinstance(t, str) and t for t in self.lora_targets)):
            raise ValueError("policy.lora_targets must be a non-empty list of module names or null (the family's "
                             f"default), got {self.lora_targets!r}")
        check(self.compile is None or self.compile in COMPILE_MODES, "policy.compile",
              f"null (eager) or {one_of(COMPILE_MODES)} (torch.compile of each repeated block)", self.compile)
        check_trainable(self, PolicyConfig)


def check_resolution_field(resolution) -> None:
    """``policy.resolution``: an integer >= 1 or a ``[height, width]`` pair of them (pixels)."""
    pair = isinstance(resolution, (list, tuple)) and len(resolution) == 2
    sides = list(resolution) if pair else [resolution]
    if not (pair or isinstance(resolution, int)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sides):
        raise ValueError("policy.resolution must be [height, width] (integers >= 1, pixels), one integer (a square) "
                         f"or null, got {resolution!r}")


def image_size(resolution, native) -> tuple[int, int]:
    """(height, width) in pixels of ``policy.resolution`` -- ``[H, W]``, one side of a square, or None for ``native``
    (itself an integer side or an ``(H, W)`` pair: the family pipeline's default size)."""
    size = native if resolution is None else resolution
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


@dataclass
class SamplingConfig:
    """Rollouts. ``group_size`` K samples per prompt; the first ``trained_steps`` steps get a loss term
    (default all but the last, nearly clean one); ``step_kind`` is the stochastic step of trained steps;
    ``ode_after_trained`` samples the rest with Euler (``ode_solver`` "euler") or DPM-Solver++(2M) ("dpmpp_2m"), in
    ``ode_steps`` steps (null: the schedule's remaining steps; :mod:`jagg_lightning.ode_solvers`). ``shift`` None = the
    model's.

    ``cps_log_prob``: "squared_error" (Flow-GRPO's CPS -mean((x - mu)^2)) or "gaussian" (the true density).
    SDE window (Flow-GRPO-Fast / MixGRPO): with ``sde_window_size`` set, only that many consecutive steps
    are stochastic (``step_kind``) and trained, every other step is ODE; the window lies inside
    ``sde_window_range`` = [lo, hi) and its start is drawn per rollout (``sde_window_schedule`` "random")
    or slides by ``sde_window_stride`` every ``sde_window_shift_every`` rollouts ("progressive", MixGRPO);
    ``sde_window_draw`` "group" draws a 1-step window per prompt instead of per rollout (Flash-GRPO's iso-temporal groups).
    ``train_guidance_scale`` overrides ``policy.guidance_scale`` in rollouts and training; 1.0 = no guidance
    (Flow-GRPO's CFG-free training; evaluation keeps ``evaluation.guidance_scale``).

    Deprecated (each still works, with one line naming its new key; :mod:`jagg_lightning.old_keys`): ``seed``
    (the rollout stream of ``model.seed``), ``window_fraction`` (``jagg.window_fraction``)."""

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


@dataclass
class GRPOConfig:
    """The GRPO update: PPO clip range, KL weight beta (0 = no reference pass), advantage clip and normalisation, inner
    epochs over each rollout, samples per micro-batch, micro-batches per optimizer step (None = one step per inner
    epoch), the gradient-norm clip (None = off). Off by default: GRPO-Guard's ``ratio_norm`` / ``ratio_reweight``,
    Flash-GRPO's ``temporal_rectification`` (grpo.py).

    ``adv_std``: "global" (Flow-GRPO's default ``sample.global_std``: each group's mean, the std of every
    reward of the step over all processes) or "group" (the group's own std, DanceGRPO).
    ``kl_convention``: "flow_grpo" divides the KL by 2 sigma_k^2 (Flow-GRPO), "exact" by 2 s_k^2.
    ``std_ddof``: 0 (np.std, Flow-GRPO) or 1 (unbiased, DanceGRPO) for the advantage std; ``adv_eps`` is
    added to it. ``skip_zero_advantage``: with kl_beta 0, samples whose advantage is exactly 0 (a group
    of equal rewards) get no forward or backward; the update is the same. ``multi_reward`` (several rewards,
    ``WeightedReward``): "weighted_sum" group-normalises the weighted sum of the rewards; "per_reward"
    group-normalises each reward on its own and sums the weighted advantages (``grpo.combined_advantages``).
    ``max_nonfinite_in_a_row``: an update with a non-finite reward, advantage, per-sample loss or gradient is
    skipped (weights, optimizer, EMA and scheduler untouched; ``train/skipped_nonfinite`` counts it); this many
    skipped in a row stop the run, naming where the first appeared (1: stop at the first; ``nonfinite.py``)."""

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
    max_nonfinite_in_a_row: int = 10
    ratio_norm: bool = False
    ratio_reweight: bool = False
    temporal_rectification: bool = False

    def __post_init__(self):
        check_ints(self, "grpo", "inner_epochs", "train_batch_size", "micro_batches_per_update", "std_ddof",
                   "max_nonfinite_in_a_row")
        for name in ("clip_range", "adv_clip", "adv_eps"):
            check(getattr(self, name) > 0, f"grpo.{name}", "> 0", getattr(self, name))
        check(self.kl_beta >= 0, "grpo.kl_beta", ">= 0", self.kl_beta)
        check(self.adv_std in ("group", "global"), "grpo.adv_std", "'group' or 'global'", self.adv_std)
        check(self.inner_epochs >= 1, "grpo.inner_epochs", ">= 1", self.inner_epochs)
        check(self.train_batch_size >= 1, "grpo.train_batch_size", ">= 1", self.train_batch_size)
        check(self.micro_batches_per_update is None or self.micro_batches_per_update >= 1,
              "grpo.micro_batches_per_update", ">= 1 or null", self.micro_batches_per_update)
        check(self.max_grad_norm is None or self.max_grad_norm > 0, "grpo.max_grad_norm", "> 0 or null",
              self.max_grad_norm)
        check(self.kl_convention in KL_CONVENTIONS, "grpo.kl_convention", "'flow_grpo' or 'exact'", self.kl_convention)
        check(self.std_ddof in (0, 1), "grpo.std_ddof", "0 (np.std) or 1 (unbiased)", self.std_ddof)
        check(self.max_nonfinite_in_a_row is not None and self.max_nonfinite_in_a_row >= 1, "grpo.max_nonfinite_in_a_row",
              ">= 1 (skipped non-finite updates in a row that stop the run; 1: the first)", self.max_nonfinite_in_a_row)
        check(self.multi_reward in MULTI_REWARD, "grpo.multi_reward", "'weighted_sum' (normalise the weighted sum of "
              "the rewards) or 'per_reward' (normalise each reward, then sum the weighted advantages)", self.multi_reward)
        check_variant_fields(self)


@dataclass
class JAGGConfig:
    """Windows of ``window_size`` trained steps (``chained``: neighbours share an anchor); the
    ``jagg_frac`` share with the smallest ``routing`` score use JAGG (``residual``: the
    velocity-interpolation residual; ``cosine``: 1 - cos(v_k - v_a, v_b - v_a), the published rule; ``random``:
    a uniform draw seeded by (seed, step), the baseline; a window above ``score_limit`` stays exact);
    ``estimator``: ``paper`` (the two-anchor interpolation) or ``control_variate`` (unbiased: a routed window
    also gets its exact gradient with probability ``control_p`` and the estimate becomes
    JAGG + (B / p)(exact - JAGG), B ~ Bernoulli(p) seeded by (seed, step), docs/method.md §8);
    ``cache_interior`` reuses the rollout's velocities for interior steps while theta = theta_old;
    ``window_fraction``: the share of the windows trained per rollout, drawn from (seed, step) (DanceGRPO's
    ``timestep_fraction`` at window granularity).

    ``fused_rollout`` (on-policy fused mode, docs/method.md §7): the rollout runs every step that will get a
    backward WITH grad and keeps its graph; as each rollout micro-batch ends it is decoded, scored, its
    groups' advantages taken, its windows routed (on its own velocities), and ONE backward runs over the
    kept graphs -- no forward is repeated. Needs one optimizer step per rollout and whole groups per
    rollout micro-batch (what it keeps: ``memory``, :class:`MemoryConfig`). ``interpolate_reference`` (an
    approximation, off by default): with kl_beta > 0 the reference velocity of a routed window's interior
    step is interpolated from its anchors', v_ref,k ~ (1 - alpha_k) v_ref,a + alpha_k v_ref,b, instead of
    a forward with the adapter off (error measured in benchmarks/kl_reference.py).

    Deprecated (each still works, with one line naming its new key; :mod:`jagg_lightning.old_keys`):
    ``low_memory`` (``memory.anchors: split``), ``memory_budget_mb`` (``memory.budget_mb``), ``fused_samples``
    (``memory.fused_samples``), ``fused_exact_interior`` (``memory.fused_interior_graphs``)."""

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
        check_ints(self, "jagg", "window_size", "fused_samples")
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
        check(self.fused_samples is None or self.fused_samples >= 1, "jagg.fused_samples", ">= 1 or null "
              "(deprecated: memory.fused_samples)", self.fused_samples)
        check(self.memory_budget_mb is None or self.memory_budget_mb > 0, "jagg.memory_budget_mb", "> 0 or null "
              "(deprecated: memory.budget_mb)", self.memory_budget_mb)


ANCHOR_PASSES = ("auto", "batched", "split")


@dataclass
class MemoryConfig:
    """What the update's gradient passes may hold in activation memory, and what it trades for that (docs/method.md
    §5 and §7). Each field means one thing:

    ``budget_mb``: the activation memory ONE gradient pass may keep -- and, in the fused mode, the kept graphs of
    one rollout micro-batch -- measured per sample (:meth:`~jagg_lightning.sampler.Sampler.activation_bytes`); it
    sets how many samples share a pass (:func:`~jagg_lightning.passes.pass_plan`). Null: no limit (all of a
    micro-batch's samples in one pass).
    ``anchors``: how a JAGG window's two anchors run: ``batched`` (one forward of both, one backward: about twice
    one step's activations), ``split`` (one forward each, still one backward per window in the fused mode, two
    passes otherwise: exact GRPO's peak), ``auto`` (batched without a budget; under one, the layout with fewer
    passes).
    ``fused_samples`` (fused mode): how many samples of each rollout micro-batch keep their graphs (the rest are
    updated unfused, their anchors re-run); null: as many as ``budget_mb`` holds, all without a budget.
    ``fused_interior_graphs`` (fused mode): also keep the graphs of interior steps of windows that may stay exact
    or be corrected by the estimator (else those are re-run after the micro-batch, as unfused).

    Not here: ``jagg.cache_interior`` (the rollout records the velocities in any case -- routing reads them --
    so reusing them saves forwards, not memory)."""

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


@dataclass
class EvalConfig:
    """``validate`` / ``test`` / ``predict`` (and ``val_check_interval`` during fit): deterministic ODE (Euler)
    sampling with ``num_steps`` steps and classifier-free guidance ``guidance_scale`` (null = the policy's),
    ``samples_per_prompt`` images per prompt whose noise depends on (seed, prompt index, sample) only, so
    every evaluation sees the same noise; the first ``grid_prompts`` prompts form the logged sample grid.
    ``seed``: null = the module's root seed (``model.seed``); a number fixes the evaluation noise apart from it."""

    num_steps: int = 20
    guidance_scale: float | None = None
    samples_per_prompt: int = 1
    seed: int | None = None
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
    check(jagg.window_size <= sampling.num_trained or sampling.num_trained == 1, "jagg.window_size",
          f"<= {trained_name} ({sampling.num_trained})", jagg.window_size)  # 1 step: its own exact window
    if jagg.fused_rollout:
        check_fused(sampling, grpo)
    check_variants(grpo, sampling.step_kind, sampling.cps_log_prob)
    if sampling.sde_window_draw == "group":  # per-row trained steps: the unfused update groups rows by their step
        why = "with sampling.sde_window_draw 'group' (each group trains its own step)"
        check(not jagg.fused_rollout, "jagg.fused_rollout", f"false {why}", jagg.fused_rollout)
        check(grpo.kl_beta == 0, "grpo.kl_beta", f"0 {why}: the KL reference is taken per rollout step", grpo.kl_beta)


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


def as_config(cls, value):
    """A private copy of a config dataclass from None (defaults), a dict (e.g. a checkpoint's hyper-parameters) or an
    instance (the signature's default instances are shared)."""
    if value is None or isinstance(value, dict):
        return cls(**(value or {}))
    if not isinstance(value, cls):
        raise TypeError(f"expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return dataclasses.replace(value)
