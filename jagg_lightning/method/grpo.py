"""GRPO pieces: group-normalised advantages and the per-step clipped surrogate with a KL term.

A *group* is the K samples drawn for one prompt. The advantage of sample i in group g is

    A_i = clip((r_i - mean_g) / (std + eps), -adv_clip, adv_clip)

with ``std`` the group's (default) or the whole batch's ("global") standard deviation, with ``ddof``
0 by default (numpy's ``np.std``, as Flow-GRPO's stat tracker; 1 = the unbiased std, as DanceGRPO's
``torch.std``). Across processes the global one comes from all-reduced count, sum and sum of squares
(:func:`global_reward_std`), so one process on N prompts and P processes on N / P each normalise alike.
A group whose rewards are all equal gets exactly zero advantage.

The loss of sample i at trained step k is written as a function of the velocity v_k alone
(every other quantity is fixed by the rollout record), so g_k = dL_k/dv_k is one cheap autograd call:

    rho  = exp(log pi_theta(z_{k+1} | z_k) - log pi_old)
    L_ik = max(-A_i rho, -A_i clip(rho, 1 - eps, 1 + eps)) + beta KL_k,
    KL_k = ||mu_theta - mu_ref||^2 / (2 sigma_k^2)     ("flow_grpo", default: Flow-GRPO's std_dev_t)
    KL_k = ||mu_theta - mu_ref||^2 / (2 s_k^2)         ("exact": the KL of the two step Gaussians)

(squared norms are means over latent elements; for the SDE s_k^2 = sigma_k^2 (-dt), for CPS the two
coincide). The log-prob convention of CPS steps is ``cps_log_prob`` (see sde.py).

Two published variants change L_ik, each a function of v_k alone (so JAGG folds their g_k = dL_k/dv_k unchanged):

* GRPO-Guard (Wang et al., arXiv 2510.22319). With Delta = mu_theta - mu_old (mu_old from the rollout's own velocity)
  the log-ratio of a Gaussian step is log rho = mean(eps Delta) / s - mean(Delta^2) / (2 s^2) (eps the step's standard
  noise, s its std): its mean under the rollout's noise is -b, b = mean(Delta^2) / (2 s^2) > 0 (the "left-shifted"
  ratio whose mean falls below 1) and its spread ~ |Delta| / s differs by step. ``ratio_norm`` (RatioNorm) re-centres
  it PER SAMPLE (Flow-GRPO issue #244: b of each sample, not a batch mean) and scales it by s,
        log rho_guard = (log rho + b) s = mean(eps Delta)           (:func:`guarded_log_ratio`),
  so every step's ratio has mean 1 and the same spread; ``ratio_reweight`` (the gradient reweighting) multiplies the
  step's policy term by 1 / (-dt), which makes the gradient scale in v the same across steps
  ((1 + sigma^2 (1 - t) / (2 t)) for the SDE). Transcribed from verl-omni's GRPO-Guard page (``GRPOGuardLoss``:
  b_t, rho_t = exp((log p_theta - log p_old + b_t) sqrt(-dt) sigma_t), L_t = 1 / (sqrt(-dt))^2 E[max(...)]);
  Flow-Factory's ``GRPOGuardTrainer`` computes the same rho (equation numbers of the paper: not read here, offline).
* Flash-GRPO's temporal gradient rectification (He et al., arXiv 2605.15980): the per-element gradient of
  log pi in v is -c_k eps at theta = theta_old, with c_k = |dmu/dv| / s_k for a Gaussian step -- for the SDE
  c_k = sqrt(-dt) / sigma_k + sigma_k sqrt(-dt) (1 - t_k) / (2 t_k) (the authors' ``sde_step_with_logprob``
  returns 1 / c_k) -- so the policy term of step k is weighted by (1 / c_k) / mean_j (1 / c_j)
  (:func:`gradient_scale`, :func:`rectification_weights`), which gives every step the same gradient scale.

Plain torch: no Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from jagg_lightning.method.sde import STEP_KINDS, LogProbConvention, StepKind, step_distribution
from jagg_lightning.utils.checks import check
from jagg_lightning.utils.dtypes import compute_dtype

KLConvention = Literal["flow_grpo", "exact"]
KL_CONVENTIONS = ("flow_grpo", "exact")


AllReduce = Callable[[Tensor], Tensor]
"""Sums a tensor over every process and returns the sum (e.g. ``torch.distributed.all_reduce``)."""


def global_reward_std(rewards: Tensor, ddof: int = 1, all_reduce: AllReduce | None = None) -> Tensor:
    """Standard deviation of the rewards of every process, from ONE all-reduce of (n, S1, S2):

        n = sum_p n_p,  S1 = sum_p sum_i r_i,  S2 = sum_p sum_i r_i^2,
        std = sqrt((S2 - S1^2 / n) / (n - ddof))

    The sums are float64, so the cancellation in S2 - S1^2 / n costs about 1e-16 (mean / std)^2 in
    relative variance (about 1e-12 for rewards whose mean is 100 standard deviations). ``ddof`` is
    the same convention as ``Tensor.std(correction=ddof)``; ``all_reduce`` None = this process only.
    """
    r = rewards.detach().to(torch.float64).flatten()
    moments = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device), r.sum(), (r * r).sum()])
    if all_reduce is not None:
        moments = all_reduce(moments)
    n, s1, s2 = moments.unbind()
    if float(n) - ddof <= 0:
        raise ValueError(f"global reward std needs more than ddof={ddof} rewards, got {int(n)}")
    var = ((s2 - s1 * s1 / n) / (n - ddof)).clamp_min(0.0)
    return var.sqrt().to(rewards.dtype)


def group_advantages(
    rewards: Tensor,
    std: Literal["group", "global"] = "global",
    eps: float = 1e-4,
    adv_clip: float = 5.0,
    ddof: int = 0,
    all_reduce: AllReduce | None = None,
) -> Tensor:
    """Advantages for rewards laid out [groups, K]; returns the same shape.

    Each group is centred on its own mean; ``std`` "global" (Flow-GRPO's default ``global_std``)
    divides by the std of every reward, "group" by the group's own.
    ``ddof`` is the std's delta degrees of freedom (0: np.std, Flow-GRPO; 1: unbiased, DanceGRPO).
    A group whose rewards are all equal gets exactly zero (set explicitly: a float mean of equal
    values need not equal them). With ``std="global"``, ``all_reduce`` (a sum over processes) makes
    the statistic span every process (see :func:`global_reward_std`).
    """
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, K] with K >= 2, got shape {tuple(rewards.shape)}")
    if std not in ("group", "global"):
        raise ValueError(f"std must be 'group' or 'global', got {std!r}")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof!r}")
    rewards = rewards.to(compute_dtype(rewards))
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std == "group":
        scale = rewards.std(dim=1, keepdim=True, correction=ddof)
    else:
        scale = global_reward_std(rewards, ddof, all_reduce)
    advantages = (centred / (scale + eps)).clamp(-adv_clip, adv_clip)
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(advantages), advantages)


MULTI_REWARD = ("weighted_sum", "per_reward")


def combined_advantages(
    rewards: Tensor,
    components: dict[str, Tensor],
    weights: dict[str, float] | None,
    group_size: int,
    mode: Literal["weighted_sum", "per_reward"] = "weighted_sum",
    std: Literal["group", "global"] = "global",
    eps: float = 1e-4,
    adv_clip: float = 5.0,
    ddof: int = 0,
    all_reduce: AllReduce | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages [N] (prompt-major) of a step's rewards, and each weighted reward's additive part of them [N].

    ``rewards`` is the reward's total, sum_n w_n r_n over the ``components`` named in ``weights`` (None:
    unknown, e.g. a served weighted reward; no parts then).
    "weighted_sum": the total is group-normalised (:func:`group_advantages`, unchanged); reward n's part is
    w_n (r_n - mean_g r_n) / (std(total) + eps).
    "per_reward": each reward is group-normalised on its own (its own std, unclipped), A_n, and the
    advantage is clip(sum_n w_n A_n, +-adv_clip); reward n's part is w_n A_n. A reward with a small spread then
    counts as much as one with a large spread. In both modes the parts sum to the advantage before the clip,
    and a group where every reward ties gets exactly 0.
    """
    if mode not in MULTI_REWARD:
        raise ValueError(f"mode must be one of {MULTI_REWARD}, got {mode!r}")
    names = list(weights or {})
    missing = [n for n in names if n not in components]
    if missing:
        raise ValueError(f"rewards {missing} are weighted but not among the components {sorted(components)}")

    def grouped(r: Tensor) -> Tensor:
        return r.reshape(-1, group_size)

    if mode == "per_reward":
        if not names:
            raise ValueError("per-reward advantages need the weight of every reward")
        parts = {n: weights[n] * group_advantages(grouped(components[n]), std, eps, math.inf, ddof, all_reduce).flatten()
                 for n in names}
        total = torch.stack(list(parts.values())).sum(0)
        tied = torch.stack([(grouped(components[n]) == grouped(components[n])[:, :1]).all(dim=1) for n in names]).all(0)
        advantages = torch.where(tied.repeat_interleave(group_size), torch.zeros_like(total),
                                 total.clamp(-adv_clip, adv_clip))
        return advantages, parts
    advantages = group_advantages(grouped(rewards), std, eps, adv_clip, ddof, all_reduce).flatten()
    if len(names) < 2:
        return advantages, dict.fromkeys(names, advantages)
    total = grouped(rewards).to(advantages.dtype)
    scale = (total.std(dim=1, keepdim=True, correction=ddof) if std == "group"
             else global_reward_std(total, ddof, all_reduce)) + eps
    parts = {n: (weights[n] * (grouped(components[n]) - grouped(components[n]).mean(dim=1, keepdim=True)).to(scale)
                 / scale).flatten() for n in names}
    return advantages, parts


@dataclass
class StepRecord:
    """What the rollout fixed for one trained step of a micro-batch of B samples."""

    z: Tensor  # [B, ...] latent at t
    z_next: Tensor  # [B, ...] sampled latent at t_next
    t: float
    t_next: float
    old_log_prob: Tensor  # [B]
    advantage: Tensor  # [B]
    ref_velocity: Tensor | None = None  # [B, ...], adapter off; needed when kl_beta > 0
    old_velocity: Tensor | None = None  # [B, ...], the rollout's (theta_old); needed by ratio_norm / ratio_reweight
    policy_weight: float = 1.0  # the policy term's weight (Flash-GRPO's temporal rectification)


@dataclass
class StepLossStats:
    """Detached diagnostics of one step's loss, per sample [B]."""

    policy_loss: Tensor
    kl: Tensor
    ratio: Tensor
    approx_kl: Tensor
    clipped: Tensor
    log_ratio: Tensor | None = None  # log pi_theta - log pi_old
    old_log_prob: Tensor | None = None


def step_loss(
    v: Tensor,
    record: StepRecord,
    kind: StepKind = "sde",
    noise_level: float = 0.7,
    clip_range: float = 1e-4,
    kl_beta: float = 0.0,
    cps_log_prob: LogProbConvention = "squared_error",
    kl_convention: KLConvention = "flow_grpo",
    ratio_norm: bool = False,
    ratio_reweight: bool = False,
) -> tuple[Tensor, StepLossStats]:
    """Per-sample loss L_k [B] at velocity ``v`` and its detached statistics (conventions: module docstring;
    ``ratio_norm``: GRPO-Guard's RatioNorm, :func:`guarded_log_ratio`; ``ratio_reweight``: its policy term x 1 / (-dt);
    ``record.policy_weight``: the policy term's weight, Flash-GRPO's rectification)."""
    if kl_convention not in KL_CONVENTIONS:
        raise ValueError(f"kl_convention must be one of {KL_CONVENTIONS}, got {kl_convention!r}")
    dist = step_distribution(record.z, v, record.t, record.t_next, kind, noise_level)
    log_prob = dist.log_prob(record.z_next, cps_log_prob)
    log_ratio = log_prob - record.old_log_prob.to(log_prob.dtype)
    clip_log_ratio = log_ratio
    if ratio_norm:
        if record.old_velocity is None:
            raise ValueError("grpo.ratio_norm needs the rollout's velocity of every trained step")
        old_mean = step_distribution(record.z, record.old_velocity, record.t, record.t_next, kind, noise_level).mean
        clip_log_ratio = guarded_log_ratio(log_ratio, dist.mean, old_mean.detach(), dist.std)
    ratio = torch.exp(clip_log_ratio)
    adv = record.advantage.to(log_prob.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped)
    weight = record.policy_weight / (record.t - record.t_next) if ratio_reweight else record.policy_weight
    loss = policy_loss if weight == 1.0 else weight * policy_loss
    kl = torch.zeros_like(policy_loss)
    if kl_beta > 0:
        kl = step_kl(record, dist, kind, noise_level, kl_convention)
        loss = loss + kl_beta * kl
    stats = StepLossStats(
        policy_loss=policy_loss.detach(),
        kl=kl.detach(),
        ratio=ratio.detach(),
        approx_kl=(0.5 * log_ratio**2).detach(),  # of the policy's own ratio, whatever the clip sees
        clipped=((ratio - 1.0).abs() > clip_range).detach().to(log_prob.dtype),
        log_ratio=log_ratio.detach(),
        old_log_prob=record.old_log_prob.detach().to(log_prob.dtype),
    )
    return loss, stats


def step_kl(record: StepRecord, dist, kind: StepKind, noise_level: float, kl_convention: str) -> Tensor:
    """Per sample, the KL of the step's Gaussian to the reference policy's (same std):
    ||mu_theta - mu_ref||^2 (mean over the latent) / (2 s^2), s = sigma_t (Flow-GRPO's convention) or the step's std."""
    if record.ref_velocity is None:
        raise ValueError("kl_beta > 0 needs the reference velocity of every trained step")
    ref = step_distribution(record.z, record.ref_velocity, record.t, record.t_next, kind, noise_level)
    scale = dist.sigma if kl_convention == "flow_grpo" else dist.std
    return ((dist.mean - ref.mean.detach()) ** 2).mean(dim=tuple(range(1, dist.mean.ndim))) / (2 * scale.flatten() ** 2)


def guarded_log_ratio(log_ratio: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's RatioNorm [B] (arXiv 2510.22319; module docstring): (log rho + b) s with
    b = mean((mean - old_mean)^2) / (2 s^2) of EACH sample and s the step's std. At theta = theta_old it is 0."""
    s = std.flatten() if std.ndim else std
    b = ((mean - old_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * s**2)
    return (log_ratio + b) * s


def gradient_scale(kind: StepKind, t: float, t_next: float, noise_level: float,
                   cps_log_prob: LogProbConvention = "squared_error") -> float:
    """c_k of one step: the per-element gradient of log pi(z_{k+1} | z_k) in v at theta = theta_old is -c_k eps / n
    (eps the step's standard noise, n the latent's elements; the log-prob is a mean). mu is affine in v with one
    scalar coefficient dmu/dv, and d log pi / dmu = eps / s (Gaussian) or 2 s eps (Flow-GRPO's CPS squared error), so
    c_k = |dmu/dv| / s or 2 s |dmu/dv|. For the SDE: sqrt(-dt) / sigma_k + sigma_k sqrt(-dt) (1 - t_k) / (2 t_k),
    the factor Flash-GRPO (arXiv 2605.15980) rectifies. Computed in float64."""
    z0, one = torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    at_one = step_distribution(z0, one, t, t_next, kind, noise_level)
    dmu_dv = float(at_one.mean - step_distribution(z0, z0, t, t_next, kind, noise_level).mean)
    s = float(at_one.std)
    if s <= 0:
        raise ValueError(f"step {t} -> {t_next} of kind {kind!r} is deterministic: it has no gradient scale")
    squared = STEP_KINDS[kind].squared_error_log_prob and cps_log_prob == "squared_error"
    return abs(dmu_dv) * 2 * s if squared else abs(dmu_dv) / s


def rectification_weights(times: Sequence[float], steps: Sequence[int], candidates: Sequence[int], kind: StepKind,
                          noise_level: float, cps_log_prob: LogProbConvention = "squared_error") -> dict[int, float]:
    """Flash-GRPO's temporal gradient rectification: step k's policy term weighted by (1 / c_k) / mean_j (1 / c_j),
    the mean over the ``candidates`` (every step a rollout may train: the weights average 1 over a uniform draw of
    the step, whatever the batch; the authors' script divides by the mean over its micro-batch, all processes)."""
    inverse = {k: 1.0 / gradient_scale(kind, times[k], times[k + 1], noise_level, cps_log_prob) for k in candidates}
    norm = sum(inverse.values()) / len(inverse)
    return {k: (inverse[k] if k in inverse else 1.0 / gradient_scale(kind, times[k], times[k + 1], noise_level,
                                                                        cps_log_prob)) / norm for k in steps}


def check_variant_fields(grpo) -> None:
    """The ``grpo`` section's variant switches (GRPO-Guard, Flash-GRPO): each true or false."""
    for name in ("ratio_norm", "ratio_reweight", "temporal_rectification"):
        check(isinstance(getattr(grpo, name), bool), f"grpo.{name}", "true or false", getattr(grpo, name))


def check_variants(grpo, step_kind: StepKind, cps_log_prob: LogProbConvention) -> None:
    """RatioNorm re-centres a Gaussian log-ratio: refused on Flow-GRPO's CPS squared-error "log-prob"."""
    squared = STEP_KINDS[step_kind].squared_error_log_prob and cps_log_prob == "squared_error"
    check(not (grpo.ratio_norm and squared), "grpo.ratio_norm", f"false with sampling.step_kind {step_kind!r} and "
          "sampling.cps_log_prob 'squared_error' (RatioNorm re-centres a Gaussian log-ratio: use cps_log_prob "
          "'gaussian' or an SDE step kind)", grpo.ratio_norm)
