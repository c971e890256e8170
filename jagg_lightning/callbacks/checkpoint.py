"""Checkpoint I/O that never leaves a torn file: write to a temporary sibling, fsync, rename.

A save killed half-way (even by kill -9) leaves the previous checkpoint at the same path intact.
Loading is ``weights_only=True``: a checkpoint is data, never code.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch.plugins.io import TorchCheckpointIO

from jagg_lightning.io import atomic_write


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: bool | None = None):
        return pl_load(path, map_location=map_location, weights_only=True)
