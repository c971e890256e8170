"""Where a training step's time goes: wall seconds per phase (``time/<phase>``, ``callbacks.StepTimes`` logs them).

The phases are exclusive: a phase entered inside another pauses it (decoding inside the rollout counts as decode,
not rollout; the gradient all-reduce inside the optimizer step as collectives), so the phases of a step add up to the
time spent in any of them. The training code marks them with ``with CLOCK.phase(name):``:

| phase | what |
|---|---|
| ``rollout`` | the rollout's denoiser forwards (and whatever of the training step no other phase claims) |
| ``decode`` | latents -> images for the reward |
| ``reward`` | the reward model |
| ``update/forward`` | the update's forwards (no-grad interiors, anchors with grad; the fused mode's kept graphs' update) |
| ``update/backward`` | the update's backward passes |
| ``optimizer`` | clipping, the optimizer, EMA and scheduler steps |
| ``collectives`` | the all-reduces across processes |
| ``evaluation`` | held-out evaluations, sample grids, validation loops during fit |
| ``checkpoint`` | checkpoint writes and adapter exports (their model cards) |

Only the thread that started the clock records (a reward pool's threads decode and score beside the rollout: their
time overlaps it, and the main thread's wait for them stays where it waits). On a GPU the clock synchronizes the
device at each phase boundary (``synchronize``), so kernels are charged to the phase that launched them.
Plain Python; no Lightning.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = ("rollout", "decode", "reward", "update/forward", "update/backward", "optimizer", "collectives", "evaluation",
          "checkpoint")


class PhaseClock:
    """Exclusive wall seconds per phase since the last :meth:`take`, on the thread that called :meth:`start`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0
        self._owner: int | None = None
        self.synchronize: Callable[[], object] | None = None

    def start(self, synchronize: Callable[[], object] | None = None) -> None:
        """Record from now on, on this thread (``synchronize``: the device's, called at each phase boundary)."""
        self._owner, self.synchronize = threading.get_ident(), synchronize
        self.seconds.clear()
        self._stack.clear()

    def stop(self) -> None:
        self._owner, self.synchronize = None, None

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def enter(self, name: str) -> bool:
        """Start phase ``name`` (pausing the one it is inside); False (nothing recorded) off the clock's thread."""
        if threading.get_ident() != self._owner:
            return False
        now = self._now()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
        self._stack.append(name)
        self._since = now
        return True

    def exit(self) -> None:
        """End the innermost phase (the one it paused resumes)."""
        if self._stack and threading.get_ident() == self._owner:
            now = self._now()
            self.seconds[self._stack.pop()] += now - self._since
            self._since = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        entered = self.enter(name)
        try:
            yield
        finally:
            if entered:
                self.exit()

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last call (every phase of :data:`PHASES`, 0 when none), then zeroed."""
        taken = {name: self.seconds.get(name, 0.0) for name in PHASES} | dict(self.seconds)
        self.seconds.clear()
        return taken


CLOCK = PhaseClock()
"""The process's clock (one training loop per process)."""


def timed(name: str, fn: Callable | None = None) -> Callable:
    """``fn`` with each call inside ``CLOCK.phase(name)`` (without ``fn``: a decorator)."""
    if fn is None:
        return lambda f: functools.wraps(f)(timed(name, f))

    def call(*args, **kwargs):
        with CLOCK.phase(name):
            return fn(*args, **kwargs)

    return call
