"""What a training step logs (the ``train/*`` dict), the first-update importance-ratio check and the reward
means of an evaluation. Plain torch: the module logs the values and raises the warning text through Lightning."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from jagg_lightning.method.jagg import Window
from jagg_lightning.training.grids import count_right, image_grid, labelled_grid, reward_marks, with_sources
from jagg_lightning.training.update import StepReport


def train_metrics(report: StepReport, windows: list[Window], ratio: FirstUpdateRatioCheck, exact_backwards: int,
                  gradient_all_reduces: int, skipped_nonfinite: int = 0, decodes: int = 0) -> dict[str, Tensor]:
    """The ``train/*`` values of one training step (without the prefix); ``skipped_nonfinite``: the updates
    skipped for a non-finite value so far in the run (a running count); ``decodes``: the samples the step's
    rollout decoded to images (0 when the reward scores latents alone)."""
    stats, records, rewards = report.stats + report.first_update_stats, report.records, report.rewards

    def mean_of(attr):
        if not stats:  # every sample skipped (zero advantage)
            return torch.tensor(float("nan"))
        return torch.stack([getattr(st, attr).float().mean() for _, st in stats]).mean()

    routed = [r for r in records if r.routed]
    return {
        "reward_mean": rewards.mean(),
        "reward_std": rewards.std(),
        "policy_loss": mean_of("policy_loss"),
        "kl": mean_of("kl"),
        "approx_kl": mean_of("approx_kl"),
        "clip_frac": mean_of("clipped"),
        "ratio_mean": mean_of("ratio"),
        "routed_frac": torch.tensor(sum(w.routed for w in windows) / len(windows)),
        "ratio_dev_first_update": torch.tensor(ratio.deviation),
        "ratio_first_update_off": torch.tensor(float(ratio.off)),
        "skipped_samples": torch.tensor(float(report.skipped_samples)),
        "skipped_nonfinite": torch.tensor(float(skipped_nonfinite)),
        "decodes": torch.tensor(float(decodes)),
        "passes/backward": torch.tensor(float(sum(r.backwards for r in records))),
        "passes/grad_forward": torch.tensor(float(sum(r.grad_forwards for r in records))),
        "passes/nograd_forward": torch.tensor(float(sum(r.nograd_forwards for r in records))),
        "passes/fused_forward": torch.tensor(float(sum(r.fused_steps for r in records))),
        "passes/reference_forward": torch.tensor(float(report.reference_forwards)),
        "passes/exact_backward": torch.tensor(float(exact_backwards)),
        "passes/routed_windows": torch.tensor(float(len(routed))),
        # routed windows the control variate drew (jagg.estimator: control_variate): their interiors got passes too
        "passes/corrected_windows": torch.tensor(float(sum(r.correction > 0 for r in routed))),
        "passes/grad_all_reduce": torch.tensor(float(gradient_all_reduces)),
        **advantage_part_stats(report.advantage_parts, report.advantages),
    }


def advantage_part_stats(parts: dict[str, Tensor], advantages: Tensor) -> dict[str, Tensor]:
    """With two or more weighted rewards, for each reward n (its part P_n of the advantage, the parts summing to
    the advantage A before its clip): ``advantage/<n>/share`` = mean|P_n| / sum_m mean|P_m| (how much of the
    signal it carries: near 0 = drowned), ``advantage/<n>/std`` = std(P_n) and ``advantage/<n>/corr`` =
    corr(P_n, A) (this process's samples)."""
    if len(parts) < 2:
        return {}
    sizes = {n: p.abs().mean() for n, p in parts.items()}
    whole = torch.stack(list(sizes.values())).sum()
    out = {}
    for n, p in parts.items():
        a, q = advantages.to(p) - advantages.to(p).mean(), p - p.mean()
        corr = (a * q).sum() / ((a * a).sum().sqrt() * (q * q).sum().sqrt())  # NaN when either is constant
        out |= {f"advantage/{n}/share": sizes[n] / whole, f"advantage/{n}/std": p.std(), f"advantage/{n}/corr": corr}
    return out


class FirstUpdateRatioCheck:
    """Whether the first update's ratio deviates from 1 by more than float noise; a warning text once.

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

    def __init__(self, sampling, grpo, jagg, sde_dtype: torch.dtype):
        self.sampling, self.grpo, self.jagg, self.sde_dtype = sampling, grpo, jagg, sde_dtype
        self.deviation = float("nan")  # max |log rho| in the first update of the last step
        self.off = False  # that deviation exceeds float noise (a warning was raised)
        self.warned = False

    def __call__(self, first_update_stats: list) -> str | None:
        """Measure the last step's first update; the warning text the first time it is off, else None."""
        s, g = self.sampling, self.grpo
        other_shape = g.train_batch_size != s.rollout_batch_size and not self.jagg.fused_rollout
        strict = other_shape and self.sde_dtype == torch.float32
        eps = torch.finfo(self.sde_dtype).eps
        tolerance = 0.0 if strict else 4 * eps
        if first_update_stats:  # two numbers read back to the host per training step, not two per step and micro-batch
            log_ratio = torch.cat([st.log_ratio.abs().flatten() for _, st in first_update_stats])
            old = torch.cat([st.old_log_prob.abs().flatten() for _, st in first_update_stats])
            deviation, off = torch.stack([log_ratio.max(), (log_ratio > tolerance * (1 + old)).any().to(log_ratio)]).tolist()
        else:
            deviation, off = 0.0, 0.0
        self.deviation, self.off = deviation, bool(off)
        if not self.off or self.warned:
            return None
        self.warned = True
        if other_shape:
            cause = (f"grpo.train_batch_size ({g.train_batch_size}) differs from sampling.rollout_batch_size "
                     f"({s.rollout_batch_size}): in float32 the transformer's kernels round differently for another "
                     "batch shape, so the recomputed log-probs differ from the rollout's (Flow-GRPO's README warns of "
                     "the same). Set both to the same value, or train in float64, for rho = 1 to float noise")
        else:
            cause = ("that is beyond float noise (4 eps (1 + |log pi_old|)) with matching batch sizes, so the forward itself is "
                     "not reproducible (nondeterministic kernels), or the weights changed between the rollout and the "
                     "first update")
        return (f"The importance ratio of the first update after a rollout deviates from 1 (max |log rho| "
                f"{self.deviation:.3g}): {cause}. Logged as train/ratio_dev_first_update.")


class EvalSums:
    """Over one process's evaluation samples: sum and count of the reward (``reward_mean``) and of each component
    (``reward/<name>``) in float64 -- :meth:`means` reduces them over the processes first -- and the first
    ``grid_images`` images (with their prompts) for the sample grid (:meth:`grid_picture`)."""

    def __init__(self, device: torch.device | str = "cpu", grid_images: int = 0):
        self.device, self.grid_images = device, grid_images
        self.sums: dict[str, Tensor] = {}  # name -> [sum, count]
        self.grid: list[Tensor] = []  # on the CPU
        self.grid_prompts: list[str] = []

    def add(self, images: Tensor, total: Tensor, components: dict[str, Tensor], prompts: list[str] = ()) -> None:
        for name, scores in {"reward_mean": total, **{f"reward/{n}": c for n, c in components.items()}}.items():
            acc = self.sums.setdefault(name, torch.zeros(2, dtype=torch.float64, device=self.device))
            acc += torch.stack([scores.double().sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)]).to(acc)
        wanted = self.grid_images - sum(len(g) for g in self.grid)
        if wanted > 0:
            self.grid.append(images[:wanted].cpu())
            self.grid_prompts += list(prompts)[:wanted]

    def grid_picture(self, per_row: int, label: str, reward=None) -> np.ndarray:
        """The grid of the kept images, ``per_row`` samples of one prompt per row, labelled: the prompts, ``label``
        (what was sampled) above it and, given the ``reward``, each image's score under it and its frame when the
        reward says right / wrong (:func:`~jagg_lightning.training.grids.reward_marks`; the count of right ones beside
        ``label``)."""
        images = torch.cat(self.grid)
        rows = [list(images[i:i + per_row]) for i in range(0, len(images), per_row)]
        prompts = self.grid_prompts[::per_row] if len(self.grid_prompts) == len(images) else []
        marks = reward_marks(reward, images, self.grid_prompts, per_row) if reward is not None and prompts else None
        if marks is not None and marks.correct:
            label += f": {count_right(marks.correct, range(per_row))}"
        rows, marks, sourced = with_sources(rows, prompts, marks)  # editing / image-to-video: source -> results
        labels, sizes = (["source", label], [1, per_row]) if sourced else ([label], None)
        return labelled_grid(image_grid(rows), images.shape[-2], prompts, labels, columns=len(rows[0]), marks=marks,
                             group_sizes=sizes)

    def means(self, reduce_sum: Callable[[Tensor], Tensor] = lambda t: t) -> dict[str, Tensor]:
        """{name: mean over every sample of every process} (``reduce_sum`` sums over the processes), float32."""
        names = sorted(self.sums)
        sums = reduce_sum(torch.stack([self.sums[n] for n in names]))
        return {n: (s[0] / s[1]).float() for n, s in zip(names, sums)}
