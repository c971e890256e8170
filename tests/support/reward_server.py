"""The reward-server tests' shared parts: ``jagg serve-reward`` started as a real subprocess on 127.0.0.1, a raw
request, and a seeded batch of images with digit prompts (tests/rewards/test_reward_server.py and
test_reward_client.py)."""

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV, TOKEN = "JAGG_TEST_REWARD_TOKEN", "test-token-5f3a"
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


@contextmanager
def thread_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stdlib HTTP server with ``handler`` in a daemon thread on 127.0.0.1; yields its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True  # a handler still sleeping (a hung endpoint) never holds the test up
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
