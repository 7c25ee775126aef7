"""The generic runner, its checkpoints and experiments/main.py, on the toy method (tests/toy_method.py).

The reference run goes through ``experiments/main.py`` in a subprocess (with a
``--config.rounds`` override); the in-process interrupted-and-resumed run must
reproduce its every logged number exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

import events
import toy_method
from ntk_fl import config as config_lib
from ntk_fl import data, metrics, models, plotting, rundir, runner, schema
from ntk_fl.checkpoint import CheckpointDamaged, Checkpoints, state_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_CONFIG = os.path.join(REPO, "tests", "configs", "toy.py")
ROUNDS = 5  # smoke has 4; the override makes checkpoints at 2, 4 and 5 (the end)
TIMES = ("step_time", "eval_time")
SUMMARY_TIMES = ("wall_time", "train_time", "time_per_round", "step_time_per_round", "resumed_from")


def toy_config(arg: str = "smoke", **overrides):
  config = config_lib.load_config(TOY_CONFIG, arg)
  config.rounds = ROUNDS
  config.update_from_flattened_dict(overrides)  # dotted keys: {"data.num_clients": 4}
  return config


def main_py(*args, timeout=240):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, os.path.join(REPO, "experiments", "main.py"), *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("reference") / "run")
  proc = main_py(
    "--config=tests/configs/toy.py:smoke", f"--config.rounds={ROUNDS}", f"--workdir={workdir}"
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(workdir, rundir.SUMMARY_FILE)) as f:
    summary = json.load(f)
  return workdir, rundir.read_metrics(workdir), summary


def without(d: dict, keys) -> dict:
  return {k: v for k, v in d.items() if k not in keys}


def assert_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


# ----------------------------------------------------------------------------- outputs


def test_logged_deviation_is_eq12_of_the_clients_weights(reference):
  # NTK-DFL eq. 12 by brute force on the round-5 checkpoint's stacked client weights [10, d], in float64:
  # V = (1/d) sum_j sqrt(sum_i (w_ij - wbar_j)^2). The line of round 5 logs the same clients' deviation.
  workdir, lines, _ = reference
  model = models.mlp(input_dim=784, hidden=(16,), num_classes=10)  # the toy config's model
  template = toy_method.ToyState(models.init_clients(model, jax.random.key(0), 10), jnp.int32(0))
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR), read_only=True) as ckpt:
    params = ckpt.restore(ROUNDS, template).params
  flat = np.concatenate(
    [np.asarray(w, np.float64).reshape(10, -1) for w in jax.tree.leaves(params)], axis=1
  )
  assert flat.shape == (10, 784 * 16 + 16 + 16 * 10 + 10)
  want = np.mean(np.sqrt(np.sum((flat - flat.mean(axis=0)) ** 2, axis=0)))
  assert want > 0  # the clients differ (IID data, different minibatch masks, a ring)
  assert lines[ROUNDS - 1]["round"] == ROUNDS
  assert lines[ROUNDS - 1]["deviation"] == pytest.approx(want, rel=1e-5)


def test_main_py_run_writes_every_output(reference):
  workdir, lines, summary = reference
  for name in (rundir.CONFIG_FILE, rundir.METRICS_FILE, rundir.SUMMARY_FILE):
    assert os.path.isfile(os.path.join(workdir, name))
  assert_png(os.path.join(workdir, rundir.ACCURACY_PLOT))
  assert_png(os.path.join(workdir, rundir.SELECTION_PLOT))
  assert_png(os.path.join(workdir, plotting.LOSS_PLOT))  # the toy method reports a training loss
  for name in (rundir.ACCURACY_PLOT, rundir.SELECTION_PLOT, plotting.LOSS_PLOT):
    with open(os.path.join(workdir, name.replace(".png", ".pdf")), "rb") as f:
      assert f.read(5) == b"%PDF-"  # vector copies for papers
  communication = os.path.isfile(os.path.join(workdir, plotting.COMMUNICATION_PLOT))
  assert communication == ("bits_cumulative" in lines[-1])
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    assert ckpt.steps() == [4, 5]  # every 2 rounds and the end; max_to_keep=2 dropped round 2

  # One line per round, 1-based; the override reached the run.
  assert [line["round"] for line in lines] == list(range(1, ROUNDS + 1))
  assert summary["rounds"] == ROUNDS and summary["method"] == "toy_gd" and summary["seed"] == 0
  for line in lines:
    for key in (
      "test_acc",
      "test_loss",
      "deviation",
      "client_acc_mean",
      "client_acc_min",
      "client_acc_max",
      "loss_mean",
      "loss_min",
      "loss_max",
      "kept_mean",
      "lr",
      *TIMES,
    ):
      assert isinstance(line[key], float), key
    # Per-client algorithm metrics are stored in full (ints stay ints) and summarised.
    kept = line["clients"]["kept"]
    assert len(kept) == 10 and all(isinstance(k, int) for k in kept)
    assert line["kept_min"] == min(kept) and line["kept_max"] == max(kept)
    assert line["kept_mean"] == pytest.approx(np.mean(kept))
    acc = line["clients"]["test_acc"]
    assert (
      len(acc) == 10 and line["client_acc_min"] == min(acc) and line["client_acc_max"] == max(acc)
    )
  assert [line["lr"] for line in lines] == pytest.approx([0.5 * 0.9**r for r in range(ROUNDS)])

  # Summary numbers recomputed from the lines.
  acc = [line["test_acc"] for line in lines]
  want = {}
  for t in (0.2, 0.99):
    want[str(t)] = next((r for r, a in enumerate(acc, start=1) if a >= t), None)
  assert summary["rounds_to_target"] == want
  assert want["0.2"] is not None and want["0.99"] is None  # both branches exercised
  assert summary["final_test_acc"] == acc[-1]
  assert summary["best_test_acc"] == max(acc) and acc[summary["best_round"] - 1] == max(acc)
  assert summary["final_client_acc_mean"] == lines[-1]["client_acc_mean"]
  assert summary["num_params"] == 784 * 16 + 16 + 16 * 10 + 10
  assert summary["config"]["rounds"] == ROUNDS and summary["resumed_from"] is None
  sel = summary["selection"]
  for name in metrics.SELECTION_ORDERS:
    assert len(sel[name]) == 10 and sorted(sel[f"{name}_order"]) == list(range(10))
  # All orders end at the same all-client average (up to float32 summation order).
  assert sel["best_to_worst"][-1] == pytest.approx(sel["random"][-1], abs=1 / 150 + 1e-9)
  assert sel["best_to_worst"][-1] == pytest.approx(sel["worst_to_best"][-1], abs=1 / 150 + 1e-9)


def test_logged_numbers_match_an_independent_evaluation(reference):
  """Final checkpoint + functional API: the logged accuracies, deviation and state are reproduced."""
  workdir, lines, _ = reference
  config = toy_config()
  exp = runner.build_experiment(config)
  algorithm = exp.algorithm
  state = algorithm.init(jax.random.PRNGKey(config.seed))
  step = algorithm.step
  with (
    exp.device_policy()
  ):  # the run's chunk size (4 clients at a time), as the runner traces the step
    for r in range(ROUNDS):
      state, _ = step(state, algorithm.round_inputs(r))
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    restored = ckpt.restore(ROUNDS, state)
  # The functional API reproduces the runner's state bit for bit (the runner adds nothing).
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  assert int(restored.steps) == ROUNDS

  params = algorithm.client_params(restored)
  x, y = exp.dataset.x_test, exp.dataset.y_test
  acc, loss = metrics.evaluate(exp.model.apply, metrics.average_params(params), x, y, batch_size=64)
  last = lines[-1]
  assert last["test_acc"] == pytest.approx(float(acc), abs=1e-6)
  assert last["test_loss"] == pytest.approx(float(loss), rel=1e-5)
  flat = np.concatenate(
    [np.asarray(w, np.float64).reshape(10, -1) for w in jax.tree_util.tree_leaves(params)], 1
  )
  want_dev = np.mean(np.sqrt(np.sum((flat - flat.mean(0)) ** 2, axis=0)))
  assert last["deviation"] == pytest.approx(want_dev, rel=1e-5)
  c_acc, _ = metrics.evaluate_clients(exp.model.apply, params, x, y)
  np.testing.assert_allclose(last["clients"]["test_acc"], np.asarray(c_acc), atol=1e-6)


# ----------------------------------------------------------------------------- resume


class _Killed(Exception):
  pass


def test_resume_after_interruption_equals_uninterrupted(reference, tmp_path):
  _, ref_lines, ref_summary = reference
  workdir = str(tmp_path / "run")
  config = toy_config()

  def kill_after_round_3(round_, line):
    if round_ == 3:
      raise _Killed

  with pytest.raises(_Killed):
    runner.run(config, workdir, on_round_end=kill_after_round_3)
  assert len(rundir.read_metrics(workdir)) == 3  # round 3 logged but not checkpointed
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    assert ckpt.latest() == 2
  assert not os.path.exists(os.path.join(workdir, rundir.SUMMARY_FILE))

  summary = runner.run(toy_config(), workdir, resume=True)
  lines = rundir.read_metrics(workdir)
  assert [without(line, TIMES) for line in lines] == [without(line, TIMES) for line in ref_lines]
  assert without(summary, SUMMARY_TIMES) == without(ref_summary, SUMMARY_TIMES)
  assert summary["resumed_from"] == 2
  # TensorBoard: the resumed run rewrites the event file from metrics.jsonl (rounds 1-2) and logs 3-5, once each.
  (only,) = (events.read_event_file(path) for path in events.event_files(workdir))
  resumed = events.scalars_by_step(only)
  assert sorted(resumed) == [1, 2, 3, 4, 5]
  assert [resumed[r]["accuracy/aggregated"] for r in (1, 2, 3, 4, 5)] == pytest.approx(
    [line["test_acc"] for line in lines], rel=1e-6
  )
  with open(os.path.join(workdir, rundir.SUMMARY_FILE)) as f:
    assert json.load(f) == summary


def test_resume_refusals_fail_before_any_work(reference, tmp_path, monkeypatch):
  ref_workdir, _, _ = reference
  monkeypatch.setattr(data.sources, "load", lambda *a, **k: pytest.fail("data loaded"))
  with pytest.raises(ValueError, match=r"different config.*seed: 0 -> 3"):
    runner.run(toy_config(seed=3), ref_workdir, resume=True)
  with pytest.raises(ValueError, match=r"different config.*seed: 0 -> 3"):
    runner.run(toy_config(seed=3), ref_workdir, resume=True)
  with pytest.raises(ValueError, match="already holds a run"):
    runner.run(toy_config(), ref_workdir)
  # The device count only places the work: it is not a config change for resume.
  assert rundir.check_workdir(toy_config(devices=1), ref_workdir, resume=True) == ROUNDS
  # A started run that never reached a checkpoint.
  os.makedirs(tmp_path / "nockpt")
  with open(tmp_path / "nockpt" / rundir.CONFIG_FILE, "w") as f:
    json.dump(rundir.jsonable(toy_config()), f)
  with pytest.raises(
    ValueError, match=r"different config.*seed: 0 -> 3"
  ):  # checked before it restarts
    runner.run(toy_config(seed=3), str(tmp_path / "nockpt"), resume=True)
  # (resuming a run with nothing to resume restarts it: tests/test_faults.py)


def test_a_run_stored_before_a_schema_key_existed_resumes_with_its_old_value(reference, tmp_path):
  ref_workdir, _, _ = reference
  old = str(tmp_path / "old")
  shutil.copytree(ref_workdir, old)
  with open(os.path.join(old, rundir.CONFIG_FILE)) as f:
    stored = json.load(f)
  del stored["data"]["max_test"]  # config.json written before data.max_test was added
  del stored["model"]["module"], stored["model"]["per_sample"]  # ... and before a user's own model
  del stored["debug_clients"]
  with open(os.path.join(old, rundir.CONFIG_FILE), "w") as f:
    json.dump(stored, f)
  assert rundir.check_workdir(toy_config(), old, resume=True) == ROUNDS
  # Scoring the consensus models too changes what is logged, not the trajectory: a resume may switch it on.
  assert rundir.check_workdir(toy_config(**{"eval.consensus": True}), old, resume=True) == ROUNDS
  loaded = rundir.rebuild_config(old, trust_method_module=toy_config().method_module)
  assert loaded["data"]["max_test"] == 0 and loaded == rundir.jsonable(toy_config())
  assert (loaded["model"]["module"], loaded["model"]["per_sample"], loaded["debug_clients"]) == (
    "",
    False,
    False,
  )
  # The filled-in value is the one the run used: a config that changes it is a different experiment.
  with pytest.raises(ValueError, match=r"different config.*max_test: 0 -> 100"):
    rundir.check_workdir(toy_config(**{"data.max_test": 100}), old, resume=True)


def test_checkpoints_written_before_a_schema_key_existed_resume_exactly(reference, tmp_path):
  """A run started by an older package version tied its checkpoints to its config as then written
  (without the keys added since); the same run resumed by this version finds them its own."""
  ref_workdir, ref_lines, ref_summary = reference
  old = str(tmp_path / "old")
  shutil.copytree(ref_workdir, old)
  os.remove(os.path.join(old, rundir.SUMMARY_FILE))
  with open(os.path.join(old, rundir.CONFIG_FILE)) as f:
    stored = json.load(f)
  del stored["model"]["module"], stored["model"]["per_sample"], stored["debug_clients"]
  with open(os.path.join(old, rundir.CONFIG_FILE), "w") as f:
    json.dump(stored, f)
  old_identity = rundir.run_identity(stored)
  assert old_identity != rundir.run_identity(toy_config())
  ckpt_dir = rundir.checkpoint_dir(old)
  with Checkpoints(ckpt_dir, read_only=True) as source:
    states = {s: source.read(s) for s in source.steps()}
  shutil.rmtree(ckpt_dir)
  with Checkpoints(ckpt_dir, identity=old_identity) as writer:  # as the older version saved them
    for step, state in states.items():
      writer.save(step, state)
  # Another run's identity is still refused: the accepted one is this run's config as written.
  with Checkpoints(ckpt_dir, read_only=True, identity=rundir.run_identity(toy_config())) as ckpt:
    with pytest.raises(CheckpointDamaged, match="written by a different run"):
      ckpt.verify(4)
  summary = runner.run(toy_config(), old, resume=True, resume_from_step=4)
  assert summary["resumed_from"] == 4
  lines = rundir.read_metrics(old)
  assert [without(line, TIMES) for line in lines] == [without(line, TIMES) for line in ref_lines]
  assert without(summary, SUMMARY_TIMES) == without(ref_summary, SUMMARY_TIMES)


def _tie_checkpoints_to(ckpt_dir: str, identity: str) -> None:
  """Rewrites ``ckpt_dir``'s checkpoints as a writer recording ``identity`` saves them."""
  with Checkpoints(ckpt_dir, read_only=True) as source:
    states = {s: source.read(s) for s in source.steps()}
  shutil.rmtree(ckpt_dir)
  with Checkpoints(ckpt_dir, identity=identity) as writer:
    for step, state in states.items():
      writer.save(step, state)


def test_a_run_resumes_with_another_checkpoint_cadence_exactly(reference, tmp_path):
  """The cadence decides when the state is written, not what is computed: a run started with
  checkpoint_every = 2 and killed after round 3, whose checkpoint an older version tied to an identity that
  included the cadence, resumes with checkpoint_every = 1, checkpoints every round from then on (killed
  again after round 4, it resumes from 4) and equals the uninterrupted run; a branch from it is accepted
  too. Another setting is still refused."""
  _, ref_lines, ref_summary = reference
  workdir = str(tmp_path / "run")

  def kill_after(stop):
    def on_round_end(round_, line):
      if round_ == stop:
        raise _Killed

    return on_round_end

  with pytest.raises(_Killed):
    runner.run(toy_config(), workdir, on_round_end=kill_after(3))
  with open(os.path.join(workdir, rundir.CONFIG_FILE)) as f:
    stored = json.load(f)
  assert stored["checkpoint_every"] == 2
  # The identity as the older version computed it: the cadence hashed with the rest.
  identifying = [k for k in rundir.RESULT_NEUTRAL_KEYS if k != "checkpoint_every"]
  plain = json.dumps(rundir.config_without(stored, *identifying), sort_keys=True)
  with_cadence = hashlib.sha256(plain.encode()).hexdigest()
  assert with_cadence != rundir.run_identity(stored)
  assert rundir.run_identity(toy_config(checkpoint_every=1)) == rundir.run_identity(toy_config())
  ckpt_dir = rundir.checkpoint_dir(workdir)
  _tie_checkpoints_to(ckpt_dir, with_cadence)
  assert (
    rundir.check_branch(toy_config(), workdir) == 2
  )  # verified against the identity it recorded
  with pytest.raises(_Killed):
    runner.run(toy_config(checkpoint_every=1), workdir, resume=True, on_round_end=kill_after(4))
  with Checkpoints(ckpt_dir, read_only=True) as ckpt:
    assert ckpt.steps() == [3, 4]  # rounds 3 and 4 each checkpointed; the two newest kept
  summary = runner.run(toy_config(checkpoint_every=1), workdir, resume=True)
  assert summary["resumed_from"] == 4
  lines = rundir.read_metrics(workdir)
  assert [without(line, TIMES) for line in lines] == [without(line, TIMES) for line in ref_lines]
  assert summary["config"]["checkpoint_every"] == 1  # the summary records what the last process ran
  summary["config"]["checkpoint_every"] = 2
  assert without(summary, SUMMARY_TIMES) == without(ref_summary, SUMMARY_TIMES)
  with pytest.raises(ValueError, match=r"different config.*lr"):
    rundir.check_workdir(toy_config(**{"algorithm.lr": 0.25}), workdir, resume=True)


def test_checkpoints_written_before_they_recorded_their_run_resume_exactly(reference, tmp_path):
  """The first checkpoint format recorded the arrays' digest alone: such a run resumes exactly, and a
  changed array in one is still damage."""
  ref_workdir, ref_lines, ref_summary = reference
  old = str(tmp_path / "old")
  shutil.copytree(ref_workdir, old)
  os.remove(os.path.join(old, rundir.SUMMARY_FILE))
  ckpt_dir = rundir.checkpoint_dir(old)
  with Checkpoints(ckpt_dir, read_only=True) as source:
    steps = source.steps()
    untied = {s: state_digest(source.read(s)) for s in steps}
  for step in steps:
    meta_path = os.path.join(ckpt_dir, str(step), "_CHECKPOINT_METADATA")
    with open(meta_path) as f:
      meta = json.load(f)
    meta["custom_metadata"]["ntk_fl"] = {"digest": untied[step]}
    with open(meta_path, "w") as f:
      json.dump(meta, f)
  summary = runner.run(toy_config(), old, resume=True, resume_from_step=4)
  assert summary["resumed_from"] == 4
  lines = rundir.read_metrics(old)
  assert [without(line, TIMES) for line in lines] == [without(line, TIMES) for line in ref_lines]
  assert without(summary, SUMMARY_TIMES) == without(ref_summary, SUMMARY_TIMES)
  meta_path = os.path.join(ckpt_dir, "4", "_CHECKPOINT_METADATA")
  with open(meta_path) as f:
    meta = json.load(f)
  meta["custom_metadata"]["ntk_fl"]["digest"] = untied[
    5
  ]  # another state's digest: the arrays differ
  with open(meta_path, "w") as f:
    json.dump(meta, f)
  with Checkpoints(ckpt_dir, read_only=True, identity=rundir.run_identity(toy_config())) as ckpt:
    with pytest.raises(CheckpointDamaged, match="arrays do not match"):
      ckpt.verify(4)


def test_branch_of_the_same_experiment_equals_the_uninterrupted_run(reference, tmp_path):
  ref_workdir, ref_lines, ref_summary = reference
  workdir = str(tmp_path / "branch")
  assert (
    rundir.check_branch(toy_config(), ref_workdir) == 4
  )  # checkpoints after 4 and 5; 5 leaves nothing to run
  summary = runner.run(toy_config(), workdir, branch_from=ref_workdir)
  lines = rundir.read_metrics(workdir)
  assert [without(line, TIMES) for line in lines] == [without(line, TIMES) for line in ref_lines]
  assert lines[:4] == ref_lines[:4]  # copied, timings included
  by_step = events.scalars_by_step(
    events.read_events(workdir)
  )  # the copied rounds are this run's too
  assert sorted(by_step) == [1, 2, 3, 4, 5]
  assert [by_step[r]["accuracy/aggregated"] for r in range(1, 6)] == pytest.approx(
    [line["test_acc"] for line in lines], rel=1e-6
  )
  assert summary["branched_from"] == {"source": ref_workdir, "round": 4}
  skip = SUMMARY_TIMES + ("branched_from",)
  assert without(summary, skip) == without(ref_summary, skip)
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    assert ckpt.steps() == [4, 5]  # its own copy of the branch point
  # The toy method certifies no shared rounds, so any config change is refused.
  with pytest.raises(ValueError, match=r"differs \(seed: 0 -> 3\).*does not certify"):
    rundir.check_branch(toy_config(seed=3), ref_workdir)
  proc = main_py(
    "--config=tests/configs/toy.py:smoke", f"--workdir={tmp_path / 'other'}", "--branch_round=2"
  )
  assert proc.returncode != 0 and "--branch_round=2 needs --branch_from" in proc.stderr


def test_checkpoint_keep_survives_the_rotation_and_is_result_neutral(reference, tmp_path):
  _, ref_lines, _ = reference
  workdir = str(tmp_path / "run")
  proc = main_py(
    "--config=tests/configs/toy.py:smoke",
    f"--config.rounds={ROUNDS}",
    "--config.checkpoint_keep=(1,)",
    f"--workdir={workdir}",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    assert ckpt.steps() == [1, 4, 5]  # 1 kept; of the every-2 checkpoints only the latest two
  assert [without(line, TIMES) for line in rundir.read_metrics(workdir)] == [
    without(line, TIMES) for line in ref_lines
  ]
  assert rundir.check_workdir(toy_config(), workdir, resume=True) == ROUNDS  # not a config change
  assert rundir.check_branch(toy_config(), workdir, 1) == 1
  with pytest.raises(
    ValueError, match=r"checkpoint_keep \(1-based round numbers\) must be an int >= 1, got 0"
  ):
    schema.validate_config(toy_config(checkpoint_keep=(0,)))


def test_stop_at_ends_the_run_at_the_first_round_reaching_it(reference, tmp_path):
  _, ref_lines, _ = reference
  accs = [line["test_acc"] for line in ref_lines]
  # A threshold first met strictly before the last round (the toy run learns).
  stop_round = next(i for i in range(1, len(accs)) if accs[i] > accs[0]) + 1
  threshold = accs[stop_round - 1]
  expected_round = metrics.rounds_to_target(accs, threshold)
  assert expected_round < ROUNDS
  workdir = str(tmp_path / "run")
  summary = runner.run(toy_config(**{"eval.stop_at": threshold}), workdir)
  lines = rundir.read_metrics(workdir)
  assert len(lines) == summary["rounds_run"] == expected_round
  assert summary["stopped_early"] is True
  assert [without(line, TIMES) for line in lines] == [
    without(line, TIMES) for line in ref_lines[:expected_round]
  ]
  with Checkpoints(os.path.join(workdir, rundir.CHECKPOINT_DIR)) as ckpt:
    assert ckpt.latest() == expected_round  # the final state is checkpointed under its own round
  # Resuming a run that already stopped trains no further round.
  again = runner.run(toy_config(**{"eval.stop_at": threshold}), workdir, resume=True)
  assert (
    again["rounds_run"] == expected_round and len(rundir.read_metrics(workdir)) == expected_round
  )


def test_stop_at_needs_evaluation_every_round(tmp_path):
  with pytest.raises(ValueError, match="eval.every must be 1"):
    runner.run(toy_config(**{"eval.stop_at": 0.5, "eval.every": 2}), str(tmp_path / "run"))


def test_checkpoints_skip_half_written_and_restore_exactly(tmp_path):
  state = {
    "w": jnp.arange(6.0).reshape(2, 3),
    "n": jnp.int32(7),
    "key": jax.random.key(3),
    "raw_key": jax.random.PRNGKey(4),
  }
  other = jax.tree.map(lambda x: x, state) | {"w": state["w"] + 1}
  directory = tmp_path / "ckpt"
  with Checkpoints(directory, max_to_keep=3) as ckpt:
    ckpt.save(2, state)
    ckpt.save(4, other)
  # What a process killed mid-save leaves behind: orbax's temporary directory, or
  # a bare step directory without the metadata orbax writes before the rename.
  os.makedirs(directory / "6.orbax-checkpoint-tmp-1234567")
  os.makedirs(directory / "8" / "default")
  with Checkpoints(directory, max_to_keep=3) as ckpt:
    assert ckpt.steps() == [2, 4] and ckpt.latest() == 4
    restored = ckpt.restore(4, state)
    with pytest.raises(FileNotFoundError, match="round 8"):
      ckpt.restore(8, state)
  np.testing.assert_array_equal(restored["w"], other["w"])
  assert restored["n"].dtype == jnp.int32 and int(restored["n"]) == 7
  assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(
    jax.random.key_data(restored["key"]), jax.random.key_data(state["key"])
  )
  np.testing.assert_array_equal(restored["raw_key"], state["raw_key"])


# ----------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize(
  "key,value,match",
  [
    ("rounds", 0, "rounds"),
    ("seed", -1, "seed"),
    ("data.name", "imagenet", "data.name"),
    ("data.partition", "random", "data.partition"),
    ("data.partition", "by_writer", "by_writer"),
    ("data.alpha", 0.0, "alpha"),
    ("data.max_train", -5, "max_train"),
    ("data.max_test", -1, "max_test"),
    ("model.name", "resnet", "model.name"),
    ("model.hidden", (16, 0), "hidden"),
    ("model.activation", "swishy", "activation"),
    ("topology.name", "star", "topology.name"),
    ("topology.mixing", "max", "mixing"),
    ("eval.targets", (0.8, 1.5), "targets"),
    ("eval.every", 0, "eval.every"),
    ("eval.stop_at", 1.2, "stop_at"),
    ("eval.stop_at", -0.1, "stop_at"),
    ("chunk_size", -1, "chunk_size"),
    ("method", "no_such_method", "unknown method"),
    ("method_module", "no_such_module_xyz", "method_module"),
    ("algorithm.lr", -1.0, "algorithm.lr"),  # the method's own validate_config
    ("data.typo_key", 1, "typo_key"),
    ("roundz", 3, "roundz"),
  ],
)
def test_bad_config_fails_before_data_load(key, value, match, tmp_path, monkeypatch):
  monkeypatch.setattr(
    data.sources, "load", lambda *a, **k: pytest.fail("data loaded before validation")
  )
  with pytest.raises(ValueError, match=match):
    runner.run(toy_config(**{key: value}), str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


def test_max_train_subsample_is_seeded(monkeypatch):
  full = runner.build_experiment(toy_config())
  a = runner.build_experiment(toy_config(**{"data.max_train": 500}))
  b = runner.build_experiment(toy_config(**{"data.max_train": 500}))
  assert a.dataset.x_train.shape == (500, 784)
  np.testing.assert_array_equal(a.dataset.x_train, b.dataset.x_train)
  # A subset of the full training set, in its original order.
  rows = {r.tobytes(): i for i, r in enumerate(full.dataset.x_train)}
  idx = [rows[r.tobytes()] for r in a.dataset.x_train]
  assert idx == sorted(idx) and len(set(idx)) == 500
  np.testing.assert_array_equal(a.dataset.y_train, full.dataset.y_train[idx])
  assert int(np.sum(a.federation.n)) == 500
  with pytest.raises(ValueError, match="max_train = 5000 exceeds"):
    runner.build_experiment(toy_config(**{"data.max_train": 5000}))


def test_max_test_subsample_is_seeded_and_leaves_the_training_draw_alone():
  full = runner.build_experiment(toy_config())
  both = runner.build_experiment(toy_config(**{"data.max_train": 500, "data.max_test": 100}))
  train_only = runner.build_experiment(toy_config(**{"data.max_train": 500}))
  assert both.dataset.x_test.shape == (100, 784)
  np.testing.assert_array_equal(both.dataset.x_train, train_only.dataset.x_train)
  np.testing.assert_array_equal(train_only.dataset.x_test, full.dataset.x_test)

  # A subset of the full test set, in its original order, with its labels; another seed draws another one.
  def kept(subset, whole):
    rows = {r.tobytes(): i for i, r in enumerate(whole.dataset.x_test)}
    return [rows[r.tobytes()] for r in subset.dataset.x_test]

  idx = kept(both, full)
  assert idx == sorted(idx) and len(set(idx)) == 100
  np.testing.assert_array_equal(both.dataset.y_test, full.dataset.y_test[idx])
  seed1 = toy_config(**{"seed": 1})
  assert (
    kept(
      runner.build_experiment(toy_config(**{"data.max_test": 100, "seed": 1})),
      runner.build_experiment(seed1),
    )
    != idx
  )
  with pytest.raises(ValueError, match="max_test = 301 exceeds the 300 test samples"):
    runner.build_experiment(toy_config(**{"data.max_test": 301}))


def test_main_py_rejects_unknown_override_and_bad_value(tmp_path):
  proc = main_py(
    "--config=tests/configs/toy.py:smoke", "--config.nonexistent=1", f"--workdir={tmp_path / 'a'}"
  )
  assert proc.returncode != 0
  assert (
    "error: unknown config key config.nonexistent\n" in proc.stderr
    and "Traceback" not in proc.stderr
  )
  proc = main_py(
    "--config=tests/configs/toy.py:smoke",
    "--config.data.partition=random",
    f"--workdir={tmp_path / 'b'}",
  )
  assert proc.returncode != 0
  assert "config.data.partition must be one of" in proc.stderr and "'random'" in proc.stderr
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
