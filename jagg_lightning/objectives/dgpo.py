"""DGPO, Direct Group Preference Optimization (Luo, Hu and Tang, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv 2510.08425, ICLR 2026): a DPO-style preference between a group's better and worse
samples, learnt on the ODE rollout's clean samples by the flow-matching loss -- no stochastic policy, no log-probs.

At a point z = (1 - t) x0 + t eps with the flow-matching target u = eps - x0, the matching losses of theta, of the
reference (adapter off) and of theta_old are

    l_i = mean (v_theta - u)^2,   l_ref,i = mean (v_ref - u)^2,   l_old,i = mean (v_old - u)^2.

The group's preference signal is the advantage-weighted DPO margin of its G samples, held fixed (stop-gradient),

    s_g = sum_{i in g} A_i beta (l_i - l_ref,i) / G,        w_g = sigmoid(s_g)            (beta = ``dgpo_beta``)

and the loss -- the gradient of the group log-likelihood -log sigmoid(-s_g) through its l_i -- is

    l_i' = sg(l_i) where clipped else l_i,   clipped = (A_i > 0 and r_i > 1 + c) or (A_i <= 0 and r_i < 1 - c),
    r_i  = exp(l_old,i - l_i)                                   (c = ``dgpo_clip_range``; null: nothing clipped)
    L_i  = w_g A_i l_i' + kl_beta mean (v_theta - v_ref)^2.

A sample's loss reads its whole group (w_g), so the update's micro-batches hold whole groups
(:meth:`DGPOUpdater.epoch_updates`: the groups shuffled, ``grpo.train_batch_size`` a multiple of the group size); a
group lives on one process (each prompt's G samples are drawn where the prompt is), so no all-reduce is needed for s_g
where the released code, whose groups span processes, all-reduces it.

theta_old: after every training step theta_old <- d theta_old + (1 - d) theta with d = min(0.3, 0.001 n), n the
optimizer steps before the step's update (the code's ``ema_ref``, decay ``min(0.3, 0.001 * global_step)``, stepped
after each optimizer step: the same with the presets' one optimizer step per rollout). The rollout samples theta
until ``dgpo_old_rollout_after`` steps, theta_old after (``switch_ema_ref``). The levels: K = ``num_levels`` (4)
distinct times among the schedule's first ``dgpo_trunc_steps`` + 1 (``trunc_steps``, the high-noise ones), drawn per
update and shared by its samples; with ``dgpo_group_noise`` a group shares one eps per level (``use_shared_noise``).

Transcribed from the authors' released code: Luo-Yihong/DGPO, commit 01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6,
``scripts/train_sd3_dgpo.py`` lines 162-192 (``compute_group_dgpo_loss_allreduce``), 799-879 (``switch_ema_ref``)
and 1060-1177 (the training loop: the points, the reference, the clip, the KL, ``ema_ref``), defaults from
``config/dgpo.py`` ``geneval_sd3_4gpu`` (``beta_dpo`` 100, ``clip_range`` 0.01, ``clip_dsm`` true, ``clip_kl``
false, ``train.beta`` 0.02, ``trunc_steps`` 4, ``switch_ema_ref`` 500, ``num_train_timesteps`` 4,
``use_shared_noise`` true) and ``config/base.py`` (``adv_clip_max`` 5: our ``grpo.adv_clip``; ``kl_cfg`` 1 and
``use_ema_ref`` false: the reference is the adapter-off model under theta's own guidance, as here). Flow-Factory
ships the same loss (X-GenGroup/Flow-Factory ``src/flow_factory/trainers/dgpo.py``). The paper's equation numbers could
not be checked offline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.method.grpo import StepLossStats
from jagg_lightning.objectives.forward_process import (
    ForwardProcessObjective, ForwardProcessUpdater, MatchingPoint, per_sample_mean,
)
from jagg_lightning.utils.checks import check


def dgpo_decay(optimizer_steps: int) -> float:
    """d of theta_old's soft update after a training step that ends at ``optimizer_steps``: min(0.3, 0.001 n), n the
    optimizer steps before its update (the code's ``ema_ref`` decay at ``global_step``)."""
    return min(0.3, 0.001 * max(optimizer_steps - 1, 0))


def group_weights(advantages: Tensor, margin: Tensor, groups: Tensor, beta: float, group_size: int) -> Tensor:
    """w_g [B] of each sample's group: sigmoid(sum_{i in g} A_i beta margin_i / G) over the rows of ``groups``."""
    ids, local = groups.unique(return_inverse=True)
    sums = torch.zeros(len(ids), dtype=margin.dtype, device=margin.device)
    sums.index_add_(0, local, advantages * beta * margin / group_size)
    return torch.sigmoid(sums)[local]


class DGPOObjective(ForwardProcessObjective):
    name = "dgpo"
    default_kl_beta = 0.02  # config/dgpo.py geneval_sd3_4gpu: train.beta (config/base.py: 0.0)
    keeps_old_policy = True
    needs_reference = True  # l_ref, whatever kl_beta
    group_size = 1  # set by updater() from sampling.group_size (the code's num_image_per_prompt)

    def point_loss(self, v: Tensor, point: MatchingPoint) -> tuple[Tensor, StepLossStats]:
        c = self.config
        target = point.eps - point.x0
        adv = point.advantages.to(v.dtype)
        matching = per_sample_mean((v - target) ** 2)
        with torch.no_grad():
            ref = per_sample_mean((point.v_ref.to(v.dtype) - target) ** 2)
            weights = group_weights(adv, matching.detach() - ref, point.groups, c.dgpo_beta, self.group_size)
            v_old = v.detach() if point.v_old is None else point.v_old.to(v.dtype)
            ratio = torch.exp(per_sample_mean((v_old - target) ** 2) - matching.detach())
            clipped = torch.zeros_like(adv, dtype=torch.bool)
            if c.dgpo_clip_range is not None:
                clipped = torch.where(adv > 0, ratio > 1 + c.dgpo_clip_range, ratio < 1 - c.dgpo_clip_range)
        matching = torch.where(clipped, matching.detach(), matching)
        policy = weights * adv * matching
        kl = self.kl_term(v, point)
        zeros = torch.zeros_like(policy)
        stats = StepLossStats(policy.detach(), kl.detach(), ratio, zeros, clipped.to(v.dtype))
        return policy + self.kl_beta * kl, stats

    def old_policy_decay(self, optimizer_steps: int) -> float:
        return dgpo_decay(optimizer_steps)

    def rollout_with_old(self, step: int) -> bool:
        return step > self.config.dgpo_old_rollout_after  # the code: global_step > switch_ema_ref

    def level_schedule(self, times: Tensor) -> Tensor:
        return times[: self.config.dgpo_trunc_steps + 2]  # noise_levels draws among all but its last entry

    def check(self, sampling, grpo, jagg) -> None:
        super().check(sampling, grpo, jagg)
        check(grpo.train_batch_size % sampling.group_size == 0, "grpo.train_batch_size",
              f"a multiple of sampling.group_size={sampling.group_size} with objective.name 'dgpo' (a sample's loss "
              "reads its whole group, so micro-batches hold whole groups)", grpo.train_batch_size)

    def updater(self, policy, sampling, grpo, jagg, memory, sampler) -> DGPOUpdater:
        self.group_size = sampling.group_size
        return DGPOUpdater(policy, sampling, grpo, jagg, memory, sampler, self)


class DGPOUpdater(ForwardProcessUpdater):
    """The forward-process update with whole groups per micro-batch and (``dgpo_group_noise``) one eps per group."""

    def epoch_updates(self, num: int, shuffle: torch.Generator) -> list[list[Tensor]]:
        """The rollout's groups shuffled by ``shuffle``, ``train_batch_size / G`` groups per micro-batch (rows sorted:
        the rollout's order inside), ``micro_batches_per_update`` micro-batches per update (null: all)."""
        size = self.sampling.group_size
        order = torch.randperm(num // size, generator=shuffle)
        rows = (order[:, None] * size + torch.arange(size)).flatten().to(self.sampler.device)
        micro = [m.sort().values for m in rows.split(self.grpo.train_batch_size)]
        per_update = self.grpo.micro_batches_per_update or len(micro)
        return [micro[start : start + per_update] for start in range(0, len(micro), per_update)]

    def noise(self, indices: list[int], step: int, epoch: int, K: int, like: Tensor) -> Tensor:
        """Each sample's own draws, or with ``dgpo_group_noise`` its group's first sample's for the whole group."""
        eps = super().noise(indices, step, epoch, K, like)
        if not self.config.dgpo_group_noise:
            return eps
        size = self.sampling.group_size
        return eps[::size].repeat_interleave(size, dim=0)
