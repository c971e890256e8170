"""FSDP2 (DTensor) helpers for the few places that must see whole LoRA weights. Plain torch.

Under FSDP2 every LoRA weight is a ``DTensor`` holding this rank's shard. Gathering one
(:func:`full_tensor`) is a collective: every rank calls it, in the same order. Without sharding both
functions return their input, so callers need not know which strategy runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor on every rank (a collective for a DTensor; ``t`` itself otherwise)."""
    return t.full_tensor() if _is_dtensor(t) else t


def shard_like(full: Tensor, reference: Tensor) -> Tensor:
    """``full`` laid out like ``reference`` (its mesh and placements when it is a DTensor; every rank
    passes the same ``full``), ready for ``reference.copy_``."""
    if not _is_dtensor(reference):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(reference.device, reference.dtype), reference.device_mesh, reference.placements)


def reshard(networks: Iterable[nn.Module]) -> None:
    """Every FSDP2 unit of ``networks`` drops its gathered parameters (a no-op for unsharded networks and for units
    already sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for network in networks:
        for module in network.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextmanager
def values_swapped(params: Sequence[Tensor], values: Sequence[Tensor], networks: Iterable[nn.Module] = ()):
    """Inside the block ``params`` hold ``values`` (theta_old, the EMA weights), restored after. Under FSDP2 the
    copy writes the shards, while a root unit keeps its parameters gathered after a forward (for the backward that
    usually follows): the units of ``networks`` are resharded on entry and on exit, so no forward inside or after the
    block reads the gathered weights of the other side."""
    networks = list(networks)
    with torch.no_grad():
        backup = [p.detach().clone() for p in params]
        reshard(networks)
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            reshard(networks)
            for p, b in zip(params, backup):
                p.copy_(b)
