"""Exponential moving average of the trainable (LoRA) weights, Flow-GRPO style. Plain torch.

    shadow <- decay * shadow + (1 - decay) * theta      after every optimizer step
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from jagg_lightning.utils.sharding import full_tensor, shard_like, values_swapped


class LoRAEMA:
    """Shadow copies of named parameters; :meth:`applied` swaps them in temporarily."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], decay: float,
                 networks: Iterable[nn.Module] = ()):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = dict(named_params)
        self.networks = list(networks)  # the modules holding them (FSDP2 units resharded around a swap)
        self.reset()

    def reset(self) -> None:
        """Start the average at the parameters' current values."""
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    def start(self, resumed: bool) -> None:
        """At the start of fit: a new run starts the average from the weights training starts with (also a LoRA
        the user loaded or set after the EMA was made), on their device; a resumed one keeps its restored
        shadow and moves it to the parameters' device."""
        if not resumed:
            self.reset()
        else:
            self.shadow = {n: t.to(self.params[n].device) for n, t in self.shadow.items()}

    @torch.no_grad()
    def update(self) -> None:
        for name, p in self.params.items():
            self.shadow[name].lerp_(p.detach(), 1.0 - self.decay)

    def applied(self):
        """Inside the block the live parameters hold the EMA weights; restored after."""
        return values_swapped(list(self.params.values()), [self.shadow[n] for n in self.params], self.networks)

    def state_dict(self) -> dict[str, Tensor]:
        """Whole tensors (under FSDP2 the shards are gathered: every rank calls this)."""
        return {n: full_tensor(t).clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}... ({len(missing)} weights)")
        for name, t in self.shadow.items():
            t.copy_(shard_like(state[name], t))
