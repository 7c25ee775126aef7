"""FEMNIST digits (NTK-DFL Fig. 10a, NTK-FL Fig. 4): LEAF's digit samples, partitioned by writer.

The fixture is a small LEAF dataset written by the test (two train files, one test file, labels across all
62 classes); the expectation is computed from the fixture directly.
"""

from __future__ import annotations

import numpy as np
import pytest

from ntk_fl import schema
from ntk_fl.config import load_config
from ntk_fl.data import partition
from ntk_fl.data.sources import DATA_DIR_ENV, load
from test_data_sources import _leaf_file, isolated  # noqa: F401  (the fixture)


def _fixture(root, rng):
  def user(n):
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 62, n)

  files = {
    "train/a.json": {"f0100_45": user(9), "f0007_12": user(7)},
    "train/b.json": {"f0500_01": user(8)},
    "test/a.json": {"f0007_12": user(5), "f0999_99": user(4)},
  }
  for name, users in files.items():
    _leaf_file(root / "femnist" / name, users)
  return files


def test_digits_keep_the_samples_labelled_0_to_9_with_their_writers(isolated):  # noqa: F811
  files = _fixture(isolated, np.random.default_rng(3))
  ds = load("femnist_digits", isolated, normalize=False, flatten=False)
  assert ds.num_classes == 10
  ids = {u: i for i, u in enumerate(sorted({u for users in files.values() for u in users}))}
  for split, names in (("train", ("train/a.json", "train/b.json")), ("test", ("test/a.json",))):
    records = [(u, x, y) for name in names for u, (x, y) in files[name].items()]
    keep = [y < 10 for _, _, y in records]
    want_y = np.concatenate([y[k] for (_, _, y), k in zip(records, keep)])
    want_w = np.concatenate([np.full(k.sum(), ids[u]) for (u, _, _), k in zip(records, keep)])
    want_x = np.concatenate([x[k] for (_, x, _), k in zip(records, keep)])
    assert 0 < len(want_y) < sum(len(y) for _, _, y in records)  # the fixture has letters to drop
    np.testing.assert_array_equal(getattr(ds, f"y_{split}"), want_y)
    np.testing.assert_array_equal(getattr(ds, f"writers_{split}"), want_w)
    np.testing.assert_allclose(getattr(ds, f"x_{split}")[..., 0] * 255, want_x, atol=1e-4)
  # by_writer: one client per writer, holding exactly that writer's digit samples.
  clients = partition(
    ds.y_train, "by_writer", len(set(ds.writers_train.tolist())), seed=0, writers=ds.writers_train
  )
  for members in clients:
    assert len(set(ds.writers_train[members].tolist())) == 1
  assert sorted(np.concatenate(clients).tolist()) == list(range(len(ds.y_train)))


def test_missing_data_says_where_to_put_the_files(isolated):  # noqa: F811
  with pytest.raises(FileNotFoundError) as err:
    load("femnist_digits", isolated)
  message = str(err.value)
  assert "No femnist_digits data found" in message and "femnist/{train,test}/" in message
  assert DATA_DIR_ENV in message and "LEAF" in message


def test_config_accepts_femnist_digits_by_writer_only_for_writer_datasets():
  config = load_config("ntk_dfl")
  config.data.name, config.data.partition = "femnist_digits", "by_writer"
  schema.validate_config(config)
  config.data.name = "mnist"
  with pytest.raises(ValueError, match="femnist_digits"):
    schema.validate_config(config)


def test_the_common_variant_selects_femnist_digits_by_writer():
  for name in ("ntk_dfl", "ntk_fl", "dfedavg"):
    config = load_config(name, "femnist_digits")
    assert (config.data.name, config.data.partition) == ("femnist_digits", "by_writer")
    schema.validate_config(config)
