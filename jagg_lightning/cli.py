"""``jagg fit --config configs/tiny.yaml``: LightningCLI over JAGGModule and PromptDataModule."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from jagg_lightning.callbacks import LoRAExport
from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.data import PromptDataModule
from jagg_lightning.module import JAGGModule


class JAGGCLI(LightningCLI):
    """Adds a ``lora_export`` section: the adapter is always written at the end of fit."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(LoRAExport, "lora_export")


def cli_main(args=None, run: bool = True) -> JAGGCLI:
    """``run=False`` parses and builds model, datamodule and trainer without a subcommand (for tests)."""
    return JAGGCLI(
        JAGGModule,
        PromptDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"accelerator": "auto", "devices": 1, "plugins": [AtomicCheckpointIO()]},
    )


def main() -> None:
    """Console entry point (``jagg``): returns nothing, so the exit status is LightningCLI's."""
    cli_main()


if __name__ == "__main__":
    main()
