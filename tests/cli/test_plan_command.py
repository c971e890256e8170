"""``jagg plan`` through the command line: the same config files and overrides as ``jagg fit``, a table per device,
exit status 0 when it fits, 1 when it does not (naming what to change), 2 for a bad argument; the presets plan
offline from their shipped configs. The console entry point runs in this process (its exit status and what it
printed are what is read); the preset, planned offline, is a real `jagg plan` process."""

import json
import os
import re
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


UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def table_numbers(text: str) -> tuple[str, dict[str, tuple[float, str]]]:
    """(the table's unit, row name -> (the number printed, its unit)) of a ``jagg plan`` table."""
    unit = re.search(r"^  per device +(GiB|MiB)  what$", text, re.M).group(1)
    rows = {}
    for match in re.finditer(r"^  (\S.*?)(?: \(peak of its phase\))? +(\d+\.\d\d)(?: (GiB|MiB|KiB|B))?  ", text, re.M):
        rows[match.group(1)] = (float(match.group(2)), match.group(3) or unit)
    return unit, rows


def test_plan_json_has_every_row_of_the_table_in_bytes(jagg_plan):
    """``--json``: one JSON object on stdout, the table's rows and peak in bytes (each equal to the number the table
    prints, to its rounding); a small config's table is in MiB with no row of it reading 0.00; the phases are told
    on stderr while it works."""
    args = ("--config", "configs/flux_tiny.yaml", "--model.policy.resolution", "48")
    shown, machine = jagg_plan(*args), jagg_plan(*args, "--json")
    assert shown.returncode == machine.returncode == 0, machine.stderr[-2000:]
    plan = json.loads(machine.stdout)
    unit, printed = table_numbers(shown.stdout)
    assert unit == "MiB" and plan["peak_bytes"] < 2**30  # a small config: GiB would read 0.xx
    rows = {r["name"]: r["bytes"] for r in plan["rows"]} | {"peak (resident + the largest phase)": plan["peak_bytes"]}
    assert set(printed) == set(rows), (sorted(printed), sorted(rows))
    for name, value in rows.items():
        number, row_unit = printed[name]
        assert abs(value / UNITS[row_unit] - number) <= 0.005 + 1e-9, (name, value, number, row_unit)
        assert value == 0 or number > 0, f"{name}: {value} B reads 0.00"
    assert plan["fits"] and plan["setup"]["devices"] == 1 and plan["tokens"] == 144  # 48 px: a 12 x 12 grid of packed tokens
    assert plan["passes"]["per_sample_bytes"] > 0 and plan["limit_bytes"] == round(0.9 * 80 * 2**30)
    assert "tracing one forward of the flux transformer on fake tensors" in shown.stderr


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
