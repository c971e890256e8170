"""Stop on a scheduler's signal with a checkpoint, the adapter as ``lora/last`` and a non-zero exit status.

``jagg fit`` adds :class:`Preemption` unless the config names one; in your own Trainer, add it to ``callbacks``.
The math of a safe point (where a step may stop and why that is consistent) is in :mod:`jagg_lightning.faults.preemption`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from jagg_lightning.distributed.collectives import Collectives
from jagg_lightning.faults import preemption

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preemption(L.Callback):
    """A checkpoint at the next safe point on a stop signal (a scheduler's SIGTERM, Ctrl-C), then exit.

    On any of ``signals`` during fit: stop at the next safe point (after the rollout micro-batch being sampled and
    scored, before the update, or after the running step: :mod:`jagg_lightning.faults.preemption`), write a checkpoint
    and exit with status 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1). ``LoRAExport`` writes the
    adapter to ``<lora dir>/last`` with that checkpoint; ``final`` is written only when fit ends normally.

    The checkpoint goes to ``<dirpath>/<filename>.ckpt`` (dirpath None = ``<default_root_dir>/checkpoints``); resume
    with ``--ckpt_path`` on it and the run ends with the same weights, bit for bit, as one never stopped. Under SLURM
    (Lightning's ``SLURMEnvironment`` with ``auto_requeue``) it goes to Lightning's ``hpc_ckpt_<n>.ckpt`` in
    ``default_root_dir`` instead, which Lightning loads by itself when the job starts again, and on the environment's
    requeue signal (SIGUSR1 unless set) rank 0 requeues the job (``scontrol requeue``), as Lightning's own handler
    would -- ours waits for a safe point instead of saving from inside the signal handler.

    Args:
        signals: The signal names that stop the run (`SIGTERM`, `SIGUSR1`, `SIGINT`, ...); null = SIGTERM and
            SIGUSR1 (the `jagg` CLI adds SIGINT).
        dirpath: The checkpoint's folder outside SLURM; null = `<default_root_dir>/checkpoints`.
        filename: The checkpoint's file name without `.ckpt` and without `/`.
    """

    def __init__(self, signals: list[str] | None = None, dirpath: str | None = None, filename: str = "preempted"):
        super().__init__()
        names = list(DEFAULT_SIGNALS if signals is None else signals)
        if not names:
            raise ValueError("Preemption.signals must name at least one signal (e.g. [SIGTERM, SIGUSR1])")
        self.signals = [preemption.signal_number(n) for n in names]
        if not filename or "/" in filename:
            raise ValueError(f"Preemption.filename must be a file name without '/', got {filename!r}")
        self.dirpath, self.filename = dirpath, filename
        self._stop: preemption.StopSignals | None = None
        self.checkpoint_path: Path | None = None  # written on the last stop

    def checkpoint_file(self, trainer) -> Path:
        """Where a stop writes its checkpoint outside SLURM (``--ckpt_path last`` considers it:
        cli/lightning_cli.py)."""
        return Path(self.dirpath or Path(trainer.default_root_dir) / "checkpoints") / f"{self.filename}.ckpt"

    # ------------------------------------------------------------------ handlers
    def on_train_start(self, trainer, pl_module) -> None:
        # after Lightning has set its own handlers (its SIGTERM one would stop only after the step, its SLURM one
        # saves from inside the handler, mid-step): ours replace them for these signals until fit ends
        announce = preemption.announce if trainer.is_global_zero else None
        self._stop = preemption.StopSignals(self.signals, announce).install()
        if getattr(trainer, "received_sigterm", False):  # a SIGTERM that came while Lightning's handler was in place
            self._stop.received = self._stop.received or 15

    def _restore(self) -> None:
        if self._stop is not None:
            self._stop.restore()
            self._stop = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not _last_step(trainer):  # the last step ends fit normally (and writes lora/final)
            preemption.check(Collectives(trainer).max_over_world, trainer.global_step, "the end of the step")

    def on_train_end(self, trainer, pl_module) -> None:  # before Lightning restores the handlers it found
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    # ------------------------------------------------------------------ the stop
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, (preemption.Preempted, SIGTERMException)):
            return
        self._restore()
        environment = trainer._accelerator_connector.cluster_environment
        slurm = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        if slurm:  # Lightning's own resume path on a requeued SLURM job
            path = Path(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        else:
            path = self.checkpoint_file(trainer)
        # every process: a sharded strategy gathers; LoRAExport writes lora/last. A full checkpoint (optimizer, loops,
        # callbacks: what a resume needs) said outright, or Lightning logs "`weights_only` was not set" on every stop
        trainer.save_checkpoint(path, weights_only=False)
        self.checkpoint_path = path
        if not trainer.is_global_zero:
            return
        signum = getattr(exception, "signum", 15)
        where = getattr(exception, "where", "the end of the step")
        requeued = slurm and signum == int(environment.requeue_signal) and _requeue_slurm_job()
        # "last" is the newest of this checkpoint and ModelCheckpoint's last files (cli/outputs.py): the same command
        # with --ckpt_path last resumes here, as the explicit path does
        resume = "the requeued job resumes from it" if requeued else (
            f"resume with the same command and --ckpt_path last (the newest checkpoint: this one) or --ckpt_path {path}")
        print(f"jagg: stopped by {preemption.signal_name(signum)} at step {trainer.global_step} ({where}): checkpoint "
              f"{path}, adapter in lora/last (not final); {resume}", file=sys.stderr, flush=True)


def _last_step(trainer) -> bool:
    """The step that just ended is fit's last: ``max_steps`` reached, or the last batch of the last epoch."""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return True
    epoch_ended = trainer.fit_loop.epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    return epoch_ended and trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs


def _requeue_slurm_job() -> bool:
    """``scontrol requeue`` this job (array jobs: ``<array job>_<task>``); True when it said yes."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        print(f"jagg: cannot requeue: SLURM_JOB_ID {job!r} is not a job id", file=sys.stderr)
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"jagg: scontrol requeue {job} failed: {err}", file=sys.stderr)
        return False
    if done.returncode != 0:
        print(f"jagg: scontrol requeue {job} failed ({done.returncode}): {done.stderr.strip()}", file=sys.stderr)
    return done.returncode == 0
