"""What a sample grid shows (plain PIL / numpy, no Lightning): cells laid out row by row, upscaled, each framed green
when the reward reads it as right and red when wrong (a reward with ``correct(images, prompts)``, the digit reward),
its score under it, the count of right ones per row and per column group, the prompts at the left, a title, in a font
one can read. Writing and logging the picture is :mod:`jagg_lightning.training.images`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from jagg_lightning.models.adapters import IDENTITY_FILE
from jagg_lightning.models.conditions import condition_images, fit_to, images_of

RIGHT, WRONG, UNMARKED = (0, 160, 0), (215, 25, 25), (255, 255, 255)
FRAME = 4  # px of frame around each cell (in the written picture)
SPACE = 4  # px between two cells' frames
GROUP_GAP = 16  # px at least between column groups (base | fine-tuned)


def image_grid(rows: list[list[torch.Tensor]]) -> np.ndarray:
    """Images [3, H, W] in [0, 1], laid out row by row -> uint8 array [rows*H, cols*W, 3]; videos
    [F, 3, H, W] -> a grid per frame, uint8 [F, rows*H, cols*W, 3]."""
    if rows[0][0].ndim == 4:
        return np.stack([image_grid([[v[f] for v in row] for row in rows]) for f in range(rows[0][0].shape[0])])
    return np.concatenate(
        [np.concatenate([(img.permute(1, 2, 0).float().cpu().numpy() * 255).round() for img in row], axis=1)
         for row in rows],
        axis=0,
    ).astype(np.uint8)


def font(size: int = 14):
    """A scalable font of ``size`` px (Pillow's bundled one, FreeType); Pillow's tiny bitmap font without FreeType."""
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType
        return ImageFont.load_default()


def _width(text: str, typeface) -> int:
    return int(np.ceil(typeface.getlength(text))) if text else 0


@dataclass
class GridMarks:
    """Per cell of a grid (row-major lists of lists): ``correct`` True / False / None (no frame) and a caption under
    it (``captions``: e.g. the reward's score); ``title``: a line above everything (e.g. what the frames mean)."""

    correct: list[list[bool | None]] | None = None
    captions: list[list[str]] | None = None
    title: str = ""


def reward_marks(reward, images: torch.Tensor, prompts: list[str], columns: int) -> GridMarks:
    """The marks of ``images`` (row-major, ``columns`` per row, one prompt each): every cell's reward score as its
    caption and, when the reward says right / wrong per sample (a ``correct(images, prompts)`` method: the digit
    reward), its frame. Plain scoring without grad; nothing else is touched."""
    if getattr(reward, "scores_latents", False):  # a latent reward cannot score the pictures
        rows = range(0, len(prompts), columns)
        return GridMarks(None, [[""] * len(prompts[i:i + columns]) for i in rows],
                         f"reward {reward.name} scores latents: no score under the images")
    parameter = next(iter(reward.parameters()), None) if isinstance(reward, torch.nn.Module) else None
    images = images if parameter is None else images.to(parameter.device)
    with torch.no_grad():
        scores = reward(images, prompts).float().cpu().tolist()
        judge = getattr(reward, "correct", None)
        right = [bool(x) for x in judge(images, prompts).cpu().tolist()] if callable(judge) else None
    name = getattr(reward, "name", type(reward).__name__)
    rows = range(0, len(scores), columns)
    title = f"under each image: reward {name}"
    if right is not None:
        title = f"frame: green = the {name} reward reads it right, red = wrong; " + title
    return GridMarks(None if right is None else [right[i:i + columns] for i in rows],
                     [[score_text(s) for s in scores[i:i + columns]] for i in rows], title)


def score_text(score: float) -> str:
    """A score under its image: two decimals (a probability: 0.93), a small one in powers of ten."""
    return f"{score:.2f}" if abs(score) >= 0.01 or score == 0 else f"{score:.1e}"


def count_right(correct: list[list[bool | None]], columns: range) -> str:
    """'3 of these 8 right' over the cells of ``columns`` in every row (or one row: ``[row]``): a count of the
    pictured samples, worded so (a held-out accuracy beside it is over samples of its own)."""
    cells = [row[c] for row in correct for c in columns]
    return f"{sum(bool(x) for x in cells)} of these {len(cells)} right"


@dataclass
class LabelledGrid:
    """The layout of a grid of ``rows`` x ``columns`` cells of ``cell`` = (height, width) px (after upscaling by
    ``scale``): prompts (``row_labels``, a second line from ``row_notes``) at the left, ``column_labels`` above their
    even share of the columns (a label may hold several lines), a frame of ``FRAME`` px around each cell, a caption
    line under each when ``marks.captions`` are given."""

    rows: int
    columns: int
    cell: tuple[int, int]
    scale: int
    row_labels: list[str]
    column_labels: list[str]
    row_notes: list[str] = field(default_factory=list)
    marks: GridMarks = field(default_factory=GridMarks)
    size: int = 15
    group_sizes: list[int] = field(default_factory=list)  # columns under each label; default: even shares

    def __post_init__(self):
        self.font, self.small = font(self.size), font(self.size - 2)
        self.line = self.size + 5
        self.groups = max(1, len(self.column_labels))
        per_group = -(-self.columns // self.groups)
        sizes = self.group_sizes or [per_group] * self.groups
        self.starts = [sum(sizes[:g]) for g in range(len(sizes))]
        texts = list(self.row_labels) + list(self.row_notes)
        self.left = max([_width(t, self.font) for t in texts] + [0]) + 16
        self.header = (self.line if self.marks.title else 0) + self.line * max(
            [len(label.split("\n")) for label in self.column_labels] + [1]) + 4
        self.caption = self.line if self.marks.captions else 0
        # a group's cells; a wider label widens the gap after it
        spans = [size * (self.cell[1] + 2 * FRAME + SPACE) for size in sizes]
        self.gap = max([GROUP_GAP] + [max(_width(t, self.font) for t in label.split("\n")) + 16 - span
                                      for label, span in zip(self.column_labels[:-1], spans)])

    def group_of(self, c: int) -> int:
        return sum(start <= c for start in self.starts[1:])

    def cell_box(self, r: int, c: int) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1) of cell (r, c)'s image in the written picture (x1, y1 exclusive)."""
        h, w = self.cell
        x = self.left + c * (w + 2 * FRAME + SPACE) + self.group_of(c) * self.gap + FRAME
        y = self.header + r * (h + 2 * FRAME + SPACE + self.caption) + FRAME
        return x, y, x + w, y + h

    def canvas_size(self) -> tuple[int, int]:
        x1, y1 = self.cell_box(self.rows - 1, self.columns - 1)[2:]
        labels = [self._group_x(g) + max(_width(t, self.font) for t in label.split("\n"))
                  for g, label in enumerate(self.column_labels)]
        width = max([x1 + FRAME, _width(self.marks.title, self.small) + 8] + labels) + 8
        return width, y1 + FRAME + self.caption + 4

    def _group_x(self, g: int) -> int:
        return self.cell_box(0, self.starts[g])[0] - FRAME

    def render(self, big: np.ndarray) -> np.ndarray:
        """The picture of the upscaled grid ``big`` (uint8 [rows*h, columns*w, 3])."""
        from PIL import Image, ImageDraw

        canvas = Image.new("RGB", self.canvas_size(), "white")
        draw = ImageDraw.Draw(canvas)
        h, w = self.cell
        y = 4
        if self.marks.title:
            draw.text((8, y), self.marks.title, fill=(90, 90, 90), font=self.small)
            y += self.line
        for g, label in enumerate(self.column_labels):
            draw.multiline_text((self._group_x(g), y), label, fill="black", font=self.font, spacing=5)
        for r in range(self.rows):
            x0, y0, _, _ = self.cell_box(r, 0)
            middle = y0 + h // 2
            draw.text((8, middle - self.line), self.row_labels[r] if r < len(self.row_labels) else "", fill="black",
                      font=self.font)
            if r < len(self.row_notes):
                draw.text((8, middle + 2), self.row_notes[r], fill=(90, 90, 90), font=self.font)
            for c in range(self.columns):
                x0, y0, x1, y1 = self.cell_box(r, c)
                mark = self.marks.correct[r][c] if self.marks.correct else None
                if mark is not None:
                    draw.rectangle([x0 - FRAME, y0 - FRAME, x1 + FRAME - 1, y1 + FRAME - 1],
                                   fill=RIGHT if mark else WRONG)
                canvas.paste(Image.fromarray(np.ascontiguousarray(big[r * h:(r + 1) * h, c * w:(c + 1) * w])), (x0, y0))
                if self.marks.captions:
                    draw.text((x0, y1 + FRAME), self.marks.captions[r][c], fill="black", font=self.small)
        return np.asarray(canvas)


def grid_layout(grid: np.ndarray, side: int, row_labels: list[str], column_labels: list[str],
                scale: int | None = None, min_side: int = 96, columns: int | None = None,
                marks: GridMarks | None = None, row_notes: list[str] | None = None,
                group_sizes: list[int] | None = None) -> LabelledGrid:
    """The :class:`LabelledGrid` :func:`labelled_grid` draws (where each cell lands: ``cell_box``)."""
    marks = marks or GridMarks()
    scale = scale or max(1, -(-min_side // side))
    rows = grid.shape[-3] // side
    per_row = marks.correct or marks.captions
    columns = columns or (len(per_row[0]) if per_row else max(1, round(grid.shape[-2] / side)))
    cell = (side * scale, grid.shape[-2] // columns * scale)
    return LabelledGrid(rows, columns, cell, scale, list(row_labels), list(column_labels), list(row_notes or []), marks,
                        group_sizes=list(group_sizes or []))


def labelled_grid(grid: np.ndarray, side: int, row_labels: list[str], column_labels: list[str],
                  scale: int | None = None, min_side: int = 96, columns: int | None = None,
                  marks: GridMarks | None = None, row_notes: list[str] | None = None,
                  group_sizes: list[int] | None = None) -> np.ndarray:
    """A readable copy of ``grid`` (uint8 [rows*side, cols*W, 3], e.g. from :func:`image_grid`; ``side`` is a cell's
    height, ``columns`` the cells per row: default from ``marks``, else square cells): every pixel repeated ``scale``
    times (nearest; None = enough for ``min_side`` px of height per image), each cell framed (``marks.correct``: green
    right, red wrong) with its caption under it, one prompt per row at the left (``row_notes``: a second line, e.g.
    'base 2/4, fine-tuned 4/4 right'), ``column_labels`` above their share of the columns (e.g. ``["base: 12 of
    these 40 right", "fine-tuned, step 60: 25 of these 40 right"]`` over 2 x 4 samples) and ``marks.title`` above all. A video grid
    (uint8 [F, rows*side, cols*W, 3]) is labelled frame by frame. ``group_sizes``: the columns under each label
    (default: even shares; a "source" column before the samples: ``[1, ...]``)."""
    layout = grid_layout(grid, side, row_labels, column_labels, scale, min_side, columns, marks, row_notes,
                         group_sizes)
    s = layout.scale
    if grid.ndim == 4:
        return np.stack([layout.render(frame.repeat(s, axis=0).repeat(s, axis=1)) for frame in grid])
    return layout.render(grid.repeat(s, axis=0).repeat(s, axis=1))


def with_sources(rows: list[list[torch.Tensor]], row_prompts: list, marks: GridMarks | None):
    """Conditioned prompts (image editing, image-to-video): each row's prompt's first condition image put in front of
    its samples, fitted to their size (a video's: held over its frames), unmarked -> (rows, marks shifted, True);
    plain prompts: everything unchanged, False."""
    if not row_prompts or not all(images_of(p) for p in row_prompts):
        return rows, marks, False
    out = []
    for row, prompt in zip(rows, row_prompts):
        cell = row[0]
        source = fit_to(condition_images(prompt)[0], *cell.shape[-2:])
        out.append([source.expand_as(cell) if cell.ndim == 4 else source, *row])
    if marks is not None:
        marks = GridMarks([[None, *r] for r in marks.correct] if marks.correct else None,
                          [["source", *r] for r in marks.captions] if marks.captions else None, marks.title)
    return out, marks, True


def weights_label(fn: str, step: int, ckpt_path: str | None, adapter: str | None) -> tuple[str, str]:
    """(what an evaluation sampled, a file name stem saying so) for an evaluation grid: during ``fit`` the fine-tuned
    weights at ``step``; in ``validate`` / ``test`` the checkpoint (its step), the exported adapter (the step its
    ``adapter.json`` records) or the base model."""
    if fn == "fit":
        return f"fine-tuned, step {step}", f"step_{step:06d}"
    if ckpt_path:
        return f"checkpoint {ckpt_path}, step {step}", f"{Path(ckpt_path).stem}_step_{step:06d}"
    if adapter:
        folder = Path(adapter)
        folder = folder.parent if folder.name in ("peft", "diffusers") or folder.is_file() else folder
        trained = exported_step(folder)
        at = "" if trained is None else f", step {trained}"
        return f"adapter {adapter}{at}", folder.name + ("" if trained is None else f"_step_{trained:06d}")
    return "base model (no adapter)", "base"


def exported_step(folder: Path) -> int | None:
    """The training step an exported adapter folder's ``adapter.json`` records (None: not recorded, or no file)."""
    try:
        return int(json.loads((Path(folder) / IDENTITY_FILE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
