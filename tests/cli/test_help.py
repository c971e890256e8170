"""``jagg fit --help`` describes every option of ours from the docstrings, under intact group headings; each config
section's docstring describes each of its fields once, and docs/configuration.md tables every one of them.

The help is built in-process (the parser LightningCLI builds for ``jagg fit``); the callbacks' init arguments are read
through jsonargparse as ``--trainer.callbacks.help <class>`` reads them.
"""

import contextlib
import dataclasses
import inspect
import io
import re
from pathlib import Path
from unittest import mock

import docstring_parser
import pytest
from jsonargparse import ArgumentParser

import jagg_lightning.callbacks as callbacks_lib
from jagg_lightning import JAGGModule, PromptDataModule
from jagg_lightning.cli import cli_main
from jagg_lightning.config import EvalConfig, GRPOConfig, JAGGConfig, MemoryConfig, PolicyConfig, SamplingConfig

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"policy": PolicyConfig, "sampling": SamplingConfig, "grpo": GRPOConfig, "jagg": JAGGConfig,
            "memory": MemoryConfig, "evaluation": EvalConfig}
OURS = ("--model.", "--data.", "--lora_export.")  # the options our docstrings describe
ROLES = re.compile(r"``|:(class|mod|func|meth|attr|data|obj):")  # reST markup the help must not show raw
# the callbacks (and the checkpoint plugin) we ship that take init arguments of their own
CALLBACKS = [c for c in map(callbacks_lib.__dict__.get, callbacks_lib.__all__) if isinstance(c, type) and "__init__" in vars(c)]


def options(help_text: str) -> tuple[dict[str, str], list[str]]:
    """({option: its description, the "(type: ...)" part left out}, the group headings) of an argparse help text."""
    described, headings, current = {}, [], None
    for line in help_text.splitlines():
        if not line.strip():
            current = None
        elif not line.startswith(" "):
            headings.append(line)
            current = None
        elif re.match(r"  -", line):  # "  --opt METAVAR[, --alias METAVAR]" then the text after two spaces or more
            invocation, *text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current = invocation.split()[0].rstrip(",")
            described[current] = " ".join(text)
        elif current is not None:
            described[current] = f"{described[current]} {line.strip()}".strip()
    return {k: v.split("(type:")[0].strip() for k, v in described.items()}, headings


@pytest.fixture(scope="module")
def fit_help() -> str:
    out = io.StringIO()
    with mock.patch.dict("os.environ", {"COLUMNS": "120"}), mock.patch("sys.argv", ["jagg"]), \
            contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        cli_main(["fit", "--help"])
    assert info.value.code in (0, None)
    return out.getvalue()


def test_the_first_lines_say_what_the_command_does(fit_help):
    """`jagg fit --help | head`: one usage line, then the description (issue 58: 186 lines of synopsis came first)."""
    head = fit_help.splitlines()[:10]
    assert head[0].startswith("usage: jagg") and " fit [-h] [--config FILE]" in head[0] and len(head[0]) <= 110
    assert head[1] == "" and head[2].strip() and not head[2].lstrip().startswith(("-", "[", "options")), head


def test_every_option_of_ours_is_described(fit_help):
    described, _ = options(fit_help)
    ours = {k: v for k, v in described.items() if k.startswith(OURS)}
    fields = {f"--model.{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert fields <= set(ours), sorted(fields - set(ours))  # the parse saw every section
    assert {"--model.reward", "--model.seed", "--data.prompts", "--lora_export.dirpath"} <= set(ours)
    undescribed = sorted(k for k, v in ours.items() if not v)
    assert not undescribed, undescribed
    raw = {k: v for k, v in ours.items() if ROLES.search(v)}
    assert not raw, raw


def test_headings_are_whole_plain_sentences(fit_help):
    """A group's heading is its class's first docstring line (jsonargparse's short description): a whole plain
    sentence, never a paragraph cut at its first line break, and no reST markup."""
    _, headings = options(fit_help)
    for cls in [*SECTIONS.values(), JAGGModule, PromptDataModule, callbacks_lib.LoRAExport]:
        first = cls.__doc__.strip().split("\n\n")[0]
        assert "\n" not in first and first.endswith("."), (cls.__name__, first)
        assert f"{first[:-1]}:" in headings, (cls.__name__, headings)
    raw = [h for h in headings if ROLES.search(h)]
    assert not raw, raw


@pytest.mark.parametrize("cls", [*SECTIONS.values(), PromptDataModule, JAGGModule, *CALLBACKS],
                         ids=lambda c: c.__name__)
def test_one_description_per_field(cls):
    """The docstring (Google style: ``Attributes:`` of a section, ``Args:`` of a class) names each field or init
    argument once, in the signature's order, and nothing else -- a section's config sections aside."""
    names = [p.arg_name for p in docstring_parser.parse(cls.__doc__, docstring_parser.DocstringStyle.GOOGLE).params]
    if dataclasses.is_dataclass(cls):
        expected = [f.name for f in dataclasses.fields(cls)]
    else:
        expected = [n for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"
                    and not (cls is JAGGModule and dataclasses.is_dataclass(p.annotation if isinstance(p.annotation, type)
                                                                            else type(p.default)))]
    assert names == expected, (cls.__name__, names, expected)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_callback_options_are_described(cls):
    """What ``jagg fit --trainer.callbacks.help <class>`` lists: every init argument described."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "callback", fail_untyped=False)
    described, _ = options(parser.format_help())
    ours = {k: v for k, v in described.items() if k.startswith("--callback.") and k != "--callback.help"}
    assert not sorted(k for k, v in ours.items() if not v or ROLES.search(v)), ours


def test_docs_table_every_field():
    """docs/configuration.md's table of each section lists exactly its fields (the meanings are kept in step by
    hand: the docstrings are the reference, the page the user's guide)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    for name, cls in [*SECTIONS.items(), ("data", PromptDataModule)]:
        heading = f"## `{name}`" if name == "data" else f"## `model.{name}`"
        start = text.index(heading)
        end = text.find("\n## ", start + 1)
        rows = [line for line in text[start:end].splitlines() if line.startswith("| `")]
        listed = {n for row in rows for n in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}
        if dataclasses.is_dataclass(cls):
            fields = {f.name for f in dataclasses.fields(cls)}
        else:
            fields = set(inspect.signature(cls.__init__).parameters) - {"self"}
        assert listed == fields, (name, sorted(fields - listed), sorted(listed - fields))
