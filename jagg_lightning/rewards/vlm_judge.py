"""A VLM judge over any OpenAI-compatible chat endpoint (vLLM, SGLang, ``transformers serve``, a hosted API).

Each request is ``POST {url}/chat/completions`` with one user message: the image(s) as ``image_url`` content parts
holding base64 PNG data URLs, then the question (:mod:`~jagg_lightning.rewards.judge_templates`); ``temperature``
0 by default. The answer's ``choices[0].message.content`` is parsed for a score; with ``use_logprobs`` the request
asks for ``logprobs`` / ``top_logprobs`` and, when the server returns them (vLLM and SGLang do; ``transformers
serve`` ignores the fields), the score is the expected score over the first answer token's score tokens instead.
Requests run concurrently, at most ``max_concurrency`` at a time, each with :class:`RemoteReward`'s timeout,
retries, backoff and token. The first request that fails ends the call: the queued requests are never sent, those
in flight make no further attempt, and the failure is raised without waiting for them (so a failure surfaces within
``timeout x (retries + 1)`` plus the backoffs, and a dead endpoint sees at most ``max_concurrency x (retries + 1)``
requests).
"""

from __future__ import annotations

import base64
import io
import json
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np
import torch
from torch import Tensor

from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.judge_templates import (
    TEMPLATES, VIDEO_NOTE, JudgeTemplate, score_from_logprobs, score_from_text,
)
from jagg_lightning.rewards.remote import RemoteReward, RequestCancelled, _one_line
from jagg_lightning.rewards.wire import to_uint8

MODES = ("pointwise", "pairwise")


class VLMJudgeReward(RemoteReward):
    """Scores from a VLM judge (module docstring); usable wherever a reward is.

    Args:
        url: the endpoint's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended).
        model: the served model's name (the request's ``model``).
        task: ``unifiedreward`` (UnifiedReward's pointwise prompt, Flow-GRPO's: "Final Score: 1-5", reward = score / 5),
            ``score_1_10`` (reward = the 1-10 answer), ``yes_no`` (reward = 1 / 0, or p(yes) from log-probs).
            ``pairwise`` mode always asks the pairwise question.
        mode: ``pointwise``, or ``pairwise`` (Pref-GRPO): the samples of one prompt in a call form its group, every
            pair (i, j) is judged and a sample's reward is its win rate against the others of its group, in [0, 1]
            (a group of one: 0.5). Score whole groups in one call (``sampling.rollout_batch_size`` a multiple of
            ``group_size``), or a win rate is over part of the group.
        question: a question of your own (``{prompt}`` = the sample's prompt) instead of the task's; ``pattern`` then
            the regex whose first group is the score and ``score_range`` [low, high] its range (reward = the score).
        use_logprobs: ask for ``top_logprobs`` and score by them when the server returns them (tasks with single-token
            scores: ``score_1_10``, ``yes_no``, pairwise); else (or without them) the answer's text.
        frames: videos [B, F, 3, H, W] (video mode): how many frames, evenly spaced first to last, go as images; None:
            every frame.
        image_size: images resized to this square side before sending (Flow-GRPO sends UnifiedReward 512); None: as
            they are.
        both_orders: pairwise: judge each pair in both orders (cancels a position bias; twice the requests).
        max_tokens: the answer's token limit (default: 512 for ``unifiedreward``, which reasons first, else 8).
        max_concurrency: requests in flight at once, >= 1.
        temperature: the sampling temperature sent with each request (0: the judge's greedy answer, repeatable).
        timeout: as :class:`RemoteReward`.
        retries: as :class:`RemoteReward`.
        token: as :class:`RemoteReward`.
        name: as :class:`RemoteReward`.
        backoff: as :class:`RemoteReward`.

    An answer that holds no score in range, or JSON that is not a chat completion, stops the step with one line
    naming the reward, the endpoint and the answer.
    """

    accepts_video = True

    def __init__(self, url: str, model: str, task: str = "score_1_10", mode: str = "pointwise",
                 question: str | None = None, pattern: str | None = None, score_range: list[float] | None = None,
                 use_logprobs: bool = False, frames: int | None = None, image_size: int | None = None,
                 both_orders: bool = False, max_tokens: int | None = None, max_concurrency: int = 8,
                 temperature: float = 0.0, timeout: float = 60.0, retries: int = 3, token: str | None = None,
                 name: str = "vlm_judge", backoff: float = 1.0):
        super().__init__(url, timeout=timeout, retries=retries, token=token, name=name, backoff=backoff)
        if task not in TEMPLATES or task == "pairwise":
            raise ValueError(f"reward {name}: task must be one of {[t for t in TEMPLATES if t != 'pairwise']}, "
                             f"got {task!r}")
        if mode not in MODES:
            raise ValueError(f"reward {name}: mode must be one of {list(MODES)}, got {mode!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"reward {name}: model must be the served model's name, got {model!r}")
        for field, value in (("max_concurrency", max_concurrency), ("frames", frames), ("image_size", image_size),
                             ("max_tokens", max_tokens)):
            if value is not None and (int(value) != value or value < 1):
                raise ValueError(f"reward {name}: {field} must be an integer >= 1, got {value}")
        self.template = self._template(task if mode == "pointwise" else "pairwise", question, pattern, score_range)
        self.model, self.task, self.mode = model, task, mode
        self.use_logprobs, self.frames, self.image_size = bool(use_logprobs), frames, image_size
        self.both_orders, self.temperature = bool(both_orders), float(temperature)
        self.max_tokens = max_tokens or (512 if task == "unifiedreward" and mode == "pointwise" else 8)
        self.max_concurrency = int(max_concurrency)

    def _template(self, task: str, question, pattern, score_range) -> JudgeTemplate:
        if question is None:
            return TEMPLATES[task]
        if pattern is None or score_range is None or len(score_range) != 2 or not score_range[0] < score_range[1]:
            raise ValueError(f"reward {self.name}: a question of your own needs pattern (a regex whose first group "
                             f"is the score) and score_range [low, high], got {pattern!r}, {score_range!r}")
        return JudgeTemplate(question, pattern, float(score_range[0]), float(score_range[1]))

    # ------------------------------------------------------------------ requests
    def _data_urls(self, images: Tensor) -> list[list[str]]:
        """Per sample, its images (one, or a video's chosen frames) as PNG data URLs."""
        from PIL import Image

        if images.ndim == 5:
            count = images.shape[1] if self.frames is None else min(self.frames, images.shape[1])
            picks = np.linspace(0, images.shape[1] - 1, count).round().astype(int).tolist()
            clips = [images[:, f] for f in picks]
        else:
            clips = [images]
        per_sample = [[] for _ in range(images.shape[0])]
        for clip in clips:
            for i, array in enumerate(to_uint8(clip)):
                picture = Image.fromarray(array)
                if self.image_size is not None:
                    picture = picture.resize((self.image_size, self.image_size), Image.BICUBIC)
                buffer = io.BytesIO()
                picture.save(buffer, format="PNG")
                per_sample[i].append("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"))
        return per_sample

    def _ask(self, urls: list[str], prompt: str, frames: int, abort: threading.Event | None = None) -> float:
        """One chat completion: the images then the question; its score (in the template's range). ``abort``: as
        :meth:`RemoteReward._call`."""
        question = self.template.question.replace("{prompt}", prompt)
        if frames > 1 and self.mode == "pointwise":
            question = VIDEO_NOTE.replace("{frames}", str(frames)) + question
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": question}]
        request = {"model": self.model, "messages": [{"role": "user", "content": content}],
                   "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": False}
        if self.use_logprobs and self.template.score_tokens:
            request |= {"logprobs": True, "top_logprobs": 20}
        raw = self._call("/chat/completions", json.dumps(request).encode(), "application/json", abort)
        text, top = self._read_answer(raw)
        try:
            score = score_from_logprobs(self.template, top) if self.use_logprobs and top else None
        except ValueError as err:
            raise RewardError(_one_line(f"reward {self.name}: {self.url}/chat/completions answered a log-probability "
                                        f"that is no float: {err}")) from None
        if score is None:
            score = score_from_text(self.template, text)
        if score is None:
            raise RewardError(_one_line(f"reward {self.name}: {self.url}/chat/completions answered no score in "
                                        f"[{self.template.low:g}, {self.template.high:g}]: {text[:200]!r}"))
        return score

    def _read_answer(self, raw: bytes) -> tuple[str, list]:
        """The first choice's text and its first token's ``top_logprobs`` (empty without them)."""
        where = f"reward {self.name}: {self.url}/chat/completions"
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            text = choice["message"]["content"]
        except (UnicodeDecodeError, ValueError, KeyError, IndexError, TypeError):
            raise RewardError(_one_line(f"{where} answered something that is not a chat completion: "
                                        f"{raw[:200]!r}")) from None
        if not isinstance(text, str):
            raise RewardError(_one_line(f"{where} answered no text: {raw[:200]!r}"))
        try:
            top = choice["logprobs"]["content"][0]["top_logprobs"] or []
        except (KeyError, IndexError, TypeError):
            top = []
        return text, top if isinstance(top, list) else []

    def _run(self, jobs: list[tuple]) -> list[float]:
        """Every job ``(urls, prompt, frames)`` asked, at most ``max_concurrency`` at once; scores in order. The
        first failure sets ``abort``: no queued job starts, no job in flight retries, and it is raised at once."""
        if len(jobs) == 1 or self.max_concurrency == 1:
            return [self._ask(*job) for job in jobs]
        abort, failures = threading.Event(), []

        def ask(job: tuple) -> float:
            if abort.is_set():
                raise RequestCancelled(f"reward {self.name}: cancelled after another request failed")
            try:
                return self._ask(*job, abort=abort)
            except RequestCancelled:
                raise
            except BaseException as err:
                failures.append(err)  # before abort is set: a cancelled request always has a failure to name
                abort.set()  # here, in the worker: before it can take the next job from the queue
                raise

        pool = ThreadPoolExecutor(min(self.max_concurrency, len(jobs)), thread_name_prefix="jagg-judge")
        try:
            futures = [pool.submit(ask, job) for job in jobs]
            wait(futures, return_when=FIRST_EXCEPTION)
            if abort.is_set():
                raise failures[0]  # the first failure, naming the answer
            return [f.result() for f in futures]
        finally:
            # the requests in flight end within their timeout and retry no more; the queued ones never start
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ scores
    def _request(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        urls = self._data_urls(images)
        frames = len(urls[0])
        if self.mode == "pointwise":
            scores = torch.tensor(self._run([(u, p, frames) for u, p in zip(urls, prompts)]), dtype=torch.float64)
            total = scores / self.template.scale
        else:
            total = self._win_rates(urls, prompts, frames)
        total = total.float().to(images.device)
        return total, {self.name: total}

    def _win_rates(self, urls: list[list[str]], prompts: list[str], frames: int) -> Tensor:
        """Pref-GRPO: per sample, the mean over the other samples of its prompt of P(it wins the pair)."""
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(p, []).append(i)
        pairs = [(i, j) for members in groups.values() for a, i in enumerate(members) for j in members[a + 1:]]
        orders = pairs + ([(j, i) for i, j in pairs] if self.both_orders else [])
        # the answer is 1 (first wins) .. 2 (second wins): P(first wins) = 2 - answer
        first_wins = [2.0 - s for s in self._run([(urls[i] + urls[j], prompts[i], frames) for i, j in orders])]
        wins = torch.zeros(len(prompts), dtype=torch.float64)
        for (i, j), p in zip(orders, first_wins):
            wins[i] += p
            wins[j] += 1.0 - p
        rounds = 2 if self.both_orders else 1
        rates = torch.full((len(prompts),), 0.5, dtype=torch.float64)
        for members in groups.values():
            if len(members) > 1:
                rates[members] = wins[members] / (rounds * (len(members) - 1))
        return rates
