"""``jagg``: the console entry point (setup.cfg: ``jagg = jagg_lightning.cli:main``). It answers ``jagg``,
``jagg --help`` and ``jagg --version`` from text alone (no torch, Lightning, diffusers or transformers is imported)
and hands each subcommand to the module that runs it, imported only then:

- ``fit`` / ``validate`` / ``test`` / ``predict`` (and LightningCLI's own top-level options, ``-c`` /
  ``--print_config``): :func:`jagg_lightning.cli.lightning_cli.lightning_main`;
- ``serve-reward``: :func:`jagg_lightning.rewards.server.serve_main` (its ``--help`` imports no torch);
- ``plan``: :func:`jagg_lightning.cli.plan.plan_main` over the fit config as
  :func:`jagg_lightning.cli.lightning_cli.parse_config` reads it.

``JAGGCLI``, ``cli_main`` and ``parse_config`` are :mod:`jagg_lightning.cli.lightning_cli`'s, still importable from here.

Ctrl-C (SIGINT) ends any of them with one ``jagg ...`` line, no traceback, and exit status 130 (128 + SIGINT, as
SIGTERM's stop is 143). During ``fit`` the first Ctrl-C stops at the next safe point with a checkpoint, as a
scheduler's SIGTERM does (:class:`~jagg_lightning.callbacks.Preemption`); a second one stops at once, through
Lightning's own graceful shutdown (``on_exception`` callbacks, e.g. ``OnExceptionCheckpoint``).

The folder is the command line, a new subcommand's module goes here: LightningCLI over ``JAGGModule`` and
``PromptDataModule`` (``lightning_cli.py``), ``jagg plan`` (``plan.py``), one run per output folder
(``outputs.py``), one ``jagg: error:`` line per bad value (``errors.py``) and the warnings known harmless
(``quiet.py``). It may import anything in the package; nothing in the package imports it but ``__main__``.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap

from jagg_lightning import DESCRIPTION, __version__

# subcommand -> what it does (the top-level help's list; LightningCLI's four first)
SUBCOMMANDS = {
    "fit": "train: GRPO with JAGG on the config's prompts and reward (a LoRA, or all weights)",
    "validate": "held-out prompts, ODE sampling: reward and metrics of a checkpoint or adapter",
    "test": "as validate, logged as test metrics",
    "predict": "images for prompts with the trained adapter",
    "serve-reward": "a reward behind HTTP, for RemoteReward (pip install 'jagg_lightning[serve]')",
    "plan": "the memory per device of a config's training step, before launch (nothing allocated)",
}
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
EXIT_SIGINT = 128 + int(signal.SIGINT)
CHOICES = "{" + ",".join(SUBCOMMANDS) + "}"
USAGE = f"usage: jagg [-h] [--version] [-c CONFIG] {CHOICES} ..."


def help_text() -> str:
    width = max(map(len, SUBCOMMANDS)) + 2
    listed = "\n".join(f"  {name:<{width}}{text}" for name, text in SUBCOMMANDS.items())
    return (f"{USAGE}\n\n{textwrap.fill(DESCRIPTION, 79)}\n\n"
            f"subcommands (jagg <subcommand> --help for each one's options):\n{listed}\n\n"
            "options:\n  -h, --help            show this help message and exit\n"
            "  --version             print the version and exit\n"
            "  -c CONFIG, --config CONFIG\n"
            "                        a YAML file whose top-level keys are subcommands (most runs\n"
            "                        give it after one: jagg fit --config configs/tiny.yaml)\n"
            "  --print_config        print the configuration after all other arguments and exit\n"
            "\nCtrl-C stops any subcommand with one line, exit status 130 (fit: with a checkpoint, see\n"
            "docs/callbacks.md); SIGTERM / SIGUSR1 stop fit the same way (143 / 138).\n")


def set_cpu_threads() -> int:
    """PyTorch's CPU threads: ``JAGG_NUM_THREADS``, else ``OMP_NUM_THREADS``, else 1 -- measured on the main job
    (README, docs/configuration.md "Threads"): a second thread gains little on the small shipped models and
    oversubscribed cores (another job running) cost up to 18x."""
    value = os.environ.get("JAGG_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "1"
    if not value.isdigit() or int(value) < 1:
        print(f"jagg: error: JAGG_NUM_THREADS / OMP_NUM_THREADS must be an integer >= 1, got {value!r}", file=sys.stderr)
        raise SystemExit(2)
    import torch

    torch.set_num_threads(int(value))
    return int(value)


def prepare() -> None:
    """What every command that runs (not a help text) sets first: the quiet defaults and the CPU threads."""
    from jagg_lightning.cli.quiet import quiet_defaults

    quiet_defaults()
    set_cpu_threads()


class _Interrupts:
    """SIGINT raises ``KeyboardInterrupt`` as Python's own handler does, and is remembered: Lightning's graceful
    shutdown swallows the interrupt and exits with status 1, which :func:`main` then reports as the interrupt."""

    received = False

    @classmethod
    def handle(cls, signum, frame) -> None:
        cls.received = True
        raise KeyboardInterrupt

    @classmethod
    def install(cls) -> None:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
            signal.signal(signal.SIGINT, cls.handle)


def _dispatch(args: list[str]) -> int | None:
    """Run the command ``args`` names; its exit status (None: 0)."""
    if not args:
        print(f"jagg: error: give a subcommand, one of {CHOICES} (jagg --help says what each does)", file=sys.stderr)
        return 2
    first = args[0]
    if first in ("-h", "--help"):
        print(help_text(), end="")
        return 0
    if first == "--version":
        print(f"jagg {__version__}")
        return 0
    if first == "serve-reward":  # its own argument parser: it builds a reward, not a Trainer
        from jagg_lightning.rewards.server import serve_main

        return serve_main(args[1:], prepare=prepare)
    if first == "plan":  # its own arguments, then the fit config parsed (nothing built)
        from jagg_lightning.cli.plan import plan_main

        if "-h" in args[1:] or "--help" in args[1:]:
            return plan_main(args[1:], None)  # argparse prints its help and exits before any config is parsed
        prepare()

        def parse_config(argv):  # imported once plan_main has said what it reads (Lightning takes seconds to load)
            from jagg_lightning.cli.lightning_cli import parse_config

            return parse_config(argv)

        return plan_main(args[1:], parse_config)
    if first in LIGHTNING_SUBCOMMANDS or first.startswith("-"):  # LightningCLI's subcommands and top-level options
        prepare()
        from jagg_lightning.cli.lightning_cli import lightning_main

        return lightning_main(args)
    print(f"jagg: error: unknown subcommand {first!r}: one of {CHOICES} (jagg --help says what each does)",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``jagg``); exits with the command's status."""
    args = sys.argv[1:] if argv is None else list(argv)
    _Interrupts.install()
    try:
        status = _dispatch(args)
    except KeyboardInterrupt:
        status = _interrupted(args)
    except SystemExit as stop:
        # Lightning's graceful shutdown on Ctrl-C ends with sys.exit(1) after its on_exception callbacks
        if not (_Interrupts.received and stop.code == 1):
            raise
        status = _interrupted(args)
    raise SystemExit(status or 0)


def _interrupted(args: list[str]) -> int:
    name = f"jagg {args[0]}" if args and not args[0].startswith("-") else "jagg"
    print(f"{name}: stopped by SIGINT (Ctrl-C), exit status {EXIT_SIGINT}", file=sys.stderr, flush=True)
    return EXIT_SIGINT


# the Lightning side's names, for ``from jagg_lightning.cli import cli_main`` (imported on first use: PEP 562)
_LIGHTNING_NAMES = ("JAGGCLI", "ParseOnlyCLI", "cli_main", "fail", "lightning_main", "parse_config")


def __getattr__(name: str):
    if name not in _LIGHTNING_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from jagg_lightning.cli import lightning_cli as cli_lightning

    return getattr(cli_lightning, name)


if __name__ == "__main__":
    main()
