"""FSDP2 for JAGGModule: Lightning's ``ModelParallelStrategy`` set up for pure data parallelism.

``JAGGModule.configure_model`` applies ``fully_shard`` to every transformer block and then to the
transformer (:func:`shard_transformer`), for each network the policy lists (``Policy.sharded_networks()``: the
transformer; both experts of Wan2.2): the frozen weights stay in the policy dtype, each LoRA weight
is sharded with the block that holds it, the text encoders and the VAE stay whole on every rank.
Gradients are reduce-scattered by FSDP2 at each backward (LoRA gradients only: the frozen weights
have none), gradient clipping works on the sharded (DTensor) gradients, the KL reference switches the
adapter off inside the same sharded transformer.

:class:`FSDP2Strategy` is ``ModelParallelStrategy`` with three changes, all about defaults and
checkpoints, none about the training math:

- ``data_parallel_size`` defaults to every process and ``tensor_parallel_size`` to 1 (the parent's
  "auto" would make every GPU of a node a tensor-parallel rank);
- checkpoints are one file holding the LoRA weights only (gathered to rank 0 weight by weight), with
  the optimizer state, written through the trainer's CheckpointIO (atomic with ``AtomicCheckpointIO``);
  the parent would gather the whole frozen model to rank 0 or write a sharded folder of it;
- on load the file's LoRA weights are handed to ``JAGGModule.on_load_checkpoint`` too, which refuses
  a checkpoint that lacks some of them.

Such a checkpoint is an ordinary Lightning checkpoint: it resumes under FSDP2 and on one process alike.

Context parallelism (``context_parallel_size`` C > 1, ``context_parallel_kind`` ulysses | ring;
:mod:`jagg_lightning.distributed.context_parallel`): :class:`DDPStrategy` (Lightning's, plus these options) and
:class:`FSDP2Strategy` build the ``(data, ring, ulysses)`` mesh, the module hands each transformer to diffusers'
``enable_parallelism``, the prompt samplers deal to the ``D = W / C`` data ranks (``distributed_sampler_kwargs``) and
the sums over samples go over the data group. FSDP2 then shards over the flattened world (every one of the W
processes), its reduce-scatter dividing by D: the sum over the context ranks of their partial gradients and the mean
over the data ranks, in the one collective FSDP2 makes anyway (docs/distributed.md says why).

Both strategies take ``collective_timeout_s``: how long a collective waits for a stuck peer, set on every process group
of the run once the model is wrapped (:mod:`jagg_lightning.distributed.peer_failure`; docs/distributed.md, "A rank that dies").

For full fine-tuning (``policy.trainable: full``) ``save_distributed_checkpoint=True`` writes a folder in which
every rank writes its own shards of the trainable weights and of the optimizer state
(``torch.distributed.checkpoint``; :mod:`jagg_lightning.distributed.sharded_checkpoint`): it resumes bit-identically on
the same world size and reshards on load to another. ``cpu_offload=True`` adds FSDP2's CPU offload of the
parameters, gradients and optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from jagg_lightning.distributed import context_parallel
from jagg_lightning.distributed.context_parallel import ContextKind, ContextParallel
from jagg_lightning.distributed.peer_failure import DEFAULT_TIMEOUT_S, CollectiveTimeout
from jagg_lightning.models.compiling import transformer_blocks
from jagg_lightning.utils.sharding import full_tensor


def shard_transformer(transformer: nn.Module, mesh, **options) -> None:
    """``fully_shard`` each block, then the transformer (its embeddings and output layers) on ``mesh``;
    ``options``: more ``fully_shard`` arguments (mixed precision, CPU offload)."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(transformer):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(transformer, mesh=mesh, **options)


class ContextParallelOptions:
    """``context_parallel_size`` / ``context_parallel_kind`` / ``attention_backend`` of a strategy, and the
    :class:`~jagg_lightning.distributed.context_parallel.ContextParallel` it builds once the processes exist (None when C = 1)."""

    def _init_context(self, size: int, kind: ContextKind, attention_backend: str | None) -> None:
        context_parallel.check_context_options(size, kind)
        self.context_parallel_size, self.context_parallel_kind = size, kind
        self.attention_backend = attention_backend  # a diffusers backend name (ring attention needs one with LSE)
        self.context_parallel: ContextParallel | None = None

    def _setup_context(self) -> None:
        if self.context_parallel_size > 1:
            self.context_parallel = context_parallel.build(self.context_parallel_size, self.context_parallel_kind,
                                                           self.root_device, self.attention_backend)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data ranks: the context ranks of one data rank draw the same prompts."""
        if self.context_parallel is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.context_parallel.data_size, "rank": self.context_parallel.data_rank}


class DDPStrategy(CollectiveTimeout, ContextParallelOptions, LightningDDPStrategy):
    """Lightning's DDPStrategy, with context parallelism beside it (``context_parallel_size`` C: the W processes are
    W / C data ranks of C context ranks each; C = 1 is plain DDP) and ``collective_timeout_s``: how long a collective
    waits for a stuck peer, on every process group (:mod:`jagg_lightning.distributed.peer_failure`)."""

    def __init__(self, *args: Any, context_parallel_size: int = 1, context_parallel_kind: ContextKind = "ulysses",
                 attention_backend: str | None = None, collective_timeout_s: float = DEFAULT_TIMEOUT_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, timeout=self._init_timeout(collective_timeout_s, kwargs), **kwargs)
        self._init_context(context_parallel_size, context_parallel_kind, attention_backend)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_context()


class FSDP2Strategy(CollectiveTimeout, ContextParallelOptions, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy for FSDP2 over every process, with checkpoints of the trainable weights only
    (one file; or, with ``save_distributed_checkpoint``, a folder of shards), context parallelism beside it
    (``context_parallel_size`` C; ``data_parallel_size`` is then W / C, and FSDP2 shards over all W processes) and
    ``collective_timeout_s`` as :class:`DDPStrategy`'s."""

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = 1,
        save_distributed_checkpoint: bool = False,
        cpu_offload: bool = False,
        context_parallel_size: int = 1,
        context_parallel_kind: ContextKind = "ulysses",
        attention_backend: str | None = None,
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint=save_distributed_checkpoint,
                         timeout=self._init_timeout(collective_timeout_s, kwargs), **kwargs)
        self.cpu_offload = cpu_offload  # read by JAGGModule.configure_model when it shards
        self._init_context(context_parallel_size, context_parallel_kind, attention_backend)

    def setup_environment(self) -> None:
        world, context = self.num_nodes * self.num_processes, self.context_parallel_size
        if self._data_parallel_size not in ("auto", world // context) or world % context:
            raise ValueError(f"FSDP2Strategy: data_parallel_size must be 'auto' or {world // context} (the "
                             f"{world} processes over context_parallel_size {context}), got {self._data_parallel_size}")
        if self._tensor_parallel_size != 1:
            raise ValueError(f"FSDP2Strategy: tensor_parallel_size must be 1, got {self._tensor_parallel_size}")
        # the parent's mesh shards over every process (the data and context ranks flattened)
        self._data_parallel_size = world
        super().setup_environment()
        self._setup_context()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable (LoRA) weights, full, on rank 0; every rank takes part in each gather (a distributed
        checkpoint: each rank's shards of them, no gather)."""
        if self._save_distributed_checkpoint:
            return {n: p.detach() for n, p in self.lightning_module.named_parameters() if p.requires_grad}
        state = {}
        for name, p in self.lightning_module.named_parameters():
            if not p.requires_grad:
                continue
            full = full_tensor(p)
            if self.global_rank == 0:
                state[name] = full.detach().cpu().clone()
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """A distributed checkpoint is written whole into a fresh sibling folder (every rank its shards), which then
        replaces ``filepath`` (:mod:`jagg_lightning.faults.io`): the parent writes into the existing folder, so a failed or
        killed save would tear the previous one. A write that fails on any rank fails on every rank (no rank left
        waiting) with :class:`~jagg_lightning.faults.io.WriteError` naming ``filepath``; the previous folder stays."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from torch.distributed.checkpoint.api import CheckpointException

        from jagg_lightning.faults.io import WriteError, discard, new_temp_directory, replace_directory

        path = Path(self.broadcast(filepath))
        tmp = Path(self.broadcast(str(new_temp_directory(path)) if self.global_rank == 0 else None))
        error = None
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except (Exception, CheckpointException) as err:  # told to every rank below, then raised
            error = err
        if self.reduce_boolean_decision(error is None, all=True):
            if self.global_rank == 0:
                try:
                    replace_directory(tmp, path)
                except Exception as err:
                    error = err
            if self.reduce_boolean_decision(error is None, all=True):
                return
        if self.global_rank == 0:
            discard(tmp)
        raise WriteError.of(path, error or OSError("another rank could not write its part")) from error

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # a distributed checkpoint (folder of shards)
            from jagg_lightning.distributed.sharded_checkpoint import load_sharded

            return load_sharded(self.lightning_module, self.optimizers, path, weights_only)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if "state_dict" not in checkpoint:  # the parent loaded the weights into the shards and dropped them
            path = Path(self.broadcast(checkpoint_path))
            checkpoint["state_dict"] = torch.load(path, mmap=True, map_location="cpu", weights_only=True)["state_dict"]
        return checkpoint


def set_divide_factor(network: nn.Module, factor: int) -> None:
    """Every FSDP2 unit of ``network`` divides its reduce-scattered gradients by ``factor`` (not the mesh size)."""
    from torch.distributed.fsdp import FSDPModule

    for module in network.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))


def shard_policy(policy, mesh, strategy=None) -> None:
    """FSDP2 for a policy: each network it lists in ``Policy.sharded_networks()`` (its transformer; Wan2.2's two
    experts) (with ``trainable: full`` in mixed precision: float32 master shards,
    compute in ``policy.dtype``), and the frozen reference copy of a full fine-tune sharded alike;
    ``strategy.cpu_offload`` (:class:`FSDP2Strategy`) adds FSDP2's CPU offload."""
    from jagg_lightning.models.full_finetune import fsdp_options
    from jagg_lightning.utils.dtypes import DTYPES

    full = policy.config.trainable == "full"
    options = fsdp_options(DTYPES[policy.config.dtype], bool(getattr(strategy, "cpu_offload", False)), full)
    context = getattr(strategy, "context_parallel", None)
    for network in policy.sharded_networks():  # the transformer; Wan2.2: both experts
        shard_transformer(network, mesh, **options)
        if context is not None:  # the sum over the context ranks' partial gradients, the mean over the data ranks
            set_divide_factor(network, context.data_size)
    reference = getattr(policy, "frozen_reference", None)
    if reference is not None:
        reference.shard(mesh, shard_transformer)
