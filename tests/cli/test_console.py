"""The ``jagg`` console entry point (issue 30, deliverable 2): help and version answer from text without importing
torch, Lightning, diffusers or transformers; every subcommand is in the usage line; a subcommand's ``--help`` imports
what it prints and no model code; Ctrl-C during ``fit`` stops with one line, no traceback and exit status 130.

What a process imports is read from ``PYTHONPROFILEIMPORTTIME=1`` (stderr lists every module imported), not timed."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_preemption_cli import CONFIG

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "diffusers", "transformers", "lightning", "pytorch_lightning", "peft"}
# the console entry point as setup.cfg names it, and the module entry point
ENTRIES = {"console": ["-c", "from jagg_lightning.cli import main; main()"], "module": ["-m", "jagg_lightning"]}


def jagg(*args, entry: str = "module", profile: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]),
               OMP_NUM_THREADS="1")
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    if profile:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    # SIGINT as a terminal leaves it (a shell's background job would inherit it ignored)
    return subprocess.run([sys.executable, *ENTRIES[entry], *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def imported(stderr: str) -> set[str]:
    """Top-level packages of every module ``PYTHONPROFILEIMPORTTIME`` listed."""
    names = {line.split("|")[-1].strip().split(".")[0] for line in stderr.splitlines()
             if line.startswith("import time:")}
    return names - {"package"}  # the header line's column name


def other_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("import time:")]


@pytest.mark.parametrize("entry", ENTRIES)
def test_help_and_version_import_nothing_heavy(entry):
    helped = jagg("--help", entry=entry, profile=True)
    assert helped.returncode == 0 and not other_lines(helped.stderr), helped.stderr[-2000:]
    modules = imported(helped.stderr)
    assert "jagg_lightning" in modules  # the profile is read: the package itself is listed
    assert not modules & HEAVY, sorted(modules & HEAVY)
    usage = helped.stdout.splitlines()[0]
    assert usage.startswith("usage: jagg") and "{fit,validate,test,predict,serve-reward,plan}" in usage, usage
    assert "GRPO fine-tuning of flow-matching text-to-image transformers" in helped.stdout
    for name in ("serve-reward", "plan"):
        assert any(line.split()[:1] == [name] for line in helped.stdout.splitlines()), name

    version = jagg("--version", entry=entry, profile=True)
    from jagg_lightning import __version__

    assert version.returncode == 0 and version.stdout.strip() == f"jagg {__version__}"
    assert not imported(version.stderr) & HEAVY, sorted(imported(version.stderr) & HEAVY)


def test_no_subcommand_or_an_unknown_one_is_one_line_naming_the_choices():
    for args, named in (((), "give a subcommand"), (("fitt",), "unknown subcommand 'fitt'")):
        proc = jagg(*args, profile=True)
        lines = other_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert lines[0].startswith(f"jagg: error: {named}") and "serve-reward,plan}" in lines[0], lines
        assert not imported(proc.stderr) & HEAVY


def test_serve_reward_and_plan_help_import_no_torch():
    served = jagg("serve-reward", "--help", profile=True)
    assert served.returncode == 0 and "--reward" in served.stdout and "--max_pixels" in served.stdout
    assert not imported(served.stderr) & HEAVY, sorted(imported(served.stderr) & HEAVY)
    planned = jagg("plan", "--help", profile=True)
    assert planned.returncode == 0 and "--device-memory" in planned.stdout
    assert not imported(planned.stderr) & HEAVY, sorted(imported(planned.stderr) & HEAVY)


@pytest.mark.slow
def test_fit_help_imports_lightning_but_no_model_or_reward_code():
    proc = jagg("fit", "--help", profile=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = imported(proc.stderr)
    assert {"lightning", "jsonargparse", "jagg_lightning"} <= modules
    # the pipelines, the LoRA library and the reward models and server load when a run builds them
    assert not modules & {"diffusers", "peft", "open_clip", "hpsv2", "rapidocr_onnxruntime", "starlette", "uvicorn"}
    # every reward is still a known subclass in the help (the rewards package imports them on first use)
    for name in ("DigitReward", "PickScoreReward", "RemoteReward", "WeightedReward"):
        assert f"jagg_lightning.rewards.{name}" in proc.stdout, name


def fit_config(tmp_path: Path, name: str, reward_args: str) -> Path:
    """test_preemption_cli's tiny fit, its reward sending signals: ``reward_args`` are SignalingReward's init_args."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.format(root=tmp_path / name, at_call=reward_args))
    return path


def jagg_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jagg")]


def interrupted_fit(tmp_path, name: str, reward_args: str) -> list[str]:
    """A tiny fit whose reward sends SIGINT (``reward_args``): it exits 130 without a traceback; its `jagg` lines."""
    stopped = jagg("fit", "--config", fit_config(tmp_path, name, f"{reward_args}, signum: {int(signal.SIGINT)}"))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    return jagg_lines(stopped.stderr)


@pytest.mark.slow
def test_ctrl_c_during_fit_stops_at_a_safe_point_with_a_checkpoint_and_status_130(tmp_path):
    lines = interrupted_fit(tmp_path, "once", "3")
    assert len(lines) == 2 and "SIGINT received" in lines[0] and "Ctrl-C again stops at once" in lines[0], lines
    ckpt = tmp_path / "once" / "checkpoints" / "preempted.ckpt"
    assert "stopped by SIGINT" in lines[1] and f"--ckpt_path {ckpt}" in lines[1] and ckpt.is_file(), lines
    assert (tmp_path / "once" / "lora" / "last").is_dir() and not (tmp_path / "once" / "lora" / "final").exists()


@pytest.mark.slow
def test_ctrl_c_twice_during_fit_stops_at_once_with_one_line(tmp_path):
    lines = interrupted_fit(tmp_path, "twice", "3, times: 2")
    assert len(lines) == 2 and "SIGINT received" in lines[0], lines
    assert lines[1] == "jagg fit: stopped by SIGINT (Ctrl-C), exit status 130", lines
    assert not (tmp_path / "twice" / "checkpoints" / "preempted.ckpt").exists()  # no safe point was waited for
