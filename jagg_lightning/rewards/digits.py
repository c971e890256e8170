"""Prompt-following on the digits test bed: does the image show the digit the prompt names?

The small-scale analogue of GenEval's correctness check. A small CNN trained on the train split of
scikit-learn's 8x8 handwritten digits (``jagg_lightning/testbed``, weights shipped as safetensors)
reads the image (RGB, any side that is a multiple of 8: channel mean, average-pooled to 8x8); the
reward is the classifier's probability (or log-probability) of the digit the prompt names. Prompts
name their digit as a numeral ("a handwritten digit 7") or a word ("the number seven"); a prompt that
names no digit, or two different ones, is an error -- there is nothing to score it against.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DIGIT_PATTERN = re.compile(r"(?<![0-9A-Za-z])(" + "|".join(("[0-9]",) + DIGIT_WORDS) + r")(?![0-9A-Za-z])",
                            re.IGNORECASE)
CLASSIFIER_PATH = Path(__file__).resolve().parent.parent / "testbed" / "digits_classifier.safetensors"


def prompt_digit(prompt: str) -> int:
    """The single digit a prompt names, as a numeral (a standalone 0-9) or a word (zero..nine).

    Raises ValueError when the prompt names no digit or two different digits.
    """
    found = {int(m) if m.isdigit() else DIGIT_WORDS.index(m.lower()) for m in _DIGIT_PATTERN.findall(prompt)}
    if len(found) != 1:
        what = "names no digit" if not found else f"names several digits {sorted(found)}"
        raise ValueError(f"reward digits: prompt {prompt!r} {what}; it must name exactly one of 0-9 "
                         f"(a numeral or one of {', '.join(DIGIT_WORDS)})")
    return found.pop()


def to_digit_grid(images: Tensor) -> Tensor:
    """[B, 3, H, W] in [0, 1] (H, W multiples of 8) -> [B, 1, 8, 8]: the channel mean, average-pooled."""
    if images.shape[-1] % 8 or images.shape[-2] % 8:
        raise ValueError(f"reward digits: image side must be a multiple of 8, got {tuple(images.shape[-2:])}")
    grey = images.float().mean(dim=1, keepdim=True)
    return F.adaptive_avg_pool2d(grey, 8)


class DigitClassifier(nn.Module):
    """8x8 grey digit in [0, 1] -> 10 logits: two 3x3 convolutions, a 2x2 pool, two linear layers."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width // 2, 3, padding=1), nn.ReLU(), nn.Conv2d(width // 2, width, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, grid: Tensor) -> Tensor:
        return self.head(self.features(grid))


def load_classifier(path: str | Path = CLASSIFIER_PATH) -> DigitClassifier:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reward digits: classifier_path {str(path)!r} does not exist")
    state = load_file(str(path))
    width = state["features.2.weight"].shape[0]
    model = DigitClassifier(width)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


class DigitReward(Reward):
    """score = p(named digit | image) (``score: prob``, in [0, 1]) or its log (``score: log_prob``).

    classifier_path: the classifier's safetensors (default: the one shipped with the test bed).
    """

    name = "digits"

    def __init__(self, classifier_path: str | None = None, score: str = "prob"):
        super().__init__()
        if score not in ("prob", "log_prob"):
            raise ValueError(f"reward digits: score must be 'prob' or 'log_prob', got {score!r}")
        self.kind = score
        self.classifier = load_classifier(classifier_path or CLASSIFIER_PATH)
        self.freeze()

    def log_probs(self, images: Tensor) -> Tensor:
        """[B, 10] log-probabilities of each digit."""
        param = next(self.classifier.parameters())
        return self.classifier(to_digit_grid(images).to(param.device, param.dtype)).log_softmax(-1)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        target = torch.tensor([prompt_digit(p) for p in prompts], device=images.device)
        logp = self.log_probs(images).gather(1, target[:, None].to(next(self.classifier.parameters()).device))[:, 0]
        return logp if self.kind == "log_prob" else logp.exp()

    @torch.no_grad()
    def correct(self, images: Tensor, prompts: list[str]) -> Tensor:
        """[B] bool: the classifier's most likely digit is the one the prompt names (prompt following)."""
        target = torch.tensor([prompt_digit(p) for p in prompts])
        return self.log_probs(images).argmax(-1).cpu() == target
