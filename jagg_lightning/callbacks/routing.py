"""Where JAGG is used: routed share, residual-score quantiles, backward passes saved, and how often each
trained step (by t) sat inside a routed window; at the end of fit a PNG in the log directory."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from jagg_lightning.faults.io import atomic_write
from jagg_lightning.training.images import log_dir, log_image


class RoutingStats(L.Callback):
    """Which windows JAGG took, logged every training step, and a plot of routing per timestep at the end of fit.

    Logs ``routing/*`` every training step through ``pl_module.log`` (any Lightning logger) and
    writes ``routing.png`` (routing frequency per timestep, score distribution) at the end of fit, also sent
    to every image-capable logger as ``routing``.

    A policy with several experts (``policy.expert_names``: Wan2.2's ``high_noise`` and ``low_noise``) also gets
    ``routing/<expert>/*``, the same values over that expert's windows (``policy.expert_index`` maps a step to its
    expert), and the plot's bars coloured by expert. One network: exactly the ``routing/*`` values.

    A forward-process objective (``model.objective.name`` ``nft`` / ``awm``) routes no SDE windows: its ``routing/*``
    values are over its noise levels (``objective.jagg``) and no plot is written.

    Args:
        plot: Write `routing.png` at the end of fit (and send it to image-capable loggers).
    """

    def __init__(self, plot: bool = True):
        super().__init__()
        self.plot = plot
        self.routed_counts: torch.Tensor | None = None  # per trained step
        self.steps_seen = 0
        self.scores: list[tuple[float, bool]] = []  # (residual, routed) of every full window seen

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        windows, records = pl_module.windows, pl_module.window_records
        if not records:
            return
        if self.routed_counts is None:
            self.routed_counts = torch.zeros(len(pl_module.trained_steps))
        first = pl_module.trained_steps[0]  # counts are per trainable step (an SDE window range may start later)
        for w in windows:
            if w.routed:
                self.routed_counts[[k - first for k in w.steps]] += 1
            if len(w.steps) > 2:
                self.scores.append((w.score, w.routed))
        self.steps_seen += 1
        exact = pl_module.exact_backwards  # one per trained step and update micro-batch
        made = sum(r.backwards for r in records)
        values = self._values("routing", windows, exact, made)
        names = pl_module.policy.expert_names
        if len(names) > 1:  # a multi-expert policy (Wan2.2): the same values per expert
            values |= self._per_expert(pl_module, names, windows, records, exact)
        pl_module.log_dict(values, batch_size=1)

    @staticmethod
    def _values(prefix: str, windows, exact: float, made: float) -> dict[str, float]:
        scores = torch.tensor([w.score for w in windows if len(w.steps) > 2] or [0.0])
        q10, q50, q90 = torch.quantile(scores, torch.tensor([0.1, 0.5, 0.9])).tolist()
        return {
            f"{prefix}/routed_share": sum(w.routed for w in windows) / max(len(windows), 1),
            f"{prefix}/score_q10": q10,
            f"{prefix}/score_q50": q50,
            f"{prefix}/score_q90": q90,
            f"{prefix}/backward_saved": float(exact - made),
            f"{prefix}/backward_saved_frac": (exact - made) / max(exact, 1),
        }

    def _per_expert(self, pl_module, names, windows, records, exact: int) -> dict[str, float]:
        """``routing/<expert>/*`` for each expert that trained this step (a window never straddles two experts,
        so its first step names its expert): exact GRPO's backward passes split by the expert's trained steps."""
        times = pl_module.sampler.times
        trained = list(pl_module.plan.trained_steps)
        of_step = dict(zip(trained, pl_module.policy.expert_index(times[trained])))
        values = {}
        for e, name in enumerate(names):
            share = sum(of_step[k] == e for k in trained)
            if not share:
                continue
            mine = [w for w in windows if of_step[w.steps[0]] == e]
            made = sum(r.backwards for r in records if of_step[r.steps[0]] == e)
            values |= self._values(f"routing/{name}", mine, exact * share / len(trained), made)
        return values

    def routing_frequency(self) -> torch.Tensor:
        """Share of training steps in which each trained step sat inside a routed window."""
        if self.routed_counts is None:
            return torch.zeros(0)
        return self.routed_counts / max(1, self.steps_seen)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.plot or self.routed_counts is None or not pl_module.objective.routes_sde_windows:
            return  # a forward-process objective (NFT, AWM): no routed timesteps, no residuals to plot
        path = log_dir(trainer) / "routing.png"  # on every process (it broadcasts)
        if trainer.is_global_zero:
            times = pl_module.sampler.times[pl_module.trained_steps]
            policy = pl_module.policy
            experts = policy.expert_index(times) if len(policy.expert_names) > 1 else None
            self.save_plot(path, times, trainer, experts, policy.expert_names)

    def save_plot(self, path: Path, times: torch.Tensor, trainer: L.Trainer | None = None,
                  experts: list[int] | None = None, expert_names: tuple[str, ...] = ()) -> Path:
        """Write the plot to ``path`` and, given a trainer, send it to its image-capable loggers as ``routing``;
        ``experts``: each trained step's expert (index into ``expert_names``), to colour its bar."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_freq, ax_score) = plt.subplots(1, 2, figsize=(10, 3.6))
        freq = self.routing_frequency()
        if experts is None:
            ax_freq.bar(range(len(freq)), freq.numpy(), color="tab:blue")
        else:
            palette = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
            for e, name in enumerate(expert_names):
                at = [k for k, x in enumerate(experts) if x == e]
                ax_freq.bar(at, freq[at].numpy(), color=palette[e % len(palette)], label=name)
            ax_freq.legend(fontsize=7)
        ax_freq.set_xticks(range(len(freq)), [f"{float(t):.2f}" for t in times], rotation=60, fontsize=7)
        ax_freq.set(xlabel="trained step (t)", ylabel="share of steps routed to JAGG", ylim=(0, 1.05),
                    title="routing frequency per timestep")
        routed = [s for s, r in self.scores if r]
        exact = [s for s, r in self.scores if not r]
        ax_score.hist([routed, exact], bins=20, stacked=True, label=["JAGG", "exact"],
                      color=["tab:blue", "tab:orange"])
        ax_score.set(xlabel="interpolation residual", ylabel="windows", title="routing score distribution")
        ax_score.legend()
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
        if trainer is not None:
            fig.canvas.draw()
            log_image(trainer, "routing", np.asarray(fig.canvas.buffer_rgba())[..., :3].copy(), trainer.global_step)
        plt.close(fig)
        return path
