"""AWM, Advantage Weighted Matching (Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in
Diffusion Models", arXiv 2509.25050): the pretraining flow-matching loss on the rollout's samples, each weighted by
its group advantage.

At a point z = (1 - t) x0 + t eps the conditional flow-matching target is u = eps - x0, and the matching
"log-likelihood" is log p_theta = -w(t) mean (v_theta(z, t) - u)^2 with w(t) = ``objective.awm_weighting`` (1, t or
t^2). AWM maximises the advantage-weighted log-likelihood of the rollout's samples (the paper's policy-gradient
objective with the score-matching surrogate of log pi), so per point

    l = A w(t) mean (v_theta(z, t) - (eps - x0))^2 + kl_beta mean (v_theta - v_ref)^2

or with ``awm_weighting`` "ghuber" (the setting Flow-Factory's SD3.5 recipe uses to reproduce the paper's PickScore
run) the generalised-Huber error t ((mse + 1e-10)^p - 1e-10^p) / p in place of w(t) mse

(the transcription follows the paper's §3 loss as Flow-Factory's ``trainers/awm.py`` implements it, where the
paper's equation numbers could not be checked offline; that code also wraps exp(log p - log p_old) in a PPO clip,
whose gradient on the first update after a rollout -- ratio exactly 1 -- is this one: with one optimizer step per
rollout, as the presets use, they are the same update). No theta_old: the rollout samples theta, and the loss reads
no old velocity. Samples with A = 0 contribute only the KL term.

A is the group advantage clipped to +-``grpo.adv_clip``; with ``objective.awm_advantage: scaled`` it is divided by
``adv_clip`` as well, the AWM code's clamp(A, -5, 5) / 5 (as issue 55 read that code; with adv_clip 5 the
default ``clipped`` makes the policy term 5x the code's against the KL term and the gradient-norm clip). The code's
noise levels, one schedule time per stratum of its indices, are ``objective.levels: stratified``.
"""

from __future__ import annotations

from torch import Tensor

from jagg_lightning.method.grpo import StepLossStats
from jagg_lightning.objectives.forward_process import ForwardProcessObjective, MatchingPoint, per_sample_mean, point_stats


def awm_weight(t: Tensor, weighting: str) -> Tensor:
    """w(t): 1, t or t^2 (and t for "ghuber")."""
    return {"uniform": t * 0 + 1, "t": t, "t2": t * t, "ghuber": t}[weighting]


def matching_error(mse: Tensor, weighting: str, power: float) -> Tensor:
    """The per-sample matching error the weight multiplies: mse, or for "ghuber" the generalised Huber
    ((mse + 1e-10)^p - 1e-10^p) / p (p = ``objective.awm_ghuber_power``)."""
    if weighting != "ghuber":
        return mse
    eps = 1e-10
    return ((mse + eps) ** power - eps**power) / power


class AWMObjective(ForwardProcessObjective):
    name = "awm"
    default_kl_beta = 0.0
    advantage_scale = 1.0  # 1 / grpo.adv_clip with awm_advantage "scaled" (set by check, with the sections)

    def check(self, sampling, grpo, jagg) -> None:
        super().check(sampling, grpo, jagg)
        self.advantage_scale = 1.0 / grpo.adv_clip if self.config.awm_advantage == "scaled" else 1.0

    def point_loss(self, v: Tensor, point: MatchingPoint) -> tuple[Tensor, StepLossStats]:
        target = point.eps - point.x0
        c = self.config
        mse = per_sample_mean((v - target) ** 2)
        matching = awm_weight(point.t, c.awm_weighting) * matching_error(mse, c.awm_weighting, c.awm_ghuber_power)
        policy = point.advantages.to(v.dtype) * self.advantage_scale * matching
        kl = self.kl_term(v, point)
        return policy + self.kl_beta * kl, point_stats(policy, kl)
