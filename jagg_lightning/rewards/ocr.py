"""Text rendering: does the image show the text the prompt quotes? Flow-GRPO's OCR reward, offline.

Definition (Flow-GRPO, ``flow_grpo/ocr.py``; the reward behind its OCR task, 0.59 -> 0.92 on SD3.5-M):

- target T: the text between the first pair of double quotes in the prompt
  (``'a shop sign that says "Open Late"'`` -> ``Open Late``);
- recognised text R: every text line the OCR reads with confidence >= ``text_score``, concatenated
  in reading order;
- both lower-cased with spaces removed;
- reward = 1 if T is a substring of R, else 1 - min(lev(R, T), |T|) / |T|, where lev is the
  Levenshtein edit distance (insertions, deletions, substitutions, each 1) of the whole strings.

So the reward lies in [0, 1]: 1 for the target anywhere in the image, 0 for nothing legible, and
partial credit per wrong character. Flow-GRPO reads with PaddleOCR (PP-OCR, English, no angle
classifier, drop score 0.5); here the PP-OCRv4 detection and recognition models that ship inside the
``rapidocr-onnxruntime`` wheel run under onnxruntime -- same model family, no Paddle, nothing downloaded
(``pip install jagg_lightning[ocr]``). Flow-GRPO scores a failed OCR call as 0 silently; here a failure
stops the step with the reward's name (``Reward.forward``), and a prompt without a quoted target is an
error naming the prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jagg_lightning.rewards.base import Reward, to_pil


def ocr_target(prompt: str) -> str:
    """The text between the prompt's first pair of double quotes, verbatim.

    Raises ValueError when the prompt has no closed pair of double quotes or quotes nothing but spaces.
    """
    parts = prompt.split('"')
    # an odd count of quote characters leaves the last part unclosed: the prompt quotes nothing
    if len(parts) < 3 or not parts[1].strip():
        raise ValueError(f'reward ocr: prompt {prompt!r} has no target text between double quotes; write the text '
                         f'to render as "..." (e.g. \'a sign that says "OPEN"\')')
    return parts[1]


def normalise(text: str) -> str:
    """Lower-case, spaces removed (Flow-GRPO's normalisation; other whitespace is kept, as there)."""
    return text.replace(" ", "").lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions from a to b."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """1 if normalise(target) is in normalise(recognised), else 1 - min(lev, |T|) / |T| (both normalised)."""
    text, goal = normalise(recognised), normalise(target)
    if not goal:
        raise ValueError(f"reward ocr: target {target!r} is empty once spaces are removed")
    if goal in text:
        return 1.0
    return 1.0 - min(edit_distance(text, goal), len(goal)) / len(goal)


class OcrReward(Reward):
    """Flow-GRPO's OCR reward (see the module docstring for the definition), in [0, 1].

    Args:
        text_score: lines the recogniser reads with lower confidence are dropped, in [0, 1]
            (0.5: PaddleOCR's drop score, which Flow-GRPO's reward runs with).
        threads: onnxruntime threads per model (intra-op), >= 1; 1 leaves the cores to sampling.
    """

    name = "ocr"

    def __init__(self, text_score: float = 0.5, threads: int = 1):
        super().__init__()
        if not 0.0 <= text_score <= 1.0:
            raise ValueError(f"reward ocr: text_score must be in [0, 1], got {text_score}")
        if int(threads) != threads or threads < 1:
            raise ValueError(f"reward ocr: threads must be an integer >= 1, got {threads}")
        self.text_score, self.threads = float(text_score), int(threads)
        self.engine = self._engine()
        self.freeze()

    def _engine(self):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ImportError("reward ocr needs rapidocr-onnxruntime: pip install 'jagg_lightning[ocr]'") from err
        # the detection and recognition models are the ONNX files inside the wheel (models/), loaded
        # from disk; the angle classifier is off, as in Flow-GRPO (rendered text is upright)
        return RapidOCR(text_score=self.text_score, use_cls=False, intra_op_num_threads=self.threads,
                        inter_op_num_threads=1)

    # onnxruntime sessions cannot be pickled: a copy (deepcopy, a spawned DDP worker) loads its own
    def __getstate__(self):
        return {**self.__dict__, "engine": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.engine = self._engine()

    def read(self, images: Tensor) -> list[str]:
        """What the OCR reads in each image [B, 3, H, W] in [0, 1]: confident lines joined, not normalised."""
        texts = []
        for image in to_pil(images):  # a PIL image: RapidOCR converts RGB to the BGR its models expect
            lines, _ = self.engine(image, use_cls=False)
            # RapidOCR filters by text_score itself; filtering again keeps the threshold ours if its default moves
            texts.append("".join(text for _, text, score in (lines or []) if float(score) >= self.text_score))
        return texts

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        targets = [ocr_target(p) for p in prompts]  # before any OCR: a bad prompt fails at once
        return torch.tensor([ocr_score(text, goal) for text, goal in zip(self.read(images), targets)],
                            dtype=torch.float32)
