"""A resumed ``jagg fit --ckpt_path ...`` logs where the run it resumes logged: the same ``CSVLogger`` /
``TensorBoardLogger`` version folder, the CSV continued after the checkpoint's step.

Lightning's loggers start a new ``version_<n>`` for every run, so a stopped and resumed run would leave its logs in two
folders. Here, for each logger of the config (``trainer.logger`` with a ``class_path``) that is a ``CSVLogger`` or a
``TensorBoardLogger`` and names no ``version`` itself, the CLI gives it the version folder the checkpoint's run logged to
(``RunSummary`` keeps it in the checkpoint) when that folder is under the logger's root:

- ``CSVLogger``: the rows of ``metrics.csv`` up to the checkpoint's step are kept and the resumed run appends after them;
  rows past it (logged after the checkpoint by a run that then crashed) are dropped, as that run's steps are trained
  again. (Lightning's writer deletes an existing ``metrics.csv``: the file is moved aside while the writer is made, then
  written back cut at the step, crash-safely.)
- ``TensorBoardLogger``: ``purge_step`` (the checkpoint's step + 1): TensorBoard hides the earlier events past it.

Other loggers (MLflow, W&B: their own run ids), a logger built without a ``class_path`` (``logger: true``) or a
checkpoint that does not say where its run logged start a new folder; the closing summary then says which folder holds
which steps (``RunSummary.log_lines``).
"""

from __future__ import annotations

import csv
import importlib
import os
import warnings
from pathlib import Path

from jagg_lightning.faults.io import atomic_write

DEFAULT_NAME = "lightning_logs"  # the loggers' default ``name``
ASIDE = ".before_resume"  # metrics.csv while Lightning's writer is made (found again after a crash in between)


def earlier_run(ckpt_file) -> tuple[int, Path | None] | None:
    """(the checkpoint's global step, the log folder of the run that wrote it, or None) -- None for no checkpoint file
    or one this cannot read (Lightning then reports it)."""
    import torch

    if ckpt_file is None or not Path(ckpt_file).is_file():
        return None
    try:
        checkpoint = torch.load(ckpt_file, map_location="cpu", weights_only=True, mmap=True)
        step = int(checkpoint["global_step"])
    except Exception:  # noqa: BLE001 -- not ours to report: Lightning's restore names the file
        return None
    logs = ((checkpoint.get("callbacks") or {}).get("RunSummary") or {}).get("logs") or []
    return step, (Path(logs[-1][2]) if logs else None)


def _logger_class(class_path: str):
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None  # the CLI's own instantiation reports it


def continued_spec(spec: dict, resumed: tuple[int, Path | None] | None) -> dict:
    """A logger's ``{class_path, init_args}`` to build for a resumed fit: a CSV / TensorBoard logger without a
    ``version`` of its own gets the earlier run's version folder when its root holds a folder of that name (a run moved
    as a whole keeps its logs); TensorBoard also ``purge_step``. Any other spec as it is."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if resumed is None or resumed[1] is None:
        return spec
    cls, init = _logger_class(spec.get("class_path", "")), dict(spec.get("init_args") or {})
    if not (isinstance(cls, type) and issubclass(cls, (CSVLogger, TensorBoardLogger))) or init.get("version") is not None:
        return spec
    name = init.get("name", DEFAULT_NAME)
    root = Path(init.get("save_dir") or ".") / (name or "")
    if not (root / resumed[1].name).is_dir():
        return spec
    init["version"] = resumed[1].name
    if issubclass(cls, TensorBoardLogger):
        init["purge_step"] = resumed[0] + 1  # events at later steps, from a run that went on past the checkpoint
    return {**spec, "init_args": init}


def continue_csv(logger, step: int) -> None:
    """Keep ``logger``'s existing ``metrics.csv`` rows up to ``step`` and have its writer append after them (rank 0)."""
    from lightning.pytorch.loggers import CSVLogger

    if not isinstance(logger, CSVLogger):
        return
    metrics = Path(logger.log_dir) / "metrics.csv"
    aside = metrics.with_name(metrics.name + ASIDE)
    if metrics.is_file():
        os.replace(metrics, aside)
    if not aside.is_file():
        return
    with warnings.catch_warnings():  # "Previous log files ... will be deleted": not so, they are carried over below
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        writer = logger.experiment
    with open(aside, newline="") as file:
        reader = csv.DictReader(file)
        header = list(reader.fieldnames or [])
        kept = [row for row in reader if _step(row) is None or _step(row) <= step]

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as file:
            out = csv.DictWriter(file, fieldnames=header)
            out.writeheader()
            out.writerows(kept)

    atomic_write(metrics, write)
    aside.unlink()
    writer.metrics_keys = list(header)  # its next save appends (a new key rewrites the header with these and it)


def _step(row: dict) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None
