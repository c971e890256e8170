"""Ctrl-C on ``jagg serve-reward`` (issue 30, deliverable 2): one line, no traceback (no ``CancelledError`` of a request
still open, no ``KeyboardInterrupt``), exit status 130 -- while it serves, with a request still open, and while the
reward is being built. Real subprocesses on 127.0.0.1."""

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reward_server import start_server, stop

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def started(*args: str):
    """The server, ready (its port answers /health), with SIGINT as a terminal leaves it."""
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # a child inherits an ignored SIGINT
    try:
        process, url = start_server("--reward", "jpeg_compressibility", *args, log=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, sigint)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for _ in range(100):
        try:
            connection = http.client.HTTPConnection(host, int(port), timeout=5)
            connection.request("GET", "/health")
            assert connection.getresponse().status == 200
            return process, connection
        except OSError:
            time.sleep(0.1)
    stop(process)
    raise AssertionError(f"{url} never answered /health")


def interrupted(process: subprocess.Popen) -> list[str]:
    """SIGINT, then the lines of stderr once the process has ended (with status 130)."""
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            stop(process)
    assert process.returncode == 130, (process.returncode, err[-3000:])
    assert "Traceback" not in err and "Error" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.strip()]


def test_ctrl_c_stops_a_serving_server_with_one_line():
    process, connection = started()
    lines = interrupted(process)
    connection.close()
    assert lines == ["jagg serve-reward: stopped by SIGINT (Ctrl-C), exit status 130"], lines


def test_ctrl_c_with_a_request_still_open_cancels_it_without_a_traceback():
    process, connection = started()
    host, port = connection.host, connection.port
    # a score request whose body never comes: the graceful shutdown (5 s) waits for it, then cancels it
    hanging = http.client.HTTPConnection(host, port, timeout=60)
    hanging.putrequest("POST", "/score")
    hanging.putheader("Content-Type", "application/json")
    hanging.putheader("Content-Length", "1000")
    hanging.endheaders()
    hanging.send(b"{")
    time.sleep(0.5)  # the server has read the headers and waits in the body
    lines = interrupted(process)
    assert lines == ["jagg serve-reward: stopped by SIGINT (Ctrl-C), 1 request(s) still open cancelled, "
                     "exit status 130"], lines


def test_ctrl_c_while_the_reward_is_built_is_one_line():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "support")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "jagg_lightning", "serve-reward", "--reward",
                           "preempt_faults.InterruptedWhileLoading", "--port", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["jagg serve-reward: stopped by SIGINT (Ctrl-C), exit status 130"]
