"""FlowGRPOServerReward against a real HTTP server on 127.0.0.1 speaking Flow-GRPO's reward-server protocol.

The test server is written from the documented format (flow_grpo_server.py's docstring: pickled dict in,
pickled dict out, JPEG images, ``/`` route, a traceback with 500 on failure). It scores each JPEG it decodes by
its mean brightness (+ the prompt's length for ``unifiedreward``; + the GenEval record's count as the strict
reward), so every score can be checked against a float64 computation on the images the client was given. Its
``mode`` makes it answer the hostile and malformed things a server can answer.
"""

import json
import math
import os
import pickle
import socket
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from jagg_lightning.models.conditions import read_conditioned_prompts
from jagg_lightning.rewards import FlowGRPOServerReward, build_reward
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.wire import quantize

from in_process import tiny_fit_with_reward

JPEG_ATOL = 0.02  # a JPEG keeps each 8x8 block's mean to about a level of 255; smooth images keep it closer


class Hostile:
    """What a malicious server pickles: unpickling it runs ``command`` in a shell."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Call:
    """Pickles as ``fn(*args)``: a few bytes that make an unrestricted reader allocate."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


STREAMED_BYTES = 16 << 20  # what the "endless" server sends, without a Content-Length


class Handler(BaseHTTPRequestHandler):
    mode: ClassVar[str] = "ok"
    sent: ClassVar[bool | None] = None  # "endless": whether the whole stream went out
    marker: ClassVar[str] = ""
    requests: ClassVar[list] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = pickle.loads(body)  # the test server trusts its client, as Flow-GRPO's servers do
        type(self).requests.append(request)
        images = [np.asarray(Image.open(BytesIO(jpeg), formats=["jpeg"]).convert("RGB"), dtype=np.float64)
                  for jpeg in request["images"]]
        brightness = [float(image.mean() / 255) for image in images]
        if "meta_datas" in request:
            answer = {"scores": brightness, "strict_rewards": [float(m["include"][0]["count"])
                                                              for m in request["meta_datas"]],
                      "rewards": [0.0] * len(images), "group_rewards": {}, "group_strict_rewards": {}}
        elif "prompts" in request:
            answer = {"outputs": [b + len(p) for b, p in zip(brightness, request["prompts"])]}
        else:
            answer = {"outputs": np.array(brightness, dtype=np.float32)}  # a numpy array: read as plain data
        mode, payload = type(self).mode, None
        if mode == "os_system":
            payload = pickle.dumps({"outputs": Hostile(f"touch {self.marker}")})
        elif mode == "object_array":
            payload = pickle.dumps({"outputs": np.array(brightness + ["x"], dtype=object)[:-1]})
        elif mode == "short":
            payload = pickle.dumps({"outputs": brightness[:-1]})
        elif mode == "nan":
            payload = pickle.dumps({"outputs": [math.nan] + brightness[1:]})
        elif mode == "not_pickle":
            payload = b"<html>502 Bad Gateway</html>"
        elif mode == "bytearray_bomb":  # 200 MB of zeros from a ~100-byte answer, in a key nobody reads
            payload = pickle.dumps({"outputs": brightness, "extra": Call(bytearray, 200 << 20)})
        elif mode in ("endless", "lying_length"):
            self.send_response(200)
            if mode == "lying_length":
                self.send_header("Content-Length", str(500 << 20))
            self.end_headers()
            try:
                for _ in range(STREAMED_BYTES >> 16 if mode == "endless" else 1):
                    self.wfile.write(b"\0" * (1 << 16))
                type(self).sent = True
            except OSError:  # the client stopped reading and closed
                type(self).sent = False
            return
        elif mode == "slow":
            time.sleep(3)
        elif mode == "error":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"Traceback (most recent call last):\n  ...\nRuntimeError: CUDA out of memory\n")
            return
        payload = payload or pickle.dumps(answer)
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def handler(server, tmp_path):
    Handler.mode, Handler.marker, Handler.requests = "ok", str(tmp_path / "marker"), []
    yield Handler
    Handler.mode = "ok"


def smooth_images(n: int, seed: int) -> torch.Tensor:
    """n images of distinct brightness, smooth (upsampled 4x4 noise) so that JPEG keeps their means closely."""
    g = torch.Generator().manual_seed(seed)
    levels = (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=g, dtype=torch.float64)) / n
    coarse = levels.view(n, 1, 1, 1) + 0.1 * torch.randn(n, 3, 4, 4, generator=g, dtype=torch.float64)
    return torch.nn.functional.interpolate(coarse, size=32, mode="bilinear").clamp(0, 1).float()


def test_scores_batched_as_the_servers_expect(server, handler, rng_seed):
    images, prompts = smooth_images(5, rng_seed), ["a cat", "two dogs", "a red boat", "x", "a tree at night"]
    expected = quantize(images).double().mean(dim=(1, 2, 3))

    deqa = FlowGRPOServerReward(server, batch_size=3, retries=0)
    torch.testing.assert_close(deqa(images, prompts).double(), expected, atol=JPEG_ATOL, rtol=0)
    assert [len(r["images"]) for r in handler.requests] == [3, 2] and all(set(r) == {"images"} for r in handler.requests)
    assert all(Image.open(BytesIO(j)).format == "JPEG" for r in handler.requests for j in r["images"])

    handler.requests.clear()
    unified = FlowGRPOServerReward(server, server="unifiedreward", batch_size=4, retries=0)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.float64)
    torch.testing.assert_close(unified(images, prompts).double(), expected + lengths, atol=JPEG_ATOL, rtol=0)
    assert [r["prompts"] for r in handler.requests] == [prompts[:4], prompts[4:]]


def test_geneval_sends_metadata_and_reports_accuracy_as_monitor(server, handler, tmp_path, rng_seed):
    prompts = ["a photo of two cats", "a photo of a dog", "a photo of three boats"]
    counts = torch.randint(1, 5, (3,), generator=torch.Generator().manual_seed(rng_seed))
    records = [{"tag": "counting", "prompt": p, "include": [{"class": "cat", "count": int(c)}]}
               for p, c in zip(prompts, counts)]
    metadata = tmp_path / "metadata.jsonl"
    metadata.write_text("\n".join(json.dumps(r) for r in records[::-1]) + "\n")  # found by prompt, not by line
    reward = FlowGRPOServerReward(server, server="geneval", metadata=str(metadata), retries=0)
    images = smooth_images(3, rng_seed)
    total, components = reward.score_with_components(images, prompts)
    torch.testing.assert_close(total.double(), quantize(images).double().mean(dim=(1, 2, 3)), atol=JPEG_ATOL, rtol=0)
    torch.testing.assert_close(components["monitor/geneval_strict_accuracy"], counts.float())
    assert set(components) == {"geneval", "monitor/geneval_strict_accuracy"}  # only_strict: no non-strict accuracy
    (request,) = handler.requests
    assert request["meta_datas"] == records and request["only_strict"] is True
    with pytest.raises(RewardError, match="no GenEval metadata record for prompt 'a cow'"):
        reward(images[:1], ["a cow"])
    # the reward is rebuilt from what the hyper-parameters record
    assert build_reward(reward.describe()).metadata == reward.metadata
    # prompts read from a metadata JSONL data file carry their records: no metadata file needed
    carried = read_conditioned_prompts(metadata, "data.prompts_file")
    FlowGRPOServerReward(server, server="geneval", retries=0)(images[:1], carried[:1])
    assert handler.requests[-1]["meta_datas"] == [records[::-1][0]]
    with pytest.raises(RewardError, match="no GenEval metadata record for prompt 'a cow'"):
        FlowGRPOServerReward(server, server="geneval", retries=0)(images[:1], ["a cow"])


def test_hostile_pickle_never_runs(server, handler, tmp_path):
    """The answer names os.system: refused by name, and the marker file the command would write never appears
    (the same bytes given to pickle.loads do write it: the payload is real)."""
    marker = tmp_path / "marker"
    reward = FlowGRPOServerReward(server, retries=0, name="deqa_remote")
    handler.mode = "os_system"
    with pytest.raises(RewardError) as err:
        reward(torch.rand(2, 3, 16, 16), ["a", "b"])
    message = str(err.value)
    assert "\n" not in message and "deqa_remote" in message and server in message
    assert "refused to load posix.system" in message or "refused to load nt.system" in message
    time.sleep(0.2)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Hostile(f"touch {marker}")))  # the control: unpickled freely, it runs
    assert marker.exists()


@pytest.mark.parametrize("mode, says", [
    ("object_array", "refused numpy dtype dtype('O')"),
    ("short", "returned 1 outputs for 2 images"),
    ("nan", "non-finite value in outputs"),
    ("not_pickle", "not a pickle: b'<html>502 Bad Gateway</html>'"),
    ("error", "failed 2 attempt(s) (timeout 120s each); last status: HTTP 500: RuntimeError: CUDA out of memory"),
])
def test_malformed_answers_are_one_line_naming_reward_and_endpoint(server, handler, mode, says):
    reward = FlowGRPOServerReward(server, retries=1, backoff=0.01, name="deqa_remote")
    handler.mode = mode
    with pytest.raises(RewardError) as err:
        reward(torch.rand(2, 3, 16, 16), ["a", "b"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward deqa_remote: {server}") and says in message, message


def test_an_answer_that_would_allocate_past_the_caps_is_refused_by_name(server, handler):
    """A ~100-byte answer building a 200 MB bytearray in an extra key: refused, naming the cap, before the
    bytearray exists (traced allocations stay small)."""
    handler.mode = "bytearray_bomb"
    reward = FlowGRPOServerReward(server, retries=0, name="deqa_remote")
    tracemalloc.start()
    try:
        with pytest.raises(RewardError) as err:
            reward(torch.rand(2, 3, 16, 16), ["a", "b"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"reward deqa_remote: {server} answered a pickle that is not")
    assert f"refused a bytearray of {200 << 20} bytes: more than max_answer_bytes={64 << 20}" in message
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MB allocated"
    # the cap is the reward's to set: 256 MiB lets the (harmless) bytearray through
    assert len(FlowGRPOServerReward(server, retries=0, max_answer_bytes=256 << 20)(torch.rand(2, 3, 8, 8),
                                                                                 ["a", "b"])) == 2
    with pytest.raises(ValueError, match="max_answer_items must be an integer >= 1, got 0"):
        FlowGRPOServerReward(server, max_answer_items=0)
    with pytest.raises(ValueError, match="max_answer_bytes must be an integer >= 1, got 0"):
        FlowGRPOServerReward(server, max_answer_bytes=0)


@pytest.mark.parametrize("mode, says", [
    ("endless", "answered more than max_answer_bytes=1048576 bytes; stopped reading and refused it"),
    ("lying_length", f"answered more than max_answer_bytes=1048576 bytes (Content-Length {500 << 20}); refusing it"),
])
def test_an_answer_larger_than_the_cap_stops_being_read(server, handler, mode, says):
    """16 MB streamed without a length, or 500 MB announced: the client reads at most its cap (1 MiB here),
    refuses at once with one line (not retried, never waiting for the timeout) and hangs up on the rest."""
    handler.mode, handler.sent = mode, None
    reward = FlowGRPOServerReward(server, retries=2, timeout=30, max_answer_bytes=1 << 20, name="big")
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        reward(torch.rand(1, 3, 16, 16), ["a"])
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "\n" not in message and message == f"reward big: {server} {says}", message
    assert len(handler.requests) == 1  # refused, not retried
    if mode == "endless":
        deadline = time.monotonic() + 10
        while handler.sent is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handler.sent is False  # the stream was cut off: the client hung up before its end


def test_the_scores_count_is_checked_before_they_are_converted(server, rng_seed):
    """An answer of 500k scores for 2 images: refused by count without converting a single one (the conversion to
    a list of 500k floats would trace ~16 MB)."""
    reward = FlowGRPOServerReward(server, retries=0, name="deqa_remote")
    scores = np.random.default_rng(rng_seed).random(500_000)
    for values in (scores, scores.tolist()):
        tracemalloc.start()
        try:
            with pytest.raises(RewardError, match=r"returned 500000 outputs for 2 images; refusing it$"):
                reward._scores({"outputs": values}, "outputs", 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"{peak / 2**20:.1f} MB allocated"
    with pytest.raises(RewardError, match="returned 3 outputs for 2 images"):  # the count first, then the types
        reward._scores({"outputs": [0.5, "x", None]}, "outputs", 2)


def test_slow_and_dead_servers_fail_within_the_timeout(server, handler):
    handler.mode = "slow"
    reward = FlowGRPOServerReward(server, timeout=0.5, retries=1, backoff=0.01, name="slow")
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"^reward slow: http://127\.0\.0\.1:\d+ failed 2 attempt\(s\) "
                                          r"\(timeout 0\.5s each\); last status: TimeoutError"):
        reward(torch.rand(1, 3, 16, 16), ["a"])
    assert time.monotonic() - start < 2.5  # two attempts of 0.5 s, never the server's 3 s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RewardError, match=rf"^reward dead: {dead} failed 1 attempt\(s\).*ConnectionRefusedError"):
        FlowGRPOServerReward(dead, retries=0, name="dead")(torch.rand(1, 3, 16, 16), ["a"])


def test_refuses_bad_configuration(server, tmp_path):
    with pytest.raises(ValueError, match="server must be one of"):
        FlowGRPOServerReward(server, server="pickscore")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        FlowGRPOServerReward(server, batch_size=0)
    with pytest.raises(ValueError, match="jpeg_quality must be an integer in"):
        FlowGRPOServerReward(server, jpeg_quality=100)


@pytest.mark.slow
def test_jagg_fit_with_a_flow_grpo_server(server, handler, tmp_path, capfd, monkeypatch):
    proc, root = tiny_fit_with_reward({"class_path": "jagg_lightning.rewards.FlowGRPOServerReward",
                                       "init_args": {"url": server, "server": "unifiedreward", "timeout": 10,
                                                     "retries": 1}}, tmp_path, capfd, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert handler.requests and all(len(r["images"]) == 2 for r in handler.requests)
    metrics = (root / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train/reward_mean" in metrics
    assert (root / "lora" / "final" / "peft" / "adapter_model.safetensors").exists()
