"""Where the time went: every training step's wall seconds per phase (``time/<phase>``, :mod:`jagg_lightning.utils.timing`)
to every logger, the step's samples per second, and the run's shares for its closing summary."""

from __future__ import annotations

import time
from collections import defaultdict

import lightning as L
import torch

from jagg_lightning.utils.timing import CLOCK, PHASES


class StepTimes(L.Callback):
    """``time/<phase>`` of every training step, logged to every logger; the run's totals in ``totals``.

    A step runs from one training batch's start to the next's, so what callbacks do after it (held-out evaluations,
    sample grids) is its own: ``time/rollout``, ``time/decode``, ``time/reward``, ``time/update/forward``,
    ``time/update/backward``, ``time/optimizer``, ``time/collectives``, ``time/evaluation``, ``time/checkpoint`` (exclusive wall seconds,
    :mod:`jagg_lightning.utils.timing`), ``time/other`` (the step's time in none of them: Lightning's loop, logging,
    the data), ``time/step`` (their sum) and ``time/samples_per_s`` (the step's rollout samples, all processes, per
    second of the step). On a GPU each phase boundary synchronizes the device. ``shares()``: each phase's share of
    the run's training time (``RunSummary`` prints them). The ``jagg`` CLI adds it to every fit.
    """

    def __init__(self):
        super().__init__()
        self.totals: dict[str, float] = defaultdict(float)
        self.samples = 0
        self.last: dict[str, float] = {}
        self._pending: tuple[int, int] | None = None
        self._since = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        CLOCK.start(torch.cuda.synchronize if pl_module.device.type == "cuda" else None)
        self.totals, self.samples, self._pending = defaultdict(float), 0, None
        self._since = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._flush(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollout = getattr(pl_module, "last_rollout", None)
        samples = 0 if rollout is None else int(rollout.advantages.shape[0]) * trainer.world_size
        self._pending = (trainer.global_step, samples)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._validating = not trainer.sanity_checking and CLOCK.enter("evaluation")  # a validation loop during fit

    def on_validation_end(self, trainer, pl_module) -> None:
        if getattr(self, "_validating", False):
            CLOCK.exit()
        self._validating = False

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer)
        CLOCK.stop()

    def _flush(self, trainer) -> None:
        """The step that ended (if any): its phases, logged at its global step."""
        now = time.perf_counter()
        seconds, phases = now - self._since, CLOCK.take()
        self._since = now
        if self._pending is None:
            return
        step, samples = self._pending
        self._pending = None
        values = {f"time/{name}": value for name, value in phases.items()}
        values["time/other"] = max(seconds - sum(phases.values()), 0.0)
        values["time/step"] = sum(values.values())
        values["time/samples_per_s"] = samples / values["time/step"] if values["time/step"] > 0 else 0.0
        for name, value in values.items():
            if name != "time/samples_per_s":
                self.totals[name] += value
        self.samples += samples
        self.last = values
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def shares(self) -> dict[str, float]:
        """Each phase's share of the run's step time (``other`` included; they add up to 1), largest first."""
        total = self.totals.get("time/step", 0.0)
        if total <= 0:
            return {}
        shares = {name[5:]: value / total for name, value in self.totals.items() if name != "time/step"}
        return dict(sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])))

    def samples_per_s(self) -> float:
        total = self.totals.get("time/step", 0.0)
        return self.samples / total if total > 0 else 0.0


__all__ = ["PHASES", "StepTimes"]
