"""``model.objective``: what a scored rollout becomes as a loss (`ObjectiveConfig`; the objectives themselves:
`jagg_lightning.objectives`). Plain data and its own checks (no I/O, no torch): a bad value fails before any model is
built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jagg_lightning.utils.checks import check, one_of

OBJECTIVE_NAMES = ("grpo", "nft", "awm", "dgpo", "flow_dppo")
LEVEL_DISTRIBUTIONS = ("schedule", "stratified", "uniform", "logit_normal")
AWM_ADVANTAGES = ("clipped", "scaled")
AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
NFT_DECAY_TYPES = (0, 1, 2)


@dataclass
class ObjectiveConfig:
    """Which objective trains, and the forward-process objectives' hyper-parameters (ignored by grpo).

    DiffusionNFT and AWM train on the rollout's clean samples x0 at K noise levels t, z_t = (1 - t) x0 + t eps, with
    no log-probs (docs/method.md section 10 has the math, docs/configuration.md every field's source).

    Attributes:
        name: `grpo` (the default: the clipped-ratio policy gradient over the SDE steps, the `grpo` / `jagg`
            sections), `nft` (DiffusionNFT, arXiv 2509.16117), `awm` (Advantage Weighted Matching, arXiv
            2509.25050), `dgpo` (Direct Group Preference Optimization, arXiv 2510.08425: a forward-process objective)
            or `flow_dppo` (Flow-DPPO, arXiv 2606.11025: GRPO's SDE steps with a divergence mask for the clip).
        num_levels: K noise levels per sample, an integer >= 1; null = int(0.99 num_steps) (the DiffusionNFT code's
            `train.timestep_fraction` 0.99), for dgpo 4 (its `num_train_timesteps`).
        levels: `schedule` (K distinct times of the rollout's own schedule, as the DiffusionNFT code), `stratified`
            (the schedule indices `level_range` cut into K consecutive strata as evenly as possible, one index drawn
            uniformly in each: the AWM code's draw; nft and awm), `uniform` or `logit_normal` (t = sigmoid(N(0, 1)),
            SD3's pretraining density); drawn per update, shared by its samples.
        level_range: `stratified`'s schedule indices [first, last], inclusive (index 0 is t = 1); null = [1,
            num_steps - 1], every time but t = 1.
        level_shift: The shift s of `uniform` / `logit_normal` levels, t <- s t / (1 + (s - 1) t), > 0.
        shared_noise: One eps per sample for all its levels (z_t on one straight line; needed by `jagg`) instead of a
            fresh eps per level (the papers' code).
        jagg: The K levels of a sample form one JAGG window: two grad forwards at the extreme levels, the interiors
            by no-grad forwards, ONE joint backward instead of K; needs `shared_noise`.
        jagg_window: With `jagg`: windows of this many consecutive levels, each with its one backward, an integer
            >= 3; null = one window of all K.
        kl_beta: The weight of mean (v_theta - v_ref)^2 (adapter off), >= 0; null = the paper's (NFT 1e-4, AWM 0).
        nft_beta: DiffusionNFT's beta of the implicit policies, in (0, 1] (its config/nft.py: 1.0).
        nft_adv_clip: DiffusionNFT's advantage clip C that maps A to the optimality probability r, > 0
            (`train.adv_clip_max` 5).
        nft_decay_type: The soft update of theta_old after each step: 0 copies theta, 1 min(0.001 step, 0.5), 2 0
            for 75 steps then min(0.0075 (step - 75), 0.999) (config/nft.py 1, its OCR preset 2).
        awm_weighting: AWM's w(t) of the matching loss: `uniform`, `t`, `t2`, or `ghuber` (t times the generalised
            Huber error ((mse + 1e-10)^p - 1e-10^p) / p).
        awm_ghuber_power: The p of `ghuber`, in (0, 1] (Flow-Factory's `ghuber_power` 0.25).
        awm_advantage: The advantage weighting the matching loss: `clipped` (the group advantage clipped to
            +-`grpo.adv_clip`), or `scaled` (that divided by `grpo.adv_clip`, in [-1, 1]: the AWM code's
            clamp(A, -5, 5) / 5 with adv_clip 5). `scaled` keeps the policy term's size against the KL term and the
            gradient-norm clip as the code has it; `clipped` makes it adv_clip times larger.
        dgpo_beta: DGPO's DPO temperature of the group preference, > 0 (its `train.beta_dpo` 100).
        dgpo_clip_range: DGPO's PPO-style clip of the matching loss against theta_old, > 0, or null for none
            (its GenEval recipe's `clip_range` 0.01 with `clip_dsm`).
        dgpo_trunc_steps: With `levels` `schedule`, DGPO draws its levels among the schedule's first
            dgpo_trunc_steps + 1 times (the high-noise ones), an integer >= 0 (its `trunc_steps` 4).
        dgpo_old_rollout_after: The training step after which DGPO's rollout samples theta_old instead of theta,
            an integer >= 0 (its `switch_ema_ref` 500).
        dgpo_group_noise: DGPO's samples of one group share one eps per level (its `use_shared_noise`).
        dppo_threshold: Flow-DPPO's trust region delta on the exact per-step KL D_k: a sample moving away from
            theta_old with D_k >= delta is dropped, >= 0 (verl-omni's and UniRL's `kl_mask_threshold` 1e-5).
    """

    name: Literal["grpo", "nft", "awm", "dgpo", "flow_dppo"] = "grpo"
    num_levels: int | None = None
    levels: Literal["schedule", "stratified", "uniform", "logit_normal"] = "schedule"
    level_range: list[int] | None = None
    level_shift: float = 1.0
    shared_noise: bool = False
    jagg: bool = False
    jagg_window: int | None = None
    kl_beta: float | None = None
    nft_beta: float = 1.0
    nft_adv_clip: float = 5.0
    nft_decay_type: int = 1
    awm_weighting: Literal["uniform", "t", "t2", "ghuber"] = "uniform"
    awm_ghuber_power: float = 0.25
    awm_advantage: Literal["clipped", "scaled"] = "clipped"
    dgpo_beta: float = 100.0
    dgpo_clip_range: float | None = 0.01
    dgpo_trunc_steps: int = 4
    dgpo_old_rollout_after: int = 500
    dgpo_group_noise: bool = True
    dppo_threshold: float = 1e-5

    def __post_init__(self):
        check(self.name in OBJECTIVE_NAMES, "objective.name", one_of(OBJECTIVE_NAMES), self.name)
        check(self.num_levels is None or (isinstance(self.num_levels, int) and self.num_levels >= 1),
              "objective.num_levels", "an integer >= 1 or null", self.num_levels)
        check(self.levels in LEVEL_DISTRIBUTIONS, "objective.levels", one_of(LEVEL_DISTRIBUTIONS), self.levels)
        check(self.level_range is None or (isinstance(self.level_range, (list, tuple)) and len(self.level_range) == 2
                                            and all(isinstance(i, int) for i in self.level_range)
                                            and 0 <= self.level_range[0] <= self.level_range[1]),
              "objective.level_range", "[first, last] schedule indices with 0 <= first <= last, or null",
              self.level_range)
        check(self.level_shift > 0, "objective.level_shift", "> 0", self.level_shift)
        check(self.jagg_window is None or (isinstance(self.jagg_window, int) and self.jagg_window >= 3),
              "objective.jagg_window", "an integer >= 3 or null (all the levels in one window)", self.jagg_window)
        check(self.kl_beta is None or self.kl_beta >= 0, "objective.kl_beta", ">= 0 or null", self.kl_beta)
        check(0 < self.nft_beta <= 1, "objective.nft_beta", "in (0, 1]", self.nft_beta)
        check(self.nft_adv_clip > 0, "objective.nft_adv_clip", "> 0", self.nft_adv_clip)
        check(self.nft_decay_type in NFT_DECAY_TYPES, "objective.nft_decay_type", one_of(NFT_DECAY_TYPES),
              self.nft_decay_type)
        check(0 < self.awm_ghuber_power <= 1, "objective.awm_ghuber_power", "in (0, 1]", self.awm_ghuber_power)
        check(self.awm_advantage in AWM_ADVANTAGES, "objective.awm_advantage", one_of(AWM_ADVANTAGES),
              self.awm_advantage)
        check(self.awm_weighting in AWM_WEIGHTINGS, "objective.awm_weighting", one_of(AWM_WEIGHTINGS),
              self.awm_weighting)
        check(self.dgpo_beta > 0, "objective.dgpo_beta", "> 0", self.dgpo_beta)
        check(self.dgpo_clip_range is None or self.dgpo_clip_range > 0, "objective.dgpo_clip_range", "> 0 or null",
              self.dgpo_clip_range)
        for field in ("dgpo_trunc_steps", "dgpo_old_rollout_after"):
            value = getattr(self, field)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"objective.{field}",
                  "an integer >= 0", value)
        check(isinstance(self.dgpo_group_noise, bool), "objective.dgpo_group_noise", "true or false",
              self.dgpo_group_noise)
        check(self.dppo_threshold >= 0, "objective.dppo_threshold", ">= 0", self.dppo_threshold)
        check(not self.jagg or self.shared_noise, "objective.jagg",
              "false unless objective.shared_noise is true (JAGG needs every level of a sample on one line "
              "z_t = (1 - t) x0 + t eps, so one eps per sample)", self.jagg)

    def levels_for(self, num_steps: int) -> int:
        """K: ``num_levels``, or int(0.99 num_steps) (at least 1; dgpo: 4, at most its schedule's choice)."""
        if self.num_levels is not None:
            return self.num_levels
        if self.name == "dgpo":
            return min(4, num_steps, self.dgpo_trunc_steps + 1)
        return max(1, int(0.99 * num_steps))

    def level_indices(self, num_steps: int) -> tuple[int, int]:
        """`stratified`'s schedule indices [first, last]: ``level_range`` or [1, num_steps - 1]."""
        return tuple(self.level_range) if self.level_range is not None else (1, num_steps - 1)

    def check_sections(self, num_steps: int) -> None:
        """Checks across sections: the "schedule" levels are distinct times of the rollout's schedule; the
        "stratified" ones need a stratum (an index) per level within the schedule (nft and awm)."""
        if self.name == "dgpo" and self.levels == "schedule":
            check(self.dgpo_trunc_steps < num_steps, "objective.dgpo_trunc_steps",
                  f"< sampling.num_steps={num_steps} (the levels are among the schedule's first trunc_steps + 1)",
                  self.dgpo_trunc_steps)
            check(self.levels_for(num_steps) <= self.dgpo_trunc_steps + 1, "objective.num_levels",
                  f"<= objective.dgpo_trunc_steps + 1 = {self.dgpo_trunc_steps + 1} with objective.levels 'schedule'",
                  self.num_levels)
        check(not (self.name == "dgpo" and self.levels == "stratified"), "objective.levels",
              "schedule, uniform or logit_normal with objective.name 'dgpo'", self.levels)
        if self.name in ("nft", "awm") and self.levels == "schedule":
            check(self.levels_for(num_steps) <= num_steps, "objective.num_levels",
                  f"<= sampling.num_steps={num_steps} with objective.levels 'schedule' (distinct schedule times)",
                  self.num_levels)
        if self.name in ("nft", "awm") and self.levels == "stratified":
            first, last = self.level_indices(num_steps)
            check(last <= num_steps - 1, "objective.level_range", f"indices <= sampling.num_steps - 1 = "
                  f"{num_steps - 1} (the schedule's times t_0 = 1 .. t_{num_steps - 1})", [first, last])
            check(self.levels_for(num_steps) <= last - first + 1, "objective.num_levels",
                  f"<= {last - first + 1}, the indices in objective.level_range {[first, last]} (one per stratum)",
                  self.levels_for(num_steps))
        if self.jagg:
            check(self.levels_for(num_steps) >= 3, "objective.num_levels",
                  ">= 3 with objective.jagg (a window of 2 levels is already exact)", self.levels_for(num_steps))
