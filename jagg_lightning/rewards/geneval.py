"""GenEval's scoring rules over a detector, as a reward: one implementation, pluggable readers.

The rules are GenEval's own, transcribed in :mod:`jagg_lightning.rewards.geneval_rules` (its module docstring lists
every matched constant with its source file and name). A reader turns an image into raw detections by class and
says the colour of detected objects; the rules select (confidence threshold, the counting one for counting prompts,
``MAX_OBJECTS``, NMS) and judge. Readers (``reader:``):

* ``scenes``: the exact analytic reader of the scenes test bed (colour segmentation, connected components, shape
  from geometry: :mod:`~jagg_lightning.rewards.geneval_scenes`); no weights;
* ``mask2former``: ``Mask2FormerForUniversalSegmentation`` from ``detector_path`` + CLIP from ``clip_path``
  (GenEval's pair: :mod:`~jagg_lightning.rewards.geneval_models`);
* ``owlv2``: ``Owlv2ForObjectDetection`` (open vocabulary) from ``detector_path`` + CLIP from ``clip_path``.

What each prompt asks is its GenEval metadata (``tag``, ``include``, ``exclude``): a metadata JSONL given as the
data file (``data.prompts_file: .../evaluation_metadata.jsonl``) hands each prompt its row
(:func:`jagg_lightning.models.conditions.metadata_of`). A prompt without it is an error naming the prompt, raised
at setup (:meth:`GenEvalReward.check_prompts`).

Scores (``score:``):

* ``flow_grpo`` (default): Flow-GRPO's dense GenEval reward, the ``score`` its reward server returns and its
  trainer optimises -- the mean of the per-clause terms of :func:`~jagg_lightning.rewards.geneval_rules.evaluate_reward`
  (count match 1 - |n - count| / count, then colour and position terms), quirks kept;
* ``strict``: Flow-GRPO's ``strict_correct`` (0 / 1: exact counts, colours and relations);
* ``geneval``: GenEval's per-image ``correct`` (0 / 1), what its benchmark reports.

:meth:`GenEvalReward.judge_images` gives every reading; :func:`~jagg_lightning.rewards.geneval_rules.geneval_metrics`
turns them into ``val/geneval/<task>`` and ``val/geneval/overall`` (the mean over tasks of per-task accuracy, as
GenEval's ``summary_scores.py`` averages).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from jagg_lightning.models.conditions import metadata_of, where
from jagg_lightning.rewards.base import Reward
from jagg_lightning.rewards.geneval_rules import (TASKS, Judgement, Thresholds, geneval_metrics, judge,
                                                  task_scores)

READERS = ("scenes", "mask2former", "owlv2")
SCORES = ("flow_grpo", "strict", "geneval")


def check_metadata(metadata: dict, prompt) -> dict:
    """The GenEval metadata a prompt carries, its shape checked; a missing or malformed one names the prompt."""
    if not metadata:
        raise ValueError(f"prompt {where(prompt)} carries no GenEval metadata: give a metadata JSONL as the data file "
                         "(one row a line with 'tag', 'include', 'prompt', ...: GenEval's evaluation_metadata.jsonl)")
    include = metadata.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError(f"prompt {where(prompt)}: GenEval metadata 'include' must be a non-empty list, "
                         f"got {include!r}")
    for req in include + list(metadata.get("exclude", [])):
        if not isinstance(req, dict) or not isinstance(req.get("class"), str) or not isinstance(req.get("count"), int) \
                or req["count"] < 1:
            raise ValueError(f"prompt {where(prompt)}: every GenEval clause needs 'class' (a string) and 'count' "
                             f"(an integer >= 1), got {req!r}")
    return metadata


def named_classes(metadata: dict) -> list[str]:
    return [req["class"] for req in metadata.get("include", []) + metadata.get("exclude", [])]


def read_and_judge(reader, images: Tensor, prompts: list[str],
                   thresholds: Thresholds = Thresholds()) -> list[Judgement]:
    """GenEval's rules over any reader (``detect(arrays, wanted classes)``, ``colors(array, detections, class)``):
    each image [3, H, W] in [0, 1] read as 8-bit RGB and judged against its prompt's metadata."""
    metadata = [check_metadata(metadata_of(p), p) for p in prompts]
    arrays = list((images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round()
                  .astype(np.uint8))
    raw = reader.detect(arrays, [named_classes(m) for m in metadata])
    return [judge(found, m, lambda objs, name, a=a: reader.colors(a, objs, name), thresholds)
            for a, found, m in zip(arrays, raw, metadata)]


class GenEvalReward(Reward):
    """GenEval's rules over a detector (see the module docstring).

    Args:
        reader: `scenes` (the scenes test bed's exact reader), `mask2former` or `owlv2` (with `detector_path` and
            `clip_path`).
        score: `flow_grpo` (Flow-GRPO's dense score, default), `strict` (Flow-GRPO's exact 0/1) or `geneval`
            (GenEval's 0/1).
        detector_path: The local folder of the detector (`mask2former`, `owlv2`).
        clip_path: The local folder of the CLIP model + processor that classifies colours (`mask2former`, `owlv2`).
        threshold: GenEval's `THRESHOLD` (0.3): a detection's confidence must exceed it.
        counting_threshold: GenEval's `COUNTING_THRESHOLD` (0.9), for counting prompts.
        max_objects: GenEval's `MAX_OBJECTS` (16) per class.
        nms_threshold: GenEval's `NMS_THRESHOLD` (`max_overlap`, 1.0 = no suppression).
        position_threshold: GenEval's `POSITION_THRESHOLD` (0.1), the relative-position margin.
        min_area: The `scenes` reader's smallest object in pixels; null = 0.4 % of the image.
    """

    name = "geneval"

    def __init__(self, reader: str = "scenes", score: str = "flow_grpo", detector_path: str | None = None,
                 clip_path: str | None = None, threshold: float = 0.3, counting_threshold: float = 0.9,
                 max_objects: int = 16, nms_threshold: float = 1.0, position_threshold: float = 0.1,
                 min_area: int | None = None):
        super().__init__()
        if reader not in READERS:
            raise ValueError(f"reward geneval: reader must be one of {READERS}, got {reader!r}")
        if score not in SCORES:
            raise ValueError(f"reward geneval: score must be one of {SCORES}, got {score!r}")
        for field, value in (("threshold", threshold), ("counting_threshold", counting_threshold),
                             ("position_threshold", position_threshold)):
            if not 0 <= value < 1:
                raise ValueError(f"reward geneval: {field} must lie in [0, 1), got {value!r}")
        if not 0 < nms_threshold <= 1:
            raise ValueError(f"reward geneval: nms_threshold must lie in (0, 1], got {nms_threshold!r}")
        if max_objects < 1:
            raise ValueError(f"reward geneval: max_objects must be >= 1, got {max_objects!r}")
        self.kind = score
        self.thresholds = Thresholds(threshold, counting_threshold, max_objects, nms_threshold, position_threshold)
        self.reader = self._build_reader(reader, detector_path, clip_path, min_area)
        self.freeze()

    @staticmethod
    def _build_reader(reader: str, detector_path, clip_path, min_area):
        if reader == "scenes":
            from jagg_lightning.rewards.geneval_scenes import SceneReader

            return SceneReader(min_area)
        from pathlib import Path

        from jagg_lightning.rewards import geneval_models

        for field, path in (("detector_path", detector_path), ("clip_path", clip_path)):
            if path is None or not Path(path).exists():
                raise FileNotFoundError(f"reward geneval: reader {reader} needs {field}, a local folder "
                                        f"(got {path!r}; nothing is downloaded)")
        cls = geneval_models.Mask2FormerReader if reader == "mask2former" else geneval_models.Owlv2Reader
        return cls(str(detector_path), str(clip_path))

    def judge_images(self, images: Tensor, prompts: list[str]) -> list[Judgement]:
        """Every image's reading against its prompt's metadata: GenEval's correctness, Flow-GRPO's strict and dense
        scores, the reasons and the detections the rules kept."""
        return read_and_judge(self.reader, images, prompts, self.thresholds)

    def check_prompts(self, prompts: list[str], field: str) -> None:
        """Every prompt carries well-formed GenEval metadata (checked before training, not at the first score)."""
        for prompt in prompts:
            try:
                check_metadata(metadata_of(prompt), prompt)
            except ValueError as err:
                raise ValueError(f"{field}: {err}") from None

    def scores_of(self, judged: list[Judgement]) -> Tensor:
        """The chosen ``score`` of each reading, float32 [B]."""
        if self.kind == "flow_grpo":
            values = [j.score for j in judged]
        else:
            values = [float(j.strict if self.kind == "strict" else j.correct) for j in judged]
        return torch.tensor(values, dtype=torch.float32)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self.scores_of(self.judge_images(images, prompts))

    @torch.no_grad()
    def correct(self, images: Tensor, prompts: list[str]) -> Tensor:
        """[B] bool: GenEval's per-image correctness."""
        return torch.tensor([j.correct for j in self.judge_images(images, prompts)])

    @staticmethod
    def metrics(judged: list[Judgement], stage: str = "val") -> dict[str, float]:
        """``<stage>/geneval/<task>`` (accuracy) and ``<stage>/geneval/overall`` (their mean over tasks)."""
        return geneval_metrics([j.tag for j in judged], [j.correct for j in judged], stage)


__all__ = ["GenEvalReward", "READERS", "SCORES", "TASKS", "check_metadata", "read_and_judge", "task_scores"]
