"""Loading a distributed (sharded) checkpoint of :class:`~jagg_lightning.distributed.strategies.FSDP2Strategy` into the
trainable weights and the optimizer state. Plain torch (``torch.distributed.checkpoint``), no Lightning.

Lightning's ``ModelParallelStrategy`` writes the folder (each rank its shards, rank 0 the rest in ``meta.pt``);
its own loader asks the folder for the whole module's state, which a checkpoint of the trainable weights alone
does not hold (the frozen text encoders, VAE and the weights a subset leaves frozen are rebuilt from
``policy``). This loads exactly the trainable weights, in place into their shards (resharded by
``torch.distributed.checkpoint`` when the world size differs from the writer's), then the optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import torch

METADATA_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


def load_sharded(module, optimizers, path: Path, weights_only: bool | None = None) -> dict:
    """Load the folder ``path`` into ``module``'s trainable parameters and ``optimizers``; returns the rest of
    the checkpoint (counters, loops, the ``jagg`` section) with ``state_dict`` set to the loaded weights (what
    ``JAGGModule.on_load_checkpoint`` checks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    weights = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    dcp.load({"state_dict": weights}, checkpoint_id=path)  # in place: the tensors share the parameters' storage
    for i, optimizer in enumerate(optimizers):
        # a fresh optimizer has no state yet: torch makes it (a step at lr 0) so there is something to load into
        state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"])
    checkpoint = torch.load(path / METADATA_FILE, weights_only=True if weights_only is None else weights_only)
    checkpoint["state_dict"] = weights
    return checkpoint
