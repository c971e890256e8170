"""What crosses processes in a training step: sums and means over the data-parallel processes, the largest
count, the local backward and the ONE gradient all-reduce per optimizer update.

:class:`Collectives` wraps the Trainer the module is attached to (``None`` outside a Trainer: one process,
every collective the identity). The strategy's model is looked up at call time: DDP wraps the module only
after the setup hooks have run.

Under context parallelism (the strategy's ``context_parallel``: :mod:`jagg_lightning.distributed.context_parallel`) the C
context ranks of a data rank hold the same samples: sums and means over samples go over the data group (one process
per data rank), and the gradient all-reduce over every process divides by the D data ranks, not by W = D * C (each
context rank's gradient is partial: their sum is the data rank's).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from jagg_lightning.utils.dtypes import compute_dtype
from jagg_lightning.utils.timing import timed


_CLEANUP_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Once a process group exists, register (once) an ``atexit`` handler that destroys it while the interpreter is
    still alive. Lightning leaves it to interpreter finalization, where gloo's worker threads may still hold tensors
    and the process aborts (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489): a
    finished run must not end in a crash."""
    global _CLEANUP_REGISTERED
    if _CLEANUP_REGISTERED or not (dist.is_available() and dist.is_initialized()):
        return
    import atexit

    atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
    _CLEANUP_REGISTERED = True


def end_process_group() -> None:
    """End a distributed run that finished on every rank: wait for the others (a barrier), then destroy the process
    group. Without the barrier the first rank out tears its connections down while a peer is still leaving its last
    collective, and that peer's gloo threads can abort the process at exit (SIGABRT, "terminate called without an
    active exception"; seen under FSDP2 even with :func:`destroy_process_group_at_exit`). ``jagg`` calls it after a
    successful command; a script that drives the Trainer under ``torchrun`` calls it last. Only on success: after a
    failure the barrier would wait for a rank that is gone (the atexit handler covers that path)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class Collectives:
    def __init__(self, trainer=None):
        self.trainer = trainer
        self.gradient_all_reduces = 0  # made through this object: one per optimizer update under DDP

    @property
    def world_size(self) -> int:
        return 1 if self.trainer is None else self.trainer.world_size

    @property
    def context(self):
        """The strategy's ``ContextParallel`` (None without context parallelism)."""
        return getattr(self.trainer.strategy, "context_parallel", None) if self.trainer is not None else None

    @property
    def data_size(self) -> int:
        """The data-parallel processes: the world, or its data ranks under context parallelism."""
        context = self.context
        return self.world_size if context is None else context.data_size

    def ddp_model(self) -> DistributedDataParallel | None:
        model = self.trainer.strategy.model if self.trainer is not None else None
        return model if isinstance(model, DistributedDataParallel) else None

    def local_backward(self):
        """Context for an update's backward calls: DDP's reducer (which would all-reduce on every backward;
        JAGG makes several per update) stays off, and :meth:`all_reduce_gradients` makes the one all-reduce.
        (Lightning's DDP forward redirection already keeps the forward from arming the reducer.)"""
        return self.trainer.strategy.block_backward_sync() if self.ddp_model() is not None else nullcontext()

    @timed("collectives")
    def sum(self, tensor: Tensor) -> Tensor:
        """Sum over the data-parallel processes, in place (one collective; identity on one process)."""
        if self.data_size == 1 or not dist.is_initialized():
            return tensor
        context = self.context
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=None if context is None else context.data_group)
        return tensor

    @timed("collectives")
    def mean(self, tensor: Tensor) -> Tensor:
        """Mean over the data-parallel processes (the strategy's reduce; identity outside a Trainer)."""
        if self.trainer is None:
            return tensor
        if self.context is not None:
            return self.sum(tensor.clone()).div_(self.data_size)
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    @timed("collectives")
    def max_over_world(self, value: int) -> int:
        """The largest ``value`` over every process (one all-reduce of one number; identity on one process): a
        decision all processes must make alike, such as stopping at a safe point."""
        if self.world_size == 1 or not dist.is_initialized():
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.trainer.strategy.root_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def max_count_if_sharded(self, count: Tensor) -> Tensor:
        """The largest ``count`` over the processes under a sharded strategy (FSDP2 gathers its weights inside
        every pass, so every process must make as many passes); ``count`` itself otherwise (DDP's backward
        stays local: one gradient all-reduce per update, zeros for a rank without passes)."""
        if self.trainer is not None and self.trainer.world_size > 1 and self.ddp_model() is None:
            count = count.clone()  # an all-reduce of one number (the strategy's all_gather: a deprecated torch API)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            return count
        return count

    @timed("collectives")
    def gather_rows(self, row: Tensor) -> Tensor:
        """Every process's ``row`` [R], stacked by global rank [W, R], on every process: ONE all-reduce (a sum) of a
        zero table with this process's row filled in (over every process, context ranks included)."""
        if self.world_size == 1 or not dist.is_initialized():
            return row[None]
        table = row.new_zeros(dist.get_world_size(), row.numel())
        table[dist.get_rank()] = row
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        return table

    @timed("collectives")
    def all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Under DDP: average the gradients of ``params`` over the processes with ONE all-reduce of their flat
        concatenation (a parameter without a gradient contributes zeros, so every rank sends the same size); under
        context parallelism the same all-reduce over every process, divided by the data ranks."""
        if self.ddp_model() is None:
            return
        dtype = compute_dtype(*params)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self.data_size)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).to(p.dtype)
        self.gradient_all_reduces += 1
