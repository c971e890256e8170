"""The API reference (docs/reference/, mkdocstrings) names the public import paths, every one of them resolves, and a
config section's fields are described there by the same text ``jagg fit --help`` prints (issue 40: one source).

Griffe is what mkdocstrings reads the code with (the ``docs`` extra; CI installs it before the tests and builds the
site with ``mkdocs build --strict``); without it these tests skip. Griffe reads source, imports nothing: ~1 s.
"""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
EXTENSIONS = "docs/_griffe/lazy_exports.py"


@pytest.fixture(scope="module")
def package():
    extensions = griffe.load_extensions(f"{ROOT / EXTENSIONS}:LazyExports", f"{ROOT / EXTENSIONS}:ReSTRoles")
    return griffe.load("jagg_lightning", search_paths=[str(ROOT)], extensions=extensions,
                       docstring_parser="google")


def referenced() -> list[str]:
    """The ``::: path`` identifiers of the reference pages."""
    return [m for page in sorted(REFERENCE.glob("*.md"))
            for m in re.findall(r"^::: (\S+)", page.read_text(), re.M)]


def documented(package, path: str):
    obj = package[path.removeprefix("jagg_lightning.")] if path != "jagg_lightning" else package
    return obj.final_target if obj.is_alias else obj


def test_every_reference_resolves_under_a_public_path(package):
    """Each identifier is a name users import (``jagg_lightning.X`` or a public subpackage's), and griffe finds its
    definition -- through the lazily exported names (PEP 562 ``_PUBLIC``) too."""
    public = ("jagg_lightning.config.", "jagg_lightning.callbacks.", "jagg_lightning.rewards.",
              "jagg_lightning.policies.", "jagg_lightning.strategies", "jagg_lightning.objectives.",
              "jagg_lightning.testbed", "jagg_lightning.data.")
    import jagg_lightning

    paths = referenced()
    assert len(paths) > 40
    private = [p for p in paths if not (p.startswith(public) or p.removeprefix("jagg_lightning.") in jagg_lightning.__all__)]
    assert not private, private
    undocumented = [p for p in paths if documented(package, p).docstring is None]  # a heading with nothing under it
    assert not undocumented, undocumented


def test_the_reference_covers_the_public_classes(package):
    """Every public class of the package's root, the config sections, the callbacks and the rewards has its entry
    (read from the source as griffe reads it: nothing is imported)."""
    import jagg_lightning  # its names are lazy: this imports no torch

    def classes(module: str, names) -> set[str]:
        return {f"{module}.{n}" for n in names if documented(package, f"{module}.{n}").is_class}

    def public(module: str) -> list[str]:
        obj = documented(package, module)
        lazy = obj.members.get("_PUBLIC")
        return list(ast.literal_eval(str(lazy.value))) if lazy is not None else [str(n) for n in obj.exports]

    expected = {f"jagg_lightning.{n}" for n in jagg_lightning.__all__ if not n.endswith("Config")}
    expected |= {n for n in classes("jagg_lightning.config", public("jagg_lightning.config")) if n.endswith("Config")}
    for module in ("jagg_lightning.callbacks", "jagg_lightning.rewards"):
        expected |= classes(module, public(module))
    assert len(expected) > 30
    assert expected <= set(referenced()), sorted(expected - set(referenced()))


def test_config_sections_read_the_same_descriptions_as_help(package):
    """mkdocstrings renders a section's ``Attributes:`` as its table of fields; jsonargparse reads the same block
    (docstring_parser) for ``--model.<section>.<field>``: the two parsers find the same fields, in the dataclass's
    order, with the same words."""
    import docstring_parser

    import jagg_lightning.config as config

    sections = [getattr(config, n) for n in config.__all__ if n.endswith("Config")]
    assert len(sections) >= 7
    for cls in sections:
        obj = documented(package, f"jagg_lightning.config.{cls.__name__}")
        [table] = [s for s in obj.docstring.parsed if s.kind is griffe.DocstringSectionKind.attributes]
        rendered = {a.name: " ".join(a.description.split()) for a in table.value}
        helped = {p.arg_name: " ".join(p.description.split())
                  for p in docstring_parser.parse(cls.__doc__, docstring_parser.DocstringStyle.GOOGLE).params}
        assert list(rendered) == [f.name for f in dataclasses.fields(cls)], cls.__name__
        assert rendered == helped, cls.__name__
