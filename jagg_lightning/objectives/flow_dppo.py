"""Flow-DPPO (arXiv 2606.11025, "Flow-DPPO: divergence proximal policy optimization for diffusion models"): Flow-GRPO's
rollout, advantages and per-step log-prob ratios, with PPO's ratio clip replaced by an asymmetric mask on the EXACT
per-step divergence between the rollout's policy and the current one.

A stochastic step is Gaussian, z_{k+1} ~ N(mu_k, s_k^2), and theta_old and theta share s_k, so the KL between their
step distributions is exact and cheap (means over latent elements, s_k the step's std: for the SDE sigma_k sqrt(-dt),
verl-omni's ``std_dev_t * sqrt_dt``):

    D_k  = mean (mu_theta - mu_old)^2 / (2 s_k^2)                       (mu_old from the rollout's own velocity)
    rho  = exp(log pi_theta(z_{k+1} | z_k) - log pi_old)
    drop = D_k >= delta  and  ((A > 0 and rho > 1) or (A < 0 and rho < 1))
    L_ik = 0 if drop else -A_i rho,    + kl_beta KL_k(theta || ref)      (the ``grpo`` section's KL, as GRPO)

An update is blocked only where it is outside the trust region AND still moving away from theta_old; a corrective
update (rho back toward 1) always passes. delta = ``objective.dppo_threshold``. The mask is a constant in theta (its
gradient is 0), so L_ik is, like GRPO's, a function of v_k alone and JAGG folds its g_k = dL_k/dv_k unchanged: the
divergence and the mask of an interior step are evaluated at that step's own mean (its no-grad forward, or the
rollout's recorded velocity on the first update), only the Jacobian J_k is interpolated between the anchors. On a
velocity affine along the window's chord the interpolated mean (1 - alpha_k) mu_a + alpha_k mu_b IS the step's mean,
so there the mask, the divergence and the gradient are all exact (tests/unit/test_dgpo_flow_dppo.py);
:meth:`FlowDPPOUpdater.mask_agreement` measures, on a real model, how often the mask at the interpolated means agrees
with the exact per-step mask (``ExactnessDiagnostics`` logs it).

Transcribed from the released code: verl-omni (verl-project/verl-omni, commit
a1139bafffb5b9711f0a6b6edff8ecaa60bfff30, ``verl_omni/trainer/diffusion/diffusion_algos.py`` lines 361-443,
``FlowDPPOLoss.compute_loss``; defaults from ``verl_omni/trainer/config/diffusion/actor/diffusion_actor.yaml`` lines
50-54) and UniRL (Tencent-Hunyuan/UniRL, commit 0c97cfb8f458eb15582827ad844ea66b795c19a8,
``unirl/algorithms/flowdppo.py``, ``_flowdppo_kl_adv_loss`` and ``FlowDPPOConfig``), which agree: the mask is
``kl >= threshold`` (verl-omni; UniRL keeps ``kl < threshold``, the same set), threshold 1e-5, the divergence divided
by s_k^2 (``add_kl_coefficient`` true), the loss's advantages not clipped again (ours are the ``grpo`` section's group
advantages, clipped by ``grpo.adv_clip``), no reference KL by default (UniRL ``beta`` 0.0; here ``grpo.kl_beta``,
with ``grpo.kl_convention``). The paper's equation numbers could not be checked offline. ``grpo.clip_range`` is not
read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.method.grpo import StepLossStats, StepRecord, step_kl
from jagg_lightning.method.jagg import alphas
from jagg_lightning.method.sde import STEP_KINDS, step_distribution
from jagg_lightning.objectives.base import Objective
from jagg_lightning.training.update import Updater
from jagg_lightning.utils.batching import batch_slice
from jagg_lightning.utils.checks import check


def step_divergence(mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """D_k [B] = mean (mean - old_mean)^2 / (2 s^2): the exact KL of two Gaussian steps of one std."""
    s = std.flatten() if std.ndim else std
    return ((mean - old_mean) ** 2).flatten(1).mean(1) / (2 * s**2)


def dppo_mask(divergence: Tensor, ratio: Tensor, advantages: Tensor, threshold: float) -> Tensor:
    """The dropped samples [B] (bool): outside the trust region and moving away from theta_old."""
    outside = divergence >= threshold
    return outside & (((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0)))


def dppo_step_loss(v: Tensor, record: StepRecord, kind: str, noise_level: float, threshold: float,
                   kl_beta: float = 0.0, cps_log_prob: str = "gaussian",
                   kl_convention: str = "flow_grpo") -> tuple[Tensor, StepLossStats]:
    """Per-sample Flow-DPPO loss L_k [B] at velocity ``v`` and its statistics (``clipped``: the dropped samples;
    ``record.old_velocity``: the rollout's velocity, which gives mu_old)."""
    dist = step_distribution(record.z, v, record.t, record.t_next, kind, noise_level)
    log_ratio = dist.log_prob(record.z_next, cps_log_prob) - record.old_log_prob.to(dist.mean.dtype)
    ratio = torch.exp(log_ratio)
    adv = record.advantage.to(ratio.dtype).detach()
    with torch.no_grad():
        old_mean = step_distribution(record.z, record.old_velocity, record.t, record.t_next, kind, noise_level).mean
        divergence = step_divergence(dist.mean.detach(), old_mean, dist.std)
        dropped = dppo_mask(divergence, ratio.detach(), adv, threshold)
    # torch.where, not a product: exp of a large log-ratio may overflow, and inf * 0 is nan (the released code's note)
    policy_loss = torch.where(dropped, torch.zeros_like(ratio), -adv * ratio)
    loss = policy_loss  # grpo's per-step weights (rectification, 1 / (-dt)) are refused with this objective
    kl = torch.zeros_like(policy_loss)
    if kl_beta > 0:
        kl = step_kl(record, dist, kind, noise_level, kl_convention)
        loss = loss + kl_beta * kl
    stats = StepLossStats(policy_loss=policy_loss.detach(), kl=kl.detach(), ratio=ratio.detach(),
                          approx_kl=divergence, clipped=dropped.to(ratio.dtype), log_ratio=log_ratio.detach(),
                          old_log_prob=record.old_log_prob.detach().to(ratio.dtype))
    return loss, stats


class FlowDPPOUpdater(Updater):
    """GRPO's update (rollout, advantages, routing, the JAGG engine, fused or unfused) with Flow-DPPO's step loss."""

    reads_old_velocity = True

    def __init__(self, policy, sampling, grpo, jagg, memory, sampler, threshold: float):
        super().__init__(policy, sampling, grpo, jagg, memory, sampler)
        self.threshold = threshold

    def record_loss(self, v: Tensor, record: StepRecord):
        s, g = self.sampling, self.grpo
        return dppo_step_loss(v, record, s.step_kind, s.noise_level, self.threshold, g.kl_beta, s.cps_log_prob,
                              g.kl_convention)

    def mask_agreement(self, batch, windows, max_samples: int | None = None) -> float | None:
        """:func:`mask_agreement` on the first ``max_samples`` samples of ``batch`` (a ``RolloutBatch``) at the
        current theta."""
        index = torch.arange(batch.advantages.shape[0], device=batch.advantages.device)[:max_samples]
        mb, times = batch.trajectory.select(index), batch.trajectory.times.tolist()

        def record(k: int) -> StepRecord:
            return StepRecord(mb.latents[k], mb.latents[k + 1], times[k], times[k + 1], mb.log_probs[k],
                              batch.advantages[index], old_velocity=mb.velocities[k])

        return mask_agreement(self.sampler.velocity, mb.latents, mb.times, batch_slice(batch.cond, index), record,
                              windows, self.record_loss)


@torch.no_grad()
def mask_agreement(velocity_fn, latents: Tensor, times: Tensor, cond, record, windows, record_loss) -> float | None:
    """The share of (routed-window interior step, sample) pairs whose Flow-DPPO mask at the INTERPOLATED velocity
    (1 - alpha_k) v_a + alpha_k v_b -- hence mean, ratio and divergence -- equals the exact per-step mask at v_k's own
    forward; None without a routed window of >= 3 steps. ``record(k)``: step k's ``StepRecord`` (its old velocity the
    rollout's); ``record_loss(v, record) -> (loss, stats)``. No gradient, nothing written."""
    agree, total = 0, 0
    for w in [w for w in windows if w.routed and len(w.steps) > 2]:
        v = {k: velocity_fn(latents[k], times[k].expand(latents.shape[1]), cond) for k in w.steps}
        a, b = w.anchors
        for k, alpha in zip(w.interior, alphas(times, w.steps)[1:-1].tolist()):
            exact = record_loss(v[k], record(k))[1].clipped
            interpolated = record_loss((1 - alpha) * v[a] + alpha * v[b], record(k))[1].clipped
            agree += int((exact == interpolated).sum())
            total += exact.numel()
    return agree / total if total else None


class FlowDPPOObjective(Objective):
    name = "flow_dppo"

    def check(self, sampling, grpo, jagg) -> None:
        spec = STEP_KINDS[sampling.step_kind]
        check(not (spec.squared_error_log_prob and sampling.cps_log_prob == "squared_error"),
              "sampling.cps_log_prob", f"'gaussian' with objective.name 'flow_dppo' and sampling.step_kind "
              f"{sampling.step_kind!r} (its ratio and its divergence are of a Gaussian step)", sampling.cps_log_prob)
        for field in ("ratio_norm", "ratio_reweight", "temporal_rectification"):
            check(not getattr(grpo, field), f"grpo.{field}",
                  "false with objective.name 'flow_dppo' (its mask reads the policy's own ratio, unweighted)",
                  getattr(grpo, field))

    def updater(self, policy, sampling, grpo, jagg, memory, sampler) -> FlowDPPOUpdater:
        return FlowDPPOUpdater(policy, sampling, grpo, jagg, memory, sampler, self.config.dppo_threshold)
