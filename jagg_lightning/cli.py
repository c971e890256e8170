"""``jagg fit --config configs/tiny.yaml``: LightningCLI over JAGGModule and PromptDataModule.

Subcommands: ``fit``, ``validate`` (held-out prompts, ODE sampling, see docs/configuration.md),
``predict`` (images for prompts with the trained adapter), ``test`` and ``serve-reward`` (a reward behind
HTTP, :mod:`jagg_lightning.rewards.server`; not a LightningCLI subcommand).

What the CLI adds to LightningCLI:

- the ``lora_export`` section (the adapter is always written at the end of fit);
- crash-safe checkpoints (:class:`AtomicCheckpointIO`) unless the user gives their own checkpoint plugin,
  added at trainer construction so that every saved or printed config stays re-runnable;
- ``--ckpt_path`` with ``--model.*`` overrides: LightningCLI would silently replace them with the
  checkpoint's hyper-parameters. Here overrides of settings that do not change what the checkpoint holds
  (sampling, grpo, jagg, reward, ...) apply; the others stop the run with a message naming them;
- a bad value found while building the objects stops with the module's own message (no traceback).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from jagg_lightning.callbacks import LoRAExport, PredictionImages
from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.data import PromptDataModule
from jagg_lightning.config import check_precision
from jagg_lightning.module import JAGGModule
from jagg_lightning.policies.base import PolicyBuildError

# model settings an existing checkpoint does not depend on: changing them on resume is safe
SAFE_ON_RESUME = ("sampling.", "grpo.", "jagg.", "evaluation.", "reward", "reward_workers", "policy.guidance_scale",
                  "policy.negative_prompt", "policy.max_sequence_length", "policy.resolution", "policy.dtype")


def _leaves(namespace) -> dict:
    """Flat {dotted key: value} of a jsonargparse Namespace (or None)."""
    if namespace is None:
        return {}
    return dict(namespace.items(branches=False)) if hasattr(namespace, "items") else {"": namespace}


def _safe_on_resume(key: str) -> bool:
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in SAFE_ON_RESUME)


class JAGGCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(LoRAExport, "lora_export")

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return super()._parse_ckpt_path()
        user = _leaves(self.config[subcommand].get("model"))
        defaults = _leaves(self._subcommand_parsers[subcommand].get_defaults().get("model"))
        super()._parse_ckpt_path()  # the checkpoint's hyper-parameters replace the model section
        restored = _leaves(self.config[subcommand].get("model"))
        # what the user said: values that differ from both the defaults and the checkpoint
        given = {k: v for k, v in user.items() if v != defaults.get(k) and v != restored.get(k)}
        refused = sorted(k for k in given if not _safe_on_resume(k))
        if refused:
            listed = "; ".join(f"model.{k}: checkpoint {restored.get(k)!r}, given {given[k]!r}" for k in refused)
            self._error(
                f"--ckpt_path {ckpt_path}: cannot change on resume what the checkpoint's LoRA or optimizer state "
                f"depends on: {listed}. Drop these overrides, or start a new run without --ckpt_path."
            )
        for key, value in given.items():
            self.config[subcommand][f"model.{key}"] = value
        if given:
            print(f"Resuming from {ckpt_path} with overrides: "
                  + ", ".join(f"model.{k}={v!r}" for k, v in sorted(given.items())), file=sys.stderr)

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if self.subcommand in ("validate", "test", "predict") and not config.get("ckpt_path") \
                and not config.get("model.policy.adapter"):
            print(f"jagg {self.subcommand}: no --ckpt_path and no --model.policy.adapter: sampling the untrained base "
                  "model", file=sys.stderr)
        try:  # LightningCLI builds the model before the datamodule: check both before any model is built
            check_precision(config.get("trainer", {}).get("precision"), config.get("model.policy.dtype"))
            data = config.get("data")
            if data is not None and not hasattr(data, "class_path"):
                PromptDataModule.check_arguments(**dict(data.items()))
        except (ValueError, FileNotFoundError) as err:
            self._error(str(err))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:
            self._error(str(err))

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except PolicyBuildError as err:  # found while the model is built (LoRA targets, adapter): no traceback
            self._error(str(err))

    def _instantiate_trainer(self, config: dict, callbacks: list):
        plugins = config.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        config["plugins"] = plugins
        if self.subcommand == "predict":  # predictions are images: write them unless the user has a writer
            given = config.get("callbacks") or []
            given = given if isinstance(given, list) else [given]
            if not any(isinstance(c, BasePredictionWriter) for c in [*given, *callbacks]):
                callbacks = [*callbacks, PredictionImages()]
        return super()._instantiate_trainer(config, callbacks)

    def _error(self, message: str) -> None:
        print(f"jagg: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def cli_main(args=None, run: bool = True) -> JAGGCLI:
    """``run=False`` parses and builds model, datamodule and trainer without a subcommand (for tests)."""
    return JAGGCLI(
        JAGGModule,
        PromptDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"accelerator": "auto", "devices": 1},
        auto_configure_optimizers=False,  # the module's own model.optimizer sees only the LoRA parameters
    )


def main() -> None:
    """Console entry point (``jagg``): returns nothing, so the exit status is LightningCLI's."""
    if sys.argv[1:2] == ["serve-reward"]:  # its own argument parser: it builds a reward, not a Trainer
        from jagg_lightning.rewards.server import serve_main

        raise SystemExit(serve_main(sys.argv[2:]))
    cli_main()


if __name__ == "__main__":
    main()
