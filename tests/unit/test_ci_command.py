"""CI runs the README's test command: `.ci/run` installs and runs, step by step, what the README's one line says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> list[str]:
    """The README's test command (the shell block after "The tests:"), split at ``&&``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"The tests:\s*(?:<!--.*?-->\s*)?```bash\n(.+?)\n```", text, re.S)  # past its docs marker
    assert block, "README.md has no test command after 'The tests:'"
    return [part.strip() for part in block.group(1).split("&&")]


def test_ci_runs_the_readme_test_command_step_by_step():
    steps = readme_test_command()
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    for step in steps:
        if step.startswith("pip install"):  # CI adds -q; everything else is the same
            step = step.replace("pip install", "pip install -q", 1)
        assert step in ci, f".ci/run lacks the README's step {step!r}"
    assert ci[-1] == steps[-1], "the last thing CI runs must be the README's pytest line"
    assert "-n 2" in steps[-1], "the suite is sized for two xdist workers (README: the tests)"
