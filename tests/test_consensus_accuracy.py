"""Consensus-model accuracy (runner's ``eval.consensus``, experiments/consensus_accuracy.py) against a
dense mixing matrix."""

from __future__ import annotations

import jax
from jax.flatten_util import ravel_pytree
import numpy as np
import pytest

from ntk_fl import gossip, metrics, rundir, runner, topology
from ntk_fl.config import load_config
from scripts import REPO, load_experiment

ROUNDS = 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A 2-round DFedAvg smoke run (20 clients, dynamic 2-regular graph, clients and consensus scored every round)."""
  config = load_config(str(REPO / "configs" / "dfedavg.py"), "smoke")
  config.rounds = ROUNDS
  config.eval.selection = False
  config.eval.consensus = True
  workdir = str(tmp_path_factory.mktemp("dfedavg"))
  runner.run(config, workdir)
  return config, workdir


def test_own_and_consensus_accuracies_match_an_independent_computation(finished_run):
  config, workdir = finished_run
  script = load_experiment("consensus_accuracy")
  result = script.client_accuracies(workdir)
  assert result["round"] == ROUNDS  # the latest checkpoint
  line = rundir.read_metrics(workdir)[-1]
  assert line["round"] == ROUNDS
  np.testing.assert_allclose(result["aggregated"], line["test_acc"], atol=1e-6)
  np.testing.assert_allclose(result["own"].mean(), line["client_acc_mean"], atol=1e-6)

  # Consensus models from the dense [M, M] mixing matrix of round ROUNDS + 1 (0-based index ROUNDS), scored one by one.
  experiment = runner.build_experiment(config)
  with script.Checkpoints(f"{workdir}/checkpoints", read_only=True) as checkpoints:
    state = checkpoints.restore(ROUNDS, experiment.algorithm.init(jax.random.PRNGKey(config.seed)))
  own = experiment.algorithm.client_params(state)
  num_clients = int(experiment.federation.n.shape[0])
  graph = experiment.settings.built_topology.sample(ROUNDS)
  mixing = topology.mixing_matrix(
    graph, config.topology.mixing, np.asarray(experiment.federation.n)
  )
  flat = [ravel_pytree(jax.tree.map(lambda leaf, i=i: leaf[i], own)) for i in range(num_clients)]
  unravel = flat[0][1]
  stacked = np.stack([np.asarray(vector, np.float64) for vector, _ in flat])
  x, y = experiment.dataset.x_test, experiment.dataset.y_test
  expected = [
    float(metrics.evaluate(experiment.model.apply, unravel(np.float32(vector)), x, y)[0])
    for vector in mixing.astype(np.float64) @ stacked
  ]
  # float32 mixing against float64: a test sample on a decision boundary may flip, hence one sample of slack.
  np.testing.assert_allclose(result["consensus"], expected, atol=1.0 / len(y) + 1e-6)
  assert not np.allclose(result["consensus"], result["own"])  # mixing changed the models
  # What the runner logged for the same models (eval.consensus) during the run.
  np.testing.assert_allclose(
    line["consensus_acc_mean"], np.mean(expected), atol=1.0 / len(y) + 1e-6
  )
  np.testing.assert_allclose(line["consensus_acc_min"], result["consensus"].min(), atol=1e-6)
  np.testing.assert_allclose(line["consensus_acc_max"], result["consensus"].max(), atol=1e-6)
  assert [
    k for k in rundir.read_metrics(workdir)[0] if k.startswith("consensus_acc")
  ]  # logged every round


def test_consensus_needs_a_decentralized_method(tmp_path):
  config = load_config(str(REPO / "configs" / "fedavg.py"), "smoke")
  config.eval.consensus = True
  with pytest.raises(ValueError, match="config.eval.consensus=True .* method 'fedavg'"):
    runner.run(config, str(tmp_path / "run"))


def test_row_and_bad_method():
  script = load_experiment("consensus_accuracy")
  result = {
    "round": 3,
    "aggregated": 0.8512,
    "own": np.array([0.80, 0.82]),
    "consensus": np.array([0.84, 0.85]),
  }
  assert (
    script.row("x_s0", result) == "| x_s0 | 3 | 85.12 | 81.00 (80.0–82.0) | 84.50 (84.0–85.0) |"
  )
  with pytest.raises(ValueError, match="decentralized method's round inputs"):
    gossip.consensus({"w": np.zeros((2, 3))}, object())
