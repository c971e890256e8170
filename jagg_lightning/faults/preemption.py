"""Preemption: the signals a scheduler sends before it kills a job, turned into a stop at the next safe point.

A handler only records which signal came (signals are process-wide, so the record is too: :func:`active`). The
training step asks at its safe points (:func:`check`): after each rollout micro-batch is sampled and scored, before
the update, and between steps. Every process takes part in the same question (one all-reduce of the signal number
over the world), so all of them stop at the same point even when the signal reached them at different moments.

A stop at a safe point is consistent by construction:

- inside a step, before its first optimizer step: the step is abandoned. Nothing it did reached the weights, the
  optimizer or the EMA; the checkpoint records the random streams as the step found them and the data position
  before its batch, so a resumed run trains the same step again, bit for bit;
- between steps: the checkpoint is the one a step-based ``ModelCheckpoint`` would write there.

:class:`Preempted` is a ``SystemExit`` whose code is 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1, 130
for SIGINT: what a shell reports for a process the signal killed), so a scheduler or a wrapper script tells it from
success, and no traceback is printed. Plain Python and torch: the Lightning side is ``callbacks/preemption.py``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

EXIT_BASE = 128  # exit status = 128 + signal number, the shell's convention for "ended by a signal"

_ACTIVE: StopSignals | None = None


class Preempted(SystemExit):
    """Raised at a safe point after a stop signal: ``signum``, the step it stopped at and where in it."""

    def __init__(self, signum: int, step: int, where: str):
        super().__init__(EXIT_BASE + signum)
        self.signum, self.step, self.where = signum, step, where



def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def signal_number(name: str | int) -> int:
    """``"SIGTERM"`` / ``"TERM"`` / 15 -> 15; anything else is one error naming the field."""
    if isinstance(name, int) and not isinstance(name, bool):
        try:
            return int(signal.Signals(name))
        except ValueError:
            pass
    elif isinstance(name, str):
        key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        if hasattr(signal, key) and isinstance(getattr(signal, key), signal.Signals):
            return int(getattr(signal, key))
    raise ValueError(f"signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)")


class StopSignals:
    """The handlers of ``signals``: each records the first signal received (``received``) and calls ``on_first``
    once; a later SIGINT (Ctrl-C pressed again) goes to the handler found at :meth:`install` and raises
    ``KeyboardInterrupt`` (stop now). :meth:`restore` puts back the handlers found at install (where ours are still
    in place)."""

    def __init__(self, signals: list[int], on_first: Callable[[int], None] | None = None):
        self.signals = list(signals)
        self.on_first = on_first
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            if self.on_first is not None:
                self.on_first(signum)
        elif signum == signal.SIGINT:  # Ctrl-C again: stop now, as the handler found at install would
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt

    def install(self) -> StopSignals:
        global _ACTIVE
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        _ACTIVE = self
        return self

    def restore(self) -> None:
        global _ACTIVE
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # not replaced since (Lightning restores its own at teardown)
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if _ACTIVE is self:
            _ACTIVE = None


def active() -> StopSignals | None:
    """The installed stop handlers (None: no preemption handling in this process)."""
    return _ACTIVE


def check(max_over_world: Callable[[int], int], step: int, where: str) -> None:
    """A safe point: raise :class:`Preempted` when any process has received a stop signal. ``max_over_world`` is the
    largest value over every process (one collective; the identity on one process). Without installed handlers
    nothing is asked (every process runs the same callbacks, so all of them skip the collective alike)."""
    stop = _ACTIVE
    if stop is None:
        return
    signum = max_over_world(stop.received or 0)
    if signum:
        raise Preempted(signum, step, where)


def announce(signum: int) -> None:
    again = "; Ctrl-C again stops at once, without one" if signum == signal.SIGINT else ""
    print(f"jagg: {signal_name(signum)} received: stopping at the next safe point (a checkpoint, then exit "
          f"status {EXIT_BASE + signum}){again}", file=sys.stderr, flush=True)
