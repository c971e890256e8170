"""Conditioned prompts: a prompt with the image(s) it edits or animates (image editing, image-to-video).

A :class:`ConditionedPrompt` IS its text (a ``str``), carrying its condition images: everything that handles
prompts (batches, the rollout's per-sample prompts, labels, rewards, gathering across processes) carries the images
along unchanged, and a part that needs them (a conditioned family's ``encode_prompts``, a reward that reads the
source) asks :func:`condition_images`. The images are paths (read when used), PIL images or tensors [3, H, W] in
[0, 1].

The dataset format (``data.prompts_file: edits.jsonl``; Flow-GRPO's Kontext / Qwen-Image-Edit ``*_metadata.jsonl``
rows work as they are): one JSON object a line with ``"prompt"`` and either ``"image"`` (one path) or ``"images"``
(a list), paths relative to the file's folder, or neither (a text-to-image row: GenEval's ``evaluation_metadata.jsonl``
and Flow-GRPO's ``dataset/geneval`` rows, ``tag`` / ``include`` / ``exclude`` / ``prompt``). The whole row travels
with its prompt as ``metadata`` (:func:`metadata_of`): a reward that scores against it (GenEval's rules) reads it
there. A folder holding ``train_metadata.jsonl``
(and ``test_metadata.jsonl``) may be named instead of the file (Flow-GRPO's layout). Every row is checked when the
file is read -- the JSON, the prompt, each image found and decodable -- and a bad row is one error naming the file,
the line and the field; whether the count suits the family is checked before training
(:func:`check_condition_counts`).

Sizes: a family resizes each condition image to the size it samples (:func:`condition_pixels`: centre-cropped to
the aspect ratio, then bicubic), as Flow-GRPO's Kontext script crops and resizes its sources. Plain torch + PIL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


class ConditionedPrompt(str):
    """A prompt's text with its condition ``images`` (paths, PIL images or tensors [3, H, W] in [0, 1]), where
    it came from (``origin``: "file.jsonl:line", for messages) and its data row (``metadata``: plain JSON data, e.g.
    GenEval's ``tag`` / ``include`` / ``exclude``). Equal to, and hashed as, its text."""

    images: tuple
    origin: str
    metadata: dict

    def __new__(cls, text: str, images=(), origin: str = "", metadata: dict | None = None):
        prompt = super().__new__(cls, text)
        prompt.images = tuple(images)
        prompt.origin = origin
        prompt.metadata = dict(metadata or {})
        return prompt

    def __reduce__(self):  # pickles (DataLoader workers, gathers across processes) with its images and metadata
        return (ConditionedPrompt, (str(self), self.images, self.origin, self.metadata))

    def __repr__(self) -> str:
        return f"ConditionedPrompt({str(self)!r}, {len(self.images)} image(s){', ' + self.origin if self.origin else ''})"


def images_of(prompt) -> tuple:
    """The condition images a prompt carries (none for a plain string)."""
    return getattr(prompt, "images", ())


def metadata_of(prompt) -> dict:
    """The data row a prompt came with (empty for a plain string)."""
    return getattr(prompt, "metadata", None) or {}



def evenly_per_task(items: list, per_task: int | None, tag_of=None) -> list:
    """``per_task`` items of each GenEval task, evenly spaced within the task in the list's order, kept in that
    order; None = all. ``tag_of(item)`` names an item's task: by default its metadata's ``tag`` (a prompt), e.g.
    ``lambda row: row["tag"]`` for metadata rows."""
    if per_task is None:
        return list(items)
    tag_of = tag_of or (lambda p: metadata_of(p).get("tag", ""))
    by_task: dict[str, list] = {}
    for item in items:
        by_task.setdefault(tag_of(item), []).append(item)
    chosen = set()
    for rows in by_task.values():
        step = max(len(rows) / per_task, 1)
        chosen |= {id(rows[int(i * step)]) for i in range(min(per_task, len(rows)))}
    return [item for item in items if id(item) in chosen]

def repeated_per_task(items: list, min_images: int, tag_of=None) -> list:
    """Each item repeated ceil(``min_images`` / its task's item count) times, in the list's order: every task then
    has at least ``min_images`` entries (GenEval scores 80-100 prompts x 4 images a task; a task of few held-out
    rows gets more samples of each). ``tag_of`` as in :func:`evenly_per_task`."""
    tag_of = tag_of or (lambda p: metadata_of(p).get("tag", ""))
    counts: dict[str, int] = {}
    for item in items:
        counts[tag_of(item)] = counts.get(tag_of(item), 0) + 1
    return [item for item in items for _ in range(-(-min_images // counts[tag_of(item)]))]


def where(prompt) -> str:
    return getattr(prompt, "origin", "") or repr(str(prompt))


def _open_rgb(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise ValueError(f"cannot read the image: {type(err).__name__}: {err}") from err


def load_image(image) -> Tensor:
    """A condition image as float32 [3, H, W] in [0, 1]: a path (str / Path), a PIL image or such a tensor."""
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"a condition image tensor must be [3, H, W] in [0, 1], got shape {list(image.shape)}")
        return image.float()
    if isinstance(image, (str, Path)):
        image = _open_rgb(Path(image))
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def condition_images(prompt) -> list[Tensor]:
    """Each condition image of ``prompt`` as float32 [3, H, W] in [0, 1] (its own size)."""
    return [load_image(image) for image in images_of(prompt)]


def fit_to(image: Tensor, height: int, width: int) -> Tensor:
    """[3, h, w] -> [3, height, width]: centre-cropped to the target's aspect ratio, then bicubic (clamped to [0, 1])."""
    _, h, w = image.shape
    if h * width > w * height:  # too tall: crop rows
        keep = round(w * height / width)
        image = image[:, (h - keep) // 2:(h - keep) // 2 + keep]
    elif h * width < w * height:  # too wide: crop columns
        keep = round(h * width / height)
        image = image[:, :, (w - keep) // 2:(w - keep) // 2 + keep]
    if image.shape[1:] == (height, width):
        return image
    resized = torch.nn.functional.interpolate(image[None], size=(height, width), mode="bicubic", align_corners=False,
                                              antialias=True)
    return resized[0].clamp(0, 1)


def condition_pixels(prompts, height: int, width: int, index: int = 0) -> Tensor:
    """The ``index``-th condition image of every prompt, fitted to (height, width): float32 [n, 3, height, width] in
    [0, 1]. A prompt without it is an error naming the prompt."""
    out = []
    for prompt in prompts:
        images = images_of(prompt)
        if len(images) <= index:
            raise ValueError(f"prompt {where(prompt)} has {len(images)} condition image(s); this model needs "
                             f"at least {index + 1} (a conditioned prompt: jagg_lightning.models.conditions.ConditionedPrompt, "
                             "or a JSONL data file with an 'image' per row)")
        out.append(fit_to(load_image(images[index]), height, width))
    return torch.stack(out)


def check_condition_counts(prompts, counts: tuple[int, int], family: str, field: str) -> None:
    """Every prompt carries between ``counts[0]`` and ``counts[1]`` condition images (the family's range); the
    first that does not is one error naming the field, the row and the allowed range."""
    low, high = counts
    for prompt in prompts:
        n = len(images_of(prompt))
        if not low <= n <= high:
            wanted = f"{low}" if low == high else f"{low} to {high}"
            hint = (" (a text-to-image family: give plain prompts)" if high == 0 else
                    " (a JSONL file with an 'image' or 'images' per row)")
            raise ValueError(f"{field}: row {where(prompt)} has {n} condition image(s); the {family} family takes "
                             f"{wanted}{hint}")


def check_data_conditions(datamodule, policy_class, reward=None) -> None:
    """:func:`check_condition_counts` of a policy class (its ``condition_images``, ``family``) on a datamodule's
    ``prompts``, ``val_prompts`` and ``predict_prompts`` (those it has: ``PromptDataModule``'s), each named as its
    ``data`` field, and the reward's own check of the training and validation prompts (``reward.check_prompts``,
    e.g. GenEval's metadata) -- before the model is built."""
    for field in ("prompts", "val_prompts", "predict_prompts"):
        if getattr(datamodule, field, None):
            check_condition_counts(getattr(datamodule, field), policy_class.condition_images, policy_class.family,
                                   f"data.{field}")
            if reward is not None and field != "predict_prompts":
                reward.check_prompts(getattr(datamodule, field), f"data.{field}")


# --------------------------------------------------------------------------------------------- the JSONL format

def metadata_file(path: Path, split: str, field: str) -> Path:
    """A data file, or a Flow-GRPO dataset folder's ``<split>_metadata.jsonl`` (its absence named with ``field``)."""
    if path.is_dir():
        found = path / f"{split}_metadata.jsonl"
        if not found.is_file():
            raise FileNotFoundError(f"{field}: no {found.name} in the folder {str(path)!r} (a text file of prompts, "
                                    "a JSONL file, or a conditioned dataset folder holding train_metadata.jsonl and "
                                    "test_metadata.jsonl)")
        return found
    return path


def read_conditioned_prompts(path: str | Path, field: str, split: str = "train") -> list[ConditionedPrompt]:
    """The rows of a JSONL data file (or a dataset folder's ``<split>_metadata.jsonl``) as conditioned prompts;
    each row checked (see the module docstring), a bad one named by ``field``, file and line."""
    path = metadata_file(Path(path), split, field)
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        origin = f"{path.name}:{line_no}"
        prompts.append(_row(line, path.parent, origin, f"{field} ({path}, line {line_no})"))
    if not prompts:
        raise ValueError(f"{field}: {str(path)!r} holds no rows")
    return prompts


def _row(line: str, folder: Path, origin: str, field: str) -> ConditionedPrompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{field}: not a JSON object: {err.msg} at column {err.colno}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{field}: a row must be a JSON object with 'prompt' and 'image' (or 'images'), got "
                         f"{type(row).__name__}")
    text = row.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{field}: 'prompt' must be a non-blank string, got {text!r}")
    if "image" in row and "images" in row:
        raise ValueError(f"{field}: give one of 'image' (a path) or 'images' (a list of paths), not both")
    if "image" not in row and "images" not in row:  # a text-to-image row; the family's count check refuses it where
        return ConditionedPrompt(text.strip(), (), origin, row)  # a condition image is needed
    names = [row["image"]] if "image" in row else row["images"]
    key = "image" if "image" in row else "images"
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{field}: {key!r} must be a path or a non-empty list of paths, got {row[key]!r}")
    paths = []
    for i, name in enumerate(names):
        label = key if key == "image" else f"images[{i}]"
        image = Path(name).expanduser()
        image = image if image.is_absolute() else folder / image
        if not image.is_file():
            raise FileNotFoundError(f"{field}: {label}: no such file {str(image)!r} (paths are relative to the "
                                    "data file's folder)")
        try:
            _open_rgb(image)
        except ValueError as err:
            raise ValueError(f"{field}: {label} {str(image)!r}: {err}") from None
        paths.append(str(image))
    return ConditionedPrompt(text.strip(), paths, origin, row)
