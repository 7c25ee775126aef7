"""Partitions read from a file (index_map), the shipped authors' maps, their variants, the contiguous split."""

from __future__ import annotations

import gzip
import json
import os
import pickle

import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import data, rundir, runner, schema
from ntk_fl.data import index_map
from ntk_fl.data.partition import partition

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "ntk_fl", "configs")
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy.py")
FMNIST_LABELS = "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz"


def write_map(path, indices, offsets, **extra):
  np.savez(path, indices=np.asarray(indices), offsets=np.asarray(offsets), **extra)
  return str(path)


def fmnist_labels():
  if not os.path.exists(FMNIST_LABELS):
    pytest.fail(f"{FMNIST_LABELS} missing (Debian package dataset-fashion-mnist)")
  with gzip.open(FMNIST_LABELS) as f:
    return np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)


# ----------------------------------------------------------------------------- reading a map


def test_round_trip_keeps_every_client_in_the_file_order(tmp_path):
  clients = [
    np.array([5, 1, 3]),
    np.array([0]),
    np.array([9, 9, 2, 7]),
  ]  # unsorted, a repeat, reuse
  path = index_map.save_index_map(tmp_path / "m.npz", clients)
  with np.load(path) as f:
    assert f["indices"].dtype == np.int32 and f["offsets"].dtype == np.int32
    np.testing.assert_array_equal(f["offsets"], [0, 3, 4, 8])
  loaded = partition(np.zeros(10, np.int64), "index_map", 3, seed=0, partition_file=str(path))
  assert [c.tolist() for c in loaded] == [[5, 1, 3], [0], [9, 9, 2, 7]]
  assert all(c.dtype == np.int64 for c in loaded)


@pytest.mark.parametrize(
  "arrays,match",
  [
    (
      dict(indices=np.int32([1, 2]), offsets=np.int32([0, 1, 2]), extra=np.int32([0])),
      "exactly the arrays",
    ),
    (dict(indices=np.int32([1, 2])), "exactly the arrays"),
    (dict(indices=np.int64([1, 2]), offsets=np.int32([0, 1, 2])), "'indices' must be a 1-D int32"),
    (
      dict(indices=np.int32([1, 2]), offsets=np.float32([0, 1, 2])),
      "'offsets' must be a 1-D int32",
    ),
    (
      dict(indices=np.int32([[1, 2]]), offsets=np.int32([0, 1, 2])),
      "'indices' must be a 1-D int32",
    ),
    (dict(indices=np.int32([1, 2]), offsets=np.int32([1, 1, 2])), "must start at 0, got 1"),
    (
      dict(indices=np.int32([1, 2, 3]), offsets=np.int32([0, 2, 1, 3])),
      r"non-decreasing, but offsets\[2\] = 1",
    ),
    (
      dict(indices=np.int32([1, 2, 3]), offsets=np.int32([0, 1, 2])),
      "last offset must equal the number of indices",
    ),
    (dict(indices=np.int32([1, 2]), offsets=np.int32([0, 1, 1, 2])), "client 1 has no samples"),
    (dict(indices=np.int32([1, -2]), offsets=np.int32([0, 1, 2])), "must be >= 0, got -2"),
    (
      dict(indices=np.int32([1, 10]), offsets=np.int32([0, 1, 2])),
      r"index 10 is outside the training set of 10",
    ),
    (dict(indices=np.int32([]), offsets=np.int32([0])), "M \\+ 1 >= 2 entries"),
  ],
)
def test_a_malformed_map_is_named_and_explained(arrays, match, tmp_path):
  path = tmp_path / "bad.npz"
  np.savez(path, **arrays)
  with pytest.raises(ValueError, match=match) as info:
    index_map.load_index_map(str(path), num_samples=10)
  assert "bad.npz" in str(info.value)


def test_the_client_count_must_match_the_config(tmp_path):
  path = write_map(tmp_path / "m.npz", np.int32([0, 1, 2]), np.int32([0, 1, 3]))
  with pytest.raises(ValueError, match="holds 2 clients but config.data.num_clients = 3"):
    index_map.load_index_map(path, num_clients=3)


@pytest.mark.parametrize(
  "value,match",
  [
    ("", "must name an index map"),
    ("fmnist_alpha0.1_9", "neither a .npz index map nor a shipped map"),
    (
      "maps/user_dataidx_map_0.10_0.dat",
      "convert it first with `python -m ntk_fl.data.index_map convert",
    ),
    ("/no/such/map.npz", "no such file"),
  ],
)
def test_bad_partition_file_values(value, match):
  with pytest.raises(ValueError, match=match):
    index_map.resolve(value)


def test_not_an_npz_is_a_clear_error(tmp_path):
  path = tmp_path / "m.npz"
  path.write_bytes(b"not a zip file")
  with pytest.raises(ValueError, match="not a readable .npz file"):
    index_map.load_index_map(str(path))


def test_a_pickled_object_inside_the_npz_is_refused(tmp_path):
  path = tmp_path / "m.npz"
  np.savez(path, indices=np.array([np.int32(1), "x"], dtype=object), offsets=np.int32([0, 2]))
  with pytest.raises(ValueError, match="not a readable .npz file"):
    index_map.load_index_map(str(path))


# ----------------------------------------------------------------------------- the shipped maps


def test_every_shipped_map_exists_and_nothing_else_is_shipped():
  shipped = sorted(
    p.removesuffix(".npz") for p in os.listdir(index_map.VENDORED_DIR) if p.endswith(".npz")
  )
  assert shipped == sorted(index_map.VENDORED_MAPS) and len(shipped) == 28


@pytest.mark.parametrize("name", index_map.VENDORED_MAPS)
def test_shipped_maps_have_the_documented_sizes(name):
  clients = index_map.load_index_map(name, num_clients=300, num_samples=60_000)
  sizes = np.array([c.size for c in clients])
  used = np.concatenate(clients)
  assert all(np.unique(c).size == c.size for c in clients), "no sample twice within a client"
  if "iid" in name:
    assert (sizes == 200).all()
    np.testing.assert_array_equal(np.sort(used), np.arange(60_000))  # disjoint, every sample once
  else:
    assert 193 <= sizes.min() and sizes.max() <= 199
    assert 37_000 <= np.unique(used).size <= 38_000  # samples reused across clients


def test_alpha_0_1_draw_0_statistics_and_label_skew():
  clients = index_map.load_index_map("fmnist_alpha0.1_0", num_clients=300, num_samples=60_000)
  sizes = np.array([c.size for c in clients])
  assert (sizes.min(), sizes.max(), sizes.sum()) == (194, 199, 59_218)
  assert np.unique(np.concatenate(clients)).size == 37_882
  # The indices are in the IDX files' order: clients are label-skewed under the true labels only.
  labels = fmnist_labels()
  shuffled = np.random.default_rng(0).permutation(labels)

  def mean_entropy(lab):
    h = []
    for c in clients:
      p = np.bincount(lab[c], minlength=10) / c.size
      h.append(-(p[p > 0] * np.log(p[p > 0])).sum())
    return float(np.mean(h))

  assert mean_entropy(labels) == pytest.approx(0.82, abs=0.01)
  assert mean_entropy(shuffled) > 2.2


def test_a_shipped_map_is_the_same_as_the_path_to_its_file():
  by_name = index_map.load_index_map("fmnist_iid_1")
  by_path = index_map.load_index_map(str(index_map.VENDORED_DIR / "fmnist_iid_1.npz"))
  assert all(np.array_equal(a, b) for a, b in zip(by_name, by_path))


# ----------------------------------------------------------------------------- config variants


@pytest.mark.parametrize(
  "config_file", ["ntk_dfl", "dfedavg", "dpsgd", "spark", "ntk_fl", "cp_ntk_fl"]
)
@pytest.mark.parametrize(
  "variant,expected",
  [
    ("authors_alpha0.1", "fmnist_alpha0.1_0"),
    ("authors_alpha0.1_d3", "fmnist_alpha0.1_3"),
    ("authors_alpha0.5_d4", "fmnist_alpha0.5_4"),
    ("authors_iid", "fmnist_iid_0"),
    ("authors_iid_d2", "fmnist_iid_2"),
  ],
)
def test_authors_variants_select_the_shipped_file(config_file, variant, expected):
  config = config_lib.load_config(os.path.join(CONFIGS, f"{config_file}.py"), variant)
  assert config.data.partition == "index_map" and config.data.partition_file == expected
  assert config.data.num_clients == 300 and config.data.name == "fashion_mnist"
  if "alpha" in variant:
    assert config.data.alpha == float(variant.split("alpha")[1].split("_")[0])
  schema.validate_config(config)


@pytest.mark.parametrize(
  "variant,match",
  [
    ("authors_alpha0.7", r"no shipped partition 'fmnist_alpha0.7_0'"),
    ("authors_iid_d3", r"no shipped partition 'fmnist_iid_3'.*iid with draws 0-2"),
    ("authors_alpha0.1_dx", "the draw must be a number"),
    ("authors_dirichlet", "expected authors_alpha"),
  ],
)
def test_bad_authors_variants(variant, match):
  with pytest.raises(ValueError, match=match):
    config_lib.load_config(os.path.join(CONFIGS, "ntk_dfl.py"), variant)


def test_contiguous_variant():
  for name in ("ntk_fl", "cp_ntk_fl"):
    config = config_lib.load_config(os.path.join(CONFIGS, f"{name}.py"), "contiguous")
    assert config.data.partition == "contiguous" and config.data.samples_per_client == 200
    schema.validate_config(config)


# ----------------------------------------------------------------------------- checks before data loads


def toy(**overrides):
  config = config_lib.load_config(TOY_CONFIG, "smoke")
  config.update_from_flattened_dict(overrides)  # dotted keys: {"data.num_clients": 4}
  return config


@pytest.mark.parametrize(
  "overrides,match",
  [
    ({"data.partition": "index_map"}, "must name an index map"),
    ({"data.partition_file": "fmnist_iid_0"}, "only read by data.partition = 'index_map'"),
    (
      {"data.partition": "index_map", "data.partition_file": "fmnist_iid_0"},
      "is a fashion_mnist partition, but data.name = 'synthetic'",
    ),
    (
      {
        "data.partition": "index_map",
        "data.partition_file": "fmnist_iid_0",
        "data.name": "fashion_mnist",
      },
      "holds 300 clients but config.data.num_clients = 10",
    ),
    (
      {
        "data.partition": "index_map",
        "data.partition_file": "fmnist_iid_0",
        "data.name": "fashion_mnist",
        "data.num_clients": 300,
        "data.max_train": 500,
      },
      "needs max_train = 0",
    ),
  ],
)
def test_bad_index_map_configs_fail_before_data_loads(overrides, match, tmp_path, monkeypatch):
  monkeypatch.setattr(
    data.sources, "load", lambda *a, **k: pytest.fail("data loaded before validation")
  )
  with pytest.raises(ValueError, match=match):
    runner.run(toy(**overrides), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_out_of_range_fmnist_indices_fail_before_data_loads(tmp_path, monkeypatch):
  monkeypatch.setattr(
    data.sources, "load", lambda *a, **k: pytest.fail("data loaded before validation")
  )
  path = write_map(tmp_path / "m.npz", np.int32([0, 60_000]), np.int32([0, 1, 2]))
  config = toy(
    **{
      "data.partition": "index_map",
      "data.partition_file": path,
      "data.name": "fashion_mnist",
      "data.num_clients": 2,
    }
  )
  with pytest.raises(ValueError, match="index 60000 is outside the training set of 60000"):
    schema.validate_config(config)


def test_out_of_range_indices_of_other_datasets_fail_when_the_partition_is_built(tmp_path):
  path = write_map(tmp_path / "m.npz", np.int32(np.arange(1_000, 1_010)), np.int32(np.arange(11)))
  config = toy(**{"data.partition": "index_map", "data.partition_file": path})
  schema.validate_config(config)  # the synthetic set's size is known only once it is generated
  with pytest.raises(ValueError, match="index 1009 is outside the training set of 1000"):
    runner.build_experiment(config)


# ----------------------------------------------------------------------------- runs


def test_smoke_run_uses_the_map_in_its_order(tmp_path):
  rng = np.random.default_rng(0)
  clients = [rng.choice(1_000, size=20 + 3 * i, replace=False) for i in range(10)]
  path = index_map.save_index_map(tmp_path / "m.npz", clients)
  workdir = str(tmp_path / "run")
  runner.run(
    toy(**{"data.partition": "index_map", "data.partition_file": str(path), "rounds": 2}), workdir
  )
  with open(os.path.join(workdir, rundir.CONFIG_FILE)) as f:
    assert json.load(f)["data"]["partition_file"] == str(path)
  assert len(rundir.read_metrics(workdir)) == 2
  exp = runner.build_experiment(rundir.rebuild_config(workdir))
  np.testing.assert_array_equal(exp.federation.n, [c.size for c in clients])
  for m, c in enumerate(clients):  # client m's rows are its map entries, in the map's order
    np.testing.assert_array_equal(exp.federation.y[m, : c.size], exp.dataset.y_train[c])
    np.testing.assert_array_equal(exp.federation.x[m, : c.size], exp.dataset.x_train[c])


def test_ntk_fl_smoke_run_on_a_map_of_fashion_mnist(tmp_path):
  rng = np.random.default_rng(1)
  clients = [rng.choice(60_000, size=60, replace=False) for _ in range(20)]
  path = index_map.save_index_map(tmp_path / "m.npz", clients)
  config = config_lib.load_config(os.path.join(CONFIGS, "ntk_fl.py"), "smoke")
  config.data.partition = "index_map"
  config.data.partition_file = str(path)
  config.data.max_train = 0
  config.rounds = 1
  config.eval.selection = False
  config.checkpoint_every = 0
  summary = runner.run(config, str(tmp_path / "run"))
  metrics = rundir.read_metrics(str(tmp_path / "run"))
  assert len(metrics) == 1 and 0.3 < metrics[0]["test_acc"] <= 1.0, (summary, metrics)


# ----------------------------------------------------------------------------- contiguous


def test_contiguous_blocks_in_training_set_order():
  clients = partition(np.zeros(1_000, np.int64), "contiguous", 4, seed=3, samples_per_client=200)
  assert [c.tolist() for c in clients] == [list(range(200 * i, 200 * i + 200)) for i in range(4)]
  default = partition(np.zeros(1_001, np.int64), "contiguous", 4, seed=0)  # floor(N / M) = 250
  assert [(c[0], c[-1]) for c in default] == [(0, 249), (250, 499), (500, 749), (750, 999)]
  with pytest.raises(ValueError, match="samples_per_client=300 too large for contiguous"):
    partition(np.zeros(1_000, np.int64), "contiguous", 4, seed=0, samples_per_client=300)


def test_contiguous_at_paper_scale_is_the_ntk_fl_code_fallback():
  clients = partition(fmnist_labels(), "contiguous", 300, seed=0, samples_per_client=200)
  np.testing.assert_array_equal(np.concatenate(clients), np.arange(60_000))
  assert clients[7].tolist() == list(range(1_400, 1_600))


# ----------------------------------------------------------------------------- the converter


def test_converter_writes_the_npz_of_a_pickled_map(tmp_path):
  rng = np.random.default_rng(2)
  mapping = {i: rng.choice(500, size=5 + i, replace=False) for i in range(6)}
  source = tmp_path / "user_dataidx_map_0.10_0.dat"
  with open(source, "wb") as f:
    pickle.dump(dict(reversed(list(mapping.items()))), f, protocol=2)  # keys stored out of order
  target = tmp_path / "m.npz"
  assert index_map.main(["convert", str(source), str(target)]) == 0
  loaded = index_map.load_index_map(str(target), num_clients=6)
  for i in range(6):
    np.testing.assert_array_equal(loaded[i], mapping[i])


def test_converter_refuses_a_pickle_that_builds_arbitrary_objects(tmp_path, capsys):
  source = tmp_path / "evil.dat"
  with open(source, "wb") as f:
    pickle.dump({0: np.arange(3), 1: os.system}, f)
  assert index_map.main(["convert", str(source), str(tmp_path / "m.npz")]) == 2
  assert capsys.readouterr().err.startswith("error: ")
  assert not (tmp_path / "m.npz").exists()


@pytest.mark.parametrize(
  "mapping,match",
  [
    ({0: np.arange(3), 2: np.arange(2)}, r"client ids must be the integers 0 .. 1"),
    ({0: np.arange(3), 1: np.zeros((2, 2), np.int64)}, "client 1 must map to a 1-D integer array"),
    ([np.arange(3)], "expected a non-empty dict"),
  ],
)
def test_converter_checks_the_pickled_structure(mapping, match, tmp_path):
  source = tmp_path / "m.dat"
  with open(source, "wb") as f:
    pickle.dump(mapping, f)
  with pytest.raises(ValueError, match=match):
    index_map.read_pickled_map(source)


def test_converter_names_a_truncated_pickle(tmp_path):
  source = tmp_path / "cut.dat"
  source.write_bytes(pickle.dumps({0: np.arange(3)})[:-5])
  with pytest.raises(ValueError, match="cut.dat"):
    index_map.read_pickled_map(source)
