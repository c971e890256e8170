"""The argument parser of the commands that are not LightningCLI's (``jagg plan``, ``jagg serve-reward``): options are
never abbreviated (``--device`` is neither ``--devices`` nor ``--device-memory``), and an unknown option is one
``<prog>: error:`` line naming the closest one, as ``jagg fit`` says it ("did you mean"), exit status 2."""

from __future__ import annotations

import argparse
import difflib
import re
import sys


class StrictParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        self.options: list[str] = []  # every --option added (--help too: argparse adds it first)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        self.options += [a for a in args if isinstance(a, str) and a.startswith("--")]
        return super().add_argument(*args, **kwargs)

    def closest(self, option: str) -> str | None:
        """The option ``option`` was meant to be: the closest by spelling, else the first it abbreviates."""
        close = difflib.get_close_matches(option, self.options, n=1, cutoff=0.6)
        longer = [o for o in self.options if o.startswith(option)]
        return close[0] if close else longer[0] if longer else None

    def unknown(self, option: str) -> str:
        """One line for an option this parser does not take."""
        close = self.closest(option)
        return f"{option} is not an option" + (f"; did you mean {close}?" if close else f" ({self.prog} --help)")

    def error(self, message: str):
        found = re.search(r"unrecognized arguments: (--[^\s=]+)", message)
        line = self.unknown(found.group(1)) if found else " ".join(message.split())
        print(f"{self.prog}: error: {line}", file=sys.stderr)
        raise SystemExit(2)
