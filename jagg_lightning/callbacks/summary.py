"""What a run came to, printed once at its end (rank 0), below the finished progress bar: every ``val/*`` (``test/*``)
metric first -> last, the wall and CPU time, where the adapter, the checkpoints (the one a resumed fit started from
among them), the logs and the images are, where the training time went (``StepTimes``' shares) and, on CUDA, the
peak memory against ``jagg plan``'s (``PeakMemory``). A resumed fit says so as it starts: ``jagg fit: resuming from step N of
<checkpoint>``."""

from __future__ import annotations

import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from jagg_lightning.callbacks.progress import finish_progress_bar, stage_name
from jagg_lightning.training.grids import weights_label
from jagg_lightning.training.images import log_dir

# the test bed's and the module's evaluation metrics, in this order, then any other one by name (docs/callbacks.md)
LABELS = {"digit_accuracy": "held-out accuracy", "judge_accuracy": "judge accuracy", "digit_reward": "held-out reward",
          "judge_agreement": "judge agreement", "reward_mean": "val-set reward"}
PICTURES = (".png", ".gif")


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 99.5 else f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def number(value: float) -> str:
    """Three decimals, half up, after rounding away float32's last digits (a share of 240 samples, 183/240 = 0.7625
    logged as 0.76249999, prints 0.763); a small or large value in four significant digits."""
    if not (1e-3 <= abs(value) < 1e4 or value == 0):
        return f"{value:.4g}"
    return str(Decimal(repr(round(value, 6))).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


def _list(folder: Path, names: list[str]) -> str:
    """``folder/`` and its files: all of up to three, else the first and the last and how many."""
    names = sorted(names)
    shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]} ({len(names)} files)"
    return f"{folder}/: {shown}"


def merged_evaluations(kept: list, current: list) -> list[tuple[int, dict[str, float]]]:
    """A checkpoint's (step, {name: value}) evaluations before this run's, by step (a step evaluated by both, as the
    step a fit resumes at, once: this run's value)."""
    by_step = {int(step): dict(values) for step, values in kept}
    by_step.update({int(step): dict(values) for step, values in current})
    return sorted(by_step.items())


def run_metrics(trainer) -> dict[str, dict[int, float]]:
    """Every evaluation metric of the run so far, {name: {step: value}}: what ``RunSummary`` recorded (the ``val/*``
    of each validation loop, and of the runs a resumed fit continues) and every callback's ``evaluations``."""
    series: dict[str, dict[int, float]] = {}
    for callback in trainer.callbacks:
        for name, values in (getattr(callback, "series", None) if isinstance(callback, RunSummary) else {}).items():
            series.setdefault(name, {}).update(values)
    for callback in trainer.callbacks:
        for step, values in getattr(callback, "evaluations", None) or []:
            for name, value in values.items():
                series.setdefault(name, {})[step] = float(value)
    return series


class KeptEvaluations:
    """A callback's ``evaluations`` kept in the checkpoint, so that a resumed fit's summary starts at the earlier run's
    first evaluation (its step 0), not at the step it resumed from. Mixed into the evaluation callbacks."""

    evaluations: list[tuple[int, dict[str, float]]]

    def state_dict(self) -> dict:
        return {"evaluations": [(step, dict(values)) for step, values in self.evaluations]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.evaluations = merged_evaluations(state_dict.get("evaluations", []), self.evaluations)


class RunSummary(L.Callback):
    """What a run came to: its metrics first to last, its time and where its files are, printed at its end.

    At the end of ``fit`` / ``validate`` / ``test``, once, on rank 0 (the ``jagg`` CLI adds it). ``series`` holds every evaluation metric: {name: {step: value}}, from what each
    evaluation leaves in ``trainer.callback_metrics`` and from any callback's ``evaluations`` list of (step, {name:
    value}) (``DigitAccuracy``, which logs to the loggers directly during fit). ``lines`` is what was printed.

    Args:
        print_fn (Callable[[str], object]): Where the lines go (a function of one string; default `print`).
    """

    def __init__(self, print_fn=print):
        super().__init__()
        self.print_fn = print_fn
        self.series: dict[str, dict[int, float]] = {}
        self.lines: list[str] = []
        self._done = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._start = (time.time(), time.perf_counter(), time.process_time())
        self._first_step, self._done, self.series, self._resumed = trainer.global_step, False, {}, None
        self._last_step = trainer.global_step
        self._log_dir = log_dir(trainer) if trainer.loggers else None  # on every process: it broadcasts
        self.earlier_logs: list[tuple[int, int, str]] = []  # (first step, last step, logs folder) of resumed runs

    def state_dict(self) -> dict:
        """What a resumed fit's summary needs of the runs before it: their metrics and where their logs are."""
        logs = list(self.earlier_logs)
        if self._log_dir is not None:
            logs.append((self._first_step, self._last_step, str(self._log_dir)))
        return {"series": {name: dict(values) for name, values in self.series.items()}, "logs": logs}

    def load_state_dict(self, state_dict: dict) -> None:
        for name, values in state_dict.get("series", {}).items():
            self.series[name] = {int(step): float(v) for step, v in values.items()} | self.series.get(name, {})
        self.earlier_logs = [(int(a), int(b), str(folder)) for a, b, folder in state_dict.get("logs", [])
                             if self._log_dir is None or Path(folder).parts[-2:] != self._log_dir.parts[-2:]]

    def on_train_start(self, trainer, pl_module) -> None:
        self._first_step = self._last_step = trainer.global_step  # after a checkpoint is restored
        self._resumed = (trainer.ckpt_path, trainer.global_step) if trainer.ckpt_path else None
        if self._resumed and trainer.is_global_zero:
            self.print_fn(f"jagg fit: resuming from step {trainer.global_step} of {trainer.ckpt_path}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._last_step = trainer.global_step

    def _record(self, trainer) -> None:
        for name, value in trainer.callback_metrics.items():
            if name.startswith(("val/", "test/")):
                self.series.setdefault(name, {})[trainer.global_step] = float(value)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._record(trainer)
            self._done = trainer.state.fn == "validate"

    def on_test_end(self, trainer, pl_module) -> None:
        self._record(trainer)
        self._done = True

    def on_fit_end(self, trainer, pl_module) -> None:
        self._done = True  # a fit that stopped on an error or a signal never gets here: no summary

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if not (self._done and trainer.is_global_zero):
            return
        self._done = False
        self.series = run_metrics(trainer)
        finish_progress_bar(trainer, pl_module)  # these lines below the finished bar
        self.lines = self.summary(trainer, pl_module)
        self.print_fn("\n".join(self.lines))

    def summary(self, trainer, pl_module) -> list[str]:
        wall, cpu = time.perf_counter() - self._start[1], time.process_time() - self._start[2]
        fn = stage_name(trainer)
        if fn == "fit":
            head = f"jagg fit: {trainer.global_step - self._first_step} steps"
        else:
            policy = getattr(pl_module, "policy_config", None)
            what = weights_label(fn, trainer.global_step, trainer.ckpt_path, getattr(policy, "adapter", None))[0]
            head = f"jagg {fn}: {what}"
        lines = [f"{head} in {duration(wall)} wall, {duration(cpu)} CPU"]
        lines += self.metric_lines(steps=fn == "fit")
        if fn == "fit":
            lines += self.adapter_lines(trainer) + self.checkpoint_lines(trainer)
        lines += self.log_lines(trainer, fn == "fit")
        lines += self.picture_lines(trainer)
        return lines + self.time_lines(trainer) + self.memory_lines(trainer) if fn == "fit" else lines

    def metric_lines(self, steps: bool = True) -> list[str]:
        """One line per metric: its label (the known ones), its name, first → last (the steps: ``steps``)."""
        def order(name: str):
            short = name.split("/", 1)[1]
            return (list(LABELS).index(short) if short in LABELS else len(LABELS), name)

        width = max([len(n) for n in self.series] + [0])
        lines = []
        for name in sorted(self.series, key=order):
            at = sorted(self.series[name])
            first, last = self.series[name][at[0]], self.series[name][at[-1]]
            label = LABELS.get(name.split("/", 1)[1], "")
            if len(at) > 1:
                values = f"{number(first)} → {number(last)}" + (f"  (step {at[0]} → {at[-1]})" if steps else "")
            else:
                values = number(last) + (f"  (step {at[0]})" if steps else "")
            lines.append(f"  {label:<17} {name:<{width}}  {values}")
        return lines

    def adapter_lines(self, trainer) -> list[str]:
        lines = []
        for callback in trainer.callbacks:
            path = getattr(callback, "exported", {}).get("final")
            if path is not None:
                parts = sorted(p.name + "/" for p in Path(path).iterdir() if p.is_dir()) if Path(path).is_dir() else []
                lines.append(f"  {'adapter':<12} {path}/" + (f" ({', '.join(parts)})" if parts else ""))
        return lines

    def checkpoint_lines(self, trainer) -> list[str]:
        saved = {}
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint):
                for path in (callback.best_model_path, callback.last_model_path):
                    if path and Path(path).is_file():
                        saved.setdefault(Path(path).parent, []).append(Path(path).name)
        lines = [_list(folder, sorted(set(names))) for folder, names in saved.items()]
        if not saved:
            why = "" if trainer.checkpoint_callbacks else " (trainer.enable_checkpointing: false)"
            lines = [("none written" if self._resumed else "none") + why]
        if self._resumed:  # where this run took up an earlier one (a Preemption checkpoint, too)
            lines.insert(0, f"resumed from {self._resumed[0]} (step {self._resumed[1]})")
        return [f"  {'checkpoints' if i == 0 else '':<12} {line}" for i, line in enumerate(lines)]

    def log_lines(self, trainer, fit: bool) -> list[str]:
        """Where the logs are; after a resume into a folder of its own (a logger the CLI cannot continue:
        :mod:`jagg_lightning.cli.resumed_logs`), which folder holds which steps. A folder of the same name and parent
        as this run's (the earlier run's own, or it moved whole) is this run's: the CLI continued it."""
        if self._log_dir is None:
            return []
        csv = " (metrics.csv)" if any(isinstance(logger, CSVLogger) for logger in trainer.loggers) else ""
        if not (fit and self.earlier_logs):
            return [f"  {'logs':<12} {self._log_dir}/{csv}"]
        runs = [*self.earlier_logs, (self._first_step, trainer.global_step, str(self._log_dir))]
        return [f"  {'logs' if i == 0 else '':<12} {folder}/{csv}: steps {first} → {last}"
                for i, (first, last, folder) in enumerate(runs)]

    def time_lines(self, trainer) -> list[str]:
        """Where the training time went (``StepTimes``): each phase's share, largest first, and samples per second."""
        timer = next((c for c in trainer.callbacks if callable(getattr(c, "shares", None))), None)
        shares = timer.shares() if timer is not None else {}
        if not shares:
            return []
        parts = [f"{name} {100 * share:.0f} %" for name, share in shares.items() if share >= 0.005]
        parts.append(f"{timer.samples_per_s():.3g} samples/s")
        rows = [", ".join(parts[i:i + 4]) for i in range(0, len(parts), 4)]
        return [f"  {'time' if i == 0 else '':<12} {row}" for i, row in enumerate(rows)]

    def memory_lines(self, trainer) -> list[str]:
        """The run's peak device memory against ``jagg plan``'s (``PeakMemory``, on CUDA; none elsewhere)."""
        lines = [line for c in trainer.callbacks if callable(getattr(c, "summary_line", None))
                 for line in [c.summary_line()] if line]
        return [f"  {'memory':<12} {line}" for line in lines]

    def picture_lines(self, trainer) -> list[str]:
        """The pictures this run wrote: the callbacks' ``written`` lists and what is new in the log directory."""
        since = self._start[0] - 1
        found = {Path(p) for c in trainer.callbacks for p in getattr(c, "written", None) or []
                 if Path(p).suffix in PICTURES}
        if self._log_dir is not None and self._log_dir.is_dir():
            found |= {p for pattern in ("*", "*/*") for p in self._log_dir.glob(pattern)
                      if p.suffix in PICTURES and p.is_file() and p.stat().st_mtime >= since}
        folders: dict[Path, list[str]] = {}
        for path in found:
            folders.setdefault(path.parent, []).append(path.name)
        return [f"  {'images' if i == 0 else '':<12} {_list(folder, names)}"
                for i, (folder, names) in enumerate(sorted(folders.items()))]
