"""VLMJudgeReward end to end against ``transformers serve`` (a real server process on 127.0.0.1) serving a tiny
random Qwen2.5-VL saved locally with its own tokenizer and processor (tests/support/tiny_vlm.py): every served
score is checked against the same model's greedy answer computed in this process. Log-probability answers (which
``transformers serve`` does not return), malformed answers and a dead endpoint are checked against a small stdlib
server speaking the chat-completions format."""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest
import torch
from in_process import tiny_fit_with_reward
from reward_server import thread_server
from tiny_vlm import greedy_answer, save_tiny_vlm

from jagg_lightning.rewards import VLMJudgeReward
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.judge_templates import (
    TEMPLATES,
    VIDEO_NOTE,
    score_from_logprobs,
    score_from_text,
)

SERVE_START_S = 600  # importing transformers + fastapi and loading: ~20 s on idle cores, minutes on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    root = save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), seed=3)  # seed 3: answers that depend on the image
    return root, Qwen2_5_VLForConditionalGeneration.from_pretrained(root).eval(), AutoProcessor.from_pretrained(root)


@pytest.fixture(scope="module")
def served(tiny_vlm, tmp_path_factory):
    """``transformers serve <the tiny VLM>`` on 127.0.0.1: its OpenAI base URL once /v1/models answers."""
    root, port = tiny_vlm[0], free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(root),
                                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}/v1", time.monotonic() + SERVE_START_S
    while True:
        try:
            urllib.request.urlopen(f"{url}/models", timeout=2).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError(f"transformers serve did not start: {open(log.name).read()[-2000:]}") from None
            time.sleep(0.5)
    yield url
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def images(n: int, seed: int, frames: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 3, 32, 32) if frames is None else (n, frames, 3, 32, 32)
    return torch.rand(shape, generator=g) ** (4 * torch.rand(n, generator=g) + 0.2).view(n, *[1] * (len(shape) - 1))


@pytest.mark.subprocess
@pytest.mark.slow
def test_pointwise_video_and_pairwise_scores_are_the_served_models_answers(served, tiny_vlm, rng_seed):
    root, model, processor = tiny_vlm
    prompts = ["a cat", "two red boats", "a tree", "a dog"]
    pictures = images(4, rng_seed)
    judge = VLMJudgeReward(served, model=str(root), task="score_1_10", max_tokens=1, max_concurrency=3, retries=0)
    question = TEMPLATES["score_1_10"].question
    expected = [float(greedy_answer(model, processor, u, question.replace("{prompt}", p)))
                for u, p in zip(judge._data_urls(pictures), prompts)]
    assert judge(pictures, prompts).tolist() == expected

    clips = images(2, rng_seed + 1, frames=5)  # video mode: frames 0, 2, 4 sent as images, in order
    video = VLMJudgeReward(served, model=str(root), frames=3, max_tokens=1, retries=0, name="video_judge")
    note = VIDEO_NOTE.replace("{frames}", "3")
    expected = [float(greedy_answer(model, processor, u, note + question.replace("{prompt}", p)))
                for u, p in zip(video._data_urls(clips), prompts[:2])]
    assert len(video._data_urls(clips)[0]) == 3
    assert video(clips, prompts[:2]).tolist() == expected

    # pairwise (Pref-GRPO): groups {0, 1, 2} ("a cat") and {3, 4} ("a dog"); P(first wins) = 2 - answer
    pictures, prompts = images(5, rng_seed + 2), ["a cat"] * 3 + ["a dog"] * 2
    pairwise = VLMJudgeReward(served, model=str(root), mode="pairwise", max_tokens=1, retries=0, both_orders=True)
    urls, pair_question = pairwise._data_urls(pictures), TEMPLATES["pairwise"].question
    wins = [0.0] * 5
    for i, j in [(0, 1), (0, 2), (1, 2), (3, 4)]:
        for a, b in ((i, j), (j, i)):
            first = 2.0 - float(greedy_answer(model, processor, urls[a] + urls[b],
                                              pair_question.replace("{prompt}", prompts[a])))
            wins[a], wins[b] = wins[a] + first, wins[b] + 1 - first
    rates = pairwise(pictures, prompts).double()
    reference = torch.tensor([w / (2 * (3 - 1)) for w in wins[:3]] + [w / 2 for w in wins[3:]], dtype=torch.float64)
    torch.testing.assert_close(rates, reference, rtol=0, atol=1e-7)
    torch.testing.assert_close(rates[:3].sum(), torch.tensor(1.5, dtype=torch.float64))  # win rates of a group of 3


@pytest.mark.subprocess
@pytest.mark.slow
def test_an_answer_without_a_score_names_endpoint_and_answer(served, tiny_vlm):
    judge = VLMJudgeReward(served, model=str(tiny_vlm[0]), task="unifiedreward", max_tokens=2, retries=0, name="ur")
    with pytest.raises(RewardError) as err:
        judge(images(1, 0), ["a cat"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward ur: {served}/chat/completions answered no score in [1, 5]")


@pytest.mark.subprocess
@pytest.mark.slow
def test_jagg_fit_with_a_vlm_judge(served, tiny_vlm, tmp_path, capfd, monkeypatch):
    proc, root = tiny_fit_with_reward({"class_path": "jagg_lightning.rewards.VLMJudgeReward",
                                       "init_args": {"url": served, "model": str(tiny_vlm[0]), "mode": "pairwise",
                                                     "max_tokens": 1, "timeout": 30, "retries": 1}}, tmp_path, capfd, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = (root / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    # a group of 2 judged pairwise: win rates 0 and 1, mean 0.5 exactly
    header = metrics.splitlines()[0].split(",")
    column = header.index("train/reward_mean")
    values = [float(row.split(",")[column]) for row in metrics.splitlines()[1:] if row.split(",")[column]]
    assert values and all(v == 0.5 for v in values)


# ---------------------------------------------------------------------- parsing, log-probs, malformed answers
def test_scores_from_text_follow_each_template():
    ur, ten, yes_no = TEMPLATES["unifiedreward"], TEMPLATES["score_1_10"], TEMPLATES["yes_no"]
    assert score_from_text(ur, "The image matches well.\nFinal Score: 4.5") == 4.5
    assert score_from_text(ur, "Final Score: 7") is None  # out of UnifiedReward's 1-5
    assert score_from_text(ten, "10") == 10 and score_from_text(ten, "Score: 7/10") == 7
    assert score_from_text(ten, "11") is None and score_from_text(ten, "7.5") is None
    assert score_from_text(yes_no, "Yes, it does.") == 1.0 and score_from_text(yes_no, "no") == 0.0
    assert score_from_text(yes_no, "nothing") is None


def test_scores_from_logprobs_are_expected_scores(rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(12, generator=g, dtype=torch.float64)
    tokens = [str(k) for k in range(1, 11)] + ["the", " x"]
    top = [{"token": t, "logprob": float(l)} for t, l in zip(tokens, torch.log_softmax(logits, 0))]
    p = torch.softmax(logits[:10], 0)
    expected = float((p * torch.arange(1, 11, dtype=torch.float64)).sum())
    assert math.isclose(score_from_logprobs(TEMPLATES["score_1_10"], top), expected, rel_tol=1e-12)
    yes_no = [{"token": " Yes", "logprob": math.log(0.3)}, {"token": "no", "logprob": math.log(0.1)}]
    assert math.isclose(score_from_logprobs(TEMPLATES["yes_no"], yes_no), 0.75, rel_tol=1e-12)
    assert score_from_logprobs(TEMPLATES["yes_no"], [{"token": "maybe", "logprob": -0.1}]) is None


class ChatHandler(BaseHTTPRequestHandler):
    answer: ClassVar[bytes] = b""
    bodies: ClassVar[list] = []
    delay: ClassVar[float] = 0.0  # seconds before answering: a slow server

    def log_message(self, *args):
        pass

    def do_POST(self):
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)


@pytest.fixture(scope="module")
def chat_server():
    with thread_server(ChatHandler) as url:
        yield f"{url}/v1"


def completion(text: str, top: list | None = None) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    if top is not None:
        choice["logprobs"] = {"content": [{"token": top[0]["token"], "logprob": top[0]["logprob"], "top_logprobs": top}]}
    return json.dumps({"choices": [choice]}).encode()


def test_logprobs_requested_and_used_when_returned(chat_server):
    ChatHandler.bodies = []
    ChatHandler.answer = completion("yes", [{"token": "yes", "logprob": math.log(0.6)},
                                            {"token": "no", "logprob": math.log(0.2)}])
    judge = VLMJudgeReward(chat_server, model="judge", task="yes_no", use_logprobs=True, retries=0, token="s3cret")
    assert judge(torch.rand(2, 3, 8, 8), ["a", "b"]).tolist() == pytest.approx([0.75, 0.75])
    body = ChatHandler.bodies[0]
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["model"] == "judge"
    parts = body["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,") and parts[-1]["text"].endswith("yes or no.")


@pytest.mark.parametrize("answer, says", [
    (b"<html>502</html>", "answered something that is not a chat completion: b'<html>502</html>'"),
    (json.dumps({"choices": []}).encode(), "answered something that is not a chat completion"),
    (completion("I cannot tell."), "answered no score in [1, 10]: 'I cannot tell.'"),
    (completion("11"), "answered no score in [1, 10]: '11'"),  # out of range: never a silent wrong score
    (completion("7", [{"token": "7", "logprob": float("nan")}])[:-2], "not a chat completion"),  # cut short
])
def test_malformed_answers_name_reward_endpoint_and_answer(chat_server, answer, says):
    ChatHandler.answer = answer
    judge = VLMJudgeReward(chat_server, model="judge", retries=0, name="judge")
    with pytest.raises(RewardError) as err:
        judge(torch.rand(1, 3, 8, 8), ["a"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward judge: {chat_server}/chat/completions") and says in message


def test_nonfinite_logprobs_never_make_a_nan_score(chat_server):
    """A NaN or infinite log-probability is left out (json.loads reads NaN and Infinity): the expected score is
    over the finite ones, or the answer's text when none is left."""
    judge = VLMJudgeReward(chat_server, model="judge", task="score_1_10", use_logprobs=True, retries=0)
    ChatHandler.answer = completion("7", [{"token": "7", "logprob": float("nan")}, {"token": "3", "logprob": -1.0},
                                          {"token": "9", "logprob": float("inf")}])
    assert judge(torch.rand(1, 3, 8, 8), ["a"]).tolist() == [3.0]
    ChatHandler.answer = completion("7", [{"token": "7", "logprob": float("nan")}])
    assert judge(torch.rand(1, 3, 8, 8), ["a"]).tolist() == [7.0]


@pytest.mark.parametrize("offset", [0.0, 709.0, 709.7, 1000.0, 1e300])
def test_logprob_scores_are_finite_for_any_finite_logprob(rng_seed, offset):
    """Log-probabilities shifted by up to 1e300 (a broken server's; exp of each overflows past 709.78): the score is
    the float64 softmax-weighted mean of the same numbers, finite; equal ones give the mean score."""
    g = torch.Generator().manual_seed(rng_seed)
    logprobs = (offset + torch.randn(10, generator=g, dtype=torch.float64)).tolist()
    top = [{"token": str(k), "logprob": lp} for k, lp in zip(range(1, 11), logprobs)]
    expected = float((torch.softmax(torch.tensor(logprobs, dtype=torch.float64), 0)
                      * torch.arange(1, 11, dtype=torch.float64)).sum())
    score = score_from_logprobs(TEMPLATES["score_1_10"], top)
    assert math.isfinite(score) and math.isclose(score, expected, rel_tol=1e-12), (score, expected)
    equal = [{"token": "yes", "logprob": offset}, {"token": "no", "logprob": offset}]
    assert score_from_logprobs(TEMPLATES["yes_no"], equal) == 0.5
    infinite = [{"token": "yes", "logprob": -math.inf}, {"token": "no", "logprob": offset}]
    assert score_from_logprobs(TEMPLATES["yes_no"], infinite) == 0.0  # exp(-inf) = 0: its token has no weight


def test_a_logprob_past_a_float_is_one_line_naming_reward_and_endpoint(chat_server):
    """JSON may carry an integer of 400 digits: ``json.loads`` reads it exactly, and no float holds it."""
    ChatHandler.answer = completion("yes", [{"token": "yes", "logprob": 10**400}, {"token": "no", "logprob": -1.0}])
    judge = VLMJudgeReward(chat_server, model="judge", task="yes_no", use_logprobs=True, retries=0, name="judge")
    with pytest.raises(RewardError) as err:
        judge(torch.rand(1, 3, 8, 8), ["a"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward judge: {chat_server}/chat/completions answered a "
                                                       f"log-probability that is no float: ")
    assert "token 'yes' overflows a float" in message


class FailingHandler(BaseHTTPRequestHandler):
    """Answers every request with a 500 (``hang`` 0) or after ``hang`` seconds; counts what it received."""

    hang: ClassVar[float] = 0.0
    received: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(time.monotonic())
        if self.hang:
            time.sleep(self.hang)
        try:
            body = b'{"error": "GPU is on fire"}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up first
            pass


@pytest.mark.parametrize("hang", [0.0, 3.0], ids=["http_500", "hangs"])
def test_the_first_failure_cancels_the_pending_requests(hang):
    """6 images, concurrency 2, timeout 1 s, one retry: the failure surfaces within timeout x (retries + 1) plus a
    margin (not after the three rounds of a pool that drains its queue), and the endpoint gets at most
    concurrency x (retries + 1) = 4 requests (not 12)."""
    FailingHandler.hang, FailingHandler.received = hang, []
    with thread_server(FailingHandler) as base:
        url = f"{base}/v1"
        judge = VLMJudgeReward(url, model="judge", max_concurrency=2, timeout=1.0, retries=1, backoff=0.05,
                               name="judge")
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            judge(torch.rand(6, 3, 8, 8), ["a"] * 6)
        elapsed = time.monotonic() - start
        time.sleep(1.5)  # whatever was still in flight has ended by now
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"reward judge: {url}/chat/completions failed 2 attempt(s)")
        assert ("TimeoutError" if hang else "HTTP 500: GPU is on fire") in message
        assert elapsed < 1.0 * 2 + 1.0, elapsed
        assert len(FailingHandler.received) <= 2 * 2, len(FailingHandler.received)


def test_slow_endpoint_fails_within_the_timeout(chat_server):
    ChatHandler.answer, ChatHandler.delay = completion("7"), 3.0
    judge = VLMJudgeReward(chat_server, model="judge", timeout=0.5, retries=1, backoff=0.01, name="judge")
    start = time.monotonic()
    try:
        with pytest.raises(RewardError) as err:
            judge(torch.rand(1, 3, 8, 8), ["a"])
    finally:
        ChatHandler.delay = 0.0
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward judge: {chat_server}/chat/completions failed 2 attempt(s)")
    assert "TimeoutError" in message and time.monotonic() - start < 2.5  # two attempts of 0.5 s, never the 3 s


def test_dead_endpoint_and_bad_configuration():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(RewardError, match=rf"^reward judge: {dead}/chat/completions failed 1 attempt"):
        VLMJudgeReward(dead, model="m", retries=0, name="judge")(torch.rand(1, 3, 8, 8), ["a"])
    with pytest.raises(ValueError, match="task must be one of"):
        VLMJudgeReward(dead, model="m", task="pairwise")
    with pytest.raises(ValueError, match="needs pattern"):
        VLMJudgeReward(dead, model="m", question="Rate {prompt}")
