"""Sample images on disk and in loggers: grids of samples, the run's log directory, and every attached logger
that takes images or videos, each through its own API (:func:`log_media`: TensorBoard, MLflow, W&B, ...)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

from jagg_lightning.faults.io import atomic_write
from jagg_lightning.training.grids import image_grid, labelled_grid  # noqa: F401 (what a grid shows: grids.py)


def log_dir(trainer) -> Path:
    """The run's log directory (the first logger's), or ``default_root_dir`` without a logger.

    ``trainer.log_dir`` broadcasts from rank 0: call this on EVERY process, before any rank-zero-only branch."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def gif_bytes(frames: np.ndarray, fps: float = 8.0) -> bytes:
    """uint8 frames [F, H, W, 3] -> an animated GIF (Pillow; loops forever)."""
    import io

    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return buffer.getvalue()


def log_media(trainer, key: str, media: np.ndarray, step: int, fps: float = 8.0) -> list[str]:
    """Send an RGB image (uint8 [H, W, 3]) or a video (uint8 [F, H, W, 3]) as ``key`` to every attached logger
    that takes it, each by its own API:

    * ``TensorBoardLogger``: ``add_image``; a video as an animated GIF image summary (what ``add_video`` writes,
      without its moviepy dependency; TensorBoard's image tab plays it);
    * ``MLFlowLogger``: ``log_image`` on the logger's run (``images/<key>+step+<step>+...png``); a video as the
      artifact ``videos/<key>_step_<step>.gif``;
    * ``WandbLogger``: ``log_image`` (``wandb.Image``); a video as ``wandb.Video`` of the GIF's bytes (no moviepy);
    * any other logger with W&B-style ``log_image(key, images, step)`` / ``log_video(key, videos, step, fps=,
      format=)`` methods (Neptune, your own); loggers without them (CSV) are skipped.

    Returns the class names of the loggers that took it. Call on rank zero only."""
    from lightning.pytorch.loggers import WandbLogger  # importable without wandb (imported when a run starts)

    video = media.ndim == 4
    took = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            _to_tensorboard(logger, key, media, step, fps)
        elif isinstance(logger, MLFlowLogger):
            _to_mlflow(logger, key, media, step, fps)
        elif isinstance(logger, WandbLogger):
            _to_wandb(logger, key, media, step, fps)
        elif not video and callable(getattr(logger, "log_image", None)):
            logger.log_image(key=key, images=[media], step=step)
        elif video and callable(getattr(logger, "log_video", None)):
            logger.log_video(key=key, videos=[media.transpose(0, 3, 1, 2)], step=step, fps=[fps], format=["gif"])
        else:
            continue
        took.append(type(logger).__name__)
    return took


def log_image(trainer, key: str, image: np.ndarray, step: int) -> list[str]:
    """One RGB image (uint8 [H, W, 3]) to every logger that takes images (:func:`log_media`)."""
    if image.ndim != 3:
        raise ValueError(f"log_image: {key} must be uint8 [H, W, 3], got shape {image.shape}")
    return log_media(trainer, key, image, step)


def log_video(trainer, key: str, frames: np.ndarray, step: int, fps: float = 8.0) -> list[str]:
    """One video (uint8 [F, H, W, 3]) to every logger that takes videos (:func:`log_media`)."""
    if frames.ndim != 4:
        raise ValueError(f"log_video: {key} must be uint8 [F, H, W, 3], got shape {frames.shape}")
    return log_media(trainer, key, frames, step, fps)


def _to_tensorboard(logger, key: str, media: np.ndarray, step: int, fps: float) -> None:
    if media.ndim == 3:
        logger.experiment.add_image(key, media, step, dataformats="HWC")
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(height=media.shape[1], width=media.shape[2], colorspace=3,
                          encoded_image_string=gif_bytes(media, fps))
    logger.experiment._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=key, image=image)]), step)


def _to_mlflow(logger, key: str, media: np.ndarray, step: int, fps: float) -> None:
    if media.ndim == 3:
        logger.experiment.log_image(logger.run_id, media, key=key.replace("/", "_"), step=step)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{key.replace('/', '_')}_step_{step:06d}.gif"
        path.write_bytes(gif_bytes(media, fps))
        logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="videos")


def _to_wandb(logger, key: str, media: np.ndarray, step: int, fps: float) -> None:
    if media.ndim == 3:
        logger.log_image(key=key, images=[media], step=step)
        return
    import io

    logger.log_video(key=key, videos=[io.BytesIO(gif_bytes(media, fps))], step=step, format=["gif"])


def write_image(trainer, path: Path, key: str, image: np.ndarray) -> Path:
    """Write ``image`` (uint8 [H, W, 3]) to ``path`` as PNG (crash-safe) and send it to the loggers as ``key``;
    a video (uint8 [F, H, W, 3]) goes to ``path`` with ``.gif`` as an animated GIF. Call on rank zero only."""
    from PIL import Image

    if image.ndim == 4:  # a video [F, H, W, 3]: an animated GIF beside where the PNG would be
        path = path.with_suffix(".gif")
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(gif_bytes(image)))
        log_media(trainer, key, image, trainer.global_step)
        return path
    atomic_write(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG"))
    log_media(trainer, key, image, trainer.global_step)
    return path
