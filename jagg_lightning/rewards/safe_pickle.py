"""A pickle reader for plain data only: what a Flow-GRPO reward server answers, never code, never unbounded.

``pickle.loads`` runs whatever callable a pickle names (``os.system``, a class's ``__reduce__``): reading an
answer from a server is then running the server's code. :func:`loads_plain` rebuilds only

- the containers and scalars pickle writes with its own opcodes (dict, list, tuple, str, bytes, int, float,
  bool, None) and ``set`` / ``frozenset`` / ``complex`` / ``bytearray`` (how older protocols write them);
- numpy arrays and numpy scalars whose dtype is plain: bool, integer, float, complex, or a fixed-width string
  (kinds ``b i u f c U S``); an object, structured (void) or datetime dtype is refused.

numpy's own pickles need a few of its globals -- ``ndarray``, ``dtype``, ``_reconstruct`` (protocols <= 4),
``_frombuffer`` (protocol 5, Python 3.14's default) and ``scalar`` --, under ``numpy.core`` (numpy 1) or
``numpy._core`` (numpy 2); exactly those are allowed, each wrapped so it builds nothing else. Every other global
is refused before it is imported, with one line naming it (:class:`UnsafePickleError`). The rebuilt value is
walked once more (each object once, however often it is referenced), so whatever got through is plain data.

Nothing is allocated before its size is checked against two caps (:class:`PickleLimits`, named in the refusal):

- ``max_answer_bytes``: the pickle itself, and every buffer a call can make larger than the bytes it was given --
  ``bytearray(n)``, a numpy array's ``shape x itemsize``, a dtype's itemsize. Buffers written in the pickle's own
  opcodes (``BINBYTES8``, ``BYTEARRAY8``, ``BINUNICODE8`` ...) declare their length before their bytes, and
  CPython's unpickler allocates that length before reading; the opcodes are therefore walked first
  (``pickletools.genops``, which reads what is there and allocates nothing from a declared length): a length past
  the end of the pickle is refused there, so every such buffer is at most the pickle's size.
- ``max_answer_items``: the opcodes of the pickle (each element of a container is pushed by at least one, so this
  bounds every list, tuple, dict and set it builds), and the elements of a numpy array (a zero-width string dtype
  makes ``shape`` free in bytes).
"""

from __future__ import annotations

import builtins
import io
import math
import pickle
import pickletools
from dataclasses import dataclass

import numpy as np

PLAIN_KINDS = "biufcUS"  # bool, int, uint, float, complex, unicode, bytes
MAX_ANSWER_BYTES = 64 << 20  # a Flow-GRPO answer for 64 images is a few kB
MAX_ANSWER_ITEMS = 1_000_000


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that is not plain data, or past a cap; the message names what it tried to load, or the cap."""


@dataclass(frozen=True)
class PickleLimits:
    """The caps :func:`loads_plain` holds an answer to (module docstring); each > 0."""

    max_answer_bytes: int = MAX_ANSWER_BYTES
    max_answer_items: int = MAX_ANSWER_ITEMS

    def __post_init__(self):
        for field in ("max_answer_bytes", "max_answer_items"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")

    def check_bytes(self, size: int, what: str) -> None:
        if size > self.max_answer_bytes:
            raise UnsafePickleError(f"refused {what} of {size} bytes: more than max_answer_bytes="
                                    f"{self.max_answer_bytes}")

    def check_array(self, shape, dtype: np.dtype) -> None:
        """A plain array of ``shape`` and ``dtype`` fits both caps (checked in Python integers: no overflow)."""
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise UnsafePickleError(f"refused array shape {shape!r}: not non-negative integers")
        count = math.prod(int(d) for d in dims)
        if count > self.max_answer_items:
            raise UnsafePickleError(f"refused an array of {count} elements: more than max_answer_items="
                                    f"{self.max_answer_items}")
        self.check_bytes(count * dtype.itemsize, f"an array of shape {tuple(int(d) for d in dims)}")


def _plain_dtype(dtype: np.dtype) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.kind not in PLAIN_KINDS or dtype.hasobject or dtype.names:
        raise UnsafePickleError(f"refused numpy dtype {dtype!r}: only plain dtypes (bool, int, float, complex, "
                                f"str, bytes) are read")
    return dtype


class _Globals:
    """The allowed globals of one read, each wrapped to build only plain data within ``limits``."""

    def __init__(self, limits: PickleLimits):
        self.limits = limits
        self.ndarray_global = self.ndarray  # one object: what numpy's pickles hand _reconstruct as the subtype

    def dtype(self, *args):
        dtype = _plain_dtype(np.dtype(*args))
        self.limits.check_bytes(dtype.itemsize, f"numpy dtype {dtype!r}")  # a scalar of it is that large
        return dtype

    def ndarray(self, shape, dtype=float, buffer=None, offset=0, strides=None, order=None):
        """``numpy.ndarray(...)`` called by a pickle: a plain dtype, within the caps, over a bytes buffer if any."""
        dtype = self.dtype(dtype)
        self.limits.check_array(shape, dtype)
        if buffer is not None and not isinstance(buffer, (bytes, bytearray)):
            raise UnsafePickleError(f"refused array buffer of type {type(buffer).__name__}")
        return np.ndarray(shape, dtype, buffer, offset, strides, order)

    def reconstruct(self, subtype, shape, dtype_code):
        if subtype is not self.ndarray_global:  # an ndarray subclass runs its own code on __setstate__/__array_finalize__
            raise UnsafePickleError(f"refused array subtype {subtype!r}")
        dtype = self.dtype(dtype_code)
        self.limits.check_array(shape, dtype)
        return np.ndarray.__new__(np.ndarray, shape, dtype)

    def frombuffer(self, buffer, dtype, shape, order):
        if not isinstance(buffer, (bytes, bytearray, memoryview)):
            raise UnsafePickleError(f"refused array buffer of type {type(buffer).__name__}")
        dtype = _plain_dtype(dtype)
        self.limits.check_array(shape, dtype)
        array = np.frombuffer(buffer, dtype=dtype)
        if order == "F":
            return array.reshape(shape, order="F").copy(order="F")
        return array.reshape(shape).copy()

    @staticmethod
    def scalar(dtype, data=None):
        from numpy._core.multiarray import scalar

        return scalar(_plain_dtype(dtype), data) if data is not None else scalar(_plain_dtype(dtype))

    def bytearray(self, source=b"", *args):
        """``bytearray(n)`` allocates n zero bytes from a few bytes of pickle: n is checked first."""
        size = source if isinstance(source, int) else len(source) if hasattr(source, "__len__") else None
        if size is None:
            raise UnsafePickleError(f"refused bytearray of a {type(source).__name__}")
        self.limits.check_bytes(int(size), "a bytearray")
        return bytearray(source, *args)

    @staticmethod
    def latin1(text, encoding="latin1"):
        # protocol 2 writes bytes as _codecs.encode(str, "latin1"); any other codec (zlib, ...) is not plain data
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise UnsafePickleError(f"refused _codecs.encode with encoding {encoding!r}")
        return text.encode("latin1")

    def allowed(self) -> dict:
        numpy = {"ndarray": self.ndarray_global, "dtype": self.dtype, "_reconstruct": self.reconstruct,
                 "_frombuffer": self.frombuffer, "scalar": self.scalar}
        return {
            **{(module, name): value for module in ("numpy.core.multiarray", "numpy._core.multiarray",
                                                    "numpy.core.numeric", "numpy._core.numeric", "numpy")
               for name, value in numpy.items()},
            **{(module, name): getattr(builtins, name) for module in ("builtins", "__builtin__")
               for name in ("set", "frozenset", "complex")},
            **{(module, "bytearray"): self.bytearray for module in ("builtins", "__builtin__")},
            ("_codecs", "encode"): self.latin1,
        }


ALLOWED = frozenset(_Globals(PickleLimits()).allowed())  # (module, name) of every global a pickle may name


class PlainUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose globals are :data:`ALLOWED`'s (wrapped), and no persistent ids."""

    def __init__(self, file, limits: PickleLimits = PickleLimits()):
        super().__init__(file)
        self._allowed = _Globals(limits).allowed()

    def find_class(self, module: str, name: str):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refused to load {module}.{name}: the answer must be plain data "
                                    f"(containers, numbers, strings, numpy arrays of plain dtypes)") from None

    def persistent_load(self, pid):
        raise UnsafePickleError("refused a persistent id: the answer must be plain data")


def _check_opcodes(data: bytes, limits: PickleLimits) -> None:
    """Before anything is built: the pickle within ``max_answer_bytes``, at most ``max_answer_items`` opcodes, and
    every declared length within the pickle (``genops`` raises ``ValueError`` on one past its end)."""
    limits.check_bytes(len(data), "a pickle")
    count = 0
    for _ in pickletools.genops(io.BytesIO(data)):
        count += 1
        if count > limits.max_answer_items:
            raise UnsafePickleError(f"refused a pickle of more than {limits.max_answer_items} opcodes: more than "
                                    f"max_answer_items={limits.max_answer_items}")


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))


def _check_plain(value, depth: int = 0, seen: set | None = None) -> None:
    seen = set() if seen is None else seen
    if depth > 100:
        raise UnsafePickleError("refused: the answer is nested more than 100 deep")
    if id(value) in seen:  # a pickle may reference one object many times (memo): each is walked once
        return
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:
            raise UnsafePickleError(f"refused array subtype {type(value).__name__}")
        _plain_dtype(value.dtype)
    elif isinstance(value, np.generic):
        _plain_dtype(value.dtype)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, depth + 1, seen)
            _check_plain(item, depth + 1, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _check_plain(item, depth + 1, seen)
    elif not isinstance(value, _SCALARS):
        raise UnsafePickleError(f"refused a value of type {type(value).__name__}")


def loads_plain(data: bytes, limits: PickleLimits = PickleLimits()):
    """``pickle.loads(data)`` restricted to plain data within ``limits`` (module docstring);
    :class:`UnsafePickleError` naming what it refused or the cap it passed, ``pickle.UnpicklingError`` (or
    ``ValueError``, ``EOFError`` ...) when ``data`` is no pickle at all."""
    _check_opcodes(data, limits)
    try:
        value = PlainUnpickler(io.BytesIO(data), limits).load()
    except RecursionError:
        raise UnsafePickleError("refused: the answer is nested too deeply") from None
    _check_plain(value)
    return value
