"""Unpickling data files without letting them run code.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import any
callable by name and ``REDUCE`` calls it, so ``pickle.load`` on a crafted file
runs ``os.system``, ``builtins.exec`` or anything else importable. The data
formats ntk_fl reads as pickles (``mnist.pkl.gz``, CIFAR-10 python batches, the
pickled partition maps of the reference codes) only ever need numpy arrays of
plain numbers inside tuples, lists, dicts, strings, bytes and numbers, so
:func:`loads` resolves exactly the globals that rebuild those and refuses every
other one with :class:`UnsafePickleError`, before anything is called.

The allow-list (:data:`ARRAY_GLOBALS`), resolved to numpy's own functions:

=================================================  =========================================
global (as written by numpy 1.x / 2.x, Python 2/3)  what it rebuilds
=================================================  =========================================
``numpy.core.multiarray._reconstruct`` (and        an ``ndarray`` (protocols 0-4)
``numpy._core.multiarray._reconstruct``)
``numpy.core.numeric._frombuffer`` (and            a contiguous ``ndarray`` (protocol 5)
``numpy._core.numeric._frombuffer``)
``numpy.ndarray``                                  the class passed to ``_reconstruct``
``numpy.dtype``                                    a dtype, of a kind in ``dtype_kinds`` only
``numpy.core.multiarray.scalar`` (and ``_core``)   a numpy scalar (``np.int64(3)`` as a dict key)
``_codecs.encode`` (``'latin1'`` only)             ``bytes`` in a protocol-2 pickle from Python 3
``builtins.bytes`` / ``__builtin__.bytes``         ``b''`` in a protocol-2 pickle (no arguments
                                                   or a bytes-like argument only)
``builtins.set``, ``builtins.frozenset`` (and      sets (protocol < 4 pickles them by name)
``__builtin__.``)
=================================================  =========================================

Dtypes are restricted to the kinds in ``dtype_kinds`` (default ``"biufc"``:
bool, signed and unsigned integers, floats, complex): no object arrays (whose
elements would be further pickled objects), no structured or void dtypes.
Callers that need a wider set (a format with another type) pass
``extra_globals={(module, name): callable}``; every entry there is trusted code,
so add only constructors that cannot reach the file system, the network or the
interpreter.

Usage::

  from ntk_fl.data import safe_pickle
  splits = safe_pickle.loads(raw_bytes, source=path, encoding="latin1")   # Python-2 pickles
  partition = safe_pickle.load_file("dict_users.dat")                    # dict[int, int array]
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
from typing import Any
from collections.abc import Callable, Mapping

import numpy as np

__all__ = ["ARRAY_GLOBALS", "DEFAULT_DTYPE_KINDS", "UnsafePickleError", "load_file", "loads"]

DEFAULT_DTYPE_KINDS = "biufc"


class UnsafePickleError(pickle.UnpicklingError, ValueError):
  """A pickle names a global outside the allow-list (or a dtype outside the allowed kinds).

  A ``ValueError`` too, so callers that report bad data files as ``ValueError``
  report this one the same way.
  """


def _numpy_reconstructors() -> dict[str, Callable]:
  """numpy's own pickle helpers, found from how numpy itself reduces an array and a scalar."""
  array = np.zeros(1, np.float32)
  return {
    "_reconstruct": array.__reduce__()[0],
    "_frombuffer": array.__reduce_ex__(5)[0],
    "scalar": np.float32(0).__reduce__()[0],
  }


def _latin1_encode(text, encoding="utf-8", errors="strict"):
  """``_codecs.encode`` as protocol-2 pickles from Python 3 use it for ``bytes``: latin-1 only."""
  if not isinstance(text, str) or encoding.replace("-", "").replace("_", "").lower() != "latin1":
    raise UnsafePickleError(
      f"_codecs.encode is allowed only as encode(str, 'latin1'), got encoding {encoding!r}"
    )
  return text.encode("latin1", errors)


def _bytes(*args):
  """``bytes()`` / ``bytes(bytes_like)`` only (``bytes(n)`` with a huge ``n`` would only waste memory)."""
  if len(args) > 1 or (args and not isinstance(args[0], (bytes, bytearray, memoryview))):
    raise UnsafePickleError(
      f"bytes(...) is allowed with no argument or a bytes-like one, got {args!r}"
    )
  return bytes(*args)


def _array_globals() -> dict[tuple[str, str], Callable]:
  numpy_fns = _numpy_reconstructors()
  table: dict[tuple[str, str], Callable] = {("numpy", "ndarray"): np.ndarray}
  for core in ("numpy.core", "numpy._core"):  # numpy 1.x writes the first, numpy 2.x the second
    table[(f"{core}.multiarray", "_reconstruct")] = numpy_fns["_reconstruct"]
    table[(f"{core}.multiarray", "scalar")] = numpy_fns["scalar"]
    table[(f"{core}.numeric", "_frombuffer")] = numpy_fns["_frombuffer"]
  table[("_codecs", "encode")] = _latin1_encode
  for builtins in ("builtins", "__builtin__"):  # Python 3 / Python 2 module name
    table[(builtins, "bytes")] = _bytes
    table[(builtins, "set")] = set
    table[(builtins, "frozenset")] = frozenset
  return table


#: ``(module, name)`` -> the object it resolves to; ``numpy.dtype`` is added per call (it checks the kind).
ARRAY_GLOBALS: Mapping[tuple[str, str], Callable] = _array_globals()


def _checked_dtype(dtype_kinds: str, source: str) -> Callable:
  def dtype(spec, align=False, copy=False):
    result = np.dtype(spec, align, copy)
    if result.kind not in dtype_kinds or result.fields is not None or result.subdtype is not None:
      raise UnsafePickleError(
        f"{source}: refused to unpickle an array of dtype {result!r} (kind {result.kind!r}); allowed kinds: "
        f"{dtype_kinds!r} (b bool, i/u integers, f floats, c complex)"
      )
    return result

  return dtype


class _RestrictedUnpickler(pickle.Unpickler):
  """``pickle.Unpickler`` whose ``find_class`` only looks names up in an allow-list."""

  def __init__(
    self, file, *, source: str, allowed: Mapping[tuple[str, str], Callable], encoding: str
  ):
    super().__init__(file, encoding=encoding, fix_imports=False)
    self._source = source
    self._allowed = allowed

  def find_class(self, module: str, name: str):
    found = self._allowed.get((module, name))
    if found is None:
      raise UnsafePickleError(
        f"{self._source}: refused to unpickle global '{module}.{name}': this data file may only hold numpy "
        "arrays of numbers in tuples, lists, dicts, strings and numbers (a pickle naming other globals can run "
        "code; see ntk_fl.data.safe_pickle)"
      )
    return found

  def persistent_load(self, pid):
    raise UnsafePickleError(
      f"{self._source}: refused a persistent id {pid!r} (plain data files have none)"
    )


def loads(
  data: bytes,
  *,
  source: str | os.PathLike = "<bytes>",
  encoding: str = "ASCII",
  dtype_kinds: str = DEFAULT_DTYPE_KINDS,
  extra_globals: Mapping[tuple[str, str], Callable] | None = None,
) -> Any:
  """Unpickles ``data``, admitting only the globals of :data:`ARRAY_GLOBALS` (plus ``extra_globals``).

  Args:
    data: the pickle bytes (already decompressed).
    source: names the file in error messages.
    encoding: how Python-2 ``str`` objects are decoded (``"latin1"`` for numpy
      arrays in Python-2 pickles, ``"bytes"`` to keep them as bytes, e.g. the
      CIFAR-10 batches' dict keys).
    dtype_kinds: numpy dtype kinds arrays may have (default bool/int/uint/float/complex).
    extra_globals: more ``(module, name) -> callable`` entries (trusted code; see the module docstring).

  Raises:
    UnsafePickleError: the pickle names a global outside the allow-list (nothing it
      names is imported or called) or an array dtype outside ``dtype_kinds``.
    pickle.UnpicklingError, EOFError, ...: a malformed pickle, as ``pickle.loads``.
  """
  source = os.fspath(source)
  allowed = {
    **ARRAY_GLOBALS,
    ("numpy", "dtype"): _checked_dtype(dtype_kinds, source),
    **(extra_globals or {}),
  }
  try:
    unpickler = _RestrictedUnpickler(
      io.BytesIO(data), source=source, allowed=allowed, encoding=encoding
    )
    result = unpickler.load()
  except (MemoryError, OverflowError) as err:  # an array constructor asked for an absurd size
    raise UnsafePickleError(
      f"{source}: refused an array of impossible size ({type(err).__name__}: {err})"
    ) from None
  _check_arrays(result, dtype_kinds, source, len(data))
  return result


def _check_arrays(obj, dtype_kinds: str, source: str, size: int) -> None:
  """Every array has an allowed dtype and holds no more bytes than the pickle's ``size`` carried.

  ``numpy.ndarray(shape, 'O')`` would bypass the dtype global; ``numpy.ndarray(shape,
  dtype, buffer, 0, strides)`` with zero strides, or without a buffer, makes an
  array far larger than the bytes the file holds (a 138-byte file, 2^28 indices).
  """
  pending, seen, total = [obj], set(), 0
  while pending:
    item = pending.pop()
    if isinstance(item, np.ndarray):
      if item.dtype.kind not in dtype_kinds or item.dtype.fields is not None:
        raise UnsafePickleError(
          f"{source}: refused an array of dtype {item.dtype!r}; allowed kinds: {dtype_kinds!r}"
        )
      if item.size > 1 and not (item.flags.c_contiguous or item.flags.f_contiguous):
        raise UnsafePickleError(
          f"{source}: refused a strided array (shape {item.shape}, strides "
          f"{item.strides}): a data file holds every element of its arrays"
        )
      if id(item) not in seen:
        seen.add(id(item))
        total += item.nbytes
        if total > size:
          raise UnsafePickleError(
            f"{source}: its arrays claim {total} bytes or more, but the "
            f"pickle holds only {size}: refused (a data file holds every "
            "element of its arrays)"
          )
    elif isinstance(item, dict):
      pending.extend(item.keys())
      pending.extend(item.values())
    elif isinstance(item, (list, tuple, set, frozenset)):
      pending.extend(item)


def load_file(path: str | os.PathLike, *, max_bytes: int = 1 << 29, **kwargs) -> Any:
  """:func:`loads` of the file at ``path`` (gzip-compressed if it starts with the gzip magic bytes).

  At most ``max_bytes`` (512 MiB) are decompressed; a larger stream is refused.
  """
  with open(path, "rb") as f:
    gzipped = f.read(2) == b"\x1f\x8b"
  with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
    data = f.read(max_bytes + 1)  # never more: a small gzip file may expand without bound
  if len(data) > max_bytes:
    raise UnsafePickleError(
      f"{path}: decompresses to more than {max_bytes} bytes; refused (a data "
      "file of this kind is smaller)"
    )
  return loads(data, source=kwargs.pop("source", path), **kwargs)
