"""A rank that dies or hangs: the bound on how long its peers wait, and the one line they exit with.

Every collective of a multi-process run waits for all its processes. A peer killed with SIGKILL (the OOM killer, a lost
node) closes its sockets: gloo's next receive on it fails at once ("Connection reset/closed by peer"), NCCL's
communicator reports an error. A peer that is alive but stuck (a hung filesystem, a deadlock, a GPU that stopped
answering) sends nothing: only the process group's timeout ends its peers' wait. :class:`CollectiveTimeout` (mixed
into both strategies) sets that timeout from ``trainer.strategy.collective_timeout_s`` on every process group of the
run -- the world group and every subgroup made after it (the context-parallel mesh, diffusers' flattened ring x
ulysses group): torch gives a subgroup its own 30-minute default, not the world group's.

Two bounds (docs/distributed.md, "A rank that dies"):

- from the process-group start until the model is loaded, sharded and wrapped: ``max(collective_timeout_s,
  STARTUP_TIMEOUT_S)``. Every rank loads the pipeline from (often shared) storage before its first collective, and a
  slow reader may arrive minutes after the others; killing the job for it would be a false alarm;
- from then on (training, validation, checkpoints): ``collective_timeout_s``, default :data:`DEFAULT_TIMEOUT_S` = 600
  s. In a step every rank does the same work, so a rank waits only for the spread of arrival times, not for a whole
  rollout; the longest legitimate spreads are a remote reward's retries (``RemoteReward``'s defaults: 4 attempts of 60
  s and their back-off, about 5 min) and a rank-0 write (a LoRA checkpoint: seconds). 10 min covers them twice over,
  and is NCCL's own default; 30 min (gloo's default, Lightning's) leaves a whole allocation idle that long per hang.

A failed collective raises a RuntimeError (gloo) or a ``torch.distributed.DistError``; :func:`report` turns it into one
line: this rank, the collective and where the run was in it, the step, and the checkpoint to resume from.
"""

from __future__ import annotations

import os
import re
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 1800.0

# what gloo says when a peer's socket closed or a receive timed out (its messages carry a "gloo/..." source path)
_GLOO_PEER_LOST = re.compile(r"gloo.*(Connection (reset|closed) by peer|Timed out waiting|Broken pipe|"
                             r"Connection refused|Socket closed|Read error|Write error)", re.S)


def check_timeout(seconds) -> float:
    """``trainer.strategy.collective_timeout_s`` as a float > 0, else a ValueError naming the field."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError("trainer.strategy.collective_timeout_s must be a number of seconds > 0 (how long a collective "
                         f"waits for a stuck peer; default {DEFAULT_TIMEOUT_S:g}), got {seconds!r}")
    return float(seconds)


def bound_every_group(seconds: float) -> int:
    """``dist.set_timeout`` on every process group this process belongs to; returns how many."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    groups = list(dist.distributed_c10d._pg_map)  # torch's own dist.breakpoint walks the groups alike
    for group in groups:
        dist.set_timeout(timedelta(seconds=seconds), group)
    return len(groups)


class CollectiveTimeout:
    """``collective_timeout_s`` of a strategy (see the module docstring), and the report of a lost peer."""

    def _init_timeout(self, seconds, kwargs: dict) -> timedelta:
        """The timeout to give the parent strategy for the process-group start (the startup bound)."""
        if "timeout" in kwargs:  # Lightning's own (a timedelta): one way to say it
            raise ValueError("trainer.strategy.timeout: give trainer.strategy.collective_timeout_s (seconds) instead")
        self.collective_timeout_s = check_timeout(seconds)
        return timedelta(seconds=max(self.collective_timeout_s, STARTUP_TIMEOUT_S))

    def setup(self, trainer) -> None:
        super().setup(trainer)  # the model is built, sharded and wrapped: the steady-state bound from here on
        bound_every_group(self.collective_timeout_s)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if is_peer_failure(exception):
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            exception.jagg_report = report(exception, self.global_rank, self.world_size, trainer)


def peer_failure(exception: BaseException | None) -> BaseException | None:
    """The collective failure in ``exception``'s chain (itself, its cause or context), or None."""
    seen = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        if isinstance(exception, getattr(dist, "DistError", ())) or (
                isinstance(exception, RuntimeError) and _GLOO_PEER_LOST.search(str(exception))):
            return exception
        exception = exception.__cause__ or exception.__context__
    return None


def is_peer_failure(exception: BaseException) -> bool:
    return peer_failure(exception) is not None


def _where(exception: BaseException) -> str:
    """The collective (the innermost torch.distributed function) and the innermost frame of ours or Lightning's."""
    frames = traceback.extract_tb(exception.__traceback__)
    collective = next((f.name for f in reversed(frames) if f"{os.sep}distributed{os.sep}" in f.filename
                       and f.name not in ("wrapper", "wait", "__call__")), None)
    ours = next((f for f in reversed(frames) if f"{os.sep}jagg_lightning{os.sep}" in f.filename), None)
    ours = ours or next((f for f in reversed(frames) if f"{os.sep}lightning{os.sep}" in f.filename), None)
    place = f" in {ours.name} ({Path(ours.filename).name}:{ours.lineno})" if ours else ""
    return f"collective {collective or '(unknown)'}{place}"


def last_checkpoint(trainer) -> str | None:
    """The newest checkpoint file the trainer's checkpoint callbacks know of (ModelCheckpoint's last and best, its
    top k, OnExceptionCheckpoint's file), or None."""
    if trainer is None:
        return None
    candidates = set()
    for callback in trainer.checkpoint_callbacks:
        for name in ("last_model_path", "best_model_path", "ckpt_path"):
            path = getattr(callback, name, None)
            if isinstance(path, (str, os.PathLike)) and path:
                candidates.add(str(path))
        candidates |= {str(p) for p in (getattr(callback, "best_k_models", None) or {})}
    existing = [p for p in candidates if Path(p).exists()]
    return max(existing, key=lambda p: Path(p).stat().st_mtime) if existing else None


def report(exception: BaseException, rank: int, world: int, trainer=None) -> str:
    """One line for a survivor: who, which collective, why, and what to do."""
    failure = peer_failure(exception) or exception
    text = re.sub(r"\s+", " ", str(failure)).strip()
    why = ("a peer stopped answering within trainer.strategy.collective_timeout_s" if "Timed out" in text
           else "a peer process is gone (killed, crashed or its node lost)")
    # the backend's own words, without gloo's source path and its generic advice
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0][:160]
    step = f" at step {trainer.global_step}" if trainer is not None else ""
    checkpoint = last_checkpoint(trainer)
    if trainer is None:  # the failure came out of a hook after the strategy's (an on_exception save): no trainer
        todo = "restart every rank from the newest checkpoint (--ckpt_path last, or its file)"
    elif checkpoint:
        todo = f"restart every rank with --ckpt_path {checkpoint} (the last checkpoint)"
    else:
        todo = "no checkpoint was written yet: a restart starts over (add a ModelCheckpoint with every_n_train_steps)"
    return f"rank {rank} of {world}: {_where(failure)} failed{step}: {why} ({detail}); the job cannot continue: {todo}"


def exit_line(exception: BaseException) -> str | None:
    """The line a survivor exits with (the strategy's report, or one from the exception alone), None when
    ``exception`` is no collective failure."""
    failure = peer_failure(exception)
    if failure is None:
        return None
    found = exception
    while found is not None and not hasattr(found, "jagg_report"):
        found = found.__cause__ or found.__context__
    if found is not None:
        return found.jagg_report
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return report(failure, rank, world)
