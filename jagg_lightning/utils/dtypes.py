"""Dtype names and the compute-dtype rule: a leaf (it imports nothing of ours), so every part can use it.

The rule, written once: the SDE, GRPO and master-weight arithmetic runs in float32 whatever the model's dtype
(a frozen bfloat16 transformer, say), and in float64 when anything it is given is float64 (a float64 run stays
float64 throughout: the exactness tests rely on it).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def compute_dtype(*like: torch.dtype | torch.Tensor | str | None) -> torch.dtype:
    """float64 if any of ``like`` (dtypes, dtype names as ``policy.dtype`` spells them, tensors) is float64, else
    float32: never a half precision."""
    for x in like:
        dtype = x.dtype if isinstance(x, torch.Tensor) else DTYPES.get(x, x) if isinstance(x, str) else x
        if dtype == torch.float64:
            return torch.float64
    return torch.float32
