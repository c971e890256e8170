"""Sample grids for fixed evaluation prompts and seeds: ODE sampling, adapter off | on side by side."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from PIL import Image

from jagg_lightning.callbacks.images import log_image
from jagg_lightning.callbacks.routing import log_dir
from jagg_lightning.io import atomic_write
from jagg_lightning.rollout import sample_generators, sample_trajectories


def image_grid(rows: list[list[torch.Tensor]]) -> np.ndarray:
    """Images [3, H, W] in [0, 1], laid out row by row -> uint8 array [rows*H, cols*W, 3]."""
    return np.concatenate(
        [np.concatenate([(img.permute(1, 2, 0).float().cpu().numpy() * 255).round() for img in row], axis=1)
         for row in rows],
        axis=0,
    ).astype(np.uint8)


class SampleImages(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of fit: one row per prompt, columns
    [adapter off, adapter on] (EMA weights when enabled), same seed for both. Writes
    ``<dirpath>/step_XXXXXX.png`` (default dirpath: ``<log dir>/samples``) and sends the grid to every
    logger that takes images (:func:`jagg_lightning.callbacks.images.log_image`)."""

    def __init__(self, prompts: list[str], every_n_steps: int = 50, seed: int = 0, num_steps: int | None = None,
                 dirpath: str | None = None):
        super().__init__()
        if not prompts:
            raise ValueError("SampleImages.prompts must not be empty")
        if every_n_steps < 1:
            raise ValueError(f"SampleImages.every_n_steps must be >= 1, got {every_n_steps}")
        self.prompts, self.every_n_steps, self.seed = list(prompts), every_n_steps, seed
        self.num_steps, self.dirpath = num_steps, dirpath
        self.written: list[Path] = []
        self._step = 0

    @torch.no_grad()
    def sample(self, pl_module) -> np.ndarray:
        policy = pl_module.policy
        steps = self.num_steps or pl_module.sampling.num_steps
        times = pl_module.schedule(steps)
        cond = policy.encode_prompts(self.prompts)

        def images():
            traj = sample_trajectories(
                policy.velocity, cond, sample_generators(self.seed, 0, range(len(self.prompts)), 1),
                policy.latent_shape, times, ["ode"] * steps, 0.0, pl_module.sampling.rollout_batch_size,
                pl_module.device, pl_module._sde_dtype,
            )
            return policy.decode(traj.latents[-1])

        with policy.adapter_disabled():
            base = images()
        with pl_module.inference_weights():
            tuned = images()
        return image_grid([[b, t] for b, t in zip(base, tuned)])

    def _write(self, trainer, pl_module) -> None:
        grid = self.sample(pl_module)
        path = Path(self.dirpath or log_dir(trainer) / "samples") / f"step_{trainer.global_step:06d}.png"
        if not trainer.is_global_zero:  # log_dir above runs on every process: it broadcasts
            return
        atomic_write(path, lambda tmp: Image.fromarray(grid).save(tmp, format="PNG"))
        self.written.append(path)
        log_image(trainer, "samples", grid, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step += 1
        if self._step % self.every_n_steps == 0:
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._step % self.every_n_steps:
            self._write(trainer, pl_module)

