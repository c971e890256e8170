"""``jagg predict`` writes what it draws: one PNG per image (an animated GIF per video), named by prompt index,
sample and the prompt itself (slugged)."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from PIL import Image

from jagg_lightning.callbacks.progress import finish_progress_bar
from jagg_lightning.faults.io import atomic_write
from jagg_lightning.training.images import gif_bytes


SLUG_CHARS = 60  # at most this many characters of the prompt in a file name


def slug(prompt: str, limit: int = SLUG_CHARS) -> str:
    """A prompt as a file-name part: ASCII letters and digits, lower case, every other run of characters one '-',
    cut to ``limit`` characters at a word's end where one is near ('a handwritten digit 7' -> 'a-handwritten-digit-7');
    '' when nothing of it is ASCII."""
    text = unicodedata.normalize("NFKD", prompt).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    if len(text) <= limit:
        return text
    cut = text[:limit + 1].rsplit("-", 1)[0] if "-" in text[limit // 2:limit + 1] else text[:limit]
    return cut.strip("-")


def file_stem(index: int, sample: int, prompt: str) -> str:
    """``p{index:05d}_s{sample:02d}_{slug}``: unique by (prompt index, sample), sorted in prompt order, readable."""
    words = slug(prompt)
    return f"p{index:05d}_s{sample:02d}" + (f"_{words}" if words else "")


class PredictionImages(BasePredictionWriter):
    """The images of ``jagg predict``, written as files.

    Writes ``<dirpath>/p{index:05d}_s{sample:02d}_{prompt slug}.png`` for every predicted image (the prompt in ASCII
    letters, digits and '-', at most ``SLUG_CHARS`` characters: :func:`slug`; the index and sample keep names unique)
    and ``prompts.rank{r}.jsonl`` (index, sample, the whole prompt, file).

    Args:
        dirpath: Where to write; null = `<default_root_dir>/predictions`.
    """

    def __init__(self, dirpath: str | None = None):
        super().__init__(write_interval="batch")
        self.dirpath = dirpath
        self.written: list[Path] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        context = getattr(trainer.strategy, "context_parallel", None)
        if context is not None and context.context_rank != 0:  # its context peers drew the same images
            return
        root = Path(self.dirpath or Path(trainer.default_root_dir) / "predictions")
        root.mkdir(parents=True, exist_ok=True)
        lines = []
        for image, prompt, index, sample in zip(prediction["images"], prediction["prompt"], prediction["index"],
                                                prediction["sample"]):
            path = root / f"{file_stem(int(index), int(sample), str(prompt))}.png"
            if image.ndim == 4:  # a video [F, 3, H, W] (video families): an animated GIF
                path = path.with_suffix(".gif")
                frames = (image.permute(0, 2, 3, 1).float().numpy() * 255).round().astype(np.uint8)
                atomic_write(path, lambda tmp, f=frames: Path(tmp).write_bytes(gif_bytes(f)))
            else:
                array = (image.permute(1, 2, 0).float().numpy() * 255).round().astype(np.uint8)
                atomic_write(path, lambda tmp, a=array: Image.fromarray(a).save(tmp, format="PNG"))
            self.written.append(path)
            lines.append(json.dumps({"index": int(index), "sample": int(sample), "prompt": prompt, "file": path.name}))
        with open(root / f"prompts.rank{trainer.global_rank}.jsonl", "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        self.root = root

    def on_predict_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.written:
            finish_progress_bar(trainer, pl_module)  # the line below the finished bar
            print(self.message(trainer.global_rank))

    def message(self, rank: int = 0) -> str:
        """What was written, by the files' own names: images (PNG) and / or videos (animated GIF)."""
        kinds = []
        for suffix, what in ((".png", "image{} (PNG"), (".gif", "video{} (animated GIF")):
            names = sorted(p.name for p in self.written if p.suffix == suffix)
            if names:
                shown = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
                kinds.append(f"{len(names)} {what.format('' if len(names) == 1 else 's')}: {shown})")
        return (f"jagg predict: wrote {' and '.join(kinds)} to {self.root}/; prompts.rank{rank}.jsonl lists each "
                "file's prompt")
