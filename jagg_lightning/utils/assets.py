"""Where a local file or folder named in a config is: shipped names, the working directory, the package's.

A path in a config (``policy.pretrained``, ``policy.adapter``, ``data.prompts_file``, ...) is looked up, in order:

1. a shipped name: ``digits`` (the digits test bed pipeline), ``digits_train`` / ``digits_heldout`` (its prompts),
   ``scenes`` (the scenes test bed pipeline), ``scenes_train`` / ``scenes_heldout`` (its GenEval metadata);
2. the path itself (absolute, or relative to the working directory);
3. relative to the directory that holds the ``jagg_lightning`` package (a repository checkout's root), so the
   shipped configs' ``jagg_lightning/testbed/digits_sd3`` and ``configs/prompts/digits.txt`` work from any
   directory.

A value that looks like a local path (absolute, ``./``, ``~``, or more than one ``/``) and is found nowhere is an
error naming the field and the path -- never a model-hub download attempt. Plain torch, no Lightning.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # jagg_lightning/ (this file is in utils/)
TESTBED_DIR = PACKAGE_DIR / "testbed"
SHIPPED = {
    "digits": TESTBED_DIR / "digits_sd3",
    "digits_train": TESTBED_DIR / "prompts" / "digits_train.txt",
    "digits_heldout": TESTBED_DIR / "prompts" / "digits_heldout.txt",
    "scenes": TESTBED_DIR / "scenes_sd3",
    "scenes_train": TESTBED_DIR / "scenes" / "train_metadata.jsonl",      # GenEval metadata JSONL (scenes test bed)
    "scenes_heldout": TESTBED_DIR / "scenes" / "heldout_metadata.jsonl",
}


def looks_local(value: str) -> bool:
    """A local path rather than a hub id (``org/name``: one ``/``, no leading ``.``, ``/`` or ``~``)."""
    text = str(value)
    return text.startswith((".", "/", "~", "\\")) or text.count("/") != 1 or Path(text).is_absolute()


def find_local(value: str | Path) -> Path | None:
    """The existing local path ``value`` names (see the module docstring), or None."""
    text = str(value)
    if text in SHIPPED:
        return SHIPPED[text]
    path = Path(text).expanduser()
    if path.exists():
        return path
    if not path.is_absolute() and (PACKAGE_DIR.parent / path).exists():
        return PACKAGE_DIR.parent / path
    return None


def resolve_path(value: str | Path | None, field: str, kind: str = "folder", hub: bool = False) -> str | None:
    """``value`` as an existing local path (str), or ``value`` unchanged when ``hub`` and it looks like a hub id.

    Raises FileNotFoundError("<field>: no such <kind> '<value>' ...") otherwise; ``kind``: "folder" or "file"."""
    if value is None:
        return None
    found = find_local(value)
    if found is not None:
        if kind == "file" and not found.is_file():
            raise FileNotFoundError(f"{field}: {str(value)!r} is a folder, not a file")
        if kind == "folder" and not found.is_dir():
            raise FileNotFoundError(f"{field}: {str(value)!r} is a file, not a folder")
        return str(found)
    if hub and str(value).count("/") == 1 and not looks_local(value):
        return str(value)
    names = ", ".join(k for k, v in SHIPPED.items()
                      if kind not in ("folder", "file") or (v.suffix == "") == (kind == "folder"))
    where = "" if Path(str(value)).expanduser().is_absolute() else (
        f" in the working directory {str(Path.cwd())!r} or in {str(PACKAGE_DIR.parent)!r}")
    raise FileNotFoundError(f"{field}: no such {kind} {str(value)!r}{where} (shipped: {names})")
