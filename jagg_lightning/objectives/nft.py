"""DiffusionNFT (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv 2509.16117):
a flow-matching loss on the rollout's clean samples that contrasts two implicit policies built from the old and the
current velocity, weighted by the optimality probability r of each sample.

At a point z = (1 - t) x0 + t eps (velocity convention v = eps - x0, so x0 = z - t v), with theta_old's velocity
v_old (held fixed) and beta = ``objective.nft_beta`` (the paper's §3 "implicit parameterisation" of the positive and
negative policies, and its loss, the transcription below follows the reference code ``scripts/train_nft_sd3.py`` of
NVlabs/DiffusionNFT, where the paper's equation numbers could not be checked offline):

    v+ = (1 - beta) v_old + beta v_theta          (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta          (implicit negative policy)
    x+ = z - t v+,   x- = z - t v-                (their clean-sample predictions)
    L+ = mean (x+ - x0)^2 / sg(max(mean |x+ - x0|, 1e-5))      (adaptive weighting: a stop-gradient L1 scale)
    L- = mean (x- - x0)^2 / sg(max(mean |x- - x0|, 1e-5))
    r  = clamp(clip(A, -C, C) / C / 2 + 1/2, 0, 1)  (optimality probability from the group-normalised reward;
                                                    C = ``objective.nft_adv_clip``)
    l  = C (r L+ + (1 - r) L-) / beta + kl_beta mean (v_theta - v_ref)^2

Minimising r L+ + (1 - r) L- pulls v+ toward the samples with r near 1 and v- toward those with r near 0; as
v+ - v_old = beta (v_theta - v_old) = v_old - v-, both move v_theta toward the positive samples and away from the
negative ones: a policy-improvement direction without a likelihood.

theta_old: the rollout samples it, and after every training step theta_old <- d theta_old + (1 - d) theta
(the code's ``return_decay(step, decay_type)``, ``step`` the optimizer steps so far): type 0 d = 0 (theta_old = theta
at each rollout: on-policy), 1 d = min(0.001 step, 0.5), 2 d = 0 for 75 steps then min(0.0075 (step - 75), 0.999).
At the first training step theta_old = theta (the code copies theta into the old adapter before the loop), and while
theta_old equals theta bit for bit (the first update after a rollout with d = 0) v_old is v_theta's own value,
detached: no forward of its own (the gradient is the same: v_old is held fixed either way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.method.grpo import StepLossStats
from jagg_lightning.objectives.forward_process import ForwardProcessObjective, MatchingPoint, per_sample_mean, point_stats


def nft_decay(optimizer_steps: int, decay_type: int) -> float:
    """d of the soft update theta_old <- d theta_old + (1 - d) theta (DiffusionNFT code's ``return_decay``)."""
    flat, rate, cap = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if optimizer_steps < flat else min((optimizer_steps - flat) * rate, cap)


def adaptive_mse(prediction: Tensor, x0: Tensor) -> Tensor:
    """mean (prediction - x0)^2 / sg(max(mean |prediction - x0|, 1e-5)) per sample [B]."""
    with torch.no_grad():
        scale = per_sample_mean((prediction.double() - x0.double()).abs()).clamp_min(1e-5).to(prediction.dtype)
    return per_sample_mean((prediction - x0) ** 2) / scale


class NFTObjective(ForwardProcessObjective):
    name = "nft"
    default_kl_beta = 1e-4  # config/base.py train.beta (SD3: config/nft.py keeps it)
    keeps_old_policy = True

    def optimality(self, advantages: Tensor) -> Tensor:
        """r = clamp(clip(A, -C, C) / C / 2 + 1/2, 0, 1)."""
        c = self.config.nft_adv_clip
        return ((advantages.clamp(-c, c) / c) / 2 + 0.5).clamp(0, 1)

    def point_loss(self, v: Tensor, point: MatchingPoint) -> tuple[Tensor, StepLossStats]:
        beta, c = self.config.nft_beta, self.config.nft_adv_clip
        v_old = v.detach() if point.v_old is None else point.v_old.to(v.dtype)
        positive = (1 - beta) * v_old + beta * v
        negative = (1 + beta) * v_old - beta * v
        r = self.optimality(point.advantages).to(v.dtype)
        loss_pos = adaptive_mse(point.z - point.t * positive, point.x0)
        loss_neg = adaptive_mse(point.z - point.t * negative, point.x0)
        policy = c * (r * loss_pos + (1 - r) * loss_neg) / beta
        kl = self.kl_term(v, point)
        return policy + self.kl_beta * kl, point_stats(policy, kl)

    def old_policy_decay(self, optimizer_steps: int) -> float:
        return nft_decay(optimizer_steps, self.config.nft_decay_type)
