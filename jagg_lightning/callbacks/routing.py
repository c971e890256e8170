"""Where JAGG is used: routed share, residual-score quantiles, backward passes saved, and how often each
trained step (by t) sat inside a routed window; at the end of fit a PNG in the log directory."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from jagg_lightning.images import log_dir, log_image
from jagg_lightning.io import atomic_write


class RoutingStats(L.Callback):
    """Logs ``routing/*`` every training step through ``pl_module.log`` (any Lightning logger) and
    writes ``routing.png`` (routing frequency per timestep, score distribution) at the end of fit, also sent
    to every image-capable logger as ``routing``."""

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
        scores = torch.tensor([w.score for w in windows if len(w.steps) > 2] or [0.0])
        q10, q50, q90 = torch.quantile(scores, torch.tensor([0.1, 0.5, 0.9])).tolist()
        pl_module.log_dict(
            {
                "routing/routed_share": sum(w.routed for w in windows) / len(windows),
                "routing/score_q10": q10,
                "routing/score_q50": q50,
                "routing/score_q90": q90,
                "routing/backward_saved": float(exact - made),
                "routing/backward_saved_frac": (exact - made) / max(exact, 1),
            },
            batch_size=1,
        )

    def routing_frequency(self) -> torch.Tensor:
        """Share of training steps in which each trained step sat inside a routed window."""
        if self.routed_counts is None:
            return torch.zeros(0)
        return self.routed_counts / max(1, self.steps_seen)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.plot or self.routed_counts is None:
            return
        path = log_dir(trainer) / "routing.png"  # on every process (it broadcasts)
        if trainer.is_global_zero:
            self.save_plot(path, pl_module.sampler.times[pl_module.trained_steps], trainer)

    def save_plot(self, path: Path, times: torch.Tensor, trainer: L.Trainer | None = None) -> Path:
        """Write the plot to ``path`` and, given a trainer, send it to its image-capable loggers as ``routing``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_freq, ax_score) = plt.subplots(1, 2, figsize=(10, 3.6))
        freq = self.routing_frequency()
        ax_freq.bar(range(len(freq)), freq.numpy(), color="tab:blue")
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
