"""GenEval's scoring rules over detections, transcribed (plain numpy; the readers that make detections are elsewhere).

Sources, fetched from GitHub and read line by line:

* ``djghosh13/geneval``, ``evaluation/evaluate_images.py`` (GenEval's evaluator): the confidence thresholds, the
  per-class cap, the NMS overlap, the position margin (its ``__main__`` defaults, each overridable there by
  ``--options``), the colour list and CLIP colour templates, ``compute_iou``, ``relative_position``, ``evaluate``
  (the 0/1 correctness) and the selection loop of ``evaluate_image``;
* ``djghosh13/geneval``, ``evaluation/summary_scores.py``: the overall score, the mean over tasks (``tag``) of each
  task's accuracy over images;
* ``yifan123/reward-server``, ``reward_server/gen_eval.py`` (the server Flow-GRPO's ``geneval_score`` posts to;
  ``flow_grpo/rewards.py`` trains on its ``scores``): ``evaluate_reward``, the dense reward, and its
  ``strict_correct`` (exact counts). Its constants equal GenEval's defaults.

Matched numbers (name in the source -> here):

=========================  =====  ====================================================================
``THRESHOLD``              0.3    confidence a detection needs (``> 0.3``) outside counting prompts
``COUNTING_THRESHOLD``     0.9    the same for ``tag == "counting"`` prompts
``MAX_OBJECTS``            16     detections kept per class, most confident first
``NMS_THRESHOLD``          1.0    ``max_overlap``: 1 = no suppression; below 1, IoU ``<`` it survives
``POSITION_THRESHOLD``     0.1    margin: each axis offset shrinks by 0.1 x (the two boxes' extents)
``relative_position``      0.5    a relation holds when the shrunk offset / the raw offset's norm passes 0.5
                           1e-3   both shrunk offsets below it: no relation at all
``COLORS``                        red, orange, yellow, green, blue, purple, pink, brown, black, white
``compute_iou``            +1     box areas count pixels inclusively, (x1 - x0 + 1) (y1 - y0 + 1)
=========================  =====  ====================================================================

A detection is a :class:`Detection` (box ``x0, y0, x1, y1`` in pixels, confidence, optional mask); a reader gives
raw detections by class name and, for colour clauses, the colour of each (GenEval asks CLIP on the masked crop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0
POSITION_THRESHOLD = 0.1
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITIONS = ("left of", "right of", "above", "below")
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# GenEval's colour classifier: a CLIP zero-shot head averaged over these templates ({c}: colour, then the class)
COLOR_TEMPLATES = ("a photo of a {c} {classname}", "a photo of a {c}-colored {classname}", "a photo of a {c} object")


@dataclass
class Detection:
    """One detected object: ``box`` (x0, y0, x1, y1) in pixels, ``score`` (confidence), ``mask`` ([H, W] bool or
    None), ``color`` (a reader that knows it exactly sets it; else the colour classifier is asked)."""

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None
    color: str | None = None


@dataclass
class Thresholds:
    """GenEval's selection and position numbers (its ``evaluate_images.py`` defaults; see the module table)."""

    threshold: float = THRESHOLD
    counting_threshold: float = COUNTING_THRESHOLD
    max_objects: int = MAX_OBJECTS
    nms_threshold: float = NMS_THRESHOLD
    position_threshold: float = POSITION_THRESHOLD


ColorFn = Callable[[list, str], list]  # (detections, class name) -> one colour name each


def compute_iou(box_a, box_b) -> float:
    """GenEval's IoU: inclusive pixel areas (+1 per side)."""
    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)
    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def select_detections(raw: dict[str, list[Detection]], tag: str, thresholds: Thresholds = Thresholds()
                      ) -> dict[str, list[Detection]]:
    """``evaluate_image``'s selection: per class, detections above the confidence threshold (the counting one for
    ``tag == "counting"``; strictly greater), most confident first, at most ``max_objects``, then greedy NMS (a
    detection survives when its IoU with every kept one is below ``nms_threshold``; 1 = none suppressed).

    "Most confident first" is GenEval's ``np.argsort(scores)[::-1]``: among equal scores the reversed ascending
    sort puts the LATER detection first (numpy's default sort keeps equal keys in order on the short arrays a class
    has: an insertion sort below 16 elements), which decides which of two tied objects is read for colour and
    position. The stable sort, reversed, is that rule on every length and CPU (a vectorised default sort may not
    keep ties in order)."""
    limit = thresholds.threshold if tag != "counting" else thresholds.counting_threshold
    detected = {}
    for classname, found in raw.items():
        scores = np.array([d.score for d in found], dtype=np.float64)
        ordering = np.argsort(scores, kind="stable")[::-1]
        ordering = ordering[scores[ordering] > limit][: thresholds.max_objects]
        order = [found[i] for i in ordering.tolist()]
        kept = []
        while order:
            best = order.pop(0)
            kept.append(best)
            order = [d for d in order if thresholds.nms_threshold == 1
                     or compute_iou(best.box, d.box) < thresholds.nms_threshold]
        if kept:
            detected[classname] = kept
    return detected


def relative_position(obj_a: Detection, obj_b: Detection, position_threshold: float = POSITION_THRESHOLD) -> set[str]:
    """Where A is relative to B: offsets of the box centres, each axis shrunk by ``position_threshold`` x (both
    boxes' extents on it) toward 0, divided by the raw offset's norm; past +-0.5 a relation holds."""
    boxes = np.array([obj_a.box, obj_b.box], dtype=np.float64)[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - position_threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def object_colors(colors: ColorFn, found: list[Detection], classname: str) -> list[str]:
    """Each detection's colour: its own when the reader set it, else the colour classifier's."""
    if all(d.color is not None for d in found):
        return [d.color for d in found]
    return list(colors(found, classname))


def evaluate(objects: dict[str, list[Detection]], metadata: dict, colors: ColorFn,
             position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, str]:
    """GenEval's ``evaluate``: include clauses ANDed (at least ``count`` of the class; the first ``count`` of the
    requested colour; each of them in the relation to every object of the target group), exclude clauses ORed (a
    class found ``count`` times or more fails). Colour and position read only the ``count`` most confident."""
    correct, reason, matched_groups = True, [], []
    for req in metadata.get("include", []):
        classname, matched = req["class"], True
        found = objects.get(classname, [])[: req["count"]]
        if len(found) < req["count"]:
            correct = matched = False
            reason.append(f"expected {classname}>={req['count']}, found {len(found)}")
        else:
            if "color" in req:
                seen = object_colors(colors, found, classname)
                if seen.count(req["color"]) < req["count"]:
                    correct = matched = False
                    reason.append(f"expected {req['color']} {classname}>={req['count']}, found "
                                  f"{seen.count(req['color'])} {req['color']}")
            if "position" in req and matched:
                expected, target = req["position"]
                if matched_groups[target] is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {expected}")
                else:
                    for obj in found:
                        for target_obj in matched_groups[target]:
                            true_rels = relative_position(obj, target_obj, position_threshold)
                            if expected not in true_rels:
                                correct = matched = False
                                reason.append(f"expected {classname} {expected} target, found "
                                              f"{' and '.join(sorted(true_rels))} target")
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        classname = req["class"]
        if len(objects.get(classname, [])) >= req["count"]:
            correct = False
            reason.append(f"expected {classname}<{req['count']}, found {len(objects[classname])}")
    return correct, "\n".join(reason)


def evaluate_reward(objects: dict[str, list[Detection]], metadata: dict, colors: ColorFn,
                    position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, float, str]:
    """Flow-GRPO's ``evaluate_reward`` (reward-server ``gen_eval.py``), kept as written: (strict correctness, dense
    score, reason). Every found object of a class counts (not only the first ``count``); per include clause
    1 - |count - found| / count (negative past twice the count); a colour clause adds 1 - |count - of that colour| /
    count when the count is exact, else 0; a position clause adds 0 for a missing target, and on a failed relation
    0 *and then* 1 (the server appends 1.0 after its loop either way), else 1. Exclude clauses are not read (the
    exact count covers counting's). The score is the mean of those terms; strict = every count exact, every colour
    and relation held."""
    correct, reason, rewards, matched_groups = True, [], [], []
    for req in metadata.get("include", []):
        classname, matched = req["class"], True
        found = objects.get(classname, [])
        rewards.append(1 - abs(req["count"] - len(found)) / req["count"])
        if len(found) != req["count"]:
            correct = matched = False
            reason.append(f"expected {classname}=={req['count']}, found {len(found)}")
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                seen = object_colors(colors, found, classname)
                rewards.append(1 - abs(req["count"] - seen.count(req["color"])) / req["count"])
                if seen.count(req["color"]) != req["count"]:
                    correct = matched = False
                    reason.append(f"expected {req['color']} {classname}=={req['count']}, found "
                                  f"{seen.count(req['color'])} {req['color']}")
            if "position" in req and matched:
                expected, target = req["position"]
                if matched_groups[target] is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {expected}")
                    rewards.append(0.0)
                else:
                    for obj in found:
                        for target_obj in matched_groups[target]:
                            if expected not in relative_position(obj, target_obj, position_threshold):
                                correct = matched = False
                                reason.append(f"expected {classname} {expected} target")
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)
        matched_groups.append(found if matched else None)
    score = sum(rewards) / len(rewards) if rewards else 0
    return correct, float(score), "\n".join(reason)


@dataclass
class Judgement:
    """One image's reading: GenEval's ``correct``, Flow-GRPO's ``strict`` and dense ``score``, the reasons."""

    tag: str
    correct: bool
    strict: bool
    score: float
    reason: str = ""
    detected: dict = field(default_factory=dict)


def judge(raw: dict[str, list[Detection]], metadata: dict, colors: ColorFn,
          thresholds: Thresholds = Thresholds()) -> Judgement:
    """Select the detections for this prompt's tag, then both GenEval's and Flow-GRPO's readings."""
    objects = select_detections(raw, metadata.get("tag", ""), thresholds)
    correct, reason = evaluate(objects, metadata, colors, thresholds.position_threshold)
    strict, score, _ = evaluate_reward(objects, metadata, colors, thresholds.position_threshold)
    return Judgement(metadata.get("tag", ""), correct, strict, score, reason, objects)


def task_scores(tags: list[str], correct: list[bool]) -> dict[str, float]:
    """``summary_scores.py``: each task's accuracy over its images, and ``overall`` = their mean over the tasks
    present (every task weighs the same, whatever its number of images)."""
    per_task: dict[str, list[bool]] = {}
    for tag, ok in zip(tags, correct):
        per_task.setdefault(tag, []).append(bool(ok))
    scores = {tag: float(np.mean(v)) for tag, v in per_task.items()}
    if scores:
        scores["overall"] = float(np.mean(list(scores.values())))
    return scores


def task_intervals(tags: list[str], correct: list[bool], z: float = 1.96) -> dict[str, float]:
    """The half-width of each task's 95 % interval (Wilson's score interval, so a task scored 0 or 1 still gets
    one) and of ``overall`` (the mean over tasks of independent proportions: sqrt(sum of the tasks' variances) / T,
    each variance from its Wilson half-width)."""
    per_task: dict[str, list[bool]] = {}
    for tag, ok in zip(tags, correct):
        per_task.setdefault(tag, []).append(bool(ok))
    half = {}
    for tag, v in per_task.items():
        n, p = len(v), float(np.mean(v))
        half[tag] = float(z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n))
    if half:
        half["overall"] = float(np.sqrt(sum(h * h for h in half.values())) / len(half))
    return half


def geneval_metrics(tags: list[str], correct: list[bool], stage: str = "val") -> dict[str, float]:
    """:func:`task_scores` under the logged names ``<stage>/geneval/<task>`` and ``<stage>/geneval/overall``."""
    return {f"{stage}/geneval/{name}": value for name, value in task_scores(tags, correct).items()}
