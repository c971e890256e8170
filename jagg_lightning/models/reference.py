"""The KL reference of a full fine-tune: a frozen copy of the initial transformer (of each trained network:
Wan2.2's two experts). Plain torch, no Lightning.

A LoRA policy's reference is its own transformer with the adapter off; a full fine-tune has no adapter to
switch off, so it keeps a copy of the transformer as it was before training, in the compute dtype
(``policy.dtype``), with no gradients. The copy lives outside the module tree (it is not trained, not
checkpointed and not wrapped by DDP); ``Policy.adapter_disabled`` swaps each copy in for its network, so the
reference forwards go through the family's own ``velocity`` and are counted where the LoRA ones are
(``Sampler.reference_velocity`` -> ``train/passes/reference_forward``). Options:

* ``policy.reference_offload``: the copy waits on the CPU and visits the policy's device for each use;
* under FSDP2 it is sharded like the policy (``fully_shard`` per block; with ``reference_offload`` FSDP2's
  CPU offload keeps its shards on the CPU);
* with kl_beta = 0 no copy is made.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from jagg_lightning.utils.dtypes import DTYPES


class FrozenReference:
    """The frozen copies of the trained networks (``Policy.trained_networks()``: the transformer; Wan2.2's two
    experts) and where they wait between uses (a plain object: not a submodule of anything)."""

    def __init__(self, networks: dict[str, nn.Module], dtype: torch.dtype, offload: bool):
        self.networks = {name: _frozen_copy(network, dtype) for name, network in networks.items()}
        self.offload, self.sharded = offload, False

    @property
    def transformer(self) -> nn.Module:
        return self.networks["transformer"]

    def shard(self, mesh, shard_fn) -> None:
        """Shard like the policy (``shard_fn(network, mesh, **fully_shard options)``)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        for network in self.networks.values():
            shard_fn(network, mesh, **({"offload_policy": CPUOffloadPolicy(pin_memory=False)} if self.offload else {}))
        self.sharded = True

    def parameters(self):
        return (p for network in self.networks.values() for p in network.parameters())


def _frozen_copy(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen copy in ``dtype``. It keeps the network's input up-cast hook (full_finetune.py), which does nothing
    on it: the hook casts inputs up to the weights' dtype, and the copy's weights are the compute dtype."""
    return nn.Module.to(copy.deepcopy(network).requires_grad_(False).eval(), dtype)


def attach_reference(policy, kl_beta: float) -> FrozenReference | None:
    """A full fine-tune with kl_beta > 0 gets its frozen reference (a LoRA policy or kl_beta = 0: none)."""
    if policy.config.trainable != "full" or kl_beta == 0:
        return None
    reference = FrozenReference(policy.trained_networks(), DTYPES[policy.config.dtype], policy.config.reference_offload)
    object.__setattr__(policy, "frozen_reference", reference)
    return reference


def reference_networks(policy) -> list[nn.Module]:
    """The frozen reference copies of a full fine-tune with KL (none otherwise): they run the transformer too."""
    reference = getattr(policy, "frozen_reference", None)
    return [] if reference is None else list(reference.networks.values())


@contextmanager
def reference_applied(policy):
    """Inside the block each trained network (``policy.transformer``; Wan2.2: also ``transformer_2``) is its
    frozen reference copy."""
    reference: FrozenReference | None = getattr(policy, "frozen_reference", None)
    if reference is None:
        raise RuntimeError("policy.trainable 'full' keeps a frozen reference copy only with grpo.kl_beta > 0: there "
                           "are no initial weights to sample with")
    trained = {name: getattr(policy, name) for name in reference.networks}
    if not reference.sharded:  # unsharded: fetch it to where the policy computes
        device = next(trained["transformer"].parameters()).device
        for network in reference.networks.values():
            if next(network.parameters()).device != device:
                network.to(device)
    for name, network in reference.networks.items():  # nn.Module's own attribute assignment registers it
        setattr(policy, name, network)
    try:
        yield
    finally:
        for name, network in trained.items():
            setattr(policy, name, network)
        for network in reference.networks.values():
            if reference.sharded:  # FSDP2 keeps a root's parameters gathered after forward, for a backward that
                network.reshard()  # a reference never makes: free them
            elif reference.offload:
                network.to("cpu")
