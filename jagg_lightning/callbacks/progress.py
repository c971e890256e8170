"""The progress bar of a ``jagg`` run: the optimizer step out of ``max_steps``, the reward and the held-out accuracy
(``val_acc``), instead of Lightning's ``Epoch 19/-2`` and ``v_num``, on one line of an 80-column terminal."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache

_RICH = RequirementCache("rich>=10.2.2")  # RichProgressBar's own requirement
_Base = RichProgressBar if _RICH else TQDMProgressBar


class StepProgressBar(_Base):
    """Lightning's progress bar (rich when installed) showing ``step: 12/60`` with ``reward`` and ``val_acc``. While
    training, rich's line holds the epoch, a short bar, the elapsed time and the metrics -- not the epoch's batch count
    nor its time left and speed, which say little beside the step --, so it fits 80 columns
    (``Epoch 19 ━━━━━━━━━━━━ 0:01:32 step: 60/60 reward: 0.537 val_acc: 0.633``: 71)."""

    def get_metrics(self, trainer, pl_module) -> dict:
        items = dict(super().get_metrics(trainer, pl_module))
        items.pop("v_num", None)
        if trainer.training:
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
            items = {"step": f"{trainer.global_step}/{total}", **items}
        return items

    def _get_train_description(self, current_epoch: int) -> str:  # rich: "Epoch 19/-2" without max_epochs
        return f"Epoch {current_epoch}" if self.trainer.max_epochs in (None, -1) else super()._get_train_description(
            current_epoch)

    def configure_columns(self, trainer) -> list:
        """rich's columns: while fitting the description, a 12-character bar, the elapsed time (the metrics follow);
        in validate / test / predict Lightning's own (their batch count is the progress)."""
        columns = super().configure_columns(trainer)
        if trainer.state.fn != "fit":
            return columns
        from lightning.pytorch.callbacks.progress.rich_progress import CustomBarColumn
        from rich.progress import TextColumn, TimeElapsedColumn

        theme = self.theme
        return [TextColumn("[progress.description]{task.description}"),
                CustomBarColumn(bar_width=12, complete_style=theme.progress_bar,
                                finished_style=theme.progress_bar_finished, pulse_style=theme.progress_bar_pulse),
                TimeElapsedColumn()]


def finish_progress_bar(trainer, pl_module) -> None:
    """Let a live (rich) progress bar make its last redraw now -- it would at teardown --, so that a line printed next
    comes after the finished bar, not above it. TQDM's bar is closed at the end of training already."""
    bar = trainer.progress_bar_callback
    progress = getattr(bar, "progress", None)
    if _RICH and isinstance(bar, RichProgressBar) and progress is not None and progress.live.is_started:
        bar.teardown(trainer, pl_module, stage_name(trainer))
        bar.progress = None  # stopped for good: rich writes a line at every stop, its own teardown has none left


def stage_name(trainer) -> str:
    """``fit`` / ``validate`` / ``test`` / ``predict``: the Trainer's function by its value."""
    fn = trainer.state.fn
    return str(getattr(fn, "value", fn))
