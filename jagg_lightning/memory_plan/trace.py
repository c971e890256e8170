"""Activation memory by tracing: the bytes autograd saves for backward, counted by saved-tensor hooks.

:func:`saved_bytes` runs one forward of a network under ``torch.autograd.graph.saved_tensors_hooks`` and sums the
storage bytes of every tensor saved for backward, each storage once, the network's own weights excluded: the unit
of ``Sampler.activation_bytes`` (and of ``memory.budget_mb``). :func:`traced_activation_bytes` does it in a
``FakeTensorMode`` on a fake copy of a meta network (nothing is allocated, any size runs on a laptop).
:class:`SavedTensorPeak` follows the same tensors from pack to release during real work and keeps the peak of
what is held at once (as ``benchmarks/whole_step.py`` measures, storages counted once): the measurement the plan
is checked against on the twins. Plain torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: shared by views, real or fake


def saved_bytes(run: Callable[[], object], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs with grad (``exclude``: storage keys not
    counted, the weights')."""
    seen: dict[int, int] = {}
    held: list[Tensor] = []  # every saved storage stays alive until the count is done: no key is reused meanwhile

    def pack(t: Tensor) -> None:
        key = _storage_key(t)
        if key not in exclude:
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        held.append(t.detach())
        # the graph keeps nothing: a saved output handed back as itself would close the cycle output -> grad_fn ->
        # saved output, which no garbage collection frees (the forward would live as long as the process)

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _no_backward):
        run()
    return sum(seen.values())


def _no_backward(_) -> Tensor:
    raise RuntimeError("a forward run to count its saved bytes is not for backward")


def weight_keys(module: nn.Module) -> set[int]:
    return {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}


def traced_activation_bytes(build: Callable[[], nn.Module], inputs: Callable[[], dict]) -> int:
    """Saved bytes of ONE forward of the meta network ``build()`` returns, on ``inputs()`` (keyword arguments),
    traced in a ``FakeTensorMode`` (parameters, inputs and activations are fake tensors: shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from jagg_lightning.memory_plan.models import fake_network

    network = build()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_network(network)
        kwargs = inputs()
        return saved_bytes(lambda: network(**kwargs), weight_keys(network))


class SavedTensorPeak:
    """The peak bytes of tensors held by autograd graphs (saved for backward) while its hooks are active: each storage
    counted once, from its first pack to the release of its last saved reference (it holds detached tensors: no
    reference cycle, so what it measures is freed when it would be without it); ``exclude``: storage keys not
    counted (the weights). Use ``with torch.autograd.graph.saved_tensors_hooks(peak.pack, peak.unpack):``."""

    class _Held:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def __init__(self, exclude: set[int]):
        self.exclude, self.live, self.peak = exclude, 0, 0
        self.refs: dict[int, list[int]] = {}  # storage key -> [references held, bytes]

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def pack(self, t: Tensor):
        key = _storage_key(t)
        if key in self.exclude:
            return t
        entry = self.refs.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        # detached (the same storage, no grad_fn): the graph of a saved output never reaches back to itself, so a
        # graph that gets no backward is freed with its last reference, as it is without hooks
        held = self._Held(t.detach())
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, SavedTensorPeak._Held) else held
