"""The KL reference of a full fine-tune: a frozen copy of the initial transformer. Plain torch, no Lightning.

A LoRA policy's reference is its own transformer with the adapter off; a full fine-tune has no adapter to
switch off, so it keeps a copy of the transformer as it was before training, in the compute dtype
(``policy.dtype``), with no gradients. The copy lives outside the module tree (it is not trained, not
checkpointed and not wrapped by DDP); ``Policy.adapter_disabled`` swaps it in for the transformer, so the
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

from jagg_lightning.policies.base import DTYPES


class FrozenReference:
    """The frozen copy and where it waits between uses (a plain object: not a submodule of anything)."""

    def __init__(self, transformer: nn.Module, dtype: torch.dtype, offload: bool):
        hooks = transformer._forward_pre_hooks
        transformer._forward_pre_hooks = type(hooks)()  # the copy runs in its own dtype: no up-cast hook
        try:
            self.transformer = copy.deepcopy(transformer)
        finally:
            transformer._forward_pre_hooks = hooks
        nn.Module.to(self.transformer.requires_grad_(False).eval(), dtype)
        self.offload, self.sharded = offload, False

    def shard(self, mesh, shard_fn) -> None:
        """Shard like the policy (``shard_fn(transformer, mesh, **fully_shard options)``)."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        shard_fn(self.transformer, mesh, **({"offload_policy": CPUOffloadPolicy(pin_memory=False)}
                                            if self.offload else {}))
        self.sharded = True

    def parameters(self):
        return self.transformer.parameters()


def attach_reference(policy, kl_beta: float) -> FrozenReference | None:
    """A full fine-tune with kl_beta > 0 gets its frozen reference (a LoRA policy or kl_beta = 0: none)."""
    if policy.config.trainable != "full" or kl_beta == 0:
        return None
    reference = FrozenReference(policy.transformer, DTYPES[policy.config.dtype], policy.config.reference_offload)
    object.__setattr__(policy, "frozen_reference", reference)
    return reference


@contextmanager
def reference_applied(policy):
    """Inside the block ``policy.transformer`` is the frozen reference copy."""
    reference: FrozenReference | None = getattr(policy, "frozen_reference", None)
    if reference is None:
        raise RuntimeError("policy.trainable 'full' keeps a frozen reference copy only with grpo.kl_beta > 0: there "
                           "are no initial weights to sample with")
    trained = policy._modules["transformer"]
    if not reference.sharded:  # unsharded: fetch it to where the policy computes
        device = next(trained.parameters()).device
        if next(reference.parameters()).device != device:
            reference.transformer.to(device)
    policy._modules["transformer"] = reference.transformer
    try:
        yield
    finally:
        policy._modules["transformer"] = trained
        if reference.sharded:  # FSDP2 keeps a root's parameters gathered after forward, for a backward that
            reference.transformer.reshard()  # a reference never makes: free them
        elif reference.offload:
            reference.transformer.to("cpu")
