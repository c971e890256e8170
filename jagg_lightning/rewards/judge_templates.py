"""What a VLM judge is asked, and how its answer becomes a score (:class:`~jagg_lightning.rewards.vlm_judge.VLMJudgeReward`).

A template is the question (``{prompt}`` stands for the sample's prompt), the pattern whose first group is the
answer's score, the range a score must lie in, how a score maps to the reward, and -- where the score is a single
token -- the tokens whose log-probabilities give an expected score instead of the sampled one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JudgeTemplate:
    question: str  # with {prompt}
    pattern: str  # a regex whose first group is the score
    low: float  # the scores the answer may give
    high: float
    scale: float = 1.0  # reward = score / scale
    score_tokens: dict[str, float] = field(default_factory=dict)  # first answer token -> its score (log-probs)


# UnifiedReward's pointwise score prompt and answer pattern, as Flow-GRPO sends them to UnifiedReward-7b-v1.5 served
# by sglang (yifan123/flow_grpo, flow_grpo/rewards.py, unifiedreward_score_sglang): a 1-5 score after "Final Score:",
# divided by 5. (Flow-GRPO scores an answer without the pattern 0; here it is an error naming the answer.)
UNIFIEDREWARD_QUESTION = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)

TEMPLATES = {
    "unifiedreward": JudgeTemplate(UNIFIEDREWARD_QUESTION, r"Final Score:\s*([1-5](?:\.\d+)?)", 1, 5, scale=5.0),
    "score_1_10": JudgeTemplate(
        "Rate the image for the caption \"{prompt}\" from 1 (poor: wrong content, low quality) to 10 (excellent: "
        "faithful to the caption, high quality). Answer with the number only.",
        r"(?<![\d.])(10|[1-9])(?![\d.])", 1, 10, score_tokens={str(k): float(k) for k in range(1, 11)}),
    "yes_no": JudgeTemplate(
        "Does the image show \"{prompt}\"? Answer yes or no.", r"\b(yes|no)\b", 0, 1,
        score_tokens={"yes": 1.0, "no": 0.0}),
    "pairwise": JudgeTemplate(
        "Two images were generated for the caption \"{prompt}\". Which one is better -- more faithful to the "
        "caption, higher quality? Answer 1 for the first image or 2 for the second, the number only.",
        r"(?<![\d.])([12])(?![\d.])", 1, 2, score_tokens={"1": 1.0, "2": 2.0}),
}
VIDEO_NOTE = "The images are {frames} frames of one video, in order; judge the video. "


def score_from_text(template: JudgeTemplate, text: str) -> float | None:
    """The first match's score (yes / no as 1 / 0), or None when the answer has none in the template's range."""
    match = re.search(template.pattern, text, flags=re.IGNORECASE)
    if match is None:
        return None
    word = match.group(1).lower()
    value = template.score_tokens.get(word, None) if word in ("yes", "no") else float(word)
    return value if value is not None and template.low <= value <= template.high else None


def score_from_logprobs(template: JudgeTemplate, top_logprobs: list) -> float | None:
    """E[score] over the template's score tokens among the first answer token's top log-probabilities
    (renormalised over those tokens), or None when none of them is there.

    With l_j the score tokens' log-probabilities and m = max_j l_j, the weights are p_j = exp(l_j - m) /
    sum_i exp(l_i - m) (the softmax over those tokens, shifted: each exp is in (0, 1] and the sum >= 1), so the
    score is finite for any finite l_j, however large (a server's log-probabilities should be <= 0). A NaN or
    infinite l_j is left out. A log-probability that is a number but no float (an integer past 1.8e308, which
    ``json.loads`` reads exactly) raises ``ValueError`` naming the token."""
    found: list[tuple[float, float]] = []  # (the token's score, its log-probability)
    for entry in top_logprobs:
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            continue
        value = template.score_tokens.get(entry["token"].strip().lower())
        logprob = entry.get("logprob")
        if value is None or isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
            continue
        try:
            logprob = float(logprob)
        except OverflowError:
            raise ValueError(f"the log-probability of token {entry['token']!r} overflows a float: "
                             f"{str(logprob)[:40]}...") from None
        if math.isfinite(logprob):
            found.append((value, logprob))
    if not found:
        return None
    top = max(logprob for _, logprob in found)
    weights = [(value, math.exp(logprob - top)) for value, logprob in found]
    return sum(v * w for v, w in weights) / sum(w for _, w in weights)
