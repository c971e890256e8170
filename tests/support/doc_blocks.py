"""The fenced blocks of README.md and docs/*.md, and how each is run as written (tests/docs/test_docs_as_written.py).

A block is run unless the HTML comment on the line before its opening fence says otherwise (a user reading the
markdown source sees it; rendered, it is invisible):

- ``<!-- not run: REASON -->``: the block needs what CI has not: a GPU, model weights, several nodes, a scheduler, a
  network -- or it is not a command (a diagram, a fragment of the user's own code) or is CI's own command. REASON
  must name one of :data:`NOT_RUN_REASONS`.
- ``<!-- output of: COMMAND -->``: the block is what COMMAND prints; it is compared with what the command printed
  when a block ran it (or it is run here, once, if none did), as :func:`matches` says.
- ``<!-- tested by: tests/PATH.py -->``: that test runs the block as written (and checks more than that it runs).
- ``<!-- run with: `NEW` for `OLD` -->`` (one or more pairs): the block runs with each OLD replaced by NEW, to keep
  CI's budget; the comment says why and what covers the rest.

How a block runs, by its language:

- ``bash``: each command (lines joined at ``\\``, split at ``&&``) in the docs' workspace (a folder with ``configs/``
  of this checkout). Install steps (``python3 -m venv``, ``. .venv/bin/activate``, ``pip install``) are skipped: CI
  itself runs them (``.ci/run``, tied to the README's test command by ``tests/unit/test_ci_command.py``). ``jagg``
  runs in this process (``tests/support/in_process.py``: the entry point itself, Lightning imported once); anything
  else in ``bash``. A leading ``NAME=value`` sets the environment of that command.
- ``python``: run as a script (a fresh interpreter) from the workspace.
- ``yaml``: a config fragment, parsed as ``jagg fit --config configs/tiny.yaml --config <block> --print_config`` (every
  key must exist and every class path import; nothing is built).
- no language, lines starting ``$ ``: a transcript -- each command is run and what follows it is compared with what it
  printed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(not run|output of|tested by|run with):\s*(.*?)\s*-->\s*$")
NOT_RUN_REASONS = ("GPU", "weights", "nodes", "scheduler", "network", "diagram", "fragment", "CI")
INSTALL_STEPS = ("python3 -m venv", "python -m venv", ". .venv/bin/activate", "source .venv/bin/activate",
                 "pip install")
DURATION = re.compile(r"\b\d+ s (wall|CPU)\b")  # timings vary run to run: any number matches


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: str | None = None  # "not run", "output of", "tested by", "run with"
    argument: str = ""
    id: str = field(init=False)

    def __post_init__(self):
        self.id = f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"

    def replacements(self) -> list[tuple[str, str]]:
        """The (OLD, NEW) pairs of a ``run with`` marker."""
        pairs = re.findall(r"`([^`]+)` for `([^`]+)`", self.argument) if self.marker == "run with" else []
        return [(old, new) for new, old in pairs]

    def runnable_text(self) -> str:
        text = self.text
        for old, new in self.replacements():
            assert old in text, f"{self.id}: 'run with' replaces {old!r}, which the block does not contain"
            text = text.replace(old, new)
        return text


def blocks(path: Path) -> list[Block]:
    lines, found, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before.strip())
        found.append(Block(path, i + 1, lines[i][3:].strip(), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else None, marker.group(2) if marker else ""))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for path in DOCUMENTS for b in blocks(path)]


def commands(text: str) -> list[str]:
    """A bash block's commands: lines joined at a trailing backslash, comments dropped, split at ``&&``."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        parts = [[]]
        for token in tokens:
            if token == "&&":
                parts.append([])
            else:
                parts[-1].append(token)
        found += [shlex.join(p) for p in parts if p]
    return found


def is_install_step(command: str) -> bool:
    return command.startswith(INSTALL_STEPS)


def split_environment(command: str) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 jagg fit ...`` -> ({A: 1, B: 2}, [jagg, fit, ...])."""
    tokens, env = shlex.split(command), {}
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        name, _, value = tokens.pop(0).partition("=")
        env[name] = value
    return env, tokens


def normalized(command: str) -> str:
    return shlex.join(shlex.split(command))


def transcript(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines printed after it) for each ``$ `` line of a transcript block."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            found.append((line[2:], []))
        elif found:
            found[-1][1].append(line)
    return found


def _line_matches(expected: str, actual: str) -> bool:
    expected, pattern, start = expected.rstrip(), "", 0
    for m in DURATION.finditer(expected):
        pattern += re.escape(expected[start:m.start()]) + r"(?:\d+ min )?\d+ s " + m.group(1)  # 1 min 40 s past 99 s
        start = m.end()
    pattern += re.escape(expected[start:])
    return re.fullmatch(pattern, actual.rstrip()) is not None


def matches(expected: list[str], actual: str) -> str | None:
    """None when every expected line is a line of ``actual``, in order, with nothing between them, except where an
    expected line starts with ``...`` (it stands for any lines, none included); numbers are compared as printed, only
    a duration (``85 s wall``, ``6 s CPU``, ``1 min 56 s wall``) may be any number; blank lines are skipped. Otherwise the first expected line not found."""
    lines = [line for line in actual.splitlines() if line.strip()]  # blank lines are not compared
    expected = [e for e in expected if e.strip()]
    position, skipping = 0, True  # the first expected line may be anywhere in the output
    for want in expected:
        if want.strip().startswith("..."):
            skipping = True
            continue
        if skipping:
            found = next((i for i in range(position, len(lines)) if _line_matches(want, lines[i])), None)
        else:
            found = position if position < len(lines) and _line_matches(want, lines[position]) else None
        if found is None:
            return want
        position, skipping = found + 1, False
    return None
