"""Warn when the trained reward rises while a monitor reward falls: the usual sign of reward hacking."""

from __future__ import annotations

import math

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from jagg_lightning.rewards.monitor import MONITOR_PREFIX


class RewardHackingWatch(L.Callback):
    """Warns when the trained reward rises while a monitor of a ``MonitoredReward`` falls (docs/rewards.md).

    After each training step (``stage: train``, reading ``train/reward_mean`` and
    ``train/reward/monitor/<name>``) or each evaluation (``stage: val``, the ``val/`` values), it keeps the
    series; once it has ``2 * window`` points it compares the mean of the last ``window`` with the mean of
    the first ``window`` (the baseline). When the trained reward has risen by more than ``min_rise`` while
    a monitor has fallen by more than ``margin`` (in the monitor's units; with ``relative`` a fraction of
    the monitor's |baseline|), it warns once, naming both; the warning re-arms when the monitor is back
    within the margin. ``alerts`` lists (step, monitor, rise, drop) of every warning; with ``stage: train`` the drop
    is logged as ``reward_watch/<name>_drop``.

    Args:
        margin: The fall of a monitor that counts, > 0 (in the monitor's units; with `relative` a fraction of its
            |baseline|).
        window: Points averaged at each end of the series, an integer >= 1 (a comparison needs 2 x window points).
        min_rise: The rise of the trained reward that counts, >= 0.
        relative: `margin` as a fraction of the monitor's |baseline| instead of in its units.
        monitors: The monitor names to watch; null = every monitor logged.
        stage: `train` (after each training step, the `train/` values) or `val` (after each evaluation, `val/`).
    """

    def __init__(self, margin: float = 0.05, window: int = 5, min_rise: float = 0.0, relative: bool = False,
                 monitors: list[str] | None = None, stage: str = "train"):
        super().__init__()
        if not (isinstance(margin, (int, float)) and margin > 0 and math.isfinite(margin)):
            raise ValueError(f"RewardHackingWatch.margin must be > 0, got {margin!r}")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"RewardHackingWatch.window must be an integer >= 1, got {window!r}")
        if not min_rise >= 0:
            raise ValueError(f"RewardHackingWatch.min_rise must be >= 0, got {min_rise!r}")
        if stage not in ("train", "val"):
            raise ValueError(f"RewardHackingWatch.stage must be 'train' or 'val', got {stage!r}")
        self.margin, self.window, self.min_rise, self.relative = float(margin), window, float(min_rise), relative
        self.monitors, self.stage = monitors, stage
        self.history: dict[str, list[float]] = {}  # "reward_mean" and each monitor -> values
        self.alerts: list[tuple[int, str, float, float]] = []
        self._alarmed: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stage == "train":
            for name, drop in self.observe(trainer.callback_metrics, trainer.global_step).items():
                pl_module.log(f"reward_watch/{name}_drop", drop, batch_size=1)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.stage == "val" and not trainer.sanity_checking:
            self.observe(trainer.callback_metrics, trainer.global_step)

    def observe(self, metrics: dict, step: int) -> dict[str, float]:
        """Add one point from ``metrics`` (logged name -> value); returns each monitor's drop so far and warns."""
        trained = metrics.get(f"{self.stage}/reward_mean")
        if trained is None:
            return {}
        prefix = f"{self.stage}/reward/{MONITOR_PREFIX}"
        watched = {k[len(prefix):]: float(v) for k, v in metrics.items() if k.startswith(prefix)}
        if self.monitors is not None:
            watched = {n: v for n, v in watched.items() if n in self.monitors}
        for name, value in {"reward_mean": float(trained), **watched}.items():
            self.history.setdefault(name, []).append(value)
        rise = self._change("reward_mean")
        drops = {}
        for name in watched:
            change = self._change(name)
            if rise is None or change is None:
                continue
            baseline = sum(self.history[name][: self.window]) / self.window
            drops[name] = drop = -change
            limit = self.margin * abs(baseline) if self.relative else self.margin
            if rise > self.min_rise and drop > limit:
                if name not in self._alarmed:
                    self._alarmed.add(name)
                    self.alerts.append((step, name, rise, drop))
                    rank_zero_warn(f"possible reward hacking at step {step}: the trained reward ({self.stage}/reward_mean) "
                                   f"rose by {rise:.4g} while monitor {name} fell by {drop:.4g} (margin {limit:.4g}), "
                                   f"mean of the last {self.window} vs the first {self.window} points")
            elif drop <= limit:
                self._alarmed.discard(name)
        return drops

    def _change(self, name: str) -> float | None:
        values = self.history.get(name, [])
        if len(values) < 2 * self.window:
            return None
        return sum(values[-self.window:]) / self.window - sum(values[: self.window]) / self.window

    def state_dict(self) -> dict:
        return {"history": self.history, "alerts": self.alerts, "alarmed": sorted(self._alarmed)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = {k: list(v) for k, v in state_dict.get("history", {}).items()}
        self.alerts = [tuple(a) for a in state_dict.get("alerts", [])]
        self._alarmed = set(state_dict.get("alarmed", []))
