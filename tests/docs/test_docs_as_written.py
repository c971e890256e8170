"""Every fenced block of README.md and docs/*.md runs as written, or says in the doc why it is not run (issue 44).

The convention (``tests/support/doc_blocks.py`` has it in full): an HTML comment on the line before a block's fence,

    <!-- not run: needs 8 GPUs and a scheduler -->      GPU, weights, nodes, scheduler, network, diagram, fragment, CI
    <!-- output of: jagg fit --config configs/digits.yaml -->   compared with what that command printed
    <!-- tested by: tests/training/test_drop_in.py -->  that test runs it as written
    <!-- run with: `max_steps=2` for `max_steps=60` -->  run with the replacement (say why in the doc)

and no comment: the block is run -- ``bash`` commands (``jagg`` in this process, install steps left to CI's own
``.ci/run``), ``python`` as a script in its own interpreter, ``yaml`` parsed as a config over ``configs/tiny.yaml``, a ``$ `` transcript run
and compared line by line. Blocks of a document run in order in one workspace shared by all documents (a folder with
this checkout's ``configs/``), so a later block finds what an earlier one wrote (the README's main job's adapter);
an output block of another document reuses the run of its command. A stale block -- an option renamed, a number
that moved, a file that is gone -- fails here.

Cost: the README's main job (60 steps, ~85 s CPU) runs once and serves every block that quotes it; the rest is a
few seconds each."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import (NOT_RUN_REASONS, ROOT, Block, all_blocks, commands, is_install_step, matches, normalized,
                        split_environment, transcript)
from in_process import jagg_in_process
from launch import search_path

BLOCKS = all_blocks()


class Workspace:
    """The folder the documents' commands run in, what each block and command printed, and the blocks run so far."""

    def __init__(self, root: Path):
        self.root, self.printed, self.done = root, {}, {}

    def run_command(self, command: str, capfd, monkeypatch, check: bool = True) -> str:
        env, argv = split_environment(command)
        with monkeypatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            if argv[0] == "jagg":
                proc = jagg_in_process(*argv[1:], cwd=self.root, capfd=capfd, monkeypatch=patch)
                code, out = proc.returncode, proc.stdout + proc.stderr
            else:
                bin_dir = str(Path(sys.executable).parent)
                proc = subprocess.run(["bash", "-c", shlex.join(argv)], cwd=self.root, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                                      env=dict(os.environ, PYTHONPATH=search_path(),
                                               PATH=f"{bin_dir}:{os.environ['PATH']}"))
                code, out = proc.returncode, proc.stdout
        self.printed[normalized(command)] = out
        assert code == 0 or not check, f"`{command}` exited with {code}:\n{out[-4000:]}"
        return out

    def output_of(self, command: str, capfd, monkeypatch) -> str:
        key = normalized(command)
        if key not in self.printed:
            self.run_command(command, capfd, monkeypatch)
        return self.printed[key]

    def run_block(self, block: Block, capfd, monkeypatch) -> str:
        """Run ``block`` (after the runnable blocks before it in its document); what it printed."""
        for earlier in BLOCKS:
            if earlier.path == block.path and earlier.line < block.line and runnable(earlier) \
                    and earlier.id not in self.done:
                self.run_block(earlier, capfd, monkeypatch)
        if block.id in self.done:
            return self.done[block.id]
        self.done[block.id] = f"{block.id} failed"  # a prerequisite that failed is not retried
        text = block.runnable_text()
        if block.language in ("bash", "sh", "shell"):
            out = "".join(self.run_command(c, capfd, monkeypatch) for c in commands(text) if not is_install_step(c))
        elif block.language == "python":  # a fresh interpreter: nothing of the earlier in-process runs
            script = self.root / f"block_{block.path.stem}_{block.line}.py"
            script.write_text(text)
            out = self.run_command(f"python {script.name}", capfd, monkeypatch)
        elif block.language == "yaml":
            fragment = self.root / f"block_{block.path.stem}_{block.line}.yaml"
            fragment.write_text(text)
            out = self.run_command(f"jagg fit --config configs/tiny.yaml --config {fragment} --print_config",
                                   capfd, monkeypatch)
        else:
            out = ""
            for command, expected in transcript(text):
                printed = self.run_command(command, capfd, monkeypatch, check=False)  # `jagg plan` may say 1
                missing = matches(expected, printed)
                assert missing is None, f"{block.id}: `{command}` did not print {missing!r}; it printed:\n{printed}"
                out += printed
        self.done[block.id] = out
        return out


def runnable(block: Block) -> bool:
    return block.marker in (None, "run with") and (block.language in ("bash", "sh", "shell", "python", "yaml")
                                                  or block.text.startswith("$ "))


def as_param(block: Block):
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if runnable(block) or block.marker ==
                        "output of" else [])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("docs")
    (root / "configs").symlink_to(ROOT / "configs")
    return Workspace(root)


def test_the_documents_have_blocks_and_markers_are_known():
    assert len(BLOCKS) > 30 and {b.path.name for b in BLOCKS} >= {"README.md", "callbacks.md", "drop_in.md"}
    for block in BLOCKS:
        if block.marker == "run with" and "`" in block.argument:
            assert block.replacements(), f"{block.id}: 'run with' needs `NEW` for `OLD` pairs"


@pytest.mark.parametrize("block", [as_param(b) for b in BLOCKS])
def test_block_runs_as_written(block, workspace, capfd, monkeypatch):
    if block.marker == "not run":
        assert any(word in block.argument for word in NOT_RUN_REASONS), (
            f"{block.id}: 'not run' must say what the block needs that CI has not ({', '.join(NOT_RUN_REASONS)}), "
            f"got {block.argument!r}")
        return
    if block.marker == "tested by":
        test = ROOT / block.argument.split()[0]
        assert test.is_file() and block.path.name in test.read_text(), (
            f"{block.id}: {test} must exist and read {block.path.name}")
        return
    if block.marker == "output of":
        printed = workspace.output_of(block.argument, capfd, monkeypatch)
        missing = matches(block.text.splitlines(), printed)
        assert missing is None, f"{block.id}: `{block.argument}` did not print {missing!r}; it printed:\n{printed}"
        return
    assert runnable(block), (f"{block.id}: a block with no language and no `$ ` command: say what it is "
                             "(<!-- output of: COMMAND --> or <!-- not run: REASON -->)")
    workspace.run_block(block, capfd, monkeypatch)


def test_the_documented_families_are_the_registry():
    """docs/configuration.md's allowed values of ``policy.family`` are the registered families, all of them."""
    from jagg_lightning.policies import FAMILIES

    [row] = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
             if line.startswith("| `family` |")]
    allowed = row.split("|")[3]
    listed = re.findall(r"`(\w+)`", allowed.split("(")[0])
    assert allowed.strip().startswith("null,") and listed == list(FAMILIES), (listed, list(FAMILIES))


def test_an_output_block_is_compared_line_by_line_numbers_included():
    expected = ["jagg fit: 60 steps in 85 s wall, 85 s CPU", "  accuracy   0.467 → 0.633", "  ...  (the others)",
                "  adapter    lora/final/"]
    printed = "a bar\njagg fit: 60 steps in 91 s wall, 90 s CPU\n  accuracy   0.467 → 0.633\n  x\n  adapter    lora/final/\n"
    assert matches(expected, printed) is None  # durations vary; "..." stands for any lines
    assert matches(expected, printed.replace("0.633", "0.634")) == expected[1]  # a number that moved
    assert matches(expected, printed.replace("  x\n", "")) is None  # "..." may stand for no line
    assert matches(expected[:2], printed.replace("0.633\n", "0.633\n  inserted\n")) is None
    assert matches(["a", "b"], "a\nc\nb") == "b"  # without "...", the lines follow each other
