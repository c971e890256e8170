"""``jagg fit --config configs/tiny.yaml``: LightningCLI over JAGGModule and PromptDataModule (``jagg fit / validate /
test / predict``).

The console entry point is :mod:`jagg_lightning.cli`: it answers ``jagg --help`` / ``--version`` without
importing this module and hands ``fit``, ``validate`` (held-out prompts, ODE sampling, see docs/configuration.md),
``predict`` (images for prompts with the trained adapter) and ``test`` to :func:`lightning_main`; ``serve-reward``
(:mod:`jagg_lightning.rewards.server`) and ``plan`` (:mod:`jagg_lightning.cli.plan`, over :func:`parse_config`)
are not LightningCLI subcommands.

What the CLI adds to LightningCLI:

- the ``lora_export`` section (the adapter is always written at the end of fit);
- a new ``fit`` never replaces an earlier run's exported adapter or checkpoints: it stops at start, naming the folder,
  unless it resumes (``--ckpt_path``) or is told ``--overwrite true`` (:mod:`jagg_lightning.cli.outputs`);
- abbreviated options are refused (``--trainer.max_step`` is not ``max_steps``: "did you mean"), as typos are;
- crash-safe checkpoints (:class:`AtomicCheckpointIO`) unless the user gives their own checkpoint plugin, and
  :class:`Preemption` (SIGTERM / SIGUSR1 / SIGINT: a checkpoint at the next safe point, exit status 128 + signal)
  unless the config names one, and :class:`RunSummary` (the metrics first -> last, the time, where the files are,
  printed at the end), added at trainer construction so that every saved or printed config stays re-runnable;
- ``--ckpt_path`` with ``--model.*`` overrides: LightningCLI would silently replace them with the
  checkpoint's hyper-parameters. Here overrides of settings that do not change what the checkpoint holds
  (sampling, grpo, jagg, reward, ...) apply; the others stop the run with a message naming them;
- a resumed fit logs on in the CSV / TensorBoard version folder of the run it resumes (:mod:`.resumed_logs`);
- a bad value found while building the objects stops with the module's own message (no traceback).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI, instantiate_class
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from jagg_lightning import DESCRIPTION, __version__
from jagg_lightning.callbacks import (LoRAExport, ParameterSummary, PeakMemory, Preemption, PredictionImages,
                                      RunSummary, StepTimes)
from jagg_lightning.callbacks.checkpoint import AtomicCheckpointIO
from jagg_lightning.callbacks.preemption import DEFAULT_SIGNALS
from jagg_lightning.callbacks.progress import StepProgressBar
from jagg_lightning.cli.errors import (
    PIP_NAMES, as_user_field, check_checkpoint_file, check_trainer, command_line_keys, explain_parse_error, flat_keys,
    missing_package, one_line, strategy_error,
)
from jagg_lightning.cli.outputs import check_new_run, follow_root, last_candidates
from jagg_lightning.cli.quiet import quiet_loading_bars
from jagg_lightning.cli.resumed_logs import continue_csv, continued_spec, earlier_run
from jagg_lightning.data import PromptDataModule
from jagg_lightning.distributed.collectives import end_process_group
from jagg_lightning.distributed.context_parallel import ContextParallelError
from jagg_lightning.distributed.peer_failure import exit_line
from jagg_lightning.faults.io import WriteError
from jagg_lightning.faults.nonfinite import NonFiniteError
from jagg_lightning.faults.preemption import EXIT_BASE
from jagg_lightning.module import JAGGModule
from jagg_lightning.rewards import import_all as import_all_rewards
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.training.state import CheckpointMismatchError
from jagg_lightning.utils.checks import PolicyBuildError, check_precision


# model settings an existing checkpoint does not depend on: changing them on resume is safe
SAFE_ON_RESUME = ("sampling.", "grpo.", "jagg.", "memory.", "evaluation.", "reward", "reward_workers",
                  "policy.guidance_scale", "policy.negative_prompt", "policy.max_sequence_length", "policy.resolution",
                  "policy.num_frames", "policy.dtype", "policy.compile")


import_all_rewards()  # jsonargparse lists and resolves the Reward subclasses it has seen imported


def _leaves(namespace) -> dict:
    """Flat {dotted key: value} of a jsonargparse Namespace (or None)."""
    if namespace is None:
        return {}
    return dict(namespace.items(branches=False)) if hasattr(namespace, "items") else {"": namespace}


def _safe_on_resume(key: str, fitting: bool = True) -> bool:
    safe = SAFE_ON_RESUME if fitting else SAFE_ON_RESUME + ("optimizer", "lr_scheduler")
    return any(key.startswith(p) if p.endswith(".") else key == p or key.startswith(p + ".") for p in safe)


class JAGGCLI(LightningCLI):
    def init_parser(self, **kwargs):
        parser = super().init_parser(**kwargs)
        original = parser.error

        def error(message: str, ex: Exception | None = None):  # one line, a suggestion, no usage dump
            if not parser.exit_on_error:
                return original(message, ex)
            known = set()
            for sub in getattr(self, "_subcommand_parsers", {}).values():
                known |= flat_keys(sub.get_defaults())
            if not known:  # no subcommands (jagg plan's parse of a fit config): the parser's own keys
                try:
                    known = flat_keys(parser.get_defaults())
                except Exception:  # a parser that cannot give its defaults: the line without a suggestion
                    pass
            self._error(explain_parse_error(message, self._argv, known))

        parser.error = error
        return parser

    def parse_arguments(self, parser, args) -> None:
        self._argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else sys.argv[1:]
        super().parse_arguments(parser, args)
        self._resume = self._model_as_given()  # LightningCLI then replaces the model section on --ckpt_path
        self._config_root = self._root_of_the_configs(parser)

    def _root_of_the_configs(self, parser):
        """The ``trainer.default_root_dir`` the configs give, when the command line gives another (the run's paths
        inside it follow: :func:`~jagg_lightning.cli.outputs.follow_root`); ``False`` when it gives none."""
        flag = "--trainer.default_root_dir"
        if not any(a == flag or a.startswith(flag + "=") for a in self._argv):
            return False
        argv, skip = [], False
        for a in self._argv:
            if skip or a.startswith(flag + "="):
                skip = False
                continue
            skip = a == flag
            if not skip:
                argv.append(a)
        configs = parser.parse_args(argv)
        subcommand = configs.get("subcommand")
        return (configs.get(subcommand) if subcommand else configs).get("trainer.default_root_dir")

    def _follow_root(self, config) -> None:
        if self._config_root is False:
            return
        given = {f"trainer.{k.replace('.init_args', '')}" for k in command_line_keys(self._argv, "trainer")}
        given |= {f"lora_export.{k}" for k in command_line_keys(self._argv, "lora_export")}
        follow_root(config, self._config_root, given)

    def add_arguments_to_parser(self, parser) -> None:
        # one usage line, so the description comes next (argparse's synopsis of every option ran to 186 lines: a
        # user who typed `jagg fit --help | head` saw no description); the options are listed below it
        parser.usage = "%(prog)s [-h] [--config FILE] [--print_config] [--<section>.<field> VALUE ...]"
        parser.add_lightning_class_args(LoRAExport, "lora_export")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: let this run replace an earlier run's exported adapter and checkpoints in its "
                                 "folders (refused otherwise; docs/configuration.md)")

    def _model_as_given(self) -> tuple | None:
        """(subcommand, ckpt_path, the model section as given, its defaults) when resuming from a checkpoint file
        (a path that is no checkpoint stops here, naming ckpt_path); None otherwise."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return None
        ckpt_path = self.config[subcommand].get("ckpt_path")
        try:
            check_checkpoint_file(ckpt_path)
        except ValueError as err:
            self._error(str(err))
        if not (ckpt_path and Path(ckpt_path).is_file()):
            return None
        return (subcommand, ckpt_path, _leaves(self.config[subcommand].get("model")),
                _leaves(self._subcommand_parsers[subcommand].get_defaults().get("model")))

    def _apply_resume_overrides(self) -> None:
        """On ``--ckpt_path`` the checkpoint's hyper-parameters have replaced the model section: put back what the user
        said that the checkpoint does not depend on, and refuse the rest by name."""
        if self._resume is None:
            return
        subcommand, ckpt_path, user, defaults = self._resume
        restored = _leaves(self.config[subcommand].get("model"))
        # what the user said: values that differ from both the defaults and the checkpoint
        # (or that the command line names, even when it restates a default: --model.policy.lora_alpha 64)
        said = command_line_keys(self._argv, "model")
        given = {k: v for k, v in user.items()
                 if (v != defaults.get(k) or k in said) and v != restored.get(k)}
        # evaluating a checkpoint reads no optimizer state: only what the weights depend on is refused there
        fitting = subcommand == "fit"
        refused = sorted(k for k in given if not _safe_on_resume(k, fitting))
        if refused:
            listed = "; ".join(f"model.{k}: checkpoint {restored.get(k)!r}, given {given[k]!r}" for k in refused)
            self._error(
                f"--ckpt_path {ckpt_path}: cannot change on resume what the checkpoint's LoRA or optimizer state "
                f"depends on: {listed}. Drop these overrides, or start a new run without --ckpt_path." if fitting else
                f"--ckpt_path {ckpt_path}: the checkpoint was trained with other model settings than given: {listed}. "
                "Drop these overrides (the checkpoint's own are used), or give the matching checkpoint."
            )
        for key, value in given.items():
            self.config[subcommand][f"model.{key}"] = value
        if given:
            print(f"Resuming from {ckpt_path} with overrides: "
                  + ", ".join(f"model.{k}={v!r}" for k, v in sorted(given.items())), file=sys.stderr)

    def before_instantiate_classes(self) -> None:
        self._apply_resume_overrides()
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        self._follow_root(config)
        try:  # LightningCLI builds the model before the datamodule: check both before any model is built
            check_trainer(config.get("trainer"))
            check_precision(config.get("trainer", {}).get("precision"), config.get("model.policy.dtype"))
            data = config.get("data")
            if data is not None and not hasattr(data, "class_path"):
                PromptDataModule.check_arguments(**dict(data.items()))
                self._check_eval_prompts(data)
        except (ValueError, FileNotFoundError) as err:
            self._error(str(err))
        if self.subcommand in ("validate", "test", "predict") and not config.get("ckpt_path") \
                and not config.get("model.policy.adapter"):
            print(f"jagg {self.subcommand}: no --ckpt_path and no --model.policy.adapter: sampling the untrained base "
                  "model", file=sys.stderr)

    def _check_eval_prompts(self, data) -> None:
        held_out = data.get("val_prompts") is not None or data.get("val_prompts_file") is not None
        if self.subcommand in ("validate", "test") and not held_out:
            raise ValueError(f"data.val_prompts: jagg {self.subcommand} needs held-out prompts: give data.val_prompts "
                             "(a list) or data.val_prompts_file (one prompt a line)")
        if self.subcommand == "predict" and not held_out and data.get("predict_prompts") is None \
                and data.get("predict_prompts_file") is None:
            raise ValueError("data.predict_prompts: jagg predict needs prompts: give data.predict_prompts (a list), "
                             "data.predict_prompts_file, or validation prompts (data.val_prompts)")

    def instantiate_classes(self) -> None:
        # fit: the loggers are built only once the run is known to be new (before_fit). A logger may write as it is
        # built (MLFlowLogger's client makes <tracking_uri>/0/meta.yaml), and a refused run leaves no files behind.
        config = self.config.get("fit") if self.subcommand == "fit" else None
        given = config.get("trainer.logger") if config is not None else None
        specs = given if isinstance(given, list) else [given]
        self._deferred_loggers = [s for s in specs if hasattr(s, "class_path")] if given else []
        if self._deferred_loggers:
            config["trainer.logger"] = False
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:
            self._error(str(err))
        except ImportError as err:  # a reward built by name whose optional package is missing (its own message)
            line = missing_package(f"{err}; {err.__cause__ or ''}")
            if line is None:
                raise
            self._error(line)
        finally:
            if self._deferred_loggers:
                config["trainer.logger"] = given  # what the run saves as its config.yaml: the loggers as given

    def before_validate(self) -> None:  # the pipeline loads when the subcommand runs: its bars off from here
        quiet_loading_bars()

    before_test = before_predict = before_validate

    def before_fit(self) -> None:
        """A new run never replaces an earlier run's adapter or checkpoints (:mod:`jagg_lightning.cli.outputs`: one
        line, before any model is built, unless ``--overwrite true``). ``--ckpt_path last``: Lightning's choice (the
        newest of ModelCheckpoint's ``last`` files and OnExceptionCheckpoint's), or the Preemption callback's
        checkpoint when that is newer -- a job restarted with the same command after a stop resumes where it stopped."""
        config = self.config_init["fit"]
        _without_validation_step_if_no_val_data(self.model, self.datamodule)
        deferred = getattr(self, "_deferred_loggers", [])
        try:
            check_new_run(self.trainer, config.get("ckpt_path"), bool(config.get("overwrite")),
                          loggers=bool(deferred) or None)
        except ValueError as err:
            self._error(str(err))
        ckpt_file = config.get("ckpt_path")
        if ckpt_file == "last":
            candidates = last_candidates(self.trainer)
            ckpt_file = max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
            if any(isinstance(c, Preemption) and c.checkpoint_file(self.trainer) in candidates
                   for c in self.trainer.callbacks):
                config["ckpt_path"] = str(ckpt_file)
        if deferred:  # a resumed fit logs on in the folder its checkpoint's run logged to (cli/resumed_logs.py)
            resumed = earlier_run(ckpt_file)
            self.trainer.loggers = [self._logger(continued_spec(spec.as_dict(), resumed)) for spec in deferred]
            for logger in self.trainer.loggers if resumed and self.trainer.is_global_zero else []:
                continue_csv(logger, resumed[0])
        quiet_loading_bars()

    def _logger(self, spec: dict):
        """A logger held back until the new-run check passed; one line when its package is missing."""
        try:
            return instantiate_class((), spec)
        except ImportError as err:  # Lightning's requirement hint, or the import itself
            line = missing_package(f"{err}; Problem with given class_path '{spec['class_path']}'", "trainer.logger")
            if line is None:
                raise
            self._error(line)

    def instantiate_trainer(self, **kwargs):
        """The Trainer with the crash-safe checkpoint plugin (unless the user gives a CheckpointIO), the step progress
        bar (unless they give a progress bar), for ``fit`` / ``validate`` / ``test`` the run's summary at its end
        (unless they give one) and, for ``predict``, the image writer (unless they give a writer)."""
        config = dict(self.config_init.get(str(self.subcommand), self.config_init).get("trainer") or {}) | kwargs
        plugins = config.get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        if self.subcommand == "fit" and not any(isinstance(c, Preemption) for c in callbacks):
            # a scheduler's signal, or Ctrl-C: a checkpoint at the next safe point and a non-zero exit status
            callbacks.append(Preemption(signals=[*DEFAULT_SIGNALS, "SIGINT"]))
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in callbacks):
            callbacks.append(ParameterSummary())  # Lightning's, without its FLOPs column (always 0 here)
        if self.subcommand == "fit" and not any(isinstance(c, StepTimes) for c in callbacks):
            callbacks.append(StepTimes())  # time/<phase> of every step, to every logger
        if self.subcommand == "fit" and not any(isinstance(c, PeakMemory) for c in callbacks):
            callbacks.append(PeakMemory())  # on CUDA: each step's peak memory against jagg plan's
        if self.subcommand in ("fit", "validate", "test") and not any(isinstance(c, RunSummary) for c in callbacks):
            callbacks.append(RunSummary())  # what the run came to, printed once at its end
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in callbacks):
            callbacks.append(PredictionImages())  # predictions are images: write them
        try:
            return super().instantiate_trainer(**(kwargs | {"plugins": plugins, "callbacks": callbacks}))
        except MisconfigurationException as err:  # a trainer value Lightning refuses
            self._error(f"trainer: {err}")

    def _error(self, message: str) -> None:
        fail(message)


def _without_validation_step_if_no_val_data(model, datamodule) -> None:
    """A fit without held-out prompts (no ``data.val_prompts``: the data module then has no ``val_dataloader``) runs
    no validation loop: the model's ``validation_step`` is hidden for this run too, so Lightning does not warn
    "You defined a `validation_step` but have no `val_dataloader`" -- a choice, not a mistake."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if datamodule is None or any(is_overridden("val_dataloader", part) for part in (datamodule, model)):
        return
    model.validation_step = LightningModule.validation_step.__get__(model)


def fail(message: str) -> None:
    """One ``jagg: error:`` line (the field as the user wrote it), exit status 2."""
    line = strategy_error(message) or missing_package(message) or one_line(as_user_field(message))
    print(f"jagg: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def cli_main(args=None, run: bool = True) -> JAGGCLI:
    """``run=False`` parses and builds model, datamodule and trainer without a subcommand (for tests). What the run
    itself finds wrong in the configuration stops it with one ``jagg: error:`` line, no traceback."""
    try:
        return JAGGCLI(
            JAGGModule,
            PromptDataModule,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": DESCRIPTION, "version": __version__, "prog": "jagg", "allow_abbrev": False},
            trainer_defaults={"accelerator": "auto", "devices": 1},
            auto_configure_optimizers=False,  # the module's own model.optimizer sees only the LoRA parameters
        )
    except PolicyBuildError as err:  # found while the model is built (LoRA targets, adapter)
        fail(str(err))
    except ContextParallelError as err:  # found when context parallelism meets the built model
        fail(str(err))
    except CheckpointMismatchError as err:  # found when the checkpoint meets the built model
        fail(f"ckpt_path {err.ckpt_path}: {err}")
    except MisconfigurationException as err:  # Lightning's checks of trainer settings at fit start
        fail(f"trainer: {err}")
    except ModuleNotFoundError as err:  # an optional package imported on first use (a logger's writer)
        if (err.name or "").split(".")[0] not in PIP_NAMES:
            raise
        fail(missing_package(str(err)))


class ParseOnlyCLI(JAGGCLI):
    """Parses and checks a config as ``jagg fit`` does, and builds nothing (``jagg plan``)."""

    def instantiate_classes(self) -> None:
        pass


def parse_config(args: list[str]):
    """The config ``jagg fit <args>`` would run (files, overrides, the trainer and data checks), without building any
    object: a jsonargparse Namespace (``model``, ``trainer``, ``data``)."""
    import warnings

    with warnings.catch_warnings():  # `jagg plan` hands its own remaining arguments over: that is the intent
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return ParseOnlyCLI(JAGGModule, PromptDataModule, args=args, run=False,
                            parser_kwargs={"description": DESCRIPTION, "version": __version__, "prog": "jagg plan",
                                           "allow_abbrev": False},
                            trainer_defaults={"accelerator": "auto", "devices": 1}, auto_configure_optimizers=False).config


def lightning_main(args: list[str] | None = None) -> None:
    """``jagg fit / validate / test / predict`` (the console entry point, :mod:`jagg_lightning.cli`, has set the
    quiet defaults and the CPU threads): returns nothing, so the exit status is LightningCLI's."""
    try:
        cli_main(None if args is None or list(args) == sys.argv[1:] else args)
        end_process_group()  # every rank finished: leave together, before interpreter shutdown (collectives.py)
    # a reward (a server) failed, non-finite values stopped the run, or a checkpoint / export could not be written (a
    # full disk): one line, no traceback; the checkpoints and adapters written before are intact
    except (RewardError, NonFiniteError, WriteError) as err:
        print(f"jagg: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except RuntimeError as err:  # a collective failed: a peer died or hung (peer_failure.py); one line, not a traceback
        line = exit_line(err)
        if line is None:
            raise
        print(f"jagg: error: {line}", file=sys.stderr)
        raise SystemExit(1) from None
    except SIGTERMException:  # Lightning's own stop on SIGTERM is a SystemExit with status 0: not a success
        raise SystemExit(EXIT_BASE + signal.SIGTERM) from None

