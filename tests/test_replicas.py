"""Seed-batched runs (``config.replicas``): each replica equals its own single-seed run, bit for bit.

The reference is the independent computation: the S seeds run one at a time through the ordinary
single-seed runner. A replicated run must write, per seed, the same metrics lines, summary, config and
final checkpoint; resumed after an interruption (replicas stopped at different rounds) it must equal the
uninterrupted one.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from ntk_fl import compare, configs, rundir, runner, schema
from ntk_fl import config as config_lib
from ntk_fl.checkpoint import Checkpoints
from ntk_fl.reproduce import queue
from ntk_fl.reproduce.experiments import SMOKE
from ntk_fl.reproduce.queue import config_key, stored_form
from ntk_fl.reproduce.registry import Experiment, Variant, build_config, override_flags

ROUNDS = 3
TIMES = ("step_time", "eval_time")
SUMMARY_TIMES = ("wall_time", "train_time", "time_per_round", "step_time_per_round", "resumed_from")
TOY_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "toy.py")


def smoke(name: str, **overrides):
  config = config_lib.load_config(configs.resolve(name), "smoke")
  config.rounds = ROUNDS
  # The final client models are compared through the selection curves too.
  config.eval.selection = True
  config.update_from_flattened_dict(overrides)
  return config


def metrics(workdir: str) -> list[dict]:
  return [
    {k: v for k, v in line.items() if k not in TIMES} for line in rundir.read_metrics(workdir)
  ]


def summary(workdir: str) -> dict:
  return {k: v for k, v in rundir.read_summary(workdir).items() if k not in SUMMARY_TIMES}


def final_params(workdir: str, like):
  with Checkpoints(rundir.checkpoint_dir(workdir), read_only=True) as ckpt:
    return ckpt.restore(ROUNDS, like)


@pytest.fixture(scope="module", params=["dfedavg", "ntk_dfl"])
def runs(request, tmp_path_factory):
  """``(name, replicated workdir, [single-seed workdirs])`` for seeds 3 and 4."""
  name = request.param
  root = tmp_path_factory.mktemp(name)
  runner.run(smoke(name, seed=3, replicas=2), str(root / "replicated"))
  singles = []
  for seed in (3, 4):
    runner.run(smoke(name, seed=seed), str(root / f"single{seed}"))
    singles.append(str(root / f"single{seed}"))
  return name, str(root / "replicated"), singles


def test_each_replica_equals_its_single_seed_run(runs):
  name, replicated, singles = runs
  assert {"replicas.json", "seed3", "seed4"} <= set(os.listdir(replicated))
  assert rundir.replica_runs(replicated) == [
    os.path.join(replicated, "seed3"),
    os.path.join(replicated, "seed4"),
  ]
  for seed, single in zip((3, 4), singles):
    replica = os.path.join(replicated, f"seed{seed}")
    assert rundir.read_config(replica) == rundir.read_config(single)
    assert rundir.read_config(replica)["seed"] == seed
    assert metrics(replica) == metrics(single)
    assert len(metrics(replica)) == ROUNDS
    assert summary(replica) == summary(single)
    # The checkpointed final state, leaf by leaf.
    exp = runner.build_experiment(rundir.read_config(single))
    like = runner._initial_state(exp.algorithm, exp.settings)
    mine, theirs = final_params(replica, like), final_params(single, like)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # `ntk-fl compare WORKDIR` reads the replicas as the seeds of one setting.
  [group] = compare.group_runs(compare.read_runs([replicated]))
  assert group.seeds == [3, 4]
  # The two seeds are different runs (their own partitions, graphs and initialisations).
  assert metrics(singles[0]) != metrics(singles[1])


def test_vmapped_replicas_agree_with_single_seed_runs_up_to_float_rounding(runs, tmp_path):
  """``replica_chunk = 0`` (one vmap over the replicas): the batched products may sum in another order
  (NTK-DFL's kernel blocks on the CPU), so the models agree to float32 rounding accumulated over the
  rounds, not bit for bit; the round inputs (graphs, keys, learning rates) are exact."""
  name, _, singles = runs
  workdir = str(tmp_path / "vmapped")
  runner.run(smoke(name, seed=3, replicas=2, replica_chunk=0), workdir)
  for seed, single in zip((3, 4), singles):
    replica = os.path.join(workdir, f"seed{seed}")
    exp = runner.build_experiment(rundir.read_config(single))
    like = runner._initial_state(exp.algorithm, exp.settings)
    for a, b in zip(
      jax.tree.leaves(final_params(replica, like)), jax.tree.leaves(final_params(single, like))
    ):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    mine, theirs = metrics(replica), metrics(single)
    assert [m["lr"] for m in mine] == [m["lr"] for m in theirs]
    assert [m["bits_sent_total"] for m in mine] == [m["bits_sent_total"] for m in theirs]
    # A test sample on a decision boundary may flip: at most a few of the 2,000.
    assert all(abs(m["test_acc"] - t["test_acc"]) <= 3 / 2000 for m, t in zip(mine, theirs))


# The resume bookkeeping is the runner's, the same for every method: DFedAvg's runs serve.
@pytest.mark.parametrize("runs", ["dfedavg"], indirect=True)
def test_resumed_replicated_run_equals_the_uninterrupted_one(runs, tmp_path):
  name, replicated, _ = runs
  assert name == "dfedavg"
  workdir = str(tmp_path / "interrupted")
  calls = []

  def stop(round_, line):
    calls.append(round_)
    if len(calls) == 3:  # seed 3 has written rounds 1-2, seed 4 round 1 only
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    runner.run(smoke(name, seed=3, replicas=2), workdir, on_round_end=stop)
  assert len(metrics(os.path.join(workdir, "seed3"))) == 2
  assert len(metrics(os.path.join(workdir, "seed4"))) == 1
  result = runner.run(smoke(name, seed=3, replicas=2), workdir, resume=True)
  assert [s["resumed_from"] for s in result["runs"]] == [2, 1]
  for seed in (3, 4):
    mine, theirs = (os.path.join(w, f"seed{seed}") for w in (workdir, replicated))
    assert metrics(mine) == metrics(theirs)
    assert summary(mine) == summary(theirs)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_replicas_is_one_error_naming_the_value(value):
  config = {**smoke("dfedavg").to_dict(), "replicas": value}
  with pytest.raises(ValueError, match=r"config\.replicas") as e:
    schema.validate_config(config)
  assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_replica_settings_are_single_seed_runs():
  settings = schema.validate_config(smoke("dfedavg", seed=7, replicas=3))
  runs = schema.replica_settings(settings)
  assert [r.seed for r in runs] == [7, 8, 9]
  assert all(r.replicas == 1 for r in runs)
  # Each replica's topology is its own seed's, as the single-seed run builds it.
  for r in runs:
    alone = schema.validate_config(smoke("dfedavg", seed=r.seed))
    assert r == alone
    np.testing.assert_array_equal(
      r.built_topology.sample(0).neighbors, alone.built_topology.sample(0).neighbors
    )


def test_method_without_replicable_step_refuses(tmp_path):
  config = config_lib.load_config(TOY_CONFIG, "smoke")
  config.replicas = 2
  with pytest.raises(ValueError, match="method 'toy_gd' does not support seed-batched runs"):
    runner.run(config, str(tmp_path / "toy"))


def test_fresh_replicated_run_refuses_a_used_workdir(runs):
  name, replicated, singles = runs
  with pytest.raises(ValueError, match="already holds a seed-batched run"):
    runner.run(smoke(name, seed=3, replicas=2), replicated)
  with pytest.raises(ValueError, match="holds a single-seed run"):
    runner.run(smoke(name, seed=3, replicas=2), singles[0])


# ----------------------------------------------------------------------------- the reproduce queue


def _flag(command, name):
  return next(c.split("=", 1)[1] for c in command if c.startswith(f"--{name}="))


class FakeLauncher:
  """Plays ``ntk-fl``: a finished run per seed, written where a (seed-batched) run writes it."""

  def __init__(self, experiment):
    self.experiment, self.commands = experiment, []

  def __call__(self, command, log_path):
    self.commands.append(command)
    workdir, seed = _flag(command, "workdir"), int(_flag(command, "config.seed"))
    replicas = int(
      next((_flag(command, "config.replicas") for c in command if "replicas=" in c), 1)
    )
    overrides = [
      c
      for c in command
      if c.startswith("--config.") and not c.startswith(("--config.seed=", "--config.replicas="))
    ]
    variant = next(v for v in self.experiment.variants if override_flags(v) == overrides)
    if replicas > 1:
      os.makedirs(workdir)
      with open(os.path.join(workdir, rundir.REPLICAS_FILE), "w") as f:
        json.dump(
          {
            "seed": seed,
            "replicas": replicas,
            "runs": [f"seed{seed + k}" for k in range(replicas)],
          },
          f,
        )
    for s in range(seed, seed + replicas):
      run = rundir.replica_dir(workdir, s) if replicas > 1 else workdir
      os.makedirs(os.path.join(run, "checkpoints", "1"))
      with open(os.path.join(run, rundir.CONFIG_FILE), "w") as f:
        json.dump(stored_form(build_config(variant, s)), f)
      with open(os.path.join(run, rundir.METRICS_FILE), "w") as f:
        f.write(json.dumps({"round": 1, "step_time": 1.0, "test_acc": 0.5}) + "\n")
      with open(os.path.join(run, rundir.SUMMARY_FILE), "w") as f:
        json.dump({"rounds_run": 1}, f)
    return 0


def test_the_queue_groups_fresh_seeds_and_finds_their_replicas(tmp_path):
  out = str(tmp_path / "runs")
  launch = FakeLauncher(SMOKE)
  jobs = queue.run_queue(
    SMOKE, out, seeds=[0, 1, 2, 4], replicas=2, launch=launch, echo=lambda _: None
  )
  # Consecutive seeds 0-1 grouped, 2 alone (3 is not asked for), 4 alone; per variant.
  assert [(os.path.basename(j.workdir), j.replicas) for j in jobs] == [
    ("smoke_lr01_s0-1", 2),
    ("smoke_lr01_s2", 1),
    ("smoke_lr01_s4", 1),
    ("smoke_lr03_s0-1", 2),
    ("smoke_lr03_s2", 1),
    ("smoke_lr03_s4", 1),
  ]
  assert "--config.replicas=2" in launch.commands[0]
  assert not any("--config.replicas" in c for c in launch.commands[1])
  # The replicas are found by config: everything is finished now.
  launch = FakeLauncher(SMOKE)
  jobs = queue.run_queue(
    SMOKE, out, seeds=[0, 1, 2, 4], replicas=2, launch=launch, echo=lambda _: None
  )
  assert {j.action for j in jobs} == {"skip"} and len(jobs) == 8 and launch.commands == []
  # An interrupted replica (checkpoint, no summary) resumes on its own, in its folder.
  os.remove(os.path.join(out, "smoke_lr01_s0-1", "seed1", rundir.SUMMARY_FILE))
  [job] = [j for j in queue.plan(SMOKE, out, seeds=[0, 1, 2, 4], replicas=2) if j.action != "skip"]
  assert (job.action, job.seed, job.replicas) == ("resume", 1, 1)
  assert job.workdir == os.path.join(out, "smoke_lr01_s0-1", "seed1")
  assert "--resume" in job.command and "--config.seed=1" in job.command


def test_runs_stored_before_replicas_existed_keep_their_identity_and_setting(tmp_path):
  """A config.json without the keys (the campaign's runs) reads back as replicas = 1: its checkpoints'
  identity and its setting (the queue's index) are unchanged, and a replica's config matches it."""
  config = smoke("dfedavg", seed=2)
  stored = rundir.jsonable(schema.validate_config(config))
  old = {k: v for k, v in stored.items() if k not in ("replicas", "replica_chunk")}
  os.makedirs(tmp_path / "old")
  with open(tmp_path / "old" / rundir.CONFIG_FILE, "w") as f:
    json.dump(old, f)
  read = rundir.read_config(str(tmp_path / "old"))
  assert (read["replicas"], read["replica_chunk"]) == (1, 1)
  assert rundir.run_identity(old) == rundir.run_identity(config)
  [replica] = [
    r
    for r in schema.replica_settings(schema.validate_config(smoke("dfedavg", seed=1, replicas=2)))
    if r.seed == 2
  ]
  assert rundir.run_identity(replica) == rundir.run_identity(old)
  assert config_key(read) == config_key(json.loads(json.dumps(rundir.jsonable(replica))))


def test_the_queue_runs_a_method_without_replicas_seed_by_seed(tmp_path):
  experiment = Experiment(
    "t:mixed",
    "mixed",
    (Variant("spark", "spark:smoke", (("rounds", 2),)), Variant("dfedavg", "dfedavg:smoke", ())),
    seeds=(0, 1),
  )
  jobs = queue.plan(experiment, str(tmp_path), replicas=2)
  assert [(j.variant.name, j.seeds) for j in jobs] == [
    ("spark", [0]),
    ("spark", [1]),
    ("dfedavg", [0, 1]),
  ]
  # What the schema says of the same request: spark refuses, naming itself.
  with pytest.raises(ValueError, match="method 'spark' does not support seed-batched runs"):
    schema.validate_config({**build_config(experiment.variants[0], 0).to_dict(), "replicas": 2})
