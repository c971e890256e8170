"""GenEval's rules on hand-built detections: each threshold, the counting threshold, MAX_OBJECTS, NMS, the position
margin, colours, exclusions, Flow-GRPO's dense score and GenEval's mean over tasks."""

import numpy as np
import pytest

from jagg_lightning.rewards.geneval_rules import (COUNTING_THRESHOLD, MAX_OBJECTS, POSITION_THRESHOLD, THRESHOLD,
                                                  Detection, Thresholds, compute_iou, evaluate, evaluate_reward,
                                                  geneval_metrics, relative_position, select_detections, task_intervals,
                                                  task_scores)


def det(x, y, w=10.0, h=10.0, score=1.0, color=None):
    """A detection centred at (x, y)."""
    return Detection((x - w / 2, y - h / 2, x + w / 2, y + h / 2), score, None, color)


def no_colors(found, classname):
    raise AssertionError("the colour classifier was asked although every detection has its colour")


def test_the_matched_constants_are_genevals_defaults():
    """evaluate_images.py: threshold 0.3, counting_threshold 0.9, max_objects 16, max_overlap 1.0, position 0.1."""
    assert (THRESHOLD, COUNTING_THRESHOLD, MAX_OBJECTS, POSITION_THRESHOLD) == (0.3, 0.9, 16, 0.1)
    assert Thresholds() == Thresholds(0.3, 0.9, 16, 1.0, 0.1)


def test_confidence_thresholds_are_strict_and_counting_uses_its_own(rng_seed):
    rng = np.random.default_rng(rng_seed)
    low, mid = rng.uniform(0.31, 0.89), rng.uniform(0.91, 0.99)
    raw = {"cup": [det(10, 10, score=THRESHOLD), det(30, 10, score=low), det(50, 10, score=mid),
                   det(70, 10, score=COUNTING_THRESHOLD)]}
    kept = select_detections(raw, "two_object")["cup"]
    assert [d.score for d in kept] == [mid, COUNTING_THRESHOLD, low]  # most confident first; exactly 0.3 is out
    assert [d.score for d in select_detections(raw, "counting")["cup"]] == [mid]  # 0.9 itself is out
    assert select_detections({"cup": [det(10, 10, score=0.2)]}, "colors") == {}


def test_max_objects_keeps_the_most_confident(rng_seed):
    scores = np.random.default_rng(rng_seed).uniform(0.4, 1.0, size=MAX_OBJECTS + 5)
    raw = {"cup": [det(20 * i, 0, score=s) for i, s in enumerate(scores)]}
    kept = select_detections(raw, "single_object")["cup"]
    assert [d.score for d in kept] == sorted(scores, reverse=True)[:MAX_OBJECTS]
    assert len(select_detections(raw, "single_object", Thresholds(max_objects=3))["cup"]) == 3


def test_equal_scores_put_the_later_detection_first_as_genevals_argsort(rng_seed):
    """GenEval orders a class's detections by ``np.argsort(scores)[::-1]``: among equal scores the later one comes
    first. Random scores drawn from three values (many ties), at most 16 per class: the kept order is descending
    score, ties by descending index (the explicit rule, not numpy's call); and a tie decides colour binding."""
    rng = np.random.default_rng(rng_seed)
    for _ in range(20):
        n = int(rng.integers(2, 17))
        scores = rng.choice([0.5, 0.7, 0.95], size=n)
        raw = {"cup": [det(20 * i, 0, score=float(s)) for i, s in enumerate(scores)]}
        kept = select_detections(raw, "colors")["cup"]
        expected = sorted(range(n), key=lambda i: (-scores[i], -i))
        assert [raw["cup"].index(d) for d in kept] == expected
    score = float(rng.uniform(0.4, 1.0))
    blue, red = det(10, 10, score=score, color="blue"), det(40, 10, score=score, color="red")
    clause = {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}]}
    assert evaluate(select_detections({"cup": [blue, red]}, "colors"), clause, no_colors)[0]  # red, the later, read
    assert not evaluate(select_detections({"cup": [red, blue]}, "colors"), clause, no_colors)[0]


def test_nms_off_by_default_and_suppressing_overlaps_at_or_above_its_threshold():
    a = Detection((0, 0, 9, 9), 0.9)       # 100 px (GenEval's inclusive areas)
    b = Detection((0, 0, 9, 4), 0.8)       # 50 px inside a: IoU 0.5
    c = Detection((20, 20, 29, 29), 0.7)   # apart
    assert compute_iou(a.box, b.box) == 0.5 and compute_iou(a.box, c.box) == 0
    assert len(select_detections({"cup": [a, b, c]}, "colors")["cup"]) == 3
    assert select_detections({"cup": [a, b, c]}, "colors", Thresholds(nms_threshold=0.5))["cup"] == [a, c]
    assert select_detections({"cup": [a, b, c]}, "colors", Thresholds(nms_threshold=0.51))["cup"] == [a, b, c]


def test_position_margin_shrinks_each_axis_by_a_tenth_of_both_extents(rng_seed):
    """Side by side, same width w, offset dx: the shrunk offset (dx - 0.2 w) over dx passes 0.5 iff dx > 0.4 w."""
    rng = np.random.default_rng(rng_seed)
    w = rng.uniform(5, 30)
    b = det(100, 100, w, w)
    assert relative_position(det(100 + 0.41 * w, 100, w, w), b) == {"right of"}
    assert relative_position(det(100 - 0.41 * w, 100, w, w), b) == {"left of"}
    assert relative_position(det(100 + 0.39 * w, 100, w, w), b) == set()        # inside the margin's half
    assert relative_position(det(100, 100 + 0.15 * w, w, w), b) == set()        # within the margin: no relation
    assert relative_position(det(100, 100 - 0.5 * w, w, w), b) == {"above"}     # image y grows downwards
    # on the diagonal both hold once (d - 0.2 w) / (d sqrt 2) > 0.5, i.e. d > 0.2 w / (1 - 1/sqrt 2) = 0.683 w
    assert relative_position(det(100 + 0.70 * w, 100 + 0.70 * w, w, w), b) == {"right of", "below"}
    assert relative_position(det(100 + 0.66 * w, 100 + 0.66 * w, w, w), b) == set()
    # a wider margin needs a wider gap
    assert relative_position(det(100 + 0.5 * w, 100, w, w), b, position_threshold=0.2) == set()


def test_presence_counting_and_exclusion():
    two = {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]}
    assert evaluate({"cup": [det(0, 0), det(30, 0)]}, two, no_colors)[0]
    assert not evaluate({"cup": [det(0, 0)]}, two, no_colors)[0]                       # too few
    ok, reason = evaluate({"cup": [det(0, 0), det(30, 0), det(60, 0)]}, two, no_colors)
    assert not ok and "expected cup<3, found 3" in reason                               # the exclude clause
    # the counting threshold decides what is counted: a third cup at 0.85 is not there for a counting prompt
    raw = {"cup": [det(0, 0, score=0.95), det(30, 0, score=0.97), det(60, 0, score=0.85)]}
    assert evaluate(select_detections(raw, "counting"), two, no_colors)[0]
    assert not evaluate(select_detections(raw, "two_object"), two, no_colors)[0]
    # another class's detections change nothing; an exclude on any class fails
    single = {"tag": "single_object", "include": [{"class": "cup", "count": 1}]}
    assert evaluate({"cup": [det(0, 0)], "dog": [det(50, 50)]}, single, no_colors)[0]
    assert not evaluate({"cup": [det(0, 0)]}, {**single, "exclude": [{"class": "cup", "count": 1}]}, no_colors)[0]


def test_colour_is_read_on_the_most_confident_objects_only():
    row = {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}]}
    asked = []

    def classifier(found, classname):
        asked.append((len(found), classname))
        return ["red" if d.score < 0.8 else "blue" for d in found]
    objects = select_detections({"cup": [det(0, 0, score=0.7), det(30, 0, score=0.9)]}, "colors")
    ok, reason = evaluate(objects, row, classifier)
    assert not ok and asked == [(1, "cup")] and "expected red cup>=1, found 0 red" in reason
    assert evaluate({"cup": [det(0, 0, color="red")]}, row, no_colors)[0]   # a reader's own colours are used
    assert not evaluate({"cup": [det(0, 0, color="green")]}, row, no_colors)[0]


def test_relations_need_the_target_group_and_hold_for_every_pair():
    row = {"tag": "position", "include": [{"class": "cup", "count": 1},
                                          {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    assert evaluate({"cup": [det(50, 0)], "dog": [det(20, 0)]}, row, no_colors)[0]
    ok, reason = evaluate({"cup": [det(50, 0)], "dog": [det(60, 0)]}, row, no_colors)
    assert not ok and "expected dog left of target" in reason
    ok, reason = evaluate({"dog": [det(20, 0)]}, row, no_colors)
    assert not ok and "no target for dog to be left of" in reason


@pytest.mark.parametrize("found,expected", [
    (1, 1.0), (0, 0.0), (2, 0.0), (3, -1.0),
])
def test_flow_grpo_dense_count_term(found, expected):
    """1 - |count - found| / count per include clause, every found object counted (negative past twice the count)."""
    row = {"tag": "single_object", "include": [{"class": "cup", "count": 1}]}
    strict, score, _ = evaluate_reward({"cup": [det(30 * i, 0) for i in range(found)]} if found else {}, row,
                                       no_colors)
    assert score == expected and strict == (found == 1)


def test_flow_grpo_dense_colour_and_position_terms_with_the_servers_quirk():
    colours = {"tag": "color_attr", "include": [{"class": "cup", "count": 1, "color": "red"},
                                                {"class": "dog", "count": 1, "color": "blue"}]}
    objects = {"cup": [det(0, 0, color="red")], "dog": [det(50, 0, color="green")]}
    strict, score, _ = evaluate_reward(objects, colours, no_colors)
    assert not strict and score == pytest.approx((1 + 1 + 1 + 0) / 4)
    missing_dog = evaluate_reward({"cup": [det(0, 0, color="red")]}, colours, no_colors)[1]
    assert missing_dog == pytest.approx((1 + 1 + 0 + 0) / 4)
    position = {"tag": "position", "include": [{"class": "cup", "count": 1},
                                               {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    assert evaluate_reward({"cup": [det(50, 0)], "dog": [det(20, 0)]}, position, no_colors)[:2] == (True, 1.0)
    # a failed relation appends 0 and then 1 (reward-server's loop appends 1.0 after it either way)
    strict, score, _ = evaluate_reward({"cup": [det(50, 0)], "dog": [det(60, 0)]}, position, no_colors)
    assert not strict and score == pytest.approx((1 + 1 + 0 + 1) / 4)
    # exact counts: GenEval's "at least" passes two cups for "a cup", Flow-GRPO's strict does not
    single = {"tag": "single_object", "include": [{"class": "cup", "count": 1}]}
    two_cups = {"cup": [det(0, 0), det(40, 0)]}
    assert evaluate(two_cups, single, no_colors)[0] and not evaluate_reward(two_cups, single, no_colors)[0]


def test_overall_is_the_mean_over_tasks_not_over_images(rng_seed):
    rng = np.random.default_rng(rng_seed)
    tags = ["counting"] * int(rng.integers(2, 9)) + ["colors"] * int(rng.integers(2, 9))
    correct = list(rng.random(len(tags)) < 0.5)
    scores = task_scores(tags, correct)
    counting = np.mean([c for t, c in zip(tags, correct) if t == "counting"])
    colors = np.mean([c for t, c in zip(tags, correct) if t == "colors"])
    assert scores == pytest.approx({"counting": counting, "colors": colors, "overall": (counting + colors) / 2})
    assert geneval_metrics(tags, correct, "val")["val/geneval/overall"] == pytest.approx((counting + colors) / 2)


def test_task_intervals_are_wilsons_half_widths(rng_seed):
    """Each task's 95 % half-width: Wilson's, so near the normal approximation 1.96 sqrt(p(1 - p) / n) for a large
    task, still positive for a task scored 0 or 1, shrinking as 1 / sqrt(n); overall's combines the tasks' as the
    mean of independent proportions does."""
    rng = np.random.default_rng(rng_seed)
    n = int(rng.integers(4000, 6000))
    correct = list(rng.random(n) < rng.uniform(0.2, 0.8))
    p = float(np.mean(correct))
    half = task_intervals(["colors"] * n, correct)
    assert half["colors"] == pytest.approx(1.96 * np.sqrt(p * (1 - p) / n), rel=0.01)
    small = int(rng.integers(8, 40))
    zero = task_intervals(["counting"] * small, [False] * small)["counting"]
    assert 0 < zero < task_intervals(["counting"] * (small // 4), [False] * (small // 4))["counting"]
    both = task_intervals(["colors"] * n + ["counting"] * small, correct + [False] * small)
    assert both["overall"] == pytest.approx(np.hypot(half["colors"], zero) / 2)
