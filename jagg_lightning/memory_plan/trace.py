"""Activation memory by tracing: the bytes autograd saves for backward, counted by saved-tensor hooks.

:func:`saved_bytes` runs one forward of a network under ``torch.autograd.graph.saved_tensors_hooks`` and sums the
storage bytes of every tensor saved for backward, each storage once, the network's own weights excluded: the unit
of ``Sampler.activation_bytes`` (and of ``memory.budget_mb``). :func:`traced_activation_bytes` does it in a
``FakeTensorMode`` on a fake copy of a meta network (nothing is allocated, any size runs on a laptop).
:class:`SavedTensorPeak` follows the same tensors from pack to release during real work and keeps the peak of
what is held at once (as ``benchmarks/whole_step.py`` measures, storages counted once): the measurement the plan
is checked against on the twins. :class:`UniformValues` answers what a forward asks of its data where that data is
one value throughout (a branch on ``torch.all(x == 0)``, a boolean mask), so such a forward traces too. Plain torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary


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
    traced in a ``FakeTensorMode`` (parameters, inputs and activations are fake tensors: shapes only) under
    :class:`UniformValues` (the inputs' masks and zeros keep their values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from jagg_lightning.memory_plan.models import fake_network

    network = build()
    with FakeTensorMode(allow_non_fake_inputs=True), UniformValues():
        fake_network(network)
        kwargs = inputs()
        return saved_bytes(lambda: network(**kwargs), weight_keys(network))


class UniformValues(TorchFunctionMode):
    """Values a shape-only trace can still know: a tensor made by ``zeros`` / ``ones`` / ``full`` (or their ``_like``
    and ``new_`` forms) holds one value throughout, and so does the result of an elementwise op or a whole-tensor
    reduction of such tensors (computed once on that value: ``==``, ``~``, ``.bool()``, ``torch.all`` ...). A forward
    that asks the data then gets the answer the real forward gets on the same inputs: ``bool(t)`` / ``t.item()`` of a
    uniform one-element ``t`` is its value (views and rows keep a tensor's value), and a uniform boolean mask indexes
    as all of ``x`` or none of it (``x[mask]``: ``mask.numel()`` or 0 rows of ``x``'s remaining shape). HunyuanVideo
    1.5's forward needs both (its text-to-video branch on ``torch.all(image_embeds == 0)``, its valid-tokens-first
    reorder by the masks). A question about a tensor of unknown values fails as it does without the mode. (The masks
    a real ``x[mask]`` saves for backward, a byte per token, are not counted.)"""

    CREATE = {torch.zeros: 0, torch.ones: 1, torch.zeros_like: 0, torch.ones_like: 1, Tensor.new_zeros: 0,
              Tensor.new_ones: 1}
    FILL = {torch.full: 1, torch.full_like: 1, Tensor.new_full: 2}  # the fill value's argument position
    ELEMENTWISE = {Tensor.bool, Tensor.long, Tensor.int, Tensor.float, Tensor.to, Tensor.__eq__, Tensor.__ne__,
                   Tensor.eq, Tensor.ne, torch.eq, torch.ne, Tensor.__invert__, torch.logical_not, Tensor.logical_not,
                   Tensor.__and__, Tensor.__or__, torch.all, Tensor.all, torch.any, Tensor.any}
    # views and copies of one tensor: the same value (iterating over rows: ``__iter__``, above)
    SAME = {Tensor.unbind, torch.unbind, Tensor.select, Tensor.__getitem__, Tensor.view, Tensor.reshape,
            Tensor.transpose, Tensor.unsqueeze, Tensor.squeeze, Tensor.expand, Tensor.repeat, Tensor.contiguous,
            Tensor.clone, Tensor.flatten}

    def __init__(self):
        super().__init__()
        self.value = WeakTensorKeyDictionary()  # tensor -> its one value, a real 0-d tensor of its dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.__bool__, Tensor.item) and args[0] in self.value and args[0].numel() == 1:
            return func(self.value[args[0]])
        if func is Tensor.__getitem__ and isinstance(args[1], Tensor) and args[1].dtype == torch.bool \
                and args[1] in self.value:
            x, mask = args
            rows = x.reshape(-1, *x.shape[mask.dim():])
            return rows.clone() if bool(self.value[mask]) else rows[:0].clone()
        if func is Tensor.__iter__ and args[0] in self.value:  # its rows, each the same one value
            rows = args[0].unbind(0)
            for row in rows:
                self.value[row] = self.value[args[0]]
            return iter(rows)
        out = func(*args, **kwargs)
        if func in self.SAME and args and isinstance(args[0], Tensor) and args[0] in self.value:
            for part in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(part, Tensor):
                    self.value[part] = self.value[args[0]]
            return out
        if not isinstance(out, Tensor):
            return out
        if func in self.CREATE or func in self.FILL:
            fill = self.CREATE.get(func)
            if fill is None:
                position = self.FILL[func]
                fill = kwargs.get("fill_value", args[position] if len(args) > position else None)
            if isinstance(fill, (bool, int, float)):
                self.value[out] = torch.tensor(fill, dtype=out.dtype, device="cpu")
        elif func in self.ELEMENTWISE:
            self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func, args, kwargs, out: Tensor) -> None:
        """``out``'s value, where every tensor argument has one: ``func`` on the 0-d values (outside the fake mode)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if not tensors or any(t not in self.value for t in tensors):
            return
        swap = lambda a: self.value[a] if isinstance(a, Tensor) else a  # noqa: E731
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        args = tuple(a for a in args if not isinstance(a, torch.device))
        try:
            with unset_fake_temporarily():
                value = func(*map(swap, args), **{k: swap(v) for k, v in kwargs.items()})
        except (RuntimeError, IndexError, TypeError):  # an argument a 0-d value cannot take (a dim): left unknown
            return
        if isinstance(value, Tensor) and value.dim() == 0:
            self.value[out] = value.to(out.dtype)


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
