"""Faults a CLI run under test is given as a callback (``trainer.callbacks``): one rank of a multi-process job is
killed (SIGKILL, as the kernel's OOM killer or a lost node would) or hangs, in the middle of a training step -- after
its first backward of step ``step``, so that its peers are inside the step's collectives or about to enter them.

``marker``: a file made just before the fault; a run that finds it injects nothing (under ``torchrun
--max-restarts`` the restarted job runs clean)."""

import os
import signal
import time
from pathlib import Path

import lightning as L


class RankFault(L.Callback):
    def __init__(self, rank: int = 1, step: int = 1, kind: str = "kill", marker: str | None = None,
                 hang_s: float = 600.0):
        if kind not in ("kill", "hang"):
            raise ValueError(f"RankFault.kind must be kill or hang, got {kind!r}")
        self.rank, self.step, self.kind, self.hang_s = rank, step, kind, hang_s
        self.marker = Path(marker) if marker else None

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.marker is not None:
            if self.marker.exists():
                return
            self.marker.write_text(f"{self.kind} at step {self.step}\n")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.hang_s)  # alive but stuck: only the collective timeout bounds its peers' wait
