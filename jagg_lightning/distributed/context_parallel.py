"""Context (sequence) parallelism through diffusers' own engine, beside data parallelism.

A run of ``W = D * C`` processes is a 2-D grid: ``D`` data-parallel ranks, each with its own prompts, times ``C``
context ranks that share ONE data rank's prompts, seeds and noise and split each forward's token sequence
between them (diffusers' ``ContextParallelConfig``: Ulysses all-to-all over heads, or ring attention; the
transformer's ``_cp_plan`` says where the sequence is split and where the output is gathered back, so every context
rank holds the whole velocity). The context ranks of one data rank are consecutive (``rank = d * C + c``), so a
context group sits on one node. The device mesh is ``("data", "ring", "ulysses")`` of shape ``(D, C, 1)`` (ring)
or ``(D, 1, C)`` (Ulysses), the dimension names diffusers reads.

What that means for the training math (one process's update, exactly):

- every context rank computes the same loss on the same gathered output; the gradient of a weight is the sum
  over the tokens, and a context rank's backward only reaches its own tokens (the gather's backward keeps
  this rank's chunk, the split's backward pads with zeros), so a weight's gradient is **partial**: the true one
  is the sum over the context group. Averaged over the data ranks as well, the update's gradient is
  ``(1 / D) * sum over all W processes`` -- one all-reduce over the world divided by ``D`` instead of ``W``
  (DDP), or FSDP2's reduce-scatter over the flattened world with its divide factor set to ``D``;
- rewards, advantages, routing scores and evaluation sums are identical on the context ranks of one data rank:
  sums and means over processes go over the **data group** only (:attr:`ContextParallel.data_group`).

Plain torch and diffusers (no Lightning): the strategies (``strategies.py``) build one and the module applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

ContextKind = Literal["ulysses", "ring"]


class ContextParallelError(ValueError):
    """A setting context parallelism cannot run, found once the model exists (the CLI prints its one line)."""


KINDS = ("ulysses", "ring")

# what a split tensor's length comes from, for the message of a sequence that does not divide
_SEQUENCE_FIELDS = {"encoder_hidden_states": "policy.max_sequence_length", "txt_ids": "policy.max_sequence_length",
                    "encoder_hidden_states_mask": "policy.max_sequence_length"}
_IMAGE_FIELDS = "policy.resolution / policy.num_frames"
# outputs a plan splits (``split_output``) that are not image tokens: (module, output index) -> the field
_OUTPUT_FIELDS = {("pos_embed", 1): "policy.max_sequence_length"}  # Qwen-Image's text rotary frequencies


def check_context_options(size, kind, world: int | None = None) -> None:
    """ValueError naming the strategy field unless ``size`` is an integer >= 1 dividing ``world`` and ``kind``
    one of :data:`KINDS`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"trainer.strategy.context_parallel_size must be an integer >= 1, got {size!r}")
    if kind not in KINDS:
        raise ValueError(f"trainer.strategy.context_parallel_kind must be one of {list(KINDS)}, got {kind!r}")
    if world is not None and world % size:
        raise ValueError(f"trainer.strategy.context_parallel_size must divide the {world} processes, got {size}")


@dataclass
class ContextParallel:
    """The ``(data, ring, ulysses)`` mesh of a run and the groups its collectives use (:func:`build`)."""

    size: int
    kind: ContextKind
    mesh: object  # torch.distributed.device_mesh.DeviceMesh, 3-D
    device: torch.device
    attention_backend: str | None = None
    applied: list = field(default_factory=list)  # the networks enable_parallelism was called on

    @property
    def data_size(self) -> int:
        return self.mesh["data"].size()

    @property
    def data_rank(self) -> int:
        return self.mesh["data"].get_local_rank()

    @property
    def context_rank(self) -> int:
        return dist.get_rank() % self.size

    @property
    def data_group(self):
        """The processes holding the same context rank of every data rank: where sums over samples go."""
        return self.mesh["data"].get_group()

    def parallel_config(self):
        from diffusers import ContextParallelConfig
        from diffusers.models._modeling_parallel import ParallelConfig

        degrees = {"ring_degree": self.size} if self.kind == "ring" else {"ulysses_degree": self.size}
        return ParallelConfig(context_parallel_config=ContextParallelConfig(mesh=self.mesh, **degrees))

    def apply(self, networks: list[nn.Module], family: str) -> None:
        """``enable_parallelism`` on each network (its ``_cp_plan``), after the checks that need the network: the
        family has a plan (else one line naming it), the attention heads divide by the Ulysses degree, and at every
        forward each tensor the plan splits divides by ``size`` (a ValueError naming the policy field, before
        diffusers' bare assertion)."""
        for network in networks:
            if any(network is done for done in self.applied):
                continue
            plan = _plan_for(network)
            if plan is None or type(network).__name__ in UNUSABLE_PLANS:
                why = UNUSABLE_PLANS.get(type(network).__name__, "has no context-parallel plan (_cp_plan) in diffusers")
                raise ContextParallelError(
                    f"trainer.strategy.context_parallel_size {self.size}: the {family!r} family's "
                    f"{type(network).__name__} {why}; use context_parallel_size 1 (data parallelism only)")
            heads = getattr(network.config, "num_attention_heads", None)
            if self.kind == "ulysses" and heads is not None and heads % self.size:
                raise ContextParallelError(
                    f"trainer.strategy.context_parallel_size {self.size}: Ulysses splits the {heads} attention heads "
                    f"of {type(network).__name__}, which do not divide by it (use context_parallel_kind ring)")
            if self.attention_backend is not None:
                network.set_attention_backend(self.attention_backend)
            self._check_backend()
            config = self.parallel_config()
            _resolve_on(network, config, self.device)
            _check_splits(network, plan, self.size)  # before diffusers' hooks: see _check_splits
            network.enable_parallelism(config=config, cp_plan=plan)
            del network._resolve_parallel_config  # the instance's override (the class method again)
            self.applied.append(network)


    def _check_backend(self) -> None:
        """Ring attention merges blocks by their log-sum-exp, which diffusers' native SDPA backend does not return."""
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        active = _AttentionBackendRegistry.get_active_backend()[0]
        backend = self.attention_backend or getattr(active, "value", active)
        if self.kind == "ring" and backend == "native":
            raise ContextParallelError(
                "trainer.strategy.context_parallel_kind ring needs an attention backend that returns the "
                "log-sum-exp (diffusers' native SDPA does not): set trainer.strategy.attention_backend to "
                "_native_cudnn, _native_flash or flash (GPU), or use context_parallel_kind ulysses")


def build(size: int, kind: ContextKind, device: torch.device, attention_backend: str | None = None) -> ContextParallel:
    """The mesh of the initialised process group: ``(world / size, ring, ulysses)``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_context_options(size, kind, world)  # a ValueError: the strategy's setup_environment, before any model
    shape = (world // size, size, 1) if kind == "ring" else (world // size, 1, size)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("data", "ring", "ulysses"))
    return ContextParallel(size, kind, mesh, device, attention_backend)


# transformers whose diffusers plan does not run on what the policy passes, each with why
UNUSABLE_PLANS = {
    "LTX2VideoTransformer3DModel": "has a _cp_plan in diffusers that splits the rotary embedding's dim 1, which with "
    "LTX-2's split RoPE ([B, heads, S, D]) is the heads, not the tokens (a shape error in the first block), and keeps "
    "the audio stream, whose cross-attention reads the video tokens, whole on every rank",
}


def _plan_for(network: nn.Module) -> dict | None:
    """The network class's ``_cp_plan``, where the policy's inputs differ from it adapted: FLUX.2's plan splits
    ``[1, seq, 4]`` position ids (``expected_dims=3``) and skips any other rank silently, while the policy passes them
    ``[seq, 4]`` as the transformer also accepts -- unsplit ids then meet a split sequence; split them along dim 0."""
    plan = getattr(type(network), "_cp_plan", None)
    if plan is not None and type(network).__name__ == "Flux2Transformer2DModel":
        from diffusers.models._modeling_parallel import ContextParallelInput

        ids = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
        plan = dict(plan) | {"": dict(plan[""]) | {"img_ids": ids, "txt_ids": ids}}
    return plan


def _resolve_on(network: nn.Module, config, device: torch.device) -> None:
    """diffusers' ``_resolve_parallel_config`` with our mesh and device: diffusers' own picks the device
    ``rank % torch.accelerator.device_count()``, a ZeroDivisionError on a CPU-only machine (and the wrong index on
    nodes of unequal size); the strategy knows this process's device. An instance override, removed after use."""

    def resolve(given):
        if given._mesh is None:  # one config per network; set up once
            given.setup(dist.get_rank(), dist.get_world_size(), device, mesh=given.context_parallel_config.mesh)
        network._parallel_config = given
        return given

    network._resolve_parallel_config = resolve


def _check_splits(network: nn.Module, plan: dict, size: int) -> None:
    """Every tensor the plan splits must divide along its split dimension by ``size``, else a
    :class:`ContextParallelError` naming the policy field its length comes from -- on every rank alike, before
    diffusers' bare ``assert`` in its sharder. Registered BEFORE ``enable_parallelism``:

    - a split input is checked by a torch forward pre-hook, which runs before the module's ``forward`` and so before
      the split diffusers' hook registry wraps around ``forward``;
    - a split output (``split_output=True``: Wan's rotary embedding, Qwen-Image's ``pos_embed``, computed before the
      first block) by a diffusers hook of its own, registered first and so innermost: its ``post_forward`` sees the
      whole output before diffusers' splits it."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.context_parallel import _get_submodule_by_name
    from diffusers.models._modeling_parallel import ContextParallelInput

    owner = type(network).__name__
    for name, entries in plan.items():
        if not isinstance(entries, dict):
            continue
        specs = {k: v for k, v in entries.items() if isinstance(v, ContextParallelInput)}
        inputs = {k: v for k, v in specs.items() if isinstance(k, str) and not v.split_output}
        outputs = {k: v for k, v in specs.items() if isinstance(k, int) and v.split_output}
        modules = _get_submodule_by_name(network, name)
        for module in modules if isinstance(modules, list) else [modules]:
            if inputs:
                module.register_forward_pre_hook(_split_check(inputs, size, owner), with_kwargs=True)
            if outputs:
                HookRegistry.check_if_exists_or_initialize(module).register_hook(
                    _split_output_check(outputs, size, owner, name), "jagg_split_output_check")


def _refuse_indivisible(value, spec, size: int, where: str, what: str) -> None:
    if not isinstance(value, torch.Tensor) or (spec.expected_dims is not None and value.dim() != spec.expected_dims):
        return  # diffusers does not split it either
    length = value.shape[spec.split_dim]
    if length % size:
        raise ContextParallelError(
            f"{where}: {what} has {length} tokens, which do not split into "
            f"trainer.strategy.context_parallel_size {size} equal parts; choose a size that makes them divide")


def _split_check(inputs: dict, size: int, owner: str):
    import inspect

    positions: dict[str, int] = {}

    def hook(module, args, kwargs):
        if not positions:  # the forward's argument names (diffusers' hook finds them alike)
            names = list(inspect.signature(type(module).forward).parameters)[1:]
            positions.update({n: i for i, n in enumerate(names)})
        for key, spec in inputs.items():
            index = positions.get(key, len(args))
            value = kwargs.get(key, args[index] if index < len(args) else None)
            _refuse_indivisible(value, spec, size, _SEQUENCE_FIELDS.get(key, _IMAGE_FIELDS), f"{owner}'s {key}")
        return None

    return hook


def _split_output_check(outputs: dict, size: int, owner: str, name: str):
    """A diffusers hook whose ``post_forward`` checks the outputs the plan splits, whole (see :func:`_check_splits`)."""
    from diffusers.hooks import ModelHook

    class SplitOutputCheck(ModelHook):
        def post_forward(self, module, output):
            values = [output] if isinstance(output, torch.Tensor) else list(output)
            for index, spec in outputs.items():
                value = values[index] if index < len(values) else None
                _refuse_indivisible(value, spec, size, _OUTPUT_FIELDS.get((name, index), _IMAGE_FIELDS),
                                    f"{owner}'s {name} output {index}")
            return output

    return SplitOutputCheck()
