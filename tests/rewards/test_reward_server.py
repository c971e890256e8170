"""``jagg serve-reward`` as a real subprocess on 127.0.0.1 and RemoteReward against it.

The served reward is a WeightedReward of the digits classifier and JPEG compressibility (prompt-dependent,
two components, no weights to download). A stdlib HTTP server in a thread stands in for a foreign reward
server where the test needs answers jagg's own server never gives (503s, a slow answer, a short list).
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from safetensors.numpy import save

from jagg_lightning.rewards import (
    DigitReward,
    JpegCompressibility,
    JpegIncompressibility,
    RemoteReward,
    WeightedReward,
    build_reward,
)
from jagg_lightning.rewards.base import RewardError
from jagg_lightning.rewards.server import _check, parser, serve_main
from jagg_lightning.rewards.wire import quantize

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV, TOKEN = "JAGG_TEST_REWARD_TOKEN", "test-token-5f3a"
SERVED = {"rewards": [{"class_path": "jagg_lightning.rewards.DigitReward", "init_args": {}},
                      {"class_path": "jagg_lightning.rewards.JpegCompressibility", "init_args": {}}]}
MAX_BODY_MB = 0.25
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def start_server(*args: str, port: int = 0, env: dict | None = None, log=None) -> tuple[subprocess.Popen, str]:
    """``python -m jagg_lightning serve-reward`` on 127.0.0.1; returns once its ready line names the URL."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "support"),
                                                               os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "jagg_lightning", "serve-reward", *args, "--host", "127.0.0.1",
                                "--port", str(port)], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                               stderr=log or subprocess.DEVNULL, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        stop(process)
        raise AssertionError("the reward server printed no ready line within 60 s") from None
    assert " on http://127.0.0.1:" in line, f"server did not start (exit {process.poll()}): {line!r}"
    return process, line.split(" on ")[-1].strip()


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with open(tmp_path_factory.mktemp("server") / "stderr.log", "w") as log:
        process, url = start_server("--reward", "jagg_lightning.rewards.WeightedReward", "--init_args",
                                    json.dumps(SERVED), "--token_env", TOKEN_ENV, "--max_body_mb", str(MAX_BODY_MB),
                                    "--max_batch", "16", env={TOKEN_ENV: TOKEN}, log=log)
        yield url
        stop(process)


@pytest.fixture(scope="module")
def local():
    return WeightedReward([DigitReward(), JpegCompressibility()])


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return f"env:{TOKEN_ENV}"


def batch(seed: int, size: int, side: int = 32):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(size, 3, side, side, generator=generator)
    digits = torch.randint(0, 10, (size,), generator=generator).tolist()
    return images, [f"the number {DIGITS[d]}" if i % 2 else f"a handwritten digit {d}" for i, d in enumerate(digits)]


def post(url: str, body: bytes, content_type: str = "application/vnd.safetensors", token: str | None = TOKEN,
         headers_out: dict | None = None):
    """A raw request; (status, decoded JSON answer); ``headers_out`` receives the answer's headers."""
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url + "/score", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        if headers_out is not None:
            headers_out.update(err.headers.items())
        return err.code, json.loads(err.read())


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` 8-bit RGB and holds no pixels: what a decompression bomb or a
    pixel-budget attack looks like before anything is decompressed (a few dozen bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


def png_json(*pngs: bytes) -> bytes:
    import base64

    return json.dumps({"prompts": ["digit 1"] * len(pngs),
                       "images": [base64.b64encode(p).decode() for p in pngs]}).encode()


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["safetensors", "png"])
def test_served_scores_equal_the_in_process_reward(server, local, token, encoding):
    images, prompts = batch(0, 6)
    remote = RemoteReward(server, token=token, encoding=encoding, name="served", retries=0)
    total, components = remote.score_with_components(images, prompts)
    expected, expected_components = local.score_with_components(quantize(images), prompts)
    assert set(components) == {"digits", "jpeg_compressibility"}
    assert (total - expected).abs().max() < 1e-6
    for name, values in expected_components.items():
        assert (components[name] - values).abs().max() < 1e-6
    assert components["digits"].std() > 0 and total.dtype == torch.float32
    health = remote.health()
    assert (health["reward"], health["version"]) == ("weighted", __import__("jagg_lightning").__version__)


@pytest.mark.subprocess
@pytest.mark.slow
def test_twenty_concurrent_clients_get_their_own_answers(server, local, token):
    requests = [batch(100 + i, 1 + i % 4) for i in range(20)]
    expected = [local(quantize(images), prompts) for images, prompts in requests]
    remote = RemoteReward(server, token=token, retries=0)
    start = threading.Barrier(20)

    def client(i):
        start.wait(timeout=30)  # all twenty in flight together
        return remote(*requests[i])

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(client, range(20)))
    for got, want in zip(answers, expected):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-6


@pytest.mark.subprocess
@pytest.mark.slow
def test_refusals_get_the_documented_4xx(server):
    images = np.zeros((2, 32, 32, 3), np.uint8)
    good = save({"images": images}, metadata={"prompts": json.dumps(["digit 1", "digit 2"])})
    assert post(server, good)[0] == 200
    for token in ("wrong-token", None):
        status, answer = post(server, good, token=token)
        assert status == 401 and "bearer token" in answer["error"]
    huge = save({"images": np.zeros((1, 300, 300, 3), np.uint8)}, metadata={"prompts": json.dumps(["digit 1"])})
    status, answer = post(server, huge)
    assert status == 413 and f"limit of {int(MAX_BODY_MB * 2**20)} bytes" in answer["error"]
    # far over the limit the server closes the connection mid-send: the client still names the limit, at once
    remote = RemoteReward(server, token=f"{TOKEN}", retries=3, backoff=5.0)
    started = time.monotonic()
    with pytest.raises(RewardError, match=f"exceeds the server's limit of {int(MAX_BODY_MB * 2**20)} bytes"):
        remote(torch.rand(8, 3, 512, 512), ["digit 1"] * 8)
    assert time.monotonic() - started < 5.0
    cases = [  # (body, content type, status, words the message must hold)
        (save({"images": images.transpose(0, 3, 1, 2).copy()}, metadata={"prompts": json.dumps(["1", "2"])}),
         "application/vnd.safetensors", 422, "shape [B, H, W, 3] (RGB, channels last), got [2, 3, 32, 32]"),
        (save({"images": images.astype(np.float32)}, metadata={"prompts": json.dumps(["1", "2"])}),
         "application/vnd.safetensors", 422, "dtype U8"),
        (save({"images": images}, metadata={"prompts": json.dumps(["1", "2", "3"])}),
         "application/vnd.safetensors", 422, "got 2 images but 3 prompts"),
        (save({"images": np.zeros((17, 8, 8, 3), np.uint8)}, metadata={"prompts": json.dumps(["1"] * 17)}),
         "application/vnd.safetensors", 422, "1 to 16 images (the server's --max_batch), got 17"),
        (json.dumps({"prompts": ["1"], "images": ["bm90IGEgcG5n"]}).encode(), "application/json", 400,
         "images[0] is not a base64-encoded PNG"),
        (b"\x00" * 16, "application/vnd.safetensors", 400, "not a safetensors file"),
        (good, "text/plain", 415, "Content-Type must be"),
        (save({"images": images}, metadata={"prompts": json.dumps(["a cat", "digit 2"])}),
         "application/vnd.safetensors", 422, "prompt 'a cat' names no digit"),
    ]
    for body, content_type, want_status, words in cases:
        status, answer = post(server, body, content_type)
        assert (status, words in answer["error"]) == (want_status, True), (status, answer, words)


@pytest.mark.subprocess
@pytest.mark.slow
def test_hostile_bodies_are_4xx_not_500(server):
    """JSON nested past the parser's depth -- in the body, the prompts, the safetensors header or its metadata --,
    a PNG decompression bomb and a tiny request whose headers declare more pixels than the budget: each a 4xx
    naming it (a 500 would make RemoteReward retry it), and the server answers the next good request."""
    deep = "[" * 100_000 + "]" * 100_000
    images = np.zeros((1, 8, 8, 3), np.uint8)

    def safetensors_with_header(header: str) -> bytes:
        raw = header.encode()
        return len(raw).to_bytes(8, "little") + raw + images.tobytes()

    cases = [
        (deep.encode(), "application/json", 400, "body is JSON nested too deeply"),
        (('{"prompts": ' + deep + ', "images": []}').encode(), "application/json", 400, "nested too deeply"),
        (save({"images": images}, metadata={"prompts": deep}), "application/vnd.safetensors", 400,
         "metadata 'prompts' is JSON nested too deeply"),
        (safetensors_with_header('{"images": ' + deep + "}"), "application/vnd.safetensors", 400,
         "the safetensors header (body is not a safetensors file) is JSON nested too deeply"),
        (safetensors_with_header('{"__metadata__": {"prompts": 3}, "images": {"dtype": "U8", "shape": [1, 8, 8, 3], '
                                 '"data_offsets": [0, 192]}}'), "application/vnd.safetensors", 422,
         "metadata 'prompts' must be a JSON array of strings"),
        (png_json(png_header(20000, 20000)), "application/json", 413, "images[0] is a decompression bomb"),
        # 3 x 4096^2 declared in a few hundred bytes: each side within --max_side, the sum past --max_pixels
        (png_json(*[png_header(4096, 4096)] * 3), "application/json", 413, f"over the server's limit of {1 << 25}"),
        (safetensors_with_header('{"__metadata__": {"prompts": "[\\"1\\", \\"2\\", \\"3\\"]"}, "images": '
                                 '{"dtype": "U8", "shape": [3, 4096, 4096, 3], "data_offsets": [0, 192]}}'),
         "application/vnd.safetensors", 413, "(--max_pixels)"),
    ]
    for body, content_type, want_status, words in cases:
        status, answer = post(server, body, content_type)
        assert (status, words in answer["error"]) == (want_status, True), (status, answer, words)
    good = save({"images": images}, metadata={"prompts": json.dumps(["digit 1"])})
    assert post(server, good)[0] == 200


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
def test_remote_reward_is_a_reward_like_any_other(server, token):
    images, prompts = batch(7, 4)
    inner = RemoteReward(server, token=token, name="served", retries=0)
    combined = WeightedReward([inner, JpegIncompressibility()], weights=[1.0, 0.5])
    total, components = combined.score_with_components(images, prompts)
    assert set(components) == {"served", "jpeg_incompressibility"}
    assert torch.allclose(total, components["served"] + 0.5 * components["jpeg_incompressibility"])
    rebuilt = build_reward(combined.describe())  # the env: form of the token is what is recorded
    assert (rebuilt(images, prompts) - total).abs().max() < 1e-6
    assert "not_rebuildable" in RemoteReward(server, token=TOKEN).describe()  # a literal secret is never recorded
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"refused the request: HTTP 422: .*prompt 'a cat' names no digit"):
        RemoteReward(server, token=token, retries=3, backoff=5.0)(images, ["a cat"] * 4)
    assert time.monotonic() - started < 5.0  # a 4xx is answered at once, never retried


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
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


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


def test_bad_arguments_fail_before_anything_is_built(capsys, monkeypatch):
    monkeypatch.delenv("JAGG_UNSET_TOKEN", raising=False)
    for argv, words in ((["--reward", "nope"], "must be one of"),
                        (["--reward", "ocr", "--init_args", "[1]"], "--init_args must be a JSON object"),
                        (["--reward", "ocr", "--max_batch", "0"], "--max_batch must be >= 1, got 0"),
                        (["--reward", "ocr", "--token_env", "JAGG_UNSET_TOKEN"], "JAGG_UNSET_TOKEN"),
                        (["--reward", "ocr", "--port", "70000"], "--port must be in [0, 65535]")):
        assert serve_main(argv) == 2
        assert words in capsys.readouterr().err
    for kwargs, words in (({"url": "127.0.0.1:8000"}, "url must start with http://"),
                          ({"url": "http://x", "timeout": 0}, "timeout must be > 0"),
                          ({"url": "http://x", "retries": -1}, "retries must be an integer >= 0"),
                          ({"url": "http://x", "encoding": "pickle"}, "encoding must be one of"),
                          ({"url": "http://x", "token": "env:JAGG_UNSET_TOKEN"}, "JAGG_UNSET_TOKEN is unset")):
        with pytest.raises(ValueError, match=words):
            RemoteReward(**kwargs)


def test_a_host_beyond_loopback_needs_a_token_or_an_explicit_no_token(capsys, monkeypatch):
    """--host 0.0.0.0 (or any address not loopback) without a token refuses to start, in one line naming both ways
    out; --no_token (or --no-token) says it on purpose; loopback hosts need neither."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert serve_main(["--reward", "nope", "--host", host]) == 2  # refused before the reward is looked up
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--host {host} is reachable beyond this machine: give --token_env VAR" in err
        assert "or --no_token to serve anyone" in err
        for ways in (["--no_token"], ["--no-token"], ["--token_env", TOKEN_ENV]):
            init_args, token = _check(parser().parse_args(["--reward", "ocr", "--host", host, *ways]))
            assert token == (TOKEN if "--token_env" in ways else None)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert _check(parser().parse_args(["--reward", "ocr", "--host", host])) == ({}, None)
    with pytest.raises(ValueError, match="--no_token and --token_env contradict each other"):
        _check(parser().parse_args(["--reward", "ocr", "--no_token", "--token_env", TOKEN_ENV]))


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's resident memory from /proc")
def test_memory_is_handed_back_after_large_requests():
    """Three requests of two 2048^2 PNGs (100 MB of decoded float pixels each): the server's resident memory afterwards
    stays within one request's decoded size of what it was before (measured: +10..53 MB; without the hand-back after
    large requests, +150 MB)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    process, url = start_server("--reward", "jpeg_compressibility", "--max_body_mb", "64",
                                "--max_pixels", str(64 << 20))
    try:
        rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        pngs = []
        for _ in range(2):
            pixels = (rng.random((2048, 2048, 3)) * 255).astype(np.uint8)
            pixels[:, 1024:] = 128  # half noise: a 6 MB PNG, so the body stays under the cap
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            pngs.append(buffer.getvalue())
        body = json.dumps({"prompts": ["x", "y"], "images": [base64.b64encode(p).decode() for p in pngs]}).encode()
        before = resident_mb(process.pid)
        for _ in range(3):
            status, answer = post(url, body, content_type="application/json", token=None)
            assert status == 200, answer
        decoded_mb = 2 * 2048 * 2048 * 3 * 4 / 2**20
        grown = resident_mb(process.pid) - before
        # one request's decoded size: resident memory is noisy (measured +10..53 MB), the leak it guards against
        # keeps ~150 MB
        assert grown < decoded_mb, f"resident memory grew by {grown:.0f} MB over three requests"
    finally:
        stop(process)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_served_geneval_reward_receives_each_prompts_metadata(tmp_path, rng_seed):
    """GenEval's rules need each prompt's metadata row (Flow-GRPO's GenEval server receives it per image): the rows
    travel in both encodings, the served scores equal the in-process ones on rendered scenes (right and wrong
    pairings), and a prompt sent without its row is a 422 naming it, not a retried failure."""
    from jagg_lightning.models.conditions import ConditionedPrompt
    from jagg_lightning.rewards import GenEvalReward
    from jagg_lightning.testbed.scenes import TRAIN_METADATA, render, scene_for

    rows = [json.loads(line) for line in TRAIN_METADATA.read_text().splitlines()]
    rng = np.random.default_rng(rng_seed)
    chosen = [rows[i] for i in rng.choice(len(rows), 6, replace=False)]
    scenes = [np.asarray(render(scene_for(r, rng)), dtype=np.float32) / 255 for r in chosen]
    images = torch.from_numpy(np.stack(scenes)).permute(0, 3, 1, 2)
    # each image twice: with its own row and with the next row's (usually wrong), so the scores spread
    prompts = [ConditionedPrompt(r["prompt"], origin=f"row {i}", metadata=r) for i, r in enumerate(chosen)]
    prompts += prompts[1:] + prompts[:1]
    images = torch.cat([images, images])
    local = GenEvalReward(reader="scenes")
    expected = local.score(quantize(images), prompts)
    assert expected.max() == 1 and expected.min() < 1
    with open(tmp_path / "stderr.log", "w") as log:
        process, url = start_server("--reward", "geneval", "--init_args", json.dumps({"reader": "scenes"}), log=log)
    try:
        for encoding in ("safetensors", "png"):
            served = RemoteReward(url, encoding=encoding, retries=0).score(images, prompts)
            assert (served - expected).abs().max() < 1e-6, encoding
        with pytest.raises(RewardError, match="422.*no GenEval metadata"):
            RemoteReward(url, retries=0).score(images[:2], [str(p) for p in prompts[:2]])
        pixels = np.zeros((1, 8, 8, 3), np.uint8)
        for bad in ([1], [{}, {}], {"tag": "single_object"}):
            body = save({"images": pixels}, metadata={"prompts": json.dumps(["a photo of a circle"]),
                                                      "rows": json.dumps(bad)})
            status, answer = post(url, body, token=None)
            assert status == 422 and "rows must be a JSON array of 1 objects" in answer["error"], (bad, answer)
        header = json.dumps({"__metadata__": {"prompts": '["a photo of a circle"]', "rows": 7},
                             "images": {"dtype": "U8", "shape": [1, 8, 8, 3], "data_offsets": [0, 192]}}).encode()
        status, answer = post(url, len(header).to_bytes(8, "little") + header + bytes(192), token=None)
        assert status == 422 and "metadata 'rows' must be" in answer["error"], answer
    finally:
        stop(process)
