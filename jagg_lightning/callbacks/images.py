"""Images to loggers: every attached logger that takes images gets them, through its own Lightning API."""

from __future__ import annotations

import numpy as np
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger


def log_image(trainer, key: str, image: np.ndarray, step: int) -> list[str]:
    """Send one RGB image (uint8 [H, W, 3]) to every image-capable logger of ``trainer``: TensorBoard
    (``experiment.add_image``), MLflow (``experiment.log_image`` of the logger's run) and any logger with a
    ``log_image(key, images, step)`` method (W&B, Neptune, ...). Returns the class names of those that took it."""
    took = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(key, image, step, dataformats="HWC")
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_image(logger.run_id, image, key=key.replace("/", "_"), step=step)
        elif callable(getattr(logger, "log_image", None)):
            logger.log_image(key=key, images=[image], step=step)
        else:
            continue
        took.append(type(logger).__name__)
    return took
