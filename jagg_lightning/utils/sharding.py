"""FSDP2 (DTensor) helpers for the few places that must see whole LoRA weights. Plain torch.

Under FSDP2 every LoRA weight is a ``DTensor`` holding this rank's shard. Gathering one
(:func:`full_tensor`) is a collective: every rank calls it, in the same order. Without sharding both
functions return their input, so callers need not know which strategy runs.
"""

from __future__ import annotations

from torch import Tensor


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
