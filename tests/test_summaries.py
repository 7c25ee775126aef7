"""TensorBoard event files (ntk_fl.summaries) and the command's console and log file (ntk_fl.cli).

The event files are read back with tests/events.py (a small TFRecord reader and
tensorboardX's protobuf classes: no TensorFlow or TensorBoard needed), and every
scalar is compared with the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from events import purge_steps, read_events, scalars_by_step
from ntk_fl import cli, rundir, summaries

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy.py")


def test_round_scalars_groups_and_skips_missing_values():
  line = {
    "round": 4,
    "step_time": 0.5,
    "eval_time": 0.25,
    "test_acc": 0.8,
    "test_loss": 0.6,
    "deviation": 0.01,
    "client_acc_mean": 0.7,
    "client_acc_min": 0.5,
    "client_acc_max": 0.9,
    "client_loss_mean": 1.1,
    "consensus_acc_mean": None,
    "tau_mean": 250.0,
    "tau_min": 100.0,
    "tau_max": 400.0,
    "loss_mean": 0.4,
    "bits_sent_total": 1e9,
    "bits_cumulative": 4e9,
    "lr": 0.01,
    "stopped": True,
    "clients": {"tau": [100, 400, 100, 400, 200, 300], "test_acc": [0.5, 0.9]},
  }
  assert summaries.round_scalars(line) == {
    "time/step_s": 0.5,
    "time/eval_s": 0.25,
    "accuracy/aggregated": 0.8,
    "loss/aggregated": 0.6,
    "deviation/inter_client": 0.01,
    "accuracy/client_mean": 0.7,
    "accuracy/client_min": 0.5,
    "accuracy/client_max": 0.9,
    "loss/client_mean": 1.1,
    "tau/mean": 250.0,
    "tau/min": 100.0,
    "tau/max": 400.0,
    "train_loss/mean": 0.4,
    "communication/bits_sent_total": 1e9,
    "communication/bits_cumulative": 4e9,
    "algorithm/lr": 0.01,
    "tau/clients_at_100": 2.0,
    "tau/clients_at_200": 1.0,
    "tau/clients_at_300": 1.0,
    "tau/clients_at_400": 2.0,
  }


def test_a_later_first_round_purges_the_earlier_writers_rounds(tmp_path):
  with summaries.EventWriter(tmp_path) as writer:
    writer.write_all({"round": r, "test_acc": r / 10} for r in (1, 2, 3))
  with summaries.EventWriter(tmp_path, first_round=3) as writer:  # a run resumed after round 2
    writer.write({"round": 3, "test_acc": 0.35})
  events = read_events(str(tmp_path))
  assert purge_steps(events) == [3]  # TensorBoard drops the first writer's events from step 3 on
  assert [e.step for e in events if e.summary.value] == [1, 2, 3, 3]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("console") / "run")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # let jax probe its backends
  env["PYTHONPATH"] = REPO
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "experiments", "main.py"),
      f"--config={TOY_CONFIG}:smoke",
      f"--workdir={workdir}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir, proc


def test_event_files_hold_every_rounds_metrics(toy_run):
  workdir, _ = toy_run
  lines = rundir.read_metrics(workdir)
  by_step = scalars_by_step(read_events(workdir))
  assert sorted(by_step) == [line["round"] for line in lines] == [1, 2, 3, 4]
  for line in lines:
    got = by_step[line["round"]]
    assert got["accuracy/aggregated"] == pytest.approx(line["test_acc"], rel=1e-6)
    assert got["loss/aggregated"] == pytest.approx(line["test_loss"], rel=1e-6)
    assert got["deviation/inter_client"] == pytest.approx(line["deviation"], rel=1e-6)
    for stat in ("mean", "min", "max"):
      assert got[f"accuracy/client_{stat}"] == pytest.approx(line[f"client_acc_{stat}"], rel=1e-6)
    assert got["algorithm/lr"] == pytest.approx(line["lr"], rel=1e-6)
    assert set(got) == set(summaries.round_scalars(line))
  histograms = {
    (e.step, v.tag) for e in read_events(workdir) for v in e.summary.value if v.HasField("histo")
  }
  assert {(r, "clients/test_acc") for r in (1, 2, 3, 4)} <= histograms


def test_console_shows_the_bar_and_the_result_and_the_log_goes_to_the_workdir(toy_run):
  workdir, proc = toy_run
  # No absl INFO lines and no backend probing on the console: they are in log.txt.
  assert not [l for l in proc.stderr.splitlines() if l[:1] in "IW" and l[1:5].isdigit()], (
    proc.stderr
  )
  assert "Unable to initialize backend" not in proc.stderr
  assert "toy_gd" in proc.stderr and "4/4" in proc.stderr and "acc=" in proc.stderr  # the tqdm bar
  # While round 1 compiles, the bar says so; from round 1 on it shows the method's name alone.
  assert "toy_gd: compiling round 1:   0%" in proc.stderr and "toy_gd: 100%" in proc.stderr
  summary = json.load(open(os.path.join(workdir, rundir.SUMMARY_FILE)))
  closing = proc.stdout.strip().splitlines()[-1]
  assert closing.startswith(
    f"toy_gd: 4 rounds, final aggregated accuracy {summary['final_test_acc']:.4f}"
  )
  assert workdir in closing
  log = open(os.path.join(workdir, cli.LOG_FILE)).read()
  assert "Unable to initialize backend" not in log  # JAX's probe of absent platforms is not news
  for r in (1, 2, 3, 4):
    assert f"round {r}: aggregated acc" in log
  assert "Finished" in log


def test_verbosity_minus_one_keeps_only_warnings_in_the_log(tmp_path):
  workdir = str(tmp_path / "quiet")
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "experiments", "main.py"),
      f"--config={TOY_CONFIG}:smoke",
      "--config.rounds=1",
      f"--workdir={workdir}",
      "--verbosity=-1",
    ],
    cwd=REPO,
    env={**os.environ, "PYTHONPATH": REPO},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "aggregated acc" not in open(os.path.join(workdir, cli.LOG_FILE)).read()


def test_the_config_is_in_the_event_files_as_hparams_and_text(toy_run):
  from tensorboardX.proto import plugin_hparams_pb2  # pylint: disable=g-import-not-at-top

  workdir, _ = toy_run
  config = json.load(open(os.path.join(workdir, rundir.CONFIG_FILE)))
  values = [v for e in read_events(workdir) for v in e.summary.value]
  start = [v for v in values if v.tag == "_hparams_/session_start_info"]
  assert len(start) == 1
  data = plugin_hparams_pb2.HParamsPluginData.FromString(start[0].metadata.plugin_data.content)
  got = {}
  for name, value in data.session_start_info.hparams.items():
    got[name] = value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
  expected = summaries.hparams_of(config)
  assert set(got) == set(expected) and "data.alpha" in got and "algorithm.lr" in got
  for name, value in expected.items():
    if isinstance(value, bool):
      assert got[name] is value, name
    elif isinstance(value, (int, float)):
      assert got[name] == pytest.approx(value), name
    else:
      assert got[name] == value, name
  experiment = [v for v in values if v.tag == "_hparams_/experiment"]
  tags = {
    m.name.tag
    for m in plugin_hparams_pb2.HParamsPluginData.FromString(
      experiment[0].metadata.plugin_data.content
    ).experiment.metric_infos
  }
  assert {"accuracy/aggregated", "loss/aggregated"} <= tags
  text = [v for v in values if v.tag.startswith("config")]
  assert len(text) == 1
  shown = b"".join(text[0].tensor.string_val).decode()
  assert json.loads(shown.strip("`\n")) == config


def test_hparams_of_flattens_and_keeps_tensorboards_types():
  config = {
    "seed": 0,
    "data": {"alpha": 0.1, "name": "mnist"},
    "model": {"hidden": [100, 10]},
    "eval": {"selection": True},
    "x": None,
  }
  assert summaries.hparams_of(config) == {
    "seed": 0,
    "data.alpha": 0.1,
    "data.name": "mnist",
    "model.hidden": "[100, 10]",
    "eval.selection": True,
    "x": "null",
  }
