"""``model.grpo``: the GRPO update (`GRPOConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jagg_lightning.method.grpo import KL_CONVENTIONS, MULTI_REWARD, check_variant_fields
from jagg_lightning.utils.checks import check, check_ints


@dataclass
class GRPOConfig:
    """The GRPO update: the clipped policy loss, its advantages and the optimizer steps.

    The advantage of sample i of group g and the loss of its trained step k (`jagg_lightning.method.grpo`):

        A_i  = clip((r_i - mean_g) / (std + adv_eps), -adv_clip, adv_clip)
        rho  = pi_theta(z_k+1 | z_k) / pi_theta_old(z_k+1 | z_k)
        L_ik = max(-A_i rho, -A_i clip(rho, 1 - clip_range, 1 + clip_range)) + kl_beta KL_k

    with KL_k the KL to the reference policy (the adapter off). The update runs `inner_epochs` passes over each
    rollout in micro-batches of `train_batch_size` samples; an optimizer step follows every
    `micro_batches_per_update` of them.

    Attributes:
        clip_range: PPO's ratio clip epsilon, > 0.
        kl_beta: The KL weight beta, >= 0; > 0 adds one no-grad reference forward (adapter off) per trained step
            per rollout, taken inside the rollout on the same z and t; 0 = no reference pass.
        adv_clip: Advantages are clipped to +-adv_clip, > 0.
        adv_std: The std that normalises the advantages (the mean is always the group's): `global` (of every reward
            of the step over every process; Flow-GRPO's default `sample.global_std`) or `group` (the group's own,
            DanceGRPO; needed by `jagg.fused_rollout`).
        inner_epochs: Passes over each rollout, an integer >= 1.
        train_batch_size: Samples per micro-batch of the update, an integer >= 1.
        micro_batches_per_update: Micro-batches accumulated per optimizer step, >= 1; null = all of an inner epoch
            (one optimizer step per inner epoch).
        max_grad_norm: The gradient-norm clip, > 0; null = off.
        kl_convention: `flow_grpo` divides the KL by 2 sigma_k^2 (Flow-GRPO, no dt), `exact` by 2 s_k^2 (the exact
            KL of the step Gaussians).
        std_ddof: The ddof of the advantage std: 0 (np.std, Flow-GRPO) or 1 (unbiased, DanceGRPO).
        adv_eps: Added to the advantage std, > 0 (Flow-GRPO 1e-4, DanceGRPO 1e-8).
        skip_zero_advantage: With kl_beta 0, samples whose advantage is exactly 0 (a group of equal rewards) get no
            forward or backward; the update is the same (`train/skipped_samples` counts them).
        multi_reward: Several rewards (`WeightedReward`): `weighted_sum` group-normalises the weighted sum of the
            rewards; `per_reward` group-normalises each reward on its own and sums the weighted advantages
            (`grpo.combined_advantages`).
        max_nonfinite_in_a_row: An update with a non-finite reward, advantage, per-sample loss or gradient is
            skipped (weights, optimizer, EMA and scheduler untouched; `train/skipped_nonfinite` counts it); this
            many skipped in a row stop the run, naming where the first appeared; an integer >= 1 (1: stop at the
            first; `jagg_lightning.faults.nonfinite`).
        ratio_norm: GRPO-Guard's RatioNorm (arXiv 2510.22319): the clipped ratio is exp((log rho + b) s), b the
            sample's mean |mu_theta - mu_old|^2 / (2 s^2), s the step's std (per sample; no extra forward); not
            with the CPS squared-error log-prob.
        ratio_reweight: GRPO-Guard's gradient reweighting: each step's policy term times 1 / (-dt).
        temporal_rectification: Flash-GRPO's temporal gradient rectification (arXiv 2605.15980): step k's policy
            term times (1 / c_k) / mean_j(1 / c_j), c_k the step's log-prob gradient scale.
    """

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
        check(self.max_nonfinite_in_a_row is not None and self.max_nonfinite_in_a_row >= 1, "grpo.max_nonfinite_in_a_row",
              ">= 1 (skipped non-finite updates in a row that stop the run; 1: the first)", self.max_nonfinite_in_a_row)
        check(self.multi_reward in MULTI_REWARD, "grpo.multi_reward", "'weighted_sum' (normalise the weighted sum of "
              "the rewards) or 'per_reward' (normalise each reward, then sum the weighted advantages)", self.multi_reward)
        check_variant_fields(self)
