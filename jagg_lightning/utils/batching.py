"""Slicing and concatenating batch-first conditions: a tensor, a tuple/list or a dict of tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def batch_slice(cond: Any, index: Tensor | slice) -> Any:
    """Index a batch-first condition (tensor, tuple/list or dict of tensors, or None)."""
    if cond is None:
        return None
    if isinstance(cond, Tensor):
        return cond[index]
    if isinstance(cond, dict):
        return {k: batch_slice(v, index) for k, v in cond.items()}
    return type(cond)(batch_slice(c, index) for c in cond)


def batch_concat(parts: Sequence[Any]) -> Any:
    """Inverse of :func:`batch_slice` over a list of pieces."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        return torch.cat(list(parts))
    if isinstance(first, dict):
        return {k: batch_concat([p[k] for p in parts]) for k in first}
    return type(first)(batch_concat(list(group)) for group in zip(*parts))
