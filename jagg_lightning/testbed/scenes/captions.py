"""Captions in GenEval's six task families, GenEval's phrasing, and the train / held-out split of compositions.

The phrasing is GenEval's ``prompts/create_prompts.py`` (``djghosh13/geneval``), word for word:

* ``single_object``: "a photo of {a} {class}"; ``two_object``: "a photo of {a} {A} and {a} {B}";
* ``counting``: "a photo of {number} {plural}" (numbers "two".."four", ``max_count=4``; plural = name + "s", or
  + "es" after an "s"), with GenEval's exclude clause ``count + 1``;
* ``colors``: "a photo of {a} {color} {class}"; ``color_attr``: "a photo of {a} {colorA} {A} and {a} {colorB} {B}"
  (distinct classes, distinct colours);
* ``position``: "a photo of {a} {A} {relation} {a} {B}", metadata ``include = [B, A with position (relation, 0)]``;

{a} is "an" before a vowel, else "a" (``with_article``). Each row has exactly GenEval's fields: ``tag``,
``include`` (``class``, ``count``, optional ``color``, ``position``), ``exclude`` (counting only), ``prompt``.

Where GenEval draws a random sample of COCO classes, the scenes' vocabulary is small enough to enumerate: every
prompt of every task over ``SHAPES`` x ``PALETTE`` (4 + 12 + 12 + 24 + 48 + 360 rows). The held-out split
(:func:`is_heldout`) takes out compositions, never words -- every word stays in the train prompts:

* colour-shape pairs ``HELDOUT_PAIRS`` (one per shape and colour): a colours or color_attr row naming one;
* counts ``HELDOUT_COUNTS``: the highest count, four, for two of the four shapes;
* relations ``HELDOUT_RELATIONS``: (shape, relation) with the shape as the subject ("a circle above ...");
* shape pairs ``HELDOUT_PAIRS_OF_SHAPES`` in that order, for two_object.

single_object has nothing to hold out (four shapes): its four rows are in both files, so the held-out file
still scores all six tasks. ``train_metadata.jsonl`` / ``heldout_metadata.jsonl`` next to this module are
:func:`write_metadata`'s output (``python -m jagg_lightning.testbed.scenes.captions`` rewrites them).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from jagg_lightning.rewards.geneval_rules import POSITIONS
from jagg_lightning.rewards.geneval_scenes import PALETTE, SHAPES

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
MAX_COUNT = 4  # create_prompts.py: generate_counting_sample(rng, max_count=4), counts 2..4
HELDOUT_PAIRS = (("red", "triangle"), ("blue", "circle"), ("yellow", "diamond"), ("green", "square"))
HELDOUT_COUNTS = (("circle", 4), ("triangle", 4))
HELDOUT_RELATIONS = (("circle", "above"), ("square", "left of"), ("triangle", "below"), ("diamond", "right of"))
HELDOUT_PAIRS_OF_SHAPES = (("diamond", "circle"), ("square", "triangle"))
HERE = Path(__file__).resolve().parent
TRAIN_METADATA = HERE / "train_metadata.jsonl"
HELDOUT_METADATA = HERE / "heldout_metadata.jsonl"


def with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def make_plural(name: str) -> str:
    return f"{name}es" if name[-1] in "s" else f"{name}s"


def single_object(shape: str) -> dict:
    return {"tag": "single_object", "include": [{"class": shape, "count": 1}],
            "prompt": f"a photo of {with_article(shape)}"}


def two_object(a: str, b: str) -> dict:
    return {"tag": "two_object", "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
            "prompt": f"a photo of {with_article(a)} and {with_article(b)}"}


def counting(shape: str, number: int) -> dict:
    return {"tag": "counting", "include": [{"class": shape, "count": number}],
            "exclude": [{"class": shape, "count": number + 1}],
            "prompt": f"a photo of {NUMBERS[number]} {make_plural(shape)}"}


def colors(color: str, shape: str) -> dict:
    return {"tag": "colors", "include": [{"class": shape, "count": 1, "color": color}],
            "prompt": f"a photo of {with_article(color)} {shape}"}


def position(a: str, relation: str, b: str) -> dict:
    return {"tag": "position",
            "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [relation, 0]}],
            "prompt": f"a photo of {with_article(a)} {relation} {with_article(b)}"}


def color_attr(color_a: str, a: str, color_b: str, b: str) -> dict:
    return {"tag": "color_attr", "include": [{"class": a, "count": 1, "color": color_a},
                                             {"class": b, "count": 1, "color": color_b}],
            "prompt": f"a photo of {with_article(color_a)} {a} and {with_article(color_b)} {b}"}


def all_metadata() -> list[dict]:
    """Every prompt of the six tasks over the scenes' vocabulary, in GenEval's task order."""
    pairs = list(itertools.permutations(SHAPES, 2))
    rows = [single_object(s) for s in SHAPES]
    rows += [two_object(a, b) for a, b in pairs]
    rows += [counting(s, n) for s in SHAPES for n in range(2, MAX_COUNT + 1)]
    rows += [colors(c, s) for s in SHAPES for c in PALETTE]
    rows += [position(a, rel, b) for a, b in pairs for rel in POSITIONS]
    rows += [color_attr(ca, a, cb, b) for a, b in pairs for ca, cb in itertools.permutations(PALETTE, 2)]
    return rows


def is_heldout(row: dict) -> bool:
    """Whether a row names a held-out composition (see the module docstring)."""
    include = row["include"]
    if any((req.get("color"), req["class"]) in HELDOUT_PAIRS for req in include):
        return True
    if row["tag"] == "counting" and (include[0]["class"], include[0]["count"]) in HELDOUT_COUNTS:
        return True
    if row["tag"] == "position" and (include[1]["class"], include[1]["position"][0]) in HELDOUT_RELATIONS:
        return True
    return row["tag"] == "two_object" and (include[0]["class"], include[1]["class"]) in HELDOUT_PAIRS_OF_SHAPES


def split_metadata() -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); single_object rows are in both (see the module docstring)."""
    rows = all_metadata()
    train = [r for r in rows if not is_heldout(r)]
    heldout = [r for r in rows if is_heldout(r) or r["tag"] == "single_object"]
    return train, heldout


def metadata_lines(rows: list[dict]) -> str:
    """GenEval's ``evaluation_metadata.jsonl`` format: one ``json.dumps`` of a row a line."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def write_metadata(train_path: Path = TRAIN_METADATA, heldout_path: Path = HELDOUT_METADATA) -> None:
    from jagg_lightning.faults.io import atomic_write

    for path, rows in zip((train_path, heldout_path), split_metadata()):
        atomic_write(path, lambda tmp, rows=rows: Path(tmp).write_text(metadata_lines(rows), encoding="utf-8"))


if __name__ == "__main__":
    write_metadata()
