"""A pickle reader for plain data only: what a Flow-GRPO reward server answers, never code.

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
walked once more, so whatever got through is plain data.
"""

from __future__ import annotations

import builtins
import io
import pickle

import numpy as np

PLAIN_KINDS = "biufcUS"  # bool, int, uint, float, complex, unicode, bytes


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that is not plain data; the message names the class or function it tried to load."""


def _plain_dtype(dtype: np.dtype) -> np.dtype:
    if not isinstance(dtype, np.dtype) or dtype.kind not in PLAIN_KINDS or dtype.hasobject or dtype.names:
        raise UnsafePickleError(f"refused numpy dtype {dtype!r}: only plain dtypes (bool, int, float, complex, "
                                f"str, bytes) are read")
    return dtype


def _dtype(*args):
    return _plain_dtype(np.dtype(*args))


def _reconstruct(subtype, shape, dtype_code):
    if subtype is not np.ndarray:  # an ndarray subclass runs its own code on __setstate__/__array_finalize__
        raise UnsafePickleError(f"refused array subtype {subtype!r}")
    return np.ndarray.__new__(np.ndarray, shape, _dtype(dtype_code))


def _frombuffer(buffer, dtype, shape, order):
    if not isinstance(buffer, (bytes, bytearray, memoryview)):
        raise UnsafePickleError(f"refused array buffer of type {type(buffer).__name__}")
    array = np.frombuffer(buffer, dtype=_plain_dtype(dtype))
    if order == "F":
        return array.reshape(shape, order="F").copy(order="F")
    return array.reshape(shape).copy()


def _scalar(dtype, data=None):
    from numpy._core.multiarray import scalar

    return scalar(_plain_dtype(dtype), data) if data is not None else scalar(_plain_dtype(dtype))


def _latin1(text, encoding="latin1"):
    # protocol 2 writes bytes as _codecs.encode(str, "latin1"); any other codec (zlib, ...) is not plain data
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"refused _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


_NUMPY = {"ndarray": np.ndarray, "dtype": _dtype, "_reconstruct": _reconstruct, "_frombuffer": _frombuffer,
          "scalar": _scalar}
ALLOWED = {
    **{(module, name): value for module in ("numpy.core.multiarray", "numpy._core.multiarray",
                                            "numpy.core.numeric", "numpy._core.numeric", "numpy")
       for name, value in _NUMPY.items()},
    **{(module, name): getattr(builtins, name) for module in ("builtins", "__builtin__")
       for name in ("set", "frozenset", "complex", "bytearray")},
    ("_codecs", "encode"): _latin1,
}


class PlainUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose globals are :data:`ALLOWED`'s, and no persistent ids."""

    def find_class(self, module: str, name: str):
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refused to load {module}.{name}: the answer must be plain data "
                                    f"(containers, numbers, strings, numpy arrays of plain dtypes)") from None

    def persistent_load(self, pid):
        raise UnsafePickleError("refused a persistent id: the answer must be plain data")


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))


def _check_plain(value, depth: int = 0) -> None:
    if depth > 100:
        raise UnsafePickleError("refused: the answer is nested more than 100 deep")
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:
            raise UnsafePickleError(f"refused array subtype {type(value).__name__}")
        _plain_dtype(value.dtype)
    elif isinstance(value, np.generic):
        _plain_dtype(value.dtype)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, depth + 1)
            _check_plain(item, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _check_plain(item, depth + 1)
    elif not isinstance(value, _SCALARS):
        raise UnsafePickleError(f"refused a value of type {type(value).__name__}")


def loads_plain(data: bytes):
    """``pickle.loads(data)`` restricted to plain data (module docstring); :class:`UnsafePickleError` naming
    what it refused, ``pickle.UnpicklingError`` (or ``EOFError`` ...) when ``data`` is no pickle at all."""
    try:
        value = PlainUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise UnsafePickleError("refused: the answer is nested too deeply") from None
    _check_plain(value)
    return value
