"""The progress bar of a ``jagg`` run: the optimizer step out of ``max_steps``, the reward and the held-out accuracy
(``val_acc``), instead of Lightning's ``Epoch 19/-2`` and ``v_num``."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache

_Base = RichProgressBar if RequirementCache("rich>=10.2.2") else TQDMProgressBar  # RichProgressBar's own requirement


class StepProgressBar(_Base):
    """Lightning's progress bar (rich when installed) showing ``step 12/60`` with ``reward`` and ``val_acc``."""

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
