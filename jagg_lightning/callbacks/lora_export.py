"""Write the trained LoRA in the formats users load (PEFT and diffusers); the layout itself lives in
:mod:`jagg_lightning.models.adapters`."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import lightning as L

from jagg_lightning.callbacks.model_card import card_facts, write_card
from jagg_lightning.callbacks.progress import finish_progress_bar
from jagg_lightning.callbacks.summary import run_metrics
from jagg_lightning.faults.io import atomic_directory, remove_directory
from jagg_lightning.models.adapters import lora_state_dict, save_adapter
from jagg_lightning.utils.timing import CLOCK

export_lora = save_adapter  # the name this module has always exported

__all__ = ["LoRAExport", "export_lora", "lora_state_dict"]


class LoRAExport(L.Callback):
    """The trained adapter, exported at every checkpoint save and at the end of fit.

    The EMA weights when enabled; with ``policy.trainable: full`` the whole transformer instead, as
    ``<dir>/<last|final>/transformer`` (Wan2.2: and ``<dir>/<last|final>/transformer_2``; ``jagg_lightning.models.export``).
    ``final/`` supersedes ``last/``: once ``final/`` is written whole, ``last/`` is removed (crash-safely,
    ``jagg_lightning.faults.io.remove_directory``). Beside each export a model card, ``README.md`` (the hub's metadata,
    the reward, the method and its settings, the steps, the metrics first -> last, the latest sample grid as
    ``samples.png``, how to load it: ``jagg_lightning.callbacks.model_card``); ``final/``'s is written once the run's
    last evaluations are in (at teardown). ``exported`` maps ``last`` and ``final`` to the path written. ``jagg fit``
    does not start a new run into a folder that holds an earlier run's ``last/`` or ``final/``
    (``jagg_lightning.cli.outputs``, ``--overwrite true``).

    Args:
        dirpath: Where to write: `last/` (updated at every checkpoint) and `final/` (end of fit), each with `peft/`
            and `diffusers/`; null = `<trainer.default_root_dir>/lora`.
    """

    def __init__(self, dirpath: str | None = None):
        super().__init__()
        self.dirpath = dirpath
        self.exported: dict[str, Path] = {}  # "last" / "final" -> where it was written (rank 0)

    def folder(self, trainer: L.Trainer) -> Path:
        """Where the exports go: ``dirpath``, or ``<trainer.default_root_dir>/lora``."""
        return Path(self.dirpath or Path(trainer.default_root_dir) / "lora")

    def _export(self, trainer, pl_module, name: str) -> Path | None:
        with CLOCK.phase("checkpoint"):
            return self._write(trainer, pl_module, name)

    def _write(self, trainer, pl_module, name: str) -> Path | None:
        if pl_module.policy.config.trainable == "full":  # no adapter: the consolidated transformer (export.py)
            from jagg_lightning.models.export import save_transformer, transformer_state_dict
            from jagg_lightning.utils.dtypes import DTYPES

            policy, dtype = pl_module.policy, DTYPES[pl_module.policy.config.dtype]
            folder = self.folder(trainer) / name
            # rank 0 builds the whole <name>/ (Wan2.2: both networks) aside: a failed write leaves the previous pair
            with (atomic_directory(folder) if trainer.is_global_zero else nullcontext()) as tmp:
                for network, module in policy.trained_networks().items():  # Wan2.2: transformer, then transformer_2
                    with pl_module.inference_weights():
                        weights = transformer_state_dict(module, dtype)  # every rank: FSDP2 gathers its shards
                    if trainer.is_global_zero:
                        save_transformer(policy, tmp / network, weights, step=trainer.global_step, network=network)
                    del weights  # one network's whole copy in host memory at a time
            return folder / "transformer" if trainer.is_global_zero else None
        with pl_module.inference_weights():
            weights = lora_state_dict(pl_module.policy.transformer)  # every rank: FSDP2 gathers its shards
            extra = {n: lora_state_dict(m) for n, m in pl_module.policy.extra_lora_modules().items()}  # Wan2.2
        if not trainer.is_global_zero:
            return None
        return export_lora(pl_module.policy, self.folder(trainer) / name, step=trainer.global_step, weights=weights,
                           extra_weights=extra)

    def _card(self, trainer, pl_module, name: str) -> None:
        """The model card beside the export ``name`` (rank 0: ``exported`` holds only its paths)."""
        path = self.exported.get(name)
        if path is not None:
            folder = path.parent if path.name == "transformer" else path  # a full fine-tune: <name>/transformer
            with CLOCK.phase("checkpoint"):
                write_card(folder, card_facts(trainer, pl_module, run_metrics(trainer)))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        path = self._export(trainer, pl_module, "last")
        if path is not None:
            self.exported["last"] = path
            self._card(trainer, pl_module, "last")

    def on_fit_end(self, trainer, pl_module) -> None:
        path = self._export(trainer, pl_module, "final")
        if path is not None:
            self.exported["final"] = path
            remove_directory(self.folder(trainer) / "last")  # an older adapter beside the final one misleads
            self.exported.pop("last", None)
            finish_progress_bar(trainer, pl_module)  # the line below the finished bar, not above its last redraw
            print(f"LoRA adapter written to {path}")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # after every callback's on_fit_end: the final evaluation is in the card
            self._card(trainer, pl_module, "final")
