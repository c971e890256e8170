"""`jagg fit` on a config that names no callbacks stops on SIGTERM with one line, a checkpoint and exit status 143
(not 0: a scheduler must not read "finished"); the same command with `--ckpt_path last` resumes from that checkpoint
and finishes with the adapter a run never stopped writes, bit for bit."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jagg_lightning.cli.quiet import unexpected_lines
from launch import search_path

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 4
  enable_checkpointing: false
  enable_progress_bar: false
  logger: false
  default_root_dir: {root}
model:
  policy:
    lora_rank: 4
    lora_alpha: 8
    lora_targets: [attn.to_q, attn.to_v]
    max_sequence_length: 4
  sampling: {{num_steps: 4, group_size: 2, rollout_batch_size: 2}}
  grpo: {{train_batch_size: 2, adv_std: group}}
  jagg: {{window_size: 2}}
  reward:
    class_path: preempt_faults.SignalingReward
    init_args: {{at_call: {at_call}}}
  optimizer:
    class_path: torch.optim.AdamW
    init_args: {{lr: 0.05}}
data:
  prompts: [a cat, a dog, a tree, a boat]
  batch_size: 2
"""


def fit(config: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=search_path(), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "jagg_lightning", "fit", "--config", str(config), *args],
                          env=env, capture_output=True, text=True, timeout=300)


def adapter(root: Path) -> dict:
    """Every tensor of every safetensors file of the final adapter (PEFT and diffusers layouts), by file and key."""
    files = sorted((root / "lora" / "final").glob("**/*.safetensors"))
    assert files, f"no adapter in {root}/lora/final"
    return {(f.relative_to(root).as_posix(), k): v for f in files for k, v in load_file(f).items()}


def test_sigterm_exits_143_and_resumes_to_the_same_adapter(tmp_path):
    at_call = random.randrange(2, 6)  # 2 reward calls a step, 4 steps: the stop lands in steps 1..2
    full, first = tmp_path / "full", tmp_path / "first"
    (tmp_path / "full.yaml").write_text(CONFIG.format(root=full, at_call=-1))
    (tmp_path / "first.yaml").write_text(CONFIG.format(root=first, at_call=at_call))
    done = fit(tmp_path / "full.yaml")
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = fit(tmp_path / "first.yaml")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("jagg: ")]
    assert len(lines) == 2 and "SIGTERM received" in lines[0] and "stopped by SIGTERM" in lines[1], lines
    assert "Traceback" not in stopped.stderr
    # nothing else on stderr: no Lightning notice about the checkpoint it wrote (weights_only) or the absent
    # validation data (quiet.ALLOWED_STDERR)
    assert [line for line in unexpected_lines(stopped.stderr) if not line.startswith("jagg: ")] == [], stopped.stderr
    assert unexpected_lines(done.stderr) == [], done.stderr
    ckpt = first / "checkpoints" / "preempted.ckpt"
    assert ckpt.is_file() and f"--ckpt_path {ckpt}" in lines[1]
    assert (first / "lora" / "last").is_dir() and not (first / "lora" / "final").exists()

    # the same command with --ckpt_path last (what a restarted job runs) finds the stop's checkpoint: resumed at
    # step 1 or 2 it scores at most 6 micro-batches, so the reward's signal at call 7 (step 3 of a run started over)
    # never comes
    resumed = fit(tmp_path / "first.yaml", "--ckpt_path", "last", "--model.reward.init_args.at_call", "7")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [line for line in unexpected_lines(resumed.stderr) if not line.startswith("jagg: ")] == [], resumed.stderr
    # it says where it took up, and its summary names that checkpoint (no "checkpoints none"); lora/last is gone
    said = re.search(rf"^jagg fit: resuming from step ([12]) of {re.escape(str(ckpt))}$", resumed.stdout, re.M)
    assert said, resumed.stdout[-3000:]
    assert f"checkpoints  resumed from {ckpt} (step {said.group(1)})" in resumed.stdout, resumed.stdout[-3000:]
    assert sorted(p.name for p in (first / "lora").iterdir()) == ["final"]
    a, b = adapter(first), adapter(full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
