"""docs/rewards.md "Your own reward", as written: the user's module and config saved from the page's blocks into a
folder of their own, the page's command run there (`jagg fit` as its console script runs it: the working directory
is NOT on the module search path unless PYTHONPATH puts it there), two steps."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jagg_lightning.cli.quiet import unexpected_lines

from in_process import jagg_in_process

ROOT = Path(__file__).resolve().parents[2]


def section_blocks() -> dict[str, str]:
    """The fenced blocks of the page's "Your own reward" section, by language."""
    page = (ROOT / "docs" / "rewards.md").read_text()
    section = page.split("## Your own reward\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    assert sorted(language for language, _ in blocks) == ["bash", "python", "yaml"], blocks
    return dict(blocks)


@pytest.mark.subprocess
@pytest.mark.slow
def test_your_own_reward_section_runs_as_written(tmp_path, capfd, monkeypatch):
    blocks = section_blocks()
    assert "class_path: my_rewards.Redness" in blocks["yaml"]
    (tmp_path / "my_rewards.py").write_text(blocks["python"])
    (tmp_path / "my_run.yaml").write_text(blocks["yaml"])
    [command] = [line for line in blocks["bash"].splitlines() if line.strip() and not line.startswith("#")]
    words = shlex.split(command)
    settings = dict(w.split("=", 1) for w in words[:words.index("jagg")])
    args = words[words.index("jagg") + 1:]
    assert settings == {"PYTHONPATH": "."} and args[0] == "fit"

    # as the `jagg` console script runs: the working directory off the path (`-c` puts it first: dropped); the
    # checkout on it after the page's entries, as an installed jagg_lightning would be
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([settings["PYTHONPATH"], str(ROOT)]))
    console = "import sys; del sys.path[0]; from jagg_lightning.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", console, *args, "--trainer.max_steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert unexpected_lines(proc.stderr) == [], proc.stderr  # the page's config runs quietly
    assert "step: 2/2" in proc.stdout and (tmp_path / "lora/final/peft/adapter_model.safetensors").is_file()
    [recorded] = (tmp_path / "lightning_logs").glob("version_*/config.yaml")
    reward = yaml.safe_load(recorded.read_text())["model"]["reward"]
    assert reward == {"class_path": "my_rewards.Redness", "init_args": {"weight": 2.0}}  # the user's own, used
    score = float(re.search(r"reward: ([-0-9.]+)", proc.stdout).group(1))
    assert -2.0 <= score <= 2.0  # weight 2 x redness in [-1, 1]

    # without the folder on the path the same config stops with one line naming the field and the module
    refused = jagg_in_process(*args, "--trainer.max_steps", "0", cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("jagg: error: model.reward") and "No module named 'my_rewards'" in lines[0]
