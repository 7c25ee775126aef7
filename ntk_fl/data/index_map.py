"""Client partitions stored in a file: the compressed-sparse-row (CSR) index map.

A partition of ``M`` clients is two integer arrays in one ``.npz`` file:

* ``indices``: ``[T]`` int32, every client's training-set indices, client after client;
* ``offsets``: ``[M + 1]`` int32, non-decreasing, ``offsets[0] = 0`` and
  ``offsets[M] = T``; client ``i`` holds ``indices[offsets[i]:offsets[i + 1]]``
  in the file's order.

Indices point into the dataset's standard training-set order (for
Fashion-MNIST, the order of ``train-images-idx3-ubyte``). The file is the
partition as given: a sample may belong to several clients (the NTK papers'
partitions reuse samples across clients), and a repeated index within a client
counts that sample twice.

The package ships the 28 Fashion-MNIST partitions of the NTK-FL / NTK-DFL authors
(``ntk_fl/data/partitions/``; provenance and statistics in
``ntk_fl/data/partitions/README.md``). They are named ``fmnist_alpha<α>_<draw>``
(α ∈ {0.1, ..., 0.5}, draws 0-4) and ``fmnist_iid_<draw>`` (draws 0-2), and
``config.data.partition_file`` accepts such a name as well as a path.

:func:`read_pickled_map` reads the authors' original pickled ``.dat`` maps
(``dict`` client id -> index array) through the restricted unpickler, and
``python -m ntk_fl.data.index_map convert IN.dat OUT.npz`` writes the ``.npz``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import zipfile
from pathlib import Path
from collections.abc import Sequence

import numpy as np

# The shipped maps' names live in a leaf, so that reading a config variant that names one
# (``authors_alpha0.1``) loads no data code; re-exported here, where the maps are read.
from ntk_fl._src.names import (
  AUTHORS_ALPHAS,  # noqa: F401
  AUTHORS_DIRICHLET_DRAWS,  # noqa: F401
  AUTHORS_IID_DRAWS,  # noqa: F401
  VENDORED_DATASET,  # noqa: F401
  VENDORED_MAPS,
  authors_map_name,
)

__all__ = [
  "VENDORED_DIR",
  "VENDORED_MAPS",
  "TRAIN_SIZES",
  "authors_map_name",
  "resolve",
  "load_index_map",
  "check_index_map",
  "save_index_map",
  "read_pickled_map",
  "convert",
  "main",
]

VENDORED_DIR = Path(__file__).resolve().parent / "partitions"
"""Folder of the index maps shipped with the package."""

TRAIN_SIZES = {"fashion_mnist": 60_000, "cifar10": 50_000, "emnist_digits": 240_000}
"""Training-set sizes of the datasets that have exactly one standard file set.

Used to check a map's indices before any data loads; for the other datasets
(MNIST has a 50k and a 60k form, FEMNIST and synthetic vary) the check happens
when the partition is built."""

_KEYS = ("indices", "offsets")


def resolve(partition_file: str) -> Path:
  """The file behind ``config.data.partition_file``: a shipped map's name, or a path.

  A value without a path separator and without a suffix that names a shipped map
  (:data:`VENDORED_MAPS`) resolves to that map; anything else is a path.

  Raises ``ValueError`` for an empty value or a path that is not a ``.npz`` file.
  """
  if not isinstance(partition_file, (str, os.PathLike)) or not str(partition_file):
    raise ValueError(
      "config.data.partition_file must name an index map: a .npz path or one of the "
      f"shipped maps {VENDORED_MAPS[0]!r} ... {VENDORED_MAPS[-1]!r}; got {partition_file!r}"
    )
  text = str(partition_file)
  if text in VENDORED_MAPS:
    return VENDORED_DIR / f"{text}.npz"
  path = Path(text).expanduser()
  if path.suffix == ".dat":
    raise ValueError(
      f"config.data.partition_file = {text!r} is a pickled map; convert it first with "
      f"`python -m ntk_fl.data.index_map convert {text} OUT.npz`"
    )
  if path.suffix != ".npz":
    raise ValueError(
      f"config.data.partition_file = {text!r} is neither a .npz index map nor a shipped "
      f"map name (e.g. {VENDORED_MAPS[0]!r})"
    )
  if not path.is_file():
    raise ValueError(f"config.data.partition_file = {text!r}: no such file")
  return path


def is_vendored(partition_file: str) -> bool:
  return isinstance(partition_file, str) and partition_file in VENDORED_MAPS


def load_index_map(
  partition_file: str | os.PathLike,
  *,
  num_clients: int | None = None,
  num_samples: int | None = None,
) -> list[np.ndarray]:
  """Reads and checks a CSR index map; returns ``M`` int64 index arrays in the file's order.

  Args:
    partition_file: a ``.npz`` path or a shipped map's name (:func:`resolve`).
    num_clients: when given, the map must have exactly this many clients.
    num_samples: when given, every index must lie in ``[0, num_samples)``.

  Raises:
    ValueError: naming the file and what is wrong with it (:func:`check_index_map`).
  """
  path = resolve(partition_file)
  if not zipfile.is_zipfile(path):
    raise ValueError(
      f"index map {str(path)!r} is not a readable .npz file: not a zip archive (of "
      ".npy arrays); write one with ntk_fl.data.index_map.save_index_map or "
      "`python -m ntk_fl.data.index_map convert`"
    )
  try:
    arrays = _read_bounded(path, num_clients=num_clients, num_samples=num_samples)
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    raise ValueError(f"index map {str(path)!r} is not a readable .npz file: {e}") from e
  return check_index_map(arrays, num_clients=num_clients, num_samples=num_samples, source=str(path))


def _read_bounded(path: Path, *, num_clients: int | None, num_samples: int | None) -> dict:
  """The arrays of an index-map ``.npz``, declared shapes checked before anything is allocated.

  A client holds at most as many entries as the training set has samples
  (``num_samples``; the largest standard training set when unknown), so a map
  holds at most ``M * num_samples`` indices for its ``M`` clients: a header
  declaring more (2^28 zeros compress to 1 MB) is refused unread.
  """
  samples = num_samples or max(TRAIN_SIZES.values())
  arrays = {}
  with zipfile.ZipFile(path) as archive:
    members = {name.removesuffix(".npy"): name for name in archive.namelist()}
    if set(members) != set(_KEYS):
      raise ValueError(f"expected exactly the arrays {list(_KEYS)}, got {sorted(members)}")
    for key in ("offsets", "indices"):
      info = archive.getinfo(members[key])
      with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        read_header = (
          np.lib.format.read_array_header_1_0
          if version == (1, 0)
          else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(f)
        count = math.prod(shape)
        if key == "offsets":  # a client holds at least one sample: at most `samples` clients
          limit, what = samples + 1, f"a map over {samples} training samples can have"
        else:
          limit = max(arrays["offsets"].size - 1, 1) * samples
          what = f"{arrays['offsets'].size - 1} clients over {samples} training samples can hold"
        if count > limit:
          raise ValueError(f"its header declares {count} {key}, more than the {limit} {what}")
        if dtype.hasobject:
          raise ValueError(f"{key!r} holds Python objects; an index map holds int32 arrays")
        data = f.read(count * dtype.itemsize + 1)
      if len(data) != count * dtype.itemsize:
        more = " or more" if len(data) > count * dtype.itemsize else ""
        raise ValueError(
          f"{key!r} holds {len(data)} bytes{more} but its header declares {count} of {dtype}"
        )
      arrays[key] = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
  return arrays


def check_index_map(
  arrays: dict,
  *,
  num_clients: int | None = None,
  num_samples: int | None = None,
  source: str = "index map",
) -> list[np.ndarray]:
  """Validates ``{'indices', 'offsets'}`` (see the module docstring) and splits it into clients."""
  keys = set(arrays)
  if keys != set(_KEYS):
    raise ValueError(f"{source}: expected exactly the arrays {list(_KEYS)}, got {sorted(keys)}")
  indices, offsets = arrays["indices"], arrays["offsets"]
  for key, array in (("indices", indices), ("offsets", offsets)):
    if array.dtype != np.int32 or array.ndim != 1:
      raise ValueError(
        f"{source}: {key!r} must be a 1-D int32 array, got shape {array.shape} dtype {array.dtype}"
      )
  if offsets.size < 2:
    raise ValueError(
      f"{source}: 'offsets' must have M + 1 >= 2 entries (M clients), got {offsets.size}"
    )
  if offsets[0] != 0:
    raise ValueError(f"{source}: 'offsets' must start at 0, got {int(offsets[0])}")
  steps = np.diff(offsets.astype(np.int64))
  if (steps < 0).any():
    i = int(np.argmax(steps < 0))
    raise ValueError(
      f"{source}: 'offsets' must be non-decreasing, but offsets[{i + 1}] = "
      f"{int(offsets[i + 1])} < offsets[{i}] = {int(offsets[i])}"
    )
  if offsets[-1] != indices.size:
    raise ValueError(
      f"{source}: the last offset must equal the number of indices ({indices.size}), "
      f"got {int(offsets[-1])}"
    )
  clients = steps.size
  if num_clients is not None and clients != num_clients:
    raise ValueError(
      f"{source} holds {clients} clients but config.data.num_clients = {num_clients}; "
      f"set --config.data.num_clients={clients}"
    )
  if (steps == 0).any():
    empty = np.flatnonzero(steps == 0)
    raise ValueError(
      f"{source}: client {int(empty[0])} has no samples ({empty.size} empty clients); "
      "every client needs at least one"
    )
  if indices.size and indices.min() < 0:
    raise ValueError(f"{source}: indices must be >= 0, got {int(indices.min())}")
  if num_samples is not None and indices.size and indices.max() >= num_samples:
    raise ValueError(
      f"{source}: index {int(indices.max())} is outside the training set of "
      f"{num_samples} samples (indices must lie in [0, {num_samples}))"
    )
  return np.split(indices.astype(np.int64), offsets[1:-1].astype(np.int64))


def save_index_map(path: str | os.PathLike, clients: Sequence[np.ndarray]) -> Path:
  """Writes ``clients`` (index arrays, in order) as a compressed CSR ``.npz``; returns the path.

  Raises ``ValueError`` for an index that does not fit int32 or a non-integer array.
  """
  parts = []
  for i, c in enumerate(clients):
    c = np.asarray(c)
    if c.ndim != 1 or not (np.issubdtype(c.dtype, np.integer) or c.size == 0):
      raise ValueError(
        f"client {i}: indices must be a 1-D integer array, got shape {c.shape} dtype {c.dtype}"
      )
    if c.size and (c.min() < 0 or c.max() > np.iinfo(np.int32).max):
      raise ValueError(f"client {i}: indices must lie in [0, 2^31), got [{c.min()}, {c.max()}]")
    parts.append(c.astype(np.int32))
  if not parts:
    raise ValueError("no clients to write")
  offsets = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int32)
  path = Path(path)
  if path.suffix != ".npz":
    raise ValueError(f"an index map is written as .npz, got {str(path)!r}")
  np.savez_compressed(path, indices=np.concatenate(parts), offsets=offsets)
  return path


def read_pickled_map(path: str | os.PathLike) -> list[np.ndarray]:
  """Client index arrays from a pickled ``dict`` client id -> indices (the authors' ``.dat`` files).

  The file is read with the restricted unpickler (:mod:`ntk_fl.data.safe_pickle`),
  which builds only plain containers and numpy arrays. Client ids must be the
  integers ``0 .. M-1`` (in any key order); client ``i``'s indices keep their
  stored order.

  Raises ``ValueError`` for anything else, naming the file.
  """
  import pickle  # pylint: disable=import-outside-toplevel -- for its error type only

  from ntk_fl.data import safe_pickle  # pylint: disable=import-outside-toplevel

  try:
    mapping = safe_pickle.load_file(path, encoding="latin1")
  except (pickle.UnpicklingError, EOFError) as e:  # UnsafePickleError is a ValueError and passes
    if isinstance(e, ValueError):
      raise
    raise ValueError(f"{str(path)!r} is not a readable pickle: {e}") from e
  if not isinstance(mapping, dict) or not mapping:
    raise ValueError(
      f"{str(path)!r}: expected a non-empty dict client id -> index array, got "
      f"{type(mapping).__name__}"
    )
  ids = sorted(mapping)
  if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in ids) or [
    int(k) for k in ids
  ] != list(range(len(ids))):
    raise ValueError(
      f"{str(path)!r}: client ids must be the integers 0 .. {len(ids) - 1}, got "
      f"{ids[:5]}{' ...' if len(ids) > 5 else ''}"
    )
  clients = []
  for k in ids:
    c = np.asarray(mapping[k])
    if c.ndim != 1 or not np.issubdtype(c.dtype, np.integer):
      raise ValueError(
        f"{str(path)!r}: client {k} must map to a 1-D integer array, got shape "
        f"{c.shape} dtype {c.dtype}"
      )
    clients.append(c)
  return clients


def convert(source: str | os.PathLike, target: str | os.PathLike) -> Path:
  """Pickled ``.dat`` map -> CSR ``.npz`` (checked by reading it back)."""
  clients = read_pickled_map(source)
  path = save_index_map(target, clients)
  load_index_map(path, num_clients=len(clients))
  return path


def _summary(clients: list[np.ndarray]) -> str:
  sizes = np.array([c.size for c in clients])
  unique = np.unique(np.concatenate(clients)).size
  return (
    f"{len(clients)} clients, {sizes.min()}-{sizes.max()} samples each (mean {sizes.mean():.1f}), "
    f"{sizes.sum()} indices, {unique} unique"
  )


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m ntk_fl.data.index_map",
    description="Convert and inspect client index maps (CSR .npz).",
  )
  commands = parser.add_subparsers(dest="command", required=True)
  conv = commands.add_parser("convert", help="pickled .dat map (dict client -> indices) -> .npz")
  conv.add_argument("source")
  conv.add_argument("target")
  show = commands.add_parser("show", help="summarise a .npz map or a shipped map's name")
  show.add_argument("partition_file")
  args = parser.parse_args(argv)
  try:
    if args.command == "convert":
      path = convert(args.source, args.target)
      print(f"wrote {path}: {_summary(load_index_map(path))}")
    else:
      print(f"{resolve(args.partition_file)}: {_summary(load_index_map(args.partition_file))}")
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
