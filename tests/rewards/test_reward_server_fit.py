"""Killing the reward server mid-run stops ``jagg fit`` with one error line and leaves the last checkpoint and
export loadable; restarting the server and resuming finishes the run (issue 21, deliverable 2).

Real subprocesses on 127.0.0.1: ``jagg serve-reward`` (JPEG compressibility) and ``jagg fit`` of a tiny config
whose reward is a RemoteReward scored in the reward pool (``reward_workers: 2``).
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY_TARGETS
from in_process import jagg_in_process
from peft import LoraConfig
from reward_server import start_server, stop
from safetensors.torch import load_file

from jagg_lightning import JAGGModule

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(root: Path, url: str) -> Path:
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": MAX_STEPS, "enable_progress_bar": False, "logger": False,
                    "enable_model_summary": False, "default_root_dir": str(root), "num_sanity_val_steps": 0,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": 1,
                                                 "save_last": True}}]},
        "model": {"policy": {"lora_rank": 4, "lora_alpha": 8, "lora_targets": TINY_TARGETS, "guidance_scale": 1.0,
                             "max_sequence_length": 4},
                  "sampling": {"num_steps": 4, "group_size": 2, "rollout_batch_size": 2},
                  "grpo": {"train_batch_size": 2}, "jagg": {"window_size": 2},
                  "reward": {"class_path": "jagg_lightning.rewards.RemoteReward",
                             "init_args": {"url": url, "name": "jpeg", "timeout": 5, "retries": 1, "backoff": 0.1}},
                  "reward_workers": 2},
        "data": {"prompts": ["a cat", "a dog", "a boat", "a tree"], "batch_size": 2},
        "lora_export": {"dirpath": str(root / "lora")},
    }
    path = root / "remote.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit(*args: str, stderr) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "jagg_lightning", "fit", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def test_killed_server_stops_fit_with_one_line_and_resume_finishes(tmp_path, capfd, monkeypatch):
    """The fit whose server is killed is a real `jagg` process; the resume (read for its exit status and what it
    wrote) runs the console entry point in this process, against a new server process."""
    port = free_port()
    server, url = start_server("--reward", "jpeg_compressibility", port=port)
    cfg, last = config(tmp_path, url), tmp_path / "ckpt" / "last.ckpt"
    with open(tmp_path / "fit.err", "w") as err:
        run = fit("--config", str(cfg), stderr=err)
        try:
            deadline = time.monotonic() + 120
            while not last.exists() and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert last.exists(), f"no checkpoint (fit exit {run.poll()})"
            stop(server)  # mid-run: the next scoring finds no server
            code = run.wait(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
            if server.poll() is None:
                stop(server)
    lines = [line for line in (tmp_path / "fit.err").read_text().splitlines() if line.strip()]
    assert code == 1, lines[-20:]
    assert "Traceback" not in "\n".join(lines)
    assert lines[-1].startswith(f"jagg: error: reward jpeg: {url}/score failed 2 attempt(s)"), lines[-5:]
    assert "last status: URLError" in lines[-1] or "ConnectionRefused" in lines[-1], lines[-1]
    # the last checkpoint and export load
    checkpoint = torch.load(last, weights_only=True)
    stopped_at = checkpoint["global_step"]
    assert 1 <= stopped_at < MAX_STEPS
    module = JAGGModule.load_from_checkpoint(last)
    export = tmp_path / "lora" / "last" / "peft"
    adapter = load_file(str(export / "adapter_model.safetensors"))
    assert LoraConfig.from_pretrained(str(export)).r == 4
    assert len(adapter) == len(list(module.policy.lora_parameters())) > 0
    # the server back on the same port: resuming finishes the run
    server, again = start_server("--reward", "jpeg_compressibility", port=port)
    assert again == url
    try:
        resumed = jagg_in_process("fit", "--config", cfg, "--ckpt_path", last, cwd=REPO, capfd=capfd,
                                  monkeypatch=monkeypatch)
    finally:
        stop(server)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == MAX_STEPS
    assert (tmp_path / "lora" / "final" / "peft" / "adapter_model.safetensors").is_file()
