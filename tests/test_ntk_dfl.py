"""NTK-DFL: averaging, neighbourhood gathering, synchronous update, options, config checks.

The reference for one round is written here independently of the algorithm's
vectorised code: numpy averaging with an explicit loop over clients and only the
*real* samples of each neighbourhood (no padding), passed to the single-client
:func:`ntk_fl.evolve.ntk_update`.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import evolve, gossip, models, parallel, rundir, runner, schema, topology
from ntk_fl.algorithms import neighbourhood_round, ntk_dfl
from federations import ragged_federation
from ntk_fl.data import federation_from_padded

REPO = pathlib.Path(__file__).resolve().parents[1]


def ntk_dfl_config(variant=None):
  return config_lib.load_config(str(REPO / "configs" / "ntk_dfl.py"), variant)


def tiny_setup(*, num_clients=6, n_max=8, degree=2, seed=0, **algo_overrides):
  """A 6-client federation with unequal sizes (padding) and a 5-8-3 MLP."""
  config = ntk_dfl_config()
  config.seed = seed
  config.data.num_clients = num_clients
  config.topology.degree = degree
  config.chunk_size = 0
  config.algorithm.lr = 0.05
  config.algorithm.lr_decay = 0.1
  config.algorithm.taus = (5, 10, 20)
  for key, value in algo_overrides.items():
    setattr(config.algorithm, key, value)
  rng = np.random.default_rng(seed)
  sizes = rng.integers(n_max - 3, n_max + 1, size=num_clients)
  federation = ragged_federation(rng, sizes, n_max)
  model = models.mlp(input_dim=5, hidden=(8,), num_classes=3)
  return config, model, federation


def reference_round(config, model, federation, params, inputs, *, average=True):
  """One NTK-DFL round client by client, on real samples only."""
  num_clients = federation.n.shape[0]
  flat = [jax.tree.map(lambda leaf: np.asarray(leaf[i]), params) for i in range(num_clients)]
  lr = config.algorithm.lr * np.exp(-config.algorithm.lr_decay * int(inputs.round))
  new, taus = [], []
  for i in range(num_clients):
    nbrs = [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    if average:
      weights = [float(inputs.self_weight[i])] + [
        float(w) for w, m in zip(inputs.neighbor_weights[i], inputs.neighbor_mask[i]) if m
      ]
      wbar = jax.tree.map(
        lambda *leaves: sum(w * l for w, l in zip(weights, leaves)),
        *([flat[i]] + [flat[j] for j in nbrs]),
      )
    else:
      wbar = flat[i]
    members = [i] + nbrs
    x = np.concatenate([federation.x[j][federation.mask[j]] for j in members])
    y = np.concatenate([federation.y[j][federation.mask[j]] for j in members])
    targets = jax.nn.one_hot(y, model.num_classes)
    updated, info = evolve.ntk_update(
      model.apply,
      wbar,
      jnp.asarray(x),
      targets,
      jnp.ones(len(y), bool),
      lr=lr,
      taus=tuple(config.algorithm.taus),
      loss=config.algorithm.loss,
      solver=config.algorithm.solver,
      dense_stack=model.dense_stack,
      kernel=config.algorithm.kernel,
      select=config.algorithm.select,
    )
    new.append(updated)
    taus.append(int(info["tau"]))
  return jax.tree.map(lambda *leaves: np.stack(leaves), *new), np.array(taus)


def assert_trees_close(a, b, rtol=2e-4, atol=2e-5):
  for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(leaf_a), np.asarray(leaf_b), rtol=rtol, atol=atol)


def test_neighbor_average_complete_graph_uniform_is_exact_mean():
  rng = np.random.default_rng(1)
  params = {
    "w": jnp.asarray(rng.normal(size=(5, 3, 2)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(5,))),
  }
  neighbors = np.array([[j for j in range(5) if j != i] for i in range(5)], np.int32)
  out = gossip.mix(params, neighbors, np.full(5, 0.2, np.float32), np.full((5, 4), 0.2, np.float32))
  for leaf, original in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
    np.testing.assert_allclose(
      leaf, np.broadcast_to(np.mean(original, axis=0), original.shape), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("scheme", ["uniform", "data_size", "metropolis"])
def test_neighbor_average_equals_dense_mixing_matrix(scheme):
  graph = topology.make_topology("erdos_renyi", 12, seed=3, p=0.4).sample(0)
  sizes = np.arange(12) + 5
  self_w, nbr_w = topology.mixing_weights(graph, scheme, sizes)
  dense = topology.mixing_matrix(graph, scheme, sizes)
  w = np.random.default_rng(0).normal(size=(12, 7)).astype(np.float32)
  out = gossip.mix({"w": jnp.asarray(w)}, graph.neighbors, self_w, nbr_w)["w"]
  np.testing.assert_allclose(out, dense @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("average", [True, False])
def test_step_equals_client_by_client_reference(average):
  config, model, federation = tiny_setup(per_round_averaging=average)
  config.model.init = "per_client"  # distinct clients make averaging visible
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  for round_index in range(2):
    inputs = algorithm.round_inputs(round_index)
    expected, expected_taus = reference_round(
      config, model, federation, state.params, inputs, average=average
    )
    state, metrics = algorithm.step(state, inputs)
    assert_trees_close(state.params, expected)
    np.testing.assert_array_equal(np.asarray(metrics["tau"]), expected_taus)
    np.testing.assert_allclose(float(metrics["lr"]), 0.05 * np.exp(-0.1 * round_index), rtol=1e-6)
    assert metrics["loss"].shape == (6,)


def test_padding_does_not_change_the_round():
  config, model, federation = tiny_setup()
  wide = federation_from_padded(
    np.pad(federation.x, [(0, 0), (0, 5), (0, 0)], constant_values=7.0),
    np.pad(federation.y, [(0, 0), (0, 5)], constant_values=2),
    np.pad(federation.mask, [(0, 0), (0, 5)]),
  )
  results = []
  for fed in (federation, wide):
    algorithm = runner.make_algorithm(config, model, fed)
    state = algorithm.init(jax.random.key(0))
    state, metrics = algorithm.step(state, algorithm.round_inputs(0))
    results.append((state.params, np.asarray(metrics["tau"])))
  assert_trees_close(results[0][0], results[1][0])
  np.testing.assert_array_equal(results[0][1], results[1][1])


def test_rounds_compile_once(monkeypatch):
  from ntk_fl._src import ntk_step as ntk_step_module  # where the method modules call the step

  traces = []
  original = ntk_step_module.ntk_step

  def counting(*args, **kwargs):
    traces.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(ntk_step_module, "ntk_step", counting)
  config, model, federation = tiny_setup()
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  for round_index in range(3):  # a new random graph every round, same shapes
    state, _ = algorithm.step(state, algorithm.round_inputs(round_index))
  assert len(traces) == 1


def test_round_inputs_are_a_function_of_the_round():
  config, model, federation = tiny_setup()
  algorithm = runner.make_algorithm(config, model, federation)
  a, b = algorithm.round_inputs(4), algorithm.round_inputs(4)
  np.testing.assert_array_equal(a.neighbors, b.neighbors)
  np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))
  assert not np.array_equal(algorithm.round_inputs(5).neighbors, a.neighbors)  # dynamic graph


def test_chunked_clients_equal_unchunked():
  config, model, federation = tiny_setup()
  outputs = []
  for chunk in (0, 4):
    algorithm = runner.make_algorithm(config, model, federation)
    with parallel.use_devices(
      1, chunk_size=chunk
    ):  # the device policy is read when the step is traced
      state, _ = algorithm.step(algorithm.init(jax.random.key(0)), algorithm.round_inputs(0))
    outputs.append(state.params)
  assert_trees_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def test_subsample_indices_draw_a_fraction_of_real_samples():
  mask = np.zeros((4, 10), bool)
  for i, n in enumerate((10, 9, 5, 1)):
    mask[i, :n] = True
  idx, keep = neighbourhood_round._subsample_indices(jax.random.key(0), jnp.asarray(mask), 4, 3)
  idx, keep = np.asarray(idx), np.asarray(keep)
  np.testing.assert_array_equal(keep.sum(axis=1), [3, 3, 1, 1])  # floor(n/3), at least one
  for i in range(4):
    chosen = idx[i][keep[i]]
    assert len(set(chosen.tolist())) == len(chosen)
    assert mask[i][chosen].all()
  idx2, _ = neighbourhood_round._subsample_indices(jax.random.key(1), jnp.asarray(mask), 4, 3)
  assert not np.array_equal(idx, np.asarray(idx2))


def test_subsampled_round_uses_only_the_drawn_samples():
  config, model, federation = tiny_setup(subsample=2)
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  inputs = algorithm.round_inputs(0)
  new_state, _ = algorithm.step(state, inputs)
  # Reference: the same draw, applied by hand, then a full (m2 = 1) round on the reduced federation.
  n_sub = -(-federation.x.shape[1] // 2)
  idx, keep = neighbourhood_round._subsample_indices(
    inputs.key, jnp.asarray(federation.mask), n_sub, 2
  )
  idx, keep = np.asarray(idx), np.asarray(keep)
  reduced = federation_from_padded(
    np.take_along_axis(federation.x, idx[..., None], axis=1),
    np.take_along_axis(federation.y, idx, axis=1),
    keep,
  )
  config.algorithm.subsample = 1
  expected, _ = reference_round(config, model, reduced, state.params, inputs)
  assert_trees_close(new_state.params, expected)


def test_learning_rate_schedule_and_metrics():
  config, model, federation = tiny_setup()
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  _, metrics = algorithm.step(state, algorithm.round_inputs(3))
  np.testing.assert_allclose(float(metrics["lr"]), 0.05 * np.exp(-0.3), rtol=1e-6)
  assert set(np.asarray(metrics["tau"]).tolist()) <= {5, 10, 20}


@pytest.mark.parametrize("average, subsample", [(True, 1), (False, 1), (True, 3)])
def test_communication_is_recorded_per_client_and_accumulated(average, subsample):
  """Bits by hand: κ_i·d·32 weights out, κ_i·d·32 consensus back (with averaging) and κ_i float32 packages."""
  config, model, federation = tiny_setup(per_round_averaging=average, subsample=subsample)
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  d = 5 * 8 + 8 + 8 * 3 + 3
  n = np.maximum(np.asarray(federation.n) // subsample, 1)
  package = n * 3 * d * 32 + n * 3 * 32 + n * 2  # Jacobian, function values, 2-bit labels
  total = 0.0
  for round_index in range(2):
    inputs = algorithm.round_inputs(round_index)
    state, metrics = algorithm.step(state, inputs)
    kappa = np.asarray(inputs.neighbor_mask).sum(axis=1)
    expected = kappa * ((2 if average else 1) * d * 32 + package)
    np.testing.assert_allclose(np.asarray(metrics["bits_sent"]), expected, rtol=1e-6)
    total += expected.sum()
    np.testing.assert_allclose(float(metrics["bits_sent_total"]), expected.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["bits_cumulative"]), total, rtol=1e-6)
  np.testing.assert_allclose(float(state.bits_cumulative), total, rtol=1e-6)


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("lr", -0.1, "lr"),
    ("lr_decay", -1.0, "lr_decay"),
    ("taus", (200, 100), "taus"),
    ("taus", (0, 100), "taus"),
    ("loss", "hinge", "loss"),
    ("solver", "rk4", "solver"),
    ("select", "best", "select"),
    ("kernel", "diag", "kernel"),
    ("jacobian_batches", 0, "jacobian_batches"),
    ("subsample", 0, "subsample"),
  ],
)
def test_validate_config_rejects_bad_values(field, value, message):
  config = ntk_dfl_config()
  setattr(config.algorithm, field, value)
  with pytest.raises(ValueError, match=message):
    schema.validate_config(config)


def test_config_variants_apply_and_unknown_variant_fails():
  config = ntk_dfl_config("iid,no_avg,static")
  assert config.data.partition == "iid"
  assert config.algorithm.per_round_averaging is False
  assert config.topology.dynamic is False
  assert ntk_dfl_config("alpha0.5").data.alpha == 0.5
  with pytest.raises(ValueError, match="unknown config variant"):
    ntk_dfl_config("alhpa0.5")
  schema.validate_config(ntk_dfl_config())


def test_jacobian_batching_is_sequential_block_evolution_at_a_fixed_linearisation_point():
  config, model, federation = tiny_setup(jacobian_batches=2)
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  inputs = algorithm.round_inputs(0)
  new_state, metrics = algorithm.step(state, inputs)

  lr = config.algorithm.lr
  n_max = federation.x.shape[1]
  wbars = gossip.mix(state.params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)
  for i in range(federation.n.shape[0]):
    members = [i] + [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    wbar = jax.tree.map(lambda leaf: leaf[i], wbars)
    current, block_taus, block_sizes = wbar, [], []
    for b in range(2):
      rows = [
        (j, s) for j in members for s in range(b, n_max, 2) if federation.mask[j, s]
      ]  # round-robin
      x = jnp.asarray(np.stack([federation.x[j, s] for j, s in rows]))
      targets = jax.nn.one_hot(np.array([federation.y[j, s] for j, s in rows]), model.num_classes)
      delta, info = evolve.ntk_step(
        model.apply,
        wbar,
        x,
        targets,
        jnp.ones(len(rows), bool),
        lr=lr,
        taus=tuple(config.algorithm.taus),
        dense_stack=model.dense_stack,
        start=current,
      )
      current = jax.tree.map(jnp.add, current, delta)
      block_taus.append(int(info["tau"]))
      block_sizes.append(len(rows))
    assert_trees_close(jax.tree.map(lambda leaf: leaf[i], new_state.params), current)
    sizes = np.array(block_sizes, float)
    np.testing.assert_allclose(
      float(metrics["tau"][i]), np.dot(sizes / sizes.sum(), block_taus), rtol=1e-6
    )


# End to end, opt-in (CI: -m slow): the default suite still runs this config's smoke run in tests/test_golden.py
# (ntk_dfl.json: every round's accuracy, losses and τ) and checks a run's output files in tests/test_runner.py.
@pytest.mark.slow
def test_smoke_variant_runs_through_the_runner_and_learns(tmp_path):
  """The CI smoke run: real Fashion-MNIST slice, 3 rounds, every output file, accuracy far above chance."""
  from ntk_fl import runner
  from ntk_fl.config import load_config

  summary = runner.run(load_config(str(REPO / "configs" / "ntk_dfl.py"), "smoke"), str(tmp_path))
  assert summary["final_test_acc"] > 0.5  # chance is 0.1
  assert summary["final_test_acc"] > summary["final_client_acc_mean"] - 0.05
  for name in ("metrics.jsonl", "summary.json", "accuracy.png", "selection.png", "checkpoints"):
    assert (tmp_path / name).exists(), name
  lines = rundir.read_metrics(str(tmp_path))
  assert [line["round"] for line in lines] == [1, 2, 3]
  assert all(set(line["clients"]["tau"]) <= {50, 100, 200} for line in lines)


def test_a_run_stopped_at_its_target_continues_as_the_longer_run(tmp_path):
  """Branching a stopped run with more rounds and no stop equals running the longer config from scratch."""
  from ntk_fl import runner
  from ntk_fl.config import load_config

  def smoke(rounds, stop_at=0.0):
    config = load_config(str(REPO / "configs" / "ntk_dfl.py"), "smoke")
    config.data.max_train, config.data.num_clients, config.data.samples_per_client = 2_000, 12, 40
    config.rounds, config.eval.stop_at, config.eval.selection = rounds, stop_at, False
    return config

  stopped, continued, scratch = (
    str(tmp_path / name) for name in ("stopped", "continued", "scratch")
  )
  first = runner.run(smoke(4, stop_at=0.05), stopped)  # any model beats 5 %: stops after round 1
  assert first["rounds_run"] == 1 and first["stopped_early"]
  summary = runner.run(smoke(3), continued, branch_from=stopped)
  runner.run(smoke(3), scratch)
  assert summary["branched_from"] == {"source": stopped, "round": 1}
  numbers = lambda line: {k: v for k, v in line.items() if k not in ("step_time", "eval_time")}
  assert [numbers(line) for line in rundir.read_metrics(continued)] == [
    numbers(line) for line in rundir.read_metrics(scratch)
  ]
  # Anything else changed is not certified.
  other = smoke(3)
  other.algorithm.lr = 0.02
  with pytest.raises(ValueError, match=r"algorithm.lr: 0.01 -> 0.02.*does not certify"):
    rundir.check_branch(other, stopped)


@pytest.mark.parametrize(
  "variant", ["clustered", "batched", "subsample", "mse", "static,per_client_init"]
)
def test_paper_option_variants_run_a_round(variant):
  from ntk_fl import runner
  from ntk_fl.config import load_config

  config = load_config(str(REPO / "configs" / "ntk_dfl.py"), f"smoke,{variant}")
  config.data.max_train = 2_000
  config.data.num_clients = 12
  config.data.samples_per_client = 40
  experiment = runner.build_experiment(config)
  algorithm = experiment.algorithm
  state = algorithm.init(jax.random.key(0))
  state, metrics = algorithm.step(state, algorithm.round_inputs(0))
  assert np.isfinite(np.asarray(metrics["loss"])).all()
  assert np.isfinite(np.concatenate([np.ravel(l) for l in jax.tree.leaves(state.params)])).all()


def test_validate_config_rejects_unknown_keys_and_bad_topology_before_any_data():
  config = ntk_dfl_config()
  config.algorithm.mse_form = "continuous"  # not an NTK-DFL option: never silently ignored
  with pytest.raises(ValueError, match="unknown"):
    schema.validate_config(config)
  config = ntk_dfl_config()
  config.data.num_clients = 301  # 301 · 5 is odd: no 5-regular graph exists
  with pytest.raises(ValueError, match="even"):
    schema.validate_config(config)


def test_too_many_jacobian_batches_for_the_data_fails_clearly():
  config, model, federation = tiny_setup(jacobian_batches=9)
  with pytest.raises(ValueError, match="jacobian_batches"):
    runner.make_algorithm(config, model, federation)


# ------------------------------------------------------------------ the scoring hook of make_ntk_dfl


def _hooked_ntk_dfl(config, model, federation, **hooks):
  settings = schema.validate_config(config)
  return ntk_dfl.make_ntk_dfl(
    model, federation, settings.built_topology, settings.algorithm, settings, **hooks
  )


def _rounds(algorithm, rounds=2):
  state = algorithm.init(jax.random.key(0))
  out = []
  for round_index in range(rounds):
    state, metrics = algorithm.step(state, algorithm.round_inputs(round_index))
    out.append((jax.tree.map(np.asarray, state.params), np.asarray(metrics["tau"]), metrics))
  return out


@pytest.mark.parametrize(
  "options",
  [{}, {"select": "linearized"}, {"loss": "mse"}, {"jacobian_batches": 2}],
  ids=["network", "linearized", "mse", "batched"],
)
def test_a_scorer_equal_to_the_default_reproduces_the_round_bit_for_bit(options):
  config, model, federation = tiny_setup(**options)
  config.model.init = "per_client"
  loss = schema.validate_config(config).algorithm.loss
  mean_loss = lambda logits, hard, mask: evolve.mean_loss(logits, hard, mask, loss)
  plain = _rounds(runner.make_algorithm(config, model, federation))
  hooked = _rounds(_hooked_ntk_dfl(config, model, federation, score_fn=mean_loss))
  for (params, taus, metrics), (params_h, taus_h, metrics_h) in zip(plain, hooked):
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_h)):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(taus, taus_h)
    np.testing.assert_array_equal(np.asarray(metrics["loss"]), np.asarray(metrics_h["loss"]))


def _squared_logits(logits, hard, mask):
  """The mean squared distance of the raw outputs to the one-hot labels over the real rows: a candidate of
  the cross-entropy evolution picked by how close its logits come to the labels."""
  per_sample = jnp.sum((logits - hard) ** 2, axis=-1)
  return jnp.sum(jnp.where(mask, per_sample, 0)) / jnp.maximum(mask.sum(), 1)


def test_another_scorer_picks_tau_as_scoring_each_candidate_by_itself_does():
  """Client by client on real samples only: each ``τ``'s candidate from a one-point grid, scored in numpy;
  the round with ``score_fn`` keeps the argmin and its network."""
  config, model, federation = tiny_setup(degree=3, lr=0.5, lr_decay=0.0, taus=(1, 5, 40, 200))
  config.model.init = "per_client"
  hooked = _hooked_ntk_dfl(config, model, federation, score_fn=_squared_logits)
  plain = runner.make_algorithm(config, model, federation)
  state = hooked.init(jax.random.key(0))
  inputs = hooked.round_inputs(0)
  new_state, metrics = hooked.step(state, inputs)
  _, plain_metrics = plain.step(state, inputs)
  taus = tuple(config.algorithm.taus)
  wbars = gossip.mix(state.params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)
  expected_taus = []
  for i in range(federation.n.shape[0]):
    members = [i] + [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    x = np.concatenate([federation.x[j][federation.mask[j]] for j in members])
    y = np.concatenate([federation.y[j][federation.mask[j]] for j in members])
    hard = np.eye(model.num_classes)[y]
    wbar = jax.tree.map(lambda leaf: leaf[i], wbars)
    candidates, scores = [], []
    for tau in taus:
      updated, _ = evolve.ntk_update(
        model.apply,
        wbar,
        jnp.asarray(x),
        jnp.asarray(hard, jnp.float32),
        jnp.ones(len(y), bool),
        lr=config.algorithm.lr,
        taus=(tau,),
        dense_stack=model.dense_stack,
      )
      logits = np.asarray(model.apply(updated, jnp.asarray(x)), np.float64)
      candidates.append(updated)
      scores.append(np.mean(np.sum((logits - hard) ** 2, axis=1)))
    best = int(np.argmin(scores))
    expected_taus.append(taus[best])
    np.testing.assert_allclose(float(metrics["loss"][i]), scores[best], rtol=1e-4)
    assert_trees_close(jax.tree.map(lambda leaf: leaf[i], new_state.params), candidates[best])
  np.testing.assert_array_equal(np.asarray(metrics["tau"]), expected_taus)
  # The two scores disagree on some client here: the hook changed the choice.
  assert np.any(np.asarray(plain_metrics["tau"]) != np.asarray(metrics["tau"]))


def test_a_scorer_and_a_validation_score_exclude_each_other():
  model = models.mlp(input_dim=5, hidden=(8,), num_classes=3)
  params = model.init(jax.random.key(0))
  x = jnp.ones((4, 5))
  with pytest.raises(ValueError, match="exclude each other"):
    evolve.ntk_step(
      model.apply,
      params,
      x,
      jnp.eye(3)[jnp.array([0, 1, 2, 0])],
      jnp.ones(4, bool),
      lr=0.1,
      taus=(1, 2),
      score_fn=lambda p: 0.0,
      score_outputs=_squared_logits,
    )


def _erdos_renyi_setup(num_clients=14):
  config, model, federation = tiny_setup(num_clients=num_clients, per_round_averaging=True)
  config.topology.name = "erdos_renyi"
  config.topology.mean_degree = 3.0
  config.model.init = "per_client"
  return config, model, federation


def test_an_erdos_renyi_round_grouped_by_degree_equals_the_client_by_client_reference():
  """Each client's neighbourhood takes the fewest slots that hold its degree (chunks of 3: part-filled last
  chunks in some groups): the round is the reference's, computed on real samples only."""
  config, model, federation = _erdos_renyi_setup()
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  inputs = algorithm.round_inputs(0)
  expected, expected_taus = reference_round(config, model, federation, state.params, inputs)
  with parallel.use_devices(1, chunk_size=3):
    state, metrics = algorithm.step(state, inputs)
  assert_trees_close(state.params, expected)
  np.testing.assert_array_equal(np.asarray(metrics["tau"]), expected_taus)


def test_degree_groups_cover_the_drawn_degrees_of_an_erdos_renyi_round():
  config, model, federation = _erdos_renyi_setup()
  algorithm = runner.make_algorithm(config, model, federation)
  degrees = algorithm.round_inputs(0).neighbor_mask.sum(axis=1)
  k_max = algorithm.round_inputs(0).neighbor_mask.shape[1]
  graphs = topology.make_topology("erdos_renyi", 14, seed=0, mean_degree=3.0)
  groups = topology.degree_slot_groups(graphs)
  assert groups[-1] == graphs.k_max == k_max
  assert list(groups) == sorted(set(groups)) and groups[0] == 2
  # This round's clients fall into at least three groups: the grouping is exercised above.
  assert len(set(np.searchsorted(groups, degrees).tolist())) >= 3
  regular = topology.make_topology("regular", 14, seed=0, degree=4)
  assert topology.degree_slot_groups(regular) == (4,)


@pytest.mark.parametrize("chunk, grouped", [(1, True), (4, True), (0, False)])
def test_a_degree_grouped_round_gives_each_client_the_slots_of_its_group(chunk, grouped):
  """What each client's update receives: its own neighbourhood, padded to its group's slot count (chunks
  of 1 or 4), or to k_max for every client (chunk 0, where grouping cannot pay)."""
  config, model, federation = _erdos_renyi_setup()
  graphs = topology.make_topology("erdos_renyi", 14, seed=config.seed, mean_degree=3.0)
  groups = topology.degree_slot_groups(graphs)
  n_max = federation.mask.shape[1]
  core = neighbourhood_round.make_neighbourhood_round(
    model,
    federation,
    graphs,
    seed=0,
    lr=0.1,
    lr_decay=0.0,
    per_round_averaging=False,
    group_by_degree=True,
  )
  seen = set()

  def client_fn(params, x, targets, mask, lr):
    seen.add(
      x.shape[1] // n_max
    )  # traced once per slot count: the slots it was given, plus its own
    return {"samples": mask.sum(), "first": x[0, 0, 0], "slots": jnp.int32(x.shape[1] // n_max)}

  params = jnp.zeros((14, 1))
  inputs = core.round_inputs(0)
  with parallel.use_devices(1, chunk_size=chunk):
    out, _ = jax.jit(lambda p, i, d: core.run(p, i, d, client_fn))(params, inputs, core.data)
  degrees = inputs.neighbor_mask.sum(axis=1)
  expected_slots = np.asarray(groups)[np.searchsorted(groups, degrees)] if grouped else graphs.k_max
  np.testing.assert_array_equal(np.asarray(out["slots"]), 1 + expected_slots)
  assert seen == ({1 + g for g in groups} if grouped else {1 + graphs.k_max})
  # Every client's real samples: its own and its neighbours', nothing lost to the narrower slots.
  members = [[i] + list(inputs.neighbors[i][inputs.neighbor_mask[i]]) for i in range(14)]
  np.testing.assert_array_equal(
    np.asarray(out["samples"]), [federation.mask[m].sum() for m in members]
  )
  np.testing.assert_array_equal(np.asarray(out["first"]), federation.x[np.arange(14), 0, 0])
