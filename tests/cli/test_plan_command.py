"""``jagg plan`` through the command line: the same config files and overrides as ``jagg fit``, a table per device,
exit status 0 when it fits, 1 when it does not (naming what to change), 2 for a bad argument; the presets plan
offline from their shipped configs. The console entry point runs in this process (its exit status and what it
printed are what is read); the preset, planned offline, is a real `jagg plan` process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from in_process import jagg_in_process
from launch import search_path

ROOT = Path(__file__).resolve().parents[2]


def jagg_plan_process(*args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=search_path(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "jagg_lightning", "plan", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def jagg_plan(capfd, monkeypatch):
    return lambda *args: jagg_in_process("plan", *args, cwd=ROOT, capfd=capfd, monkeypatch=monkeypatch)


pytestmark = pytest.mark.slow


def test_plan_of_a_twin_fits_and_takes_fit_overrides(jagg_plan):
    proc = jagg_plan("--config", "configs/flux_tiny.yaml", "--model.policy.resolution", "64")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FITS" in proc.stdout and "activations: JAGG anchor pass" in proc.stdout
    assert "256 tokens" in proc.stdout  # 64 px: (64 / 8 / 2)^2 packed tokens, not the native 32 px's 16


def test_plan_that_does_not_fit_says_what_to_change_and_exits_1(jagg_plan):
    proc = jagg_plan("--config", "configs/flux_tiny.yaml", "--device-memory", "0.00005")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "DOES NOT FIT" in proc.stdout
    assert "    - " in proc.stdout  # at least one setting named with its peak


def test_bad_context_degree_exits_2(jagg_plan):
    proc = jagg_plan("--config", "configs/flux_tiny.yaml", "--devices", "2", "--context", "3")
    assert proc.returncode == 2 and "--context 3 must divide the devices (2)" in proc.stderr


@pytest.mark.subprocess
def test_a_preset_plans_offline_on_eight_devices():
    """A real `jagg plan` process, offline (HF_HUB_OFFLINE=1 in its environment): the preset's shipped config."""
    proc = jagg_plan_process("--config", "configs/wan21_t2v_1_3b.yaml", "--devices", "8")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (shipped config" in proc.stdout and "8 device(s)" in proc.stdout
