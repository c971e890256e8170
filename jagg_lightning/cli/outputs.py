"""One run, one folder: ``--trainer.default_root_dir DIR`` puts a whole run there, and ``jagg fit`` never replaces what
an earlier run trained.

**The run's folder.** Every path a config places inside its own ``trainer.default_root_dir`` -- the logger's
``save_dir``, ``lora_export.dirpath``, a callback's ``dirpath`` (checkpoints, sample grids, predictions) -- moves with
it when the command line gives another ``--trainer.default_root_dir`` (:func:`follow_root`), unless the command line
sets that path too. What a config leaves unset is there already (``<root>/lora``, ``<root>/checkpoints``, ...).

**No run replaces another.** A new run into folders that hold an earlier run's exported adapter (``lora/final``,
``lora/last``: :class:`~jagg_lightning.callbacks.LoRAExport`) or checkpoints stops at start, before any model is built,
with one line naming the folder and the ways on: a folder of its own (``--trainer.default_root_dir``); ``--ckpt_path``
when that run left a checkpoint (this run then continues it and writes on in its folders); ``--overwrite true``
(replace them as the new run writes).

A run is new unless it resumes: ``--ckpt_path`` names a checkpoint, ``--ckpt_path last`` finds one (Lightning's
choice, or the Preemption callback's), or Lightning finds a SLURM ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``
(a requeued job). The folders looked in are the ones this run writes to: every ``LoRAExport``'s, the ``Preemption``
and ``OnExceptionCheckpoint`` checkpoints', and a ``ModelCheckpoint``'s ``dirpath`` (without one and without a logger:
``<default_root_dir>/checkpoints``; with a logger it is the logger's new ``version_<n>/checkpoints``).
Logs, sample grids and predictions are not looked at: Lightning's loggers give every new run its own ``version_<n>``
(a resumed one logs on in its earlier run's: :mod:`jagg_lightning.cli.resumed_logs`).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from jagg_lightning.callbacks import LoRAExport, Preemption
from jagg_lightning.faults.io import readable_path

EXPORTS = ("final", "last")  # what LoRAExport writes under its folder
RUN_PATHS = ("dirpath", "save_dir")  # the init arguments of loggers and callbacks that say where a run writes


def moved(path, old_root, new_root) -> str | None:
    """``path`` moved from inside ``old_root`` (None: the working directory, as Lightning reads it) to the same place
    inside ``new_root``; None when ``path`` is not inside ``old_root``."""
    if path is None:
        return None
    inside = os.path.relpath(os.path.abspath(path), os.path.abspath(old_root or os.getcwd()))
    if inside == os.pardir or inside.startswith(os.pardir + os.sep):
        return None
    return str(new_root) if inside == os.curdir else os.path.join(str(new_root), inside)


def follow_root(config, old_root, given: set[str]) -> dict[str, str]:
    """Move into ``config``'s ``trainer.default_root_dir`` every run path that ``old_root`` (the root the config files
    gave) held: ``lora_export.dirpath`` and the loggers' and callbacks' ``dirpath`` / ``save_dir`` -- except the keys
    in ``given`` (set on the command line: ``lora_export.dirpath``, ``trainer.logger.save_dir``). ``config`` is the
    subcommand's jsonargparse Namespace, changed in place; returns {key: new path}."""
    new_root, changes = config.get("trainer.default_root_dir"), {}
    if new_root is None:
        return changes
    if "lora_export.dirpath" not in given:
        path = moved(config.get("lora_export.dirpath"), old_root, new_root)
        if path is not None:
            config["lora_export.dirpath"] = changes["lora_export.dirpath"] = path
    for section in ("logger", "callbacks"):
        value = config.get(f"trainer.{section}")
        for item in value if isinstance(value, (list, tuple)) else [value]:
            arguments = getattr(item, "init_args", None)
            for name in RUN_PATHS:
                key = f"trainer.{section}.{name}"
                path = None if key in given else moved(getattr(arguments, name, None), old_root, new_root)
                if path is not None:
                    setattr(arguments, name, path)
                    changes[f"{item.class_path.rsplit('.', 1)[-1]}.{name}"] = path
    return changes


def last_candidates(trainer) -> set[Path]:
    """The checkpoints ``--ckpt_path last`` chooses among: Lightning's (every ``ModelCheckpoint``'s ``last`` files,
    ``OnExceptionCheckpoint``'s file) and the ``Preemption`` callback's."""
    found = {p for c in trainer.callbacks if isinstance(c, Preemption)
             for p in [c.checkpoint_file(trainer)] if p.is_file()}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found |= {Path(p) for p in callback._find_last_checkpoints(trainer)}
        if isinstance(callback, OnExceptionCheckpoint) and Path(callback.ckpt_path).is_file():
            found.add(Path(callback.ckpt_path))
    return found


def resumes(trainer, ckpt_path) -> bool:
    """This fit continues an earlier run: a checkpoint given, found for ``last``, or a SLURM requeue's."""
    if ckpt_path is not None and (str(ckpt_path) != "last" or last_candidates(trainer)):
        return True
    return any(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))  # Lightning resumes from it by itself


def checkpoint_folders(trainer, loggers: bool | None = None) -> set[Path]:
    """The folders this run's checkpoints go to that are not new for every run (see the module docstring);
    ``loggers``: whether the run has loggers, when they are not yet attached (None: the trainer's)."""
    logged = bool(trainer.loggers) if loggers is None else loggers
    root = Path(trainer.default_root_dir)
    folders = set()
    for callback in trainer.callbacks:
        if isinstance(callback, Preemption):
            folders.add(callback.checkpoint_file(trainer).parent)
        elif isinstance(callback, OnExceptionCheckpoint):
            folders.add(Path(callback.ckpt_path).parent)
        elif isinstance(callback, ModelCheckpoint):
            if callback.dirpath is not None:
                folders.add(Path(callback.dirpath))
            elif not logged:
                folders.add(root / "checkpoints")
    return folders


def earlier_outputs(trainer, loggers: bool | None = None) -> list[tuple[str, Path, list[str]]]:
    """What a new run would replace: (field, folder, the names found there), adapters first."""
    found = []
    for callback in trainer.callbacks:
        if isinstance(callback, LoRAExport):
            folder = callback.folder(trainer)
            names = [n for n in EXPORTS if readable_path(folder / n).exists()]
            if names:
                found.append(("lora_export.dirpath", folder, names))
    for folder in sorted(checkpoint_folders(trainer, loggers)):
        names = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
        if names:
            found.append(("checkpoints", folder, names))
    return found


def check_new_run(trainer, ckpt_path, overwrite: bool, loggers: bool | None = None) -> None:
    """ValueError (one line) when a new run would replace an earlier run's adapter or checkpoints: it names the flag
    that gives this run a folder of its own, ``--ckpt_path`` only when the earlier run left a checkpoint to continue
    from, and ``--overwrite true`` (``loggers``: see :func:`checkpoint_folders`; the CLI attaches a run's loggers only
    after this check)."""
    if overwrite or resumes(trainer, ckpt_path):
        return
    found = earlier_outputs(trainer, loggers)
    if not found:
        return
    field, folder, names = found[0]
    what = "adapter" if field == "lora_export.dirpath" else "checkpoints"
    root = Path(trainer.default_root_dir)
    if moved(folder, root, root) is not None:  # inside the run's folder: the one flag moves it all
        own = "--trainer.default_root_dir <another folder> (logs, checkpoints, adapter and images all go there)"
    elif field == "lora_export.dirpath":
        own = "--lora_export.dirpath <another folder>"
    else:
        own = f"another dirpath for the callback that checkpoints to {str(folder)!r}"
    checkpoints = [where / n for kind, where, found_names in found if kind == "checkpoints" for n in found_names]
    resume = ""
    if checkpoints:
        newest = max(checkpoints, key=lambda p: p.stat().st_mtime)
        resume = f", continue that run with --ckpt_path {newest}"
    raise ValueError(
        f"{field}: {str(folder)!r} holds an earlier run's {what} ({', '.join(names)}); a new fit does not write over "
        f"them (nothing was started): give this run its own folder with {own}{resume}, or let it replace them with "
        "--overwrite true")
