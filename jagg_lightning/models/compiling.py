"""Regional compilation (``policy.compile: repeated_blocks``): each trained network's repeated block compiled with
``torch.compile`` once, after the LoRA is injected, so the rollout's forwards, the update's passes (exact, JAGG
anchors, the fused mode's kept graphs), the KL reference and evaluation all run compiled blocks. Plain torch.

What is compiled, per network (``Policy.trained_networks()`` and a full fine-tune's frozen reference copies):

* a model that declares ``_repeated_blocks`` (FLUX.1 / FLUX.2, Qwen-Image, Z-Image, Wan): diffusers'
  ``ModelMixin.compile_repeated_blocks()``, every module of those classes;
* one that declares none (SD3 / SD3.5): every block of its block lists (:func:`transformer_blocks`).

Both call ``nn.Module.compile`` on each block: the block is compiled *in place* (its ``__call__`` runs the compiled
function), not wrapped in an ``OptimizedModule``, so no name gains ``_orig_mod``: parameter names, state dicts,
checkpoints, the optimizer's parameters and the LoRA exports are the uncompiled module's. The LoRA (peft's layers
inside each block) is traced into the block's graph; the embeddings, the final norm and projection stay eager.

Compiled with ``dynamic=True``: the batch dimension is symbolic from the first compile, so the rollout's
micro-batches, the update's passes, batched anchors (2n) and CFG's doubled batch share one graph. What still
compiles a new graph, once each, normally all in the first training step (docs/method.md §7 counts them):

* grad mode (the rollout without grad, the passes with it) and, under grad, whether a block's input requires grad
  (the first block's does not, the later blocks' do);
* the adapter switched off (peft's ``disable_adapters`` flag: the KL reference, ``grpo.kl_beta`` > 0);
* a block whose structure differs (SD3's last block is ``context_pre_only``; SD3.5's dual-attention blocks);
* a pass of exactly one sample (torch specialises sizes 0 and 1), whenever one first occurs;
* another dtype or device.

Every block of one class shares torch's per-code-object cache, whose default limit (8 entries) these variants
exceed: past it torch silently runs the block eagerly. :func:`compile_policy` therefore raises
``torch._dynamo.config.recompile_limit`` (process-wide) to at least :data:`RECOMPILE_LIMIT`.

Not supported (refused by ``JAGGModule.setup`` with a message naming the field): FSDP2 and context parallelism
(both rewrap or hook the blocks after this point).
"""

from __future__ import annotations

import torch
from torch import nn

from jagg_lightning.models.reference import reference_networks

COMPILE_MODES = ("repeated_blocks",)  # what policy.compile accepts besides null
RECOMPILE_LIMIT = 64  # at least this many compiled variants per block class (see the module docstring)


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a diffusers transformer: every entry of its ``*blocks`` ModuleLists
    (``transformer_blocks`` for SD3 and Qwen-Image, plus ``single_transformer_blocks`` for FLUX / FLUX.2), or of
    Z-Image's ``layers`` and its two ``*_refiner`` lists."""
    blocks = [m for name, lst in transformer.named_children() if isinstance(lst, nn.ModuleList)
              and (name.endswith("blocks") or name == "layers" or name.endswith("_refiner")) for m in lst]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no '*blocks' ModuleList to shard or compile")
    return blocks


def repeated_blocks(network: nn.Module) -> list[nn.Module]:
    """The blocks :func:`compile_network` compiles: the modules of the classes the model declares in
    ``_repeated_blocks``, or, where it declares none, the entries of its block lists."""
    classes = getattr(network, "_repeated_blocks", None)
    if classes:
        return [m for m in network.modules() if type(m).__name__ in classes]
    return transformer_blocks(network)


def compile_network(network: nn.Module, backend: str = "inductor") -> list[nn.Module]:
    """Compile ``network``'s repeated blocks in place (``dynamic=True``, torch.compile's ``backend``); returns them.
    Lazy, as ``nn.Module.compile`` is: the first call of a block compiles it; compiling again before that call
    replaces the backend."""
    if getattr(network, "_repeated_blocks", None) and hasattr(network, "compile_repeated_blocks"):
        network.compile_repeated_blocks(dynamic=True, backend=backend)  # diffusers: block.compile(...) per block
    else:
        for block in transformer_blocks(network):
            block.compile(dynamic=True, backend=backend)
    return repeated_blocks(network)


def compile_policy(policy, backend: str = "inductor") -> list[nn.Module]:
    """``policy.compile``: compile the repeated blocks of every network the policy runs (the trained ones, with their
    LoRA already injected, and a full fine-tune's frozen reference copies); returns the compiled blocks (none when
    ``policy.compile`` is null). Call it once, after the LoRA and the reference copies exist. ``backend``: inductor
    (what ``JAGGModule`` uses); the tests trace the same graphs with ``aot_eager`` (dynamo and AOT autograd, no code
    generation), which costs them seconds instead of inductor's minutes of cold compile."""
    if policy.config.compile is None:
        return []
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    networks = [*policy.trained_networks().values(), *reference_networks(policy)]
    return [block for network in networks for block in compile_network(network, backend)]


def is_compiled(block: nn.Module) -> bool:
    """Whether ``nn.Module.compile`` has been called on ``block`` (its calls go through the compiled function)."""
    return getattr(block, "_compiled_call_impl", None) is not None


def compile_counts() -> dict[str, int]:
    """torch's process-wide compile counters: ``frames`` (frames dynamo was asked to compile: first compiles and
    recompiles, including any it gave up on), ``compiled`` (those it compiled) and ``graphs`` (graphs made). Read
    them before and after a step: a step that compiled nothing leaves them unchanged."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "compiled": int(counters["frames"]["ok"]),
            "graphs": int(counters["stats"]["unique_graphs"])}


__all__ = ["COMPILE_MODES", "RECOMPILE_LIMIT", "compile_counts", "compile_network", "compile_policy", "is_compiled",
           "repeated_blocks", "transformer_blocks"]
