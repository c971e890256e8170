"""RemoteReward, the client, against servers that misbehave: jagg's own server past its in-flight limit or killed and
restarted mid-retry (a real subprocess on 127.0.0.1), and a stdlib HTTP server in a thread standing in for a foreign
reward server where the test needs answers jagg's own server never gives (503s, a slow or trickled answer, a short
list, non-finite scores)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest
import torch
from reward_server import batch, post, start_server, stop, thread_server
from safetensors.numpy import save

from jagg_lightning.rewards import JpegCompressibility, RemoteReward
from jagg_lightning.rewards.base import RewardError


@pytest.mark.subprocess
@pytest.mark.slow
def test_requests_past_the_in_flight_limit_get_503_with_retry_after_and_the_client_waits_it():
    """--max_concurrency 1 and a reward that takes 1.5 s: a second request while the first is scored is a 503 with
    Retry-After, at once; RemoteReward waits the Retry-After (longer than its own backoff) and then gets its
    answer."""
    process, url = start_server("--reward", "helpers.SlowJpeg", "--init_args", '{"seconds": 1.5}',
                                "--max_concurrency", "1")
    try:
        images, prompts = batch(11, 1)
        body = save({"images": (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()},
                    metadata={"prompts": json.dumps(prompts)})
        first = ThreadPoolExecutor(1).submit(post, url, body, token=None)
        time.sleep(0.5)  # the first is being scored
        headers, started = {}, time.monotonic()
        status, answer = post(url, body, token=None, headers_out=headers)
        assert status == 503 and "already in flight (--max_concurrency)" in answer["error"]
        assert headers.get("retry-after", headers.get("Retry-After")) == "1" and time.monotonic() - started < 1.0
        assert first.result(timeout=30)[0] == 200
        remote = RemoteReward(url, retries=3, backoff=0.01, timeout=10)
        busy = ThreadPoolExecutor(1).submit(post, url, body, token=None)
        time.sleep(0.5)
        started = time.monotonic()
        assert remote(images, prompts).shape == (1,)  # after one 503 and a wait of its Retry-After
        assert time.monotonic() - started >= 1.0 and busy.result(timeout=30)[0] == 200
    finally:
        stop(process)



@pytest.mark.subprocess
@pytest.mark.slow
def test_client_retries_then_stops_with_one_line_when_the_server_dies(tmp_path):
    process, url = start_server("--reward", "jpeg_compressibility")
    images, prompts = batch(3, 2)
    remote = RemoteReward(url, retries=2, backoff=0.2, timeout=5)
    try:
        first = remote(images, prompts)
        # a reward that rounds to 8 bits itself (through PIL or like it) sees no difference at all
        assert torch.equal(first, JpegCompressibility()(images, prompts))
    finally:
        stop(process)
    started = time.monotonic()
    with pytest.raises(RewardError) as failure:
        remote(images, prompts)
    message = str(failure.value)
    assert "\n" not in message and f"{url}/score failed 3 attempt(s)" in message and "ConnectionRefusedError" in message
    assert time.monotonic() - started >= 0.2 + 0.4  # the two backoffs were waited

    # a server restarted on the same port while the client is still retrying: the run carries on
    port = int(url.rsplit(":", 1)[1])
    patient = RemoteReward(url, retries=40, backoff=0.25, timeout=5)
    result = {}
    waiting = threading.Thread(target=lambda: result.update(scores=patient(images, prompts)))
    waiting.start()
    process, _ = start_server("--reward", "jpeg_compressibility", port=port)
    try:
        waiting.join(timeout=60)
        assert torch.equal(result["scores"], first)
    finally:
        stop(process)


class Foreign(BaseHTTPRequestHandler):
    """A foreign reward server scripted per test: ``script`` is a list of (status, delay_s, body) answers."""

    script: ClassVar[list] = []
    seen: ClassVar[list] = []
    trickle: ClassVar[float] = 0.0  # > 0: the answer's body is sent one byte per that many seconds

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, delay, body = self.script[min(len(self.seen), len(self.script) - 1)]
        self.seen.append(status)
        time.sleep(delay)
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 503:
                self.send_header("Retry-After", "1")
            self.end_headers()
            if self.trickle:
                for i in range(len(data)):
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(self.trickle)
            else:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign():
    with thread_server(Foreign) as url:
        yield url


def test_timeouts_and_5xx_are_retried_bad_answers_refused(foreign):
    images, prompts = batch(5, 3)
    good = {"scores": [0.5, 1.0, 1.5]}
    Foreign.seen, Foreign.script = [], [(503, 0, {"error": "busy"}), (200, 1.0, good), (200, 0, good)]
    scores = RemoteReward(foreign, retries=2, backoff=0.05, timeout=0.3)(images, prompts)
    assert scores.tolist() == [0.5, 1.0, 1.5] and len(Foreign.seen) == 3  # 503, timeout, answer

    # timeout bounds the whole attempt: an answer trickled a byte every 0.2 s is cut at 1 s, not read for 8 s
    Foreign.seen, Foreign.script, Foreign.trickle = [], [(200, 0, good)], 0.2
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"failed 1 attempt\(s\) \(timeout 1s each\).*TimeoutError"):
        RemoteReward(foreign, retries=0, timeout=1.0)(images, prompts)
    assert time.monotonic() - started < 2.0
    Foreign.trickle = 0.0

    # a 503's Retry-After (1 s) is waited when it is longer than the backoff
    Foreign.seen, Foreign.script = [], [(503, 0, {"error": "busy"}), (200, 0, good)]
    started = time.monotonic()
    assert RemoteReward(foreign, retries=1, backoff=0.01)(images, prompts).tolist() == [0.5, 1.0, 1.5]
    assert time.monotonic() - started >= 1.0

    Foreign.seen, Foreign.script = [], [(500, 0, {"error": "model fell over"})]
    failed = rf"{foreign}/score failed 2 attempt\(s\).*last status: HTTP 500: model fell over"
    with pytest.raises(RewardError, match=failed):
        RemoteReward(foreign, retries=1, backoff=0.05)(images, prompts)
    assert len(Foreign.seen) == 2

    for body, words in (({"scores": [0.5, 1.0]}, "returned 2 scores for 3 images"),
                        ({"scores": [0.5, float("nan"), 1.0]}, "non-finite"),
                        ({"scores": [0.5, 1.0, 1.5], "components": {"a": [1, 2, float("inf")]}}, "non-finite"),
                        ({"score": [0.5, 1.0, 1.5]}, "scores must be a list of numbers")):
        Foreign.seen, Foreign.script = [], [(200, 0, body)]
        with pytest.raises(RewardError, match=words):
            RemoteReward(foreign, retries=0)(images, prompts)
