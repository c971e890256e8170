"""Sample images on disk and in loggers: grids of samples, the run's log directory, and every attached logger
that takes images, each through its own Lightning API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

from jagg_lightning.grids import image_grid, labelled_grid  # noqa: F401 (what a grid shows: grids.py)
from jagg_lightning.io import atomic_write


def log_dir(trainer) -> Path:
    """The run's log directory (the first logger's), or ``default_root_dir`` without a logger.

    ``trainer.log_dir`` broadcasts from rank 0: call this on EVERY process, before any rank-zero-only branch."""
    return Path(trainer.log_dir or trainer.default_root_dir)


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


def gif_bytes(frames: np.ndarray, fps: float = 8.0) -> bytes:
    """uint8 frames [F, H, W, 3] -> an animated GIF (Pillow; loops forever)."""
    import io

    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return buffer.getvalue()


def log_video(trainer, key: str, frames: np.ndarray, step: int, fps: float = 8.0) -> list[str]:
    """Send a video (uint8 [F, H, W, 3]) to the loggers that take one: TensorBoard as an animated GIF image
    summary (what ``add_video`` writes, without its moviepy dependency) and any logger with a
    ``log_video(key, videos, step, fps=, format=)`` method (W&B). Returns the class names of those that took it."""
    took = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            from tensorboard.compat.proto.summary_pb2 import Summary

            image = Summary.Image(height=frames.shape[1], width=frames.shape[2], colorspace=3,
                                  encoded_image_string=gif_bytes(frames, fps))
            logger.experiment._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=key, image=image)]), step)
        elif callable(getattr(logger, "log_video", None)):
            logger.log_video(key=key, videos=[frames.transpose(0, 3, 1, 2)], step=step, fps=[fps], format=["gif"])
        else:
            continue
        took.append(type(logger).__name__)
    return took


def write_image(trainer, path: Path, key: str, image: np.ndarray) -> Path:
    """Write ``image`` (uint8 [H, W, 3]) to ``path`` as PNG (crash-safe) and send it to the loggers as ``key``;
    a video (uint8 [F, H, W, 3]) goes to ``path`` with ``.gif`` as an animated GIF. Call on rank zero only."""
    from PIL import Image

    if image.ndim == 4:  # a video [F, H, W, 3]: an animated GIF beside where the PNG would be
        path = path.with_suffix(".gif")
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(gif_bytes(image)))
        log_video(trainer, key, image, trainer.global_step)
        return path
    atomic_write(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG"))
    log_image(trainer, key, image, trainer.global_step)
    return path
