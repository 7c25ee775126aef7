"""``ntk_fl.data.load`` on a real prepared tensorflow-datasets directory (needs the ``tfds`` extra).

A tiny ``fashion_mnist`` (50 train / 20 test random images) is prepared on disk
with TFDS itself (``TfDataBuilder``: the same ``dataset_info.json`` +
TFRecord layout ``download_and_prepare`` writes) and read back offline through
``ntk_fl.data.load`` from the ``data_dir`` argument. TensorFlow is a 250 MB install, so the default test
environment (``scripts/setup.sh``) does not have it and these tests skip there;
run them after ``pip install -e '.[tfds]'``. The error paths without TensorFlow
are covered everywhere by tests/test_data_sources.py.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="needs the tfds extra (pip install -e '.[tfds]')")
tfds = pytest.importorskip(
  "tensorflow_datasets", reason="needs the tfds extra (pip install -e '.[tfds]')"
)

from ntk_fl.data import sources  # noqa: E402  (after the skips)

_SIZES = {"train": 50, "test": 20}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """A prepared TFDS data directory holding a tiny fashion_mnist; returns (directory, {split: (pixels, labels)})."""
  root = tmp_path_factory.mktemp("tfds")
  rng = np.random.default_rng(0)
  data = {
    split: (rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, n))
    for split, n in _SIZES.items()
  }
  builder = tfds.dataset_builders.TfDataBuilder(
    name="fashion_mnist",
    version="3.0.1",
    data_dir=str(root),
    split_datasets={
      split: tf.data.Dataset.from_tensor_slices({"image": x, "label": y})
      for split, (x, y) in data.items()
    },
    features=tfds.features.FeaturesDict(
      {
        "image": tfds.features.Image(shape=(28, 28, 1)),
        "label": tfds.features.ClassLabel(num_classes=10),
      }
    ),
  )
  builder.download_and_prepare()
  assert (root / "fashion_mnist" / "3.0.1" / "dataset_info.json").is_file()
  return root, data


@pytest.fixture
def only_tfds(monkeypatch, tmp_path):
  """No IDX files anywhere (empty system root, no $NTK_FL_DATA_DIR): the TFDS directory is the only source."""
  monkeypatch.delenv(sources.DATA_DIR_ENV, raising=False)
  monkeypatch.setattr(sources, "_SYSTEM_ROOT", tmp_path / "system")


def _check(dataset, data):
  (x_train, y_train), (x_test, y_test) = data["train"], data["test"]
  # TFDS's order within a split is its own (it shuffles by key): compare as sets of (image, label) pairs.
  for x, y, want_x, want_y in (
    (dataset.x_train, dataset.y_train, x_train, y_train),
    (dataset.x_test, dataset.y_test, x_test, y_test),
  ):
    assert x.shape == (len(want_y), 28, 28, 1) and x.dtype == np.float32 and y.dtype == np.int32
    pixels = np.rint(x * 255).astype(np.uint8)
    np.testing.assert_allclose(x * 255, pixels, atol=1e-3)
    got = sorted((int(label), image.tobytes()) for image, label in zip(pixels, y))
    want = sorted((int(label), image.tobytes()) for image, label in zip(want_x, want_y))
    assert got == want


def test_load_reads_a_prepared_tfds_directory(prepared, only_tfds):
  root, data = prepared
  dataset = sources.load("fashion_mnist", root, normalize=False, flatten=False)
  _check(dataset, data)
  # Normalised and flattened like every other source.
  normalised = sources.load("fashion_mnist", root)
  assert normalised.x_train.shape == (_SIZES["train"], 784)
  assert abs(float(normalised.x_train.min()) - (0 - 0.2860) / 0.3530) < 1e-5
