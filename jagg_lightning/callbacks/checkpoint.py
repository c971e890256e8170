"""Checkpoint I/O that never leaves a torn file: write to a temporary sibling, fsync, rename
(:func:`jagg_lightning.faults.io.atomic_write`).

A save killed half-way (even by kill -9) leaves the previous checkpoint at the same path intact; a save that fails
(a full disk, a file size limit) raises :class:`~jagg_lightning.faults.io.WriteError` naming the checkpoint, removes its
temporary file and leaves the previous one too. Lightning's ``ModelCheckpoint`` removes the checkpoints it no longer
keeps (``save_top_k``, the previous ``last``) only after the new one is saved, so a failed save deletes nothing.
Loading is ``weights_only=True``: a checkpoint is data, never code.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch.plugins.io import TorchCheckpointIO

from jagg_lightning.faults.io import atomic_write
from jagg_lightning.utils.timing import CLOCK


class _ErrorRecordingFile:
    """A file ``torch.save`` writes through, keeping the storage's error: torch's writer replaces it with an
    "unexpected pos" RuntimeError that says nothing of a full disk."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``; a storage error is raised as the OSError the storage gave (ENOSPC, EFBIG...)."""
    with open(path, "wb") as raw:
        file = _ErrorRecordingFile(raw)
        try:
            torch.save(obj, file)
        except RuntimeError as err:
            if file.error is not None:
                raise file.error from err
            raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose saves never leave a torn file and whose loads are ``weights_only``.

    Given to the Trainer as a plugin (``trainer.plugins``; ``jagg fit`` adds it): each checkpoint is written to a
    temporary sibling, fsynced and renamed over the path, so the previous checkpoint survives a save that is killed
    or fails (a full disk raises ``WriteError`` naming the checkpoint).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        with CLOCK.phase("checkpoint"):
            atomic_write(path, lambda tmp: torch_save(checkpoint, tmp))

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = None):
        return pl_load(path, map_location=map_location, weights_only=True)
