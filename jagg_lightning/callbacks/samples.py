"""Sample grids for fixed evaluation prompts and seeds: ODE sampling, adapter off | on side by side, labelled and
marked by the training reward (right / wrong frames, scores)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch

from jagg_lightning.data import read_prompts
from jagg_lightning.models.conditions import evenly_per_task
from jagg_lightning.training.grids import (
    GridMarks, LabelledGrid, count_right, grid_layout, image_grid, labelled_grid, reward_marks, with_sources,
)
from jagg_lightning.training.images import log_dir, write_image
from jagg_lightning.utils.timing import CLOCK


class SampleImages(L.Callback):
    """Sample grids, base model beside fine-tuned, every N training steps and at the end of fit.

    Every ``every_n_steps`` training steps and at the end of fit: one row per prompt, ``samples_per_prompt``
    samples of the base model (adapter off) then as many of the fine-tuned one (adapter on, EMA weights when
    enabled), the same seeds for both. The written grid is upscaled (nearest, ``scale``; None = at least 96 px
    per image), with each row's prompt and each half's name -- and, when a callback measures it (``DigitAccuracy``:
    its ``column_scores``), the held-out accuracy of base and fine-tuned -- written on it, and each image marked by the
    training reward (:func:`jagg_lightning.training.grids.reward_marks`): its score under it and, when the reward says right /
    wrong per sample (the digit reward), a green or red frame, counted per row ("base 1/4, tuned 3/4 right") and per
    half ("base (adapter off): 4 of these 8 right"; the held-out accuracy beside it: "(240 held-out samples)").
    Writes ``<dirpath>/step_XXXXXX.png`` (default dirpath: ``<log dir>/samples``) and sends the same image to every
    logger that takes images (:func:`jagg_lightning.training.images.log_image`: TensorBoard, MLflow, ...). ``last_grid`` is
    the unlabelled grid at native size, ``last_marks`` / ``last_layout`` what was drawn on it and where. Conditioned
    prompts (:class:`jagg_lightning.models.conditions.ConditionedPrompt`: image editing, image-to-video) get their source
    image as a first column, labelled "source": source -> base -> fine-tuned.

    Args:
        prompts: The prompts of the grid's rows; exactly one of `prompts` and `prompts_file`.
        every_n_steps: Training steps between grids, >= 1.
        seed: The seed of the samples' noise (the same for base and fine-tuned, every grid).
        num_steps: ODE steps per image; null = `sampling.num_steps`.
        dirpath: Where the grids go; null = `<log dir>/samples`.
        samples_per_prompt: Samples per prompt in each half, >= 1.
        scale: The upscale factor of the written grid (nearest), >= 1; null = at least 96 px per image.
        prompts_file: Prompts read as `data.prompts_file` reads them: a text file, a JSONL file or a dataset folder
            (its `split`'s metadata) -- how a config gives conditioned prompts.
        split: The split a dataset folder given as `prompts_file` is read from (its `<split>_metadata.jsonl`).
        prompts_per_task: With GenEval metadata prompts: only this many rows of each task (`tag`), evenly spaced in
            the file's order, >= 1 (the scenes test bed's grid: a few rows per task, framed right / wrong by
            GenEval's rules); null = every prompt.
    """

    def __init__(self, prompts: list[str] | None = None, every_n_steps: int = 50, seed: int = 0,
                 num_steps: int | None = None, dirpath: str | None = None, samples_per_prompt: int = 1,
                 scale: int | None = None, prompts_file: str | None = None, split: str = "test",
                 prompts_per_task: int | None = None):
        super().__init__()
        if (prompts is None) == (prompts_file is None):
            raise ValueError("SampleImages needs exactly one of prompts (a list) and prompts_file (a text or JSONL "
                             f"file, or a dataset folder); got prompts={prompts!r}, prompts_file={prompts_file!r}")
        if prompts_file is not None:
            prompts = read_prompts(prompts_file, "SampleImages.prompts_file", split)
        if prompts_per_task is not None:
            if prompts_per_task < 1:
                raise ValueError(f"SampleImages.prompts_per_task must be >= 1 or null, got {prompts_per_task}")
            prompts = evenly_per_task(prompts, prompts_per_task)
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
        self.last_marks: GridMarks | None = None
        self.last_layout: LabelledGrid | None = None

    @torch.no_grad()
    def sample_cells(self, pl_module) -> list[torch.Tensor]:
        """The cells row by row: per prompt, its base samples then its fine-tuned samples (same seeds)."""
        sampler, per = pl_module.sampler, self.samples_per_prompt
        steps = self.num_steps or pl_module.sampling.num_steps

        def images():
            return sampler.ode_images(self.prompts, range(len(self.prompts)), per, self.seed, 0, steps)

        with pl_module.policy.adapter_disabled():
            base = images()
        with pl_module.inference_weights():
            tuned = images()
        return [c for i in range(len(self.prompts)) for c in (*base[i * per:(i + 1) * per], *tuned[i * per:(i + 1) * per])]

    def sample(self, pl_module) -> np.ndarray:
        """The unlabelled grid: rows = prompts, columns = base samples then fine-tuned samples."""
        cells, columns = self.sample_cells(pl_module), 2 * self.samples_per_prompt
        return image_grid([cells[i:i + columns] for i in range(0, len(cells), columns)])

    def column_labels(self, trainer, marks: GridMarks | None = None) -> list[str]:
        """Each half's name with how many of its pictured samples the reward reads right ("19 of these 40 right")
        and, when a callback measured it (``column_scores``), the held-out accuracy over that callback's own samples,
        with their number ("held-out accuracy 0.467 (240 held-out samples)"): two counts of two samples, each saying
        which."""
        scores = next((c.column_scores() for c in trainer.callbacks if callable(getattr(c, "column_scores", None))),
                      None)
        labels = ["base (adapter off)", f"fine-tuned, step {trainer.global_step}"]
        if marks is not None and marks.correct:
            per = self.samples_per_prompt
            labels = [f"{label}: {count_right(marks.correct, range(h * per, (h + 1) * per))}"
                      for h, label in enumerate(labels)]
        if scores:  # over the callback's own samples (its prompts and seeds, not these): said so
            over = f" ({scores['samples']} held-out samples)" if scores.get("samples") else ""
            labels = [f"{labels[0]}\nheld-out accuracy {scores['base']:.3f}{over}",
                      f"{labels[1]}\nheld-out accuracy {scores['fine-tuned']:.3f}{over}"]
        return labels

    def row_notes(self, marks: GridMarks) -> list[str]:
        """Per row: how many of its base and of its fine-tuned samples the reward reads right."""
        if not marks.correct:
            return []
        per = self.samples_per_prompt
        return [f"base {sum(map(bool, row[:per]))}/{per}, tuned {sum(map(bool, row[per:]))}/{per} right"
                for row in marks.correct]

    def _write(self, trainer, pl_module) -> None:
        with CLOCK.phase("evaluation"):
            self._write_grid(trainer, pl_module)

    def _write_grid(self, trainer, pl_module) -> None:
        cells, per = self.sample_cells(pl_module), self.samples_per_prompt
        columns = 2 * per
        rows = [cells[i:i + columns] for i in range(0, len(cells), columns)]
        path = Path(self.dirpath or log_dir(trainer) / "samples") / f"step_{trainer.global_step:06d}.png"
        if not trainer.is_global_zero:  # log_dir above runs on every process: it broadcasts
            self.last_grid = image_grid(with_sources(rows, self.prompts, None)[0])
            return
        prompts = [p for p in self.prompts for _ in range(columns)]
        marks = reward_marks(pl_module.reward_fn, torch.stack(cells), prompts, columns)
        labels, notes = self.column_labels(trainer, marks), self.row_notes(marks)
        # conditioned prompts (editing, image-to-video): each row's source before its samples
        rows, self.last_marks, sourced = with_sources(rows, self.prompts, marks)
        self.last_grid = grid = image_grid(rows)
        side = grid.shape[-3] // len(self.prompts)  # an image grid [H, W, 3] or a video grid [F, H, W, 3]
        args = (grid, side, self.prompts, ["source", *labels] if sourced else labels, self.scale, 96, len(rows[0]),
                self.last_marks, notes, [1, per, per] if sourced else None)
        self.last_layout = grid_layout(*args)
        self.written.append(write_image(trainer, path, "samples", labelled_grid(*args)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.rollouts_done % self.every_n_steps == 0:  # the run's step count: a resumed fit keeps the schedule
            self._write(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if pl_module.rollouts_done % self.every_n_steps:
            self._write(trainer, pl_module)
