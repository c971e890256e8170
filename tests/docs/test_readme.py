"""The README gets to the point and stays true (issue 40): short, its family list is the registry's, its links land,
and the docs site's pages that repeat its commands repeat them exactly."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# a section the README links to that another branch of issue 40 is writing (docs/method.md's "Which method should I
# use"): its anchor is checked once the heading exists, and this entry can go then
AWAITED_ANCHORS: set[str] = set()  # links to sections not yet written (none now)


def fenced(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def anchors(path: Path) -> set[str]:
    """The heading ids the docs site gives ``path`` (Python-Markdown's toc, as mkdocs renders it)."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{1,6} (.+?)\s*#*$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M),
                          re.M)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in headings}


def test_readme_is_at_most_150_lines():
    assert len(README.read_text().splitlines()) <= 150


def test_readme_family_list_is_the_registry():
    """The feature table's families are ``policy.family``'s values, every one, in the registry's order: a family added
    or renamed without the README fails here."""
    from jagg_lightning.policies import FAMILIES

    [row] = [line for line in README.read_text().splitlines() if line.startswith("| **Model families** |")]
    listed = re.findall(r"`(\w+)`", row)
    assert listed == list(FAMILIES), (listed, list(FAMILIES))


def test_readme_links_land():
    """Every relative link of the README names a file of this checkout, and a heading of it where it has an anchor
    (the heading ids the docs site renders)."""
    pytest.importorskip("markdown")
    text = README.read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]
    assert len(links) > 20
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.is_file():
            broken.append(link)
        elif anchor and anchor not in anchors(target) and link not in AWAITED_ANCHORS:
            broken.append(link)
    assert not broken, broken


def test_the_sites_pages_repeat_the_readme_commands_exactly():
    """docs/index.md shows the README's main command and docs/install.md its test command (the site has no README):
    the same text, so a changed command cannot leave a stale copy."""
    main, tests = fenced(README, "bash")[:2]
    assert "jagg fit --config configs/digits.yaml" in main and "pytest" in tests
    assert main in fenced(ROOT / "docs" / "index.md", "bash")
    assert tests in fenced(ROOT / "docs" / "install.md", "bash")
