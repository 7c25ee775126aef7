"""Several JAX processes standing in for several hosts: ``experiments/main.py --num_processes=2``.

Each distributed run is 2 processes x 2 forced CPU devices (``XLA_FLAGS=
--xla_force_host_platform_device_count=2``), joined by ``jax.distributed`` with
gloo collectives: 4 devices, 5 of the 20 smoke clients on each, each process
computing and keeping its own 10. The reference is the same config run in this
pytest process (one process, one device).

Tolerance: the two runs compute the same float32 programs, but the distributed
one is partitioned differently (the neighbour mixing gathers clients across
devices, reductions over clients are split into per-device partial sums), so
sums may be reordered: relative differences of a few float32 ulps per round,
grown by three rounds of training. Losses, deviations and per-client values are
compared with ``rtol = 1e-4`` (observed: at most 7e-7 relative, in the clients'
NTK losses, over 3 NTK-DFL rounds; 140x below the bound, which still catches a
client computed on the wrong data or a lost update). Accuracies count correct
predictions among 2,000 test samples; a reordered sum can flip a prediction that
sits on a tie, so they may differ by at most 2 samples (0.001; observed: equal).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from ntk_fl import cli, distributed, rundir, runner
from ntk_fl.config import load_config
from ntk_fl.data.federation import block_layout

REPO = pathlib.Path(__file__).resolve().parents[1]
MAIN = REPO / "experiments" / "main.py"
RTOL, ACC_ATOL = 1e-4, 1e-3
TIMEOUT = 600


def _reference(tmp_path, name: str, **overrides) -> list[dict]:
  """The smoke run of ``name`` in this (one-device) process."""
  config = load_config(str(REPO / "configs" / f"{name}.py"), "smoke")
  for key, value in overrides.items():
    config[key] = value
  workdir = tmp_path / f"{name}_reference"
  runner.run(config, str(workdir))
  return rundir.read_metrics(str(workdir))


def _launch(workdir, name: str, *extra: str) -> subprocess.Popen:
  """``main.py --num_processes=2`` on the smoke config, 2 devices per process; output in ``workdir.log``."""
  env = {
    **os.environ,
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "PYTHONPATH": str(REPO),
  }
  log = open(f"{workdir}.log", "w")  # closed with the process (the launcher inherits it)
  return subprocess.Popen(
    [
      sys.executable,
      str(MAIN),
      f"--config={REPO / 'configs' / name}.py:smoke",
      f"--workdir={workdir}",
      "--num_processes=2",
      *extra,
    ],
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
    cwd=REPO,
  )


def _wait(proc: subprocess.Popen, workdir) -> str:
  proc.wait(timeout=TIMEOUT)
  with open(f"{workdir}.log") as f:
    return f.read()


def _compare(lines: list[dict], reference: list[dict]) -> None:
  assert [line["round"] for line in lines] == [line["round"] for line in reference]
  for line, ref in zip(lines, reference):
    keys = sorted(set(ref) - {"step_time", "eval_time", "clients"})
    assert sorted(set(line) - {"step_time", "eval_time", "clients"}) == keys
    for key in keys:
      atol = ACC_ATOL if "acc" in key else 0.0
      np.testing.assert_allclose(
        line[key], ref[key], rtol=RTOL, atol=atol, err_msg=f"round {ref['round']} {key}"
      )
    assert sorted(line["clients"]) == sorted(ref["clients"])
    for key, values in ref["clients"].items():
      atol = ACC_ATOL * 10 if "acc" in key else 0.0  # one client's accuracy: on 2,000 samples too
      np.testing.assert_allclose(
        line["clients"][key],
        values,
        rtol=RTOL,
        atol=atol,
        err_msg=f"round {ref['round']} clients.{key}",
      )


def _only_process_0_wrote(workdir, console: str, rounds: int) -> None:
  # Both processes appending would double the lines; both logging or printing would repeat the closing lines.
  assert len(rundir.read_metrics(str(workdir))) == rounds
  assert console.count("Outputs in ") == 1, console[-3000:]
  log = (workdir / cli.LOG_FILE).read_text()
  assert log.count("Finished ") == 1, log[-3000:]
  for name in ("summary.json", "config.json", "accuracy.png", "selection.png"):
    assert (workdir / name).is_file(), name


def _each_process_held_only_its_blocks(workdir, name: str) -> None:
  """Each process kept only its 2 devices' sample blocks, far fewer rows than the training set (process 0's log)."""
  exp = runner.build_experiment(load_config(str(REPO / "configs" / f"{name}.py"), "smoke"))
  num_samples = exp.dataset.x_train.shape[0]
  layout = block_layout(exp.client_indices, num_samples, 4)
  log = (workdir / cli.LOG_FILE).read_text()
  found = re.findall(
    r"processes hold (\d+) / (\d+) of the (\d+) training samples' rows \(one block of (\d+) rows",
    log,
  )
  assert found, log[-3000:]
  *held, total, size = map(int, found[-1])
  assert (total, size) == (num_samples, layout.block_size)
  for rank, rows in enumerate(held):
    assert rows == 2 * layout.block_size
    # The samples its 10 clients use, once each (the partition reuses samples across clients).
    used = np.unique(np.concatenate(exp.client_indices[10 * rank : 10 * rank + 10])).size
    assert used <= rows < num_samples // 2


@pytest.mark.slow  # a one-process reference run, then a two-process run: minutes (CI: -m slow)
def test_two_processes_equal_one_process_dfedavg(tmp_path):
  reference = _reference(tmp_path, "dfedavg")
  workdir = tmp_path / "dfedavg_2proc"
  proc = _launch(workdir, "dfedavg")
  log = _wait(proc, workdir)
  assert proc.returncode == 0, log[-5000:]
  _only_process_0_wrote(workdir, log, len(reference))
  _each_process_held_only_its_blocks(workdir, "dfedavg")
  _compare(rundir.read_metrics(str(workdir)), reference)


@pytest.mark.slow  # two two-process NTK-DFL runs (a kill, then a resume): minutes (CI: -m slow)
def test_killed_process_resumes_to_the_same_numbers_ntk_dfl(tmp_path):
  """NTK-DFL over 2 processes; process 1 is killed mid-run, the run is resumed by both: the one-process numbers."""
  rounds, flags = 6, ("--config.rounds=6", "--config.checkpoint_every=1")
  reference = _reference(tmp_path, "ntk_dfl", rounds=rounds)
  workdir = tmp_path / "ntk_dfl_2proc"
  proc = _launch(workdir, "ntk_dfl", *flags)
  metrics = workdir / rundir.METRICS_FILE
  deadline = time.monotonic() + TIMEOUT
  # Two rounds logged: the checkpoint after round 1 (checkpoint_every = 1) is final, saved before round 2 ran.
  while not (metrics.is_file() and len(rundir.read_metrics(str(workdir))) >= 2):
    assert proc.poll() is None, _wait(proc, workdir)[-5000:]
    assert time.monotonic() < deadline
    time.sleep(0.05)
  children = psutil.Process(proc.pid).children()
  rank_1 = [c for c in children if "--process_id=1" in c.cmdline()]
  assert len(children) == 2 and len(rank_1) == 1, [c.cmdline() for c in children]
  rank_1[0].send_signal(signal.SIGKILL)
  log = _wait(proc, workdir)
  assert proc.returncode != 0, "the launcher must report the killed process"
  done = len(rundir.read_metrics(str(workdir)))
  assert done < rounds, "the run ended before the kill; nothing was resumed"
  assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children), (
    "a process outlived the launcher"
  )

  proc = _launch(workdir, "ntk_dfl", *flags, "--resume")
  log = _wait(proc, workdir)
  assert proc.returncode == 0, log[-5000:]
  _each_process_held_only_its_blocks(workdir, "ntk_dfl")
  assert "Resuming" in (workdir / cli.LOG_FILE).read_text()
  _only_process_0_wrote(workdir, log, rounds)
  _compare(rundir.read_metrics(str(workdir)), reference)


def test_launcher_stops_the_others_when_one_process_fails(tmp_path):
  """Rank 1 fails at once; rank 0 (which would wait an hour) is stopped and rank 1's status returned."""
  script = tmp_path / "rank.py"
  script.write_text(
    "import sys, time\n"
    "rank = int([a for a in sys.argv if a.startswith('--process_id=')][0].split('=')[1])\n"
    "open(sys.argv[1] + f'.{rank}', 'w').write(' '.join(sys.argv[2:]))\n"
    "if rank == 0:\n  time.sleep(3600)\n"
    "import os\n"
    "while not os.path.exists(sys.argv[1] + '.0'):  # fail once rank 0 is surely running\n"
    "  time.sleep(0.05)\n"
    "sys.exit(3)\n"
  )
  started = time.monotonic()
  status = distributed.launch_local([sys.executable, str(script), str(tmp_path / "args")], 2)
  assert status == 3
  assert time.monotonic() - started < 60
  for rank in (0, 1):
    args = (tmp_path / f"args.{rank}").read_text().split()
    assert args[:2] == [f"--process_id={rank}", "--num_processes=2"]
    assert args[2].startswith("--coordinator_address=localhost:")


def test_strip_flags_removes_only_the_named_flags():
  argv = [
    "--config=c.py",
    "--num_processes=2",
    "--num_processes",
    "3",
    "--num_processes_x=1",
    "--workdir=w",
  ]
  assert distributed.strip_flags(argv, ["num_processes"]) == [
    "--config=c.py",
    "--num_processes_x=1",
    "--workdir=w",
  ]
