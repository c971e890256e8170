"""Sample grids for fixed evaluation prompts and seeds: ODE sampling, adapter off | on side by side."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from jagg_lightning.images import image_grid, log_dir, write_image


class SampleImages(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of fit: one row per prompt, columns
    [adapter off, adapter on] (EMA weights when enabled), same seed for both. Writes
    ``<dirpath>/step_XXXXXX.png`` (default dirpath: ``<log dir>/samples``) and sends the grid to every
    logger that takes images (:func:`jagg_lightning.images.log_image`)."""

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
        sampler = pl_module.sampler
        steps = self.num_steps or pl_module.sampling.num_steps

        def images():
            return sampler.ode_images(self.prompts, range(len(self.prompts)), 1, self.seed, 0, steps)

        with pl_module.policy.adapter_disabled():
            base = images()
        with pl_module.inference_weights():
            tuned = images()
        return image_grid([[b, t] for b, t in zip(base, tuned)])

    def _write(self, trainer, pl_module) -> None:
        grid = self.sample(pl_module)
        path = Path(self.dirpath or log_dir(trainer) / "samples") / f"step_{trainer.global_step:06d}.png"
        if not trainer.is_global_zero:  # log_dir above runs on every process: it broadcasts
            return
        self.written.append(write_image(trainer, path, "samples", grid))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step += 1
        if self._step % self.every_n_steps == 0:
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._step % self.every_n_steps:
            self._write(trainer, pl_module)

