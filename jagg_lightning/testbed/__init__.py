"""The digits test bed: a small StableDiffusion3Pipeline trained offline on scikit-learn's 8x8 digits.

``PIPELINE_DIR`` is the shipped pipeline (``save_pretrained``, safetensors); ``CLASSIFIER_PATH`` the
classifier behind :class:`jagg_lightning.rewards.DigitReward`; ``JUDGE_PATH`` the independent judge
(:mod:`jagg_lightning.testbed.judge`) that reads the same images and is never a reward.
``python -m jagg_lightning.testbed.train`` rebuilds the pipeline and classifier (see that module;
``python -m jagg_lightning.testbed.judge`` the judge); ``training_info.json`` next to the weights
records the data split, seeds, step counts, the losses reached and the base model's per-digit accuracy.

Prompts come from templates: ``TRAIN_TEMPLATES`` (pretraining and GRPO fine-tuning) and
``HELDOUT_TEMPLATES`` (seen in pretraining, never by GRPO: the held-out prompt-following metric).

The test bed uses the package as a user does: it may import anything but ``callbacks/`` and ``cli/``.
"""

from __future__ import annotations

from pathlib import Path

from jagg_lightning.rewards.digits import CLASSIFIER_PATH, DIGIT_WORDS

PIPELINE_DIR = Path(__file__).resolve().parent / "digits_sd3"
JUDGE_PATH = Path(__file__).resolve().parent / "digits_judge.safetensors"  # testbed.judge's
INFO_PATH = PIPELINE_DIR / "training_info.json"

TRAIN_TEMPLATES = (
    "a handwritten digit {d}",
    "the number {w}",
    "a drawing of a {w}",
    "digit {d}",
    "the digit {w}",
    "a {w}",
)
HELDOUT_TEMPLATES = (
    "a handwritten {w}",
    "the numeral {d}",
    "number {d}, handwritten",
)


def digit_prompts(templates=TRAIN_TEMPLATES, digits=range(10)) -> list[str]:
    """Every template filled with every digit (numeral {d}, word {w}), template-major."""
    return [t.format(d=d, w=DIGIT_WORDS[d]) for t in templates for d in digits]


__all__ = ["CLASSIFIER_PATH", "HELDOUT_TEMPLATES", "INFO_PATH", "JUDGE_PATH", "PIPELINE_DIR", "TRAIN_TEMPLATES", "digit_prompts"]
