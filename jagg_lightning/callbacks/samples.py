"""Sample grids for fixed evaluation prompts and seeds: ODE sampling, adapter off | on side by side, labelled."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from jagg_lightning.images import image_grid, labelled_grid, log_dir, write_image


class SampleImages(L.Callback):
    """Every ``every_n_steps`` training steps and at the end of fit: one row per prompt, ``samples_per_prompt``
    samples of the base model (adapter off) then as many of the fine-tuned one (adapter on, EMA weights when
    enabled), the same seeds for both. The written grid is upscaled (nearest, ``scale``; None = at least 96 px
    per image), with each row's prompt and each half's name -- and, when a callback measures it (``DigitAccuracy``:
    its ``column_scores``), the held-out accuracy of base and fine-tuned -- written on it. Writes
    ``<dirpath>/step_XXXXXX.png`` (default dirpath: ``<log dir>/samples``) and sends the same image to every logger
    that takes images (:func:`jagg_lightning.images.log_image`: TensorBoard, MLflow, ...). ``last_grid`` is the
    unlabelled grid at native size."""

    def __init__(self, prompts: list[str], every_n_steps: int = 50, seed: int = 0, num_steps: int | None = None,
                 dirpath: str | None = None, samples_per_prompt: int = 1, scale: int | None = None):
        super().__init__()
        if not prompts:
            raise ValueError("SampleImages.prompts must not be empty")
        if every_n_steps < 1:
            raise ValueError(f"SampleImages.every_n_steps must be >= 1, got {every_n_steps}")
        if samples_per_prompt < 1:
            raise ValueError(f"SampleImages.samples_per_prompt must be >= 1, got {samples_per_prompt}")
        if scale is not None and scale < 1:
            raise ValueError(f"SampleImages.scale must be >= 1 or null, got {scale}")
        self.prompts, self.every_n_steps, self.seed = list(prompts), every_n_steps, seed
        self.num_steps, self.dirpath = num_steps, dirpath
        self.samples_per_prompt, self.scale = samples_per_prompt, scale
        self.written: list[Path] = []
        self.last_grid: np.ndarray | None = None
        self._step = 0

    @torch.no_grad()
    def sample(self, pl_module) -> np.ndarray:
        """The unlabelled grid: rows = prompts, columns = base samples then fine-tuned samples."""
        sampler, per = pl_module.sampler, self.samples_per_prompt
        steps = self.num_steps or pl_module.sampling.num_steps

        def images():
            return sampler.ode_images(self.prompts, range(len(self.prompts)), per, self.seed, 0, steps)

        with pl_module.policy.adapter_disabled():
            base = images()
        with pl_module.inference_weights():
            tuned = images()
        return image_grid([[*base[i * per:(i + 1) * per], *tuned[i * per:(i + 1) * per]]
                           for i in range(len(self.prompts))])

    def column_labels(self, trainer) -> list[str]:
        scores = next((c.column_scores() for c in trainer.callbacks if callable(getattr(c, "column_scores", None))),
                      None)
        if not scores:
            return ["base (adapter off)", f"fine-tuned, step {trainer.global_step}"]
        return [f"base: held-out acc {scores['base']:.2f}",
                f"fine-tuned, step {trainer.global_step}: held-out acc {scores['fine-tuned']:.2f}"]

    def _write(self, trainer, pl_module) -> None:
        self.last_grid = grid = self.sample(pl_module)
        path = Path(self.dirpath or log_dir(trainer) / "samples") / f"step_{trainer.global_step:06d}.png"
        if not trainer.is_global_zero:  # log_dir above runs on every process: it broadcasts
            return
        side = grid.shape[-3] // len(self.prompts)  # an image grid [H, W, 3] or a video grid [F, H, W, 3]
        labelled = labelled_grid(grid, side, self.prompts, self.column_labels(trainer), self.scale)
        self.written.append(write_image(trainer, path, "samples", labelled))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step += 1
        if self._step % self.every_n_steps == 0:
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self._step % self.every_n_steps:
            self._write(trainer, pl_module)
