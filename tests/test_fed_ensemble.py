"""Fed-ensemble on tiny federations, checked against independent computations.

* Schedule: strata are a near-equal split; within an age every stratum trains
  every mode exactly once; ages redraw the permutations; stratified sampling
  takes equal counts per stratum; uniform sampling is FedAvg's draw.
* K = 1 equals FedAvg (and FedProx) bit for bit under the same sampling.
* A K = 3 round equals brute force: every participant trained alone (no vmap)
  from its mode, then a per-mode numpy mean over exactly the participants that
  downloaded it; idle modes unchanged.
* NTK local training: each mode == :func:`ntk_fl.evolve.ntk_update` on its
  participants' explicitly gathered pooled data.
* The ensemble evaluator == numpy (mean of probabilities / logits, entropies).
* Bad config values raise before any work; the smoke config runs through the
  runner and logs per-mode metrics and entropies.
* Experiments: the toy script's training (JAX) == the closed-form FedAvg
  bias and variance (numpy, exact over initialisations); the NTK check's
  finite-time linearised prediction == centralised gradient descent in closed
  form (one client) and leaves an idle mode at its NNGP prior.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import evolve, metrics, models, rundir, runner, schema
from ntk_fl.algorithms import fed_ensemble, local
from federations import ragged_federation
from scripts import load_experiment

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = models.mlp(input_dim=5, hidden=(6,), num_classes=3)
RTOL, ATOL = 2e-5, 2e-6


def load(arg=None):
  return config_lib.load_config(str(REPO / "configs" / "fed_ensemble.py"), arg)


def tiny(method="fed_ensemble", *, sizes=(6, 6, 6, 6, 6, 6), seed=0, **algo):
  """``method``'s config on a 6-client, 5-feature, 3-class federation (MLP 5-6-3)."""
  if method == "fed_ensemble":
    config = load()
  else:
    config = config_lib.load_config(str(REPO / "configs" / f"{method}.py"))
  config.seed = seed
  config.data.num_clients = len(sizes)
  config.chunk_size = 0
  config.algorithm.epochs = 1
  config.algorithm.batch_size = max(sizes)
  config.algorithm.clients_per_round = 0
  for key, value in algo.items():
    setattr(config.algorithm, key, value)
  return config, ragged_federation(np.random.default_rng(seed), sizes)


def run_rounds(algorithm, rounds, key=0):
  state = algorithm.init(jax.random.key(key))
  for r in range(rounds):
    state, step_metrics = algorithm.step(state, algorithm.round_inputs(r))
  return state, step_metrics


def leaves(tree):
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
  for u, v in zip(leaves(a), leaves(b), strict=True):
    np.testing.assert_allclose(u, v, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- schedule


def test_strata_are_a_fixed_near_equal_split():
  strata = fed_ensemble.make_strata(23, 5, seed=3)
  np.testing.assert_array_equal(np.sort(np.bincount(strata)), [4, 4, 5, 5, 5])
  np.testing.assert_array_equal(strata, fed_ensemble.make_strata(23, 5, seed=3))
  assert not np.array_equal(strata, fed_ensemble.make_strata(23, 5, seed=4))
  np.testing.assert_array_equal(
    np.sort(fed_ensemble.make_strata(7, 0, seed=0)), np.arange(7)
  )  # Q = N


@pytest.mark.parametrize("num_strata", [3, 0])
def test_every_stratum_trains_every_mode_once_per_age(num_strata):
  k, n, seed = 4, 12, 1
  strata = fed_ensemble.make_strata(n, num_strata, seed)
  ages = []
  for age in range(3):
    modes = np.stack(
      [fed_ensemble.round_modes(strata, k, seed, age * k + r) for r in range(k)], axis=1
    )  # [N, K]
    for i in range(n):
      np.testing.assert_array_equal(np.sort(modes[i]), np.arange(k))  # each mode exactly once
      np.testing.assert_array_equal(
        modes[i], modes[strata == strata[i]][0]
      )  # a stratum moves together
    ages.append(modes)
  assert not np.array_equal(ages[0], ages[1])  # a new P every age


def test_participant_sampling():
  strata = fed_ensemble.make_strata(12, 4, seed=0)
  chosen = fed_ensemble.sample_participants(strata, 8, "stratified", seed=0, round_index=5)
  np.testing.assert_array_equal(np.bincount(strata[chosen], minlength=4), [2, 2, 2, 2])
  assert len(set(chosen.tolist())) == 8
  # 'uniform' is the FedAvg family's draw of the same round.
  config, fed = tiny("fedavg", sizes=(4,) * 12, clients_per_round=5)
  fedavg = runner.make_algorithm(config, MODEL, fed)
  for r in range(3):
    np.testing.assert_array_equal(
      fed_ensemble.sample_participants(strata, 5, "uniform", 0, r), fedavg.round_inputs(r).clients
    )


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("base, extra", [("fedavg", {}), ("fedprox", {"prox_mu": 0.1})])
def test_one_mode_is_fedavg_bit_for_bit(base, extra):
  common = dict(
    epochs=2, batch_size=4, lr=0.2, lr_gamma=0.9, clients_per_round=4, **extra
  )  # minibatches, partial
  sizes = (6, 3, 5, 6, 2, 6)
  base_config, base_fed = tiny(base, sizes=sizes, **common)
  reference, ref_metrics = run_rounds(runner.make_algorithm(base_config, MODEL, base_fed), 3)
  config, fed = tiny(
    sizes=sizes, num_modes=1, aggregation_weights="data_size", local_training=base, **common
  )
  ensemble = runner.make_algorithm(config, MODEL, fed)
  state, step_metrics = run_rounds(ensemble, 3)
  for got, want in zip(leaves(state.modes), leaves(reference.params), strict=True):
    np.testing.assert_array_equal(got[0], want)
  assert float(step_metrics["loss"]) == float(ref_metrics["loss"])
  assert float(state.bits_cumulative) == float(reference.bits_cumulative)


def test_each_mode_averages_exactly_the_clients_that_trained_it():
  sizes = (6, 3, 5, 6, 2, 6)
  update = None
  for weights in ("uniform", "data_size"):
    config, fed = tiny(
      sizes=sizes,
      num_modes=3,
      epochs=2,
      batch_size=4,
      lr=0.3,
      aggregation_weights=weights,
      clients_per_round=5,
      seed=2,
    )
    algorithm = runner.make_algorithm(config, MODEL, fed)
    state0 = algorithm.init(jax.random.key(0))
    for r in range(2):  # two rounds, so round 1 starts from three distinct trained modes
      inputs = algorithm.round_inputs(r)
      state1, step_metrics = algorithm.step(state0, inputs)
      update = update or jax.jit(
        local.local_update_from_hparams(MODEL.apply, schema.validate_config(config).algorithm)
      )  # one client
      lr = float(local.round_lr(config.algorithm, r))
      client_keys = jax.random.split(jax.random.split(inputs.key)[0], len(inputs.clients))
      trained = {}
      for slot, (c, m) in enumerate(
        zip(inputs.clients, inputs.modes)
      ):  # one client at a time, no vmap
        start = jax.tree.map(lambda w: w[m], state0.modes)
        trained[slot] = update(start, fed.x[c], fed.y[c], fed.mask[c], client_keys[slot], lr).params
      counts = np.bincount(inputs.modes, minlength=3)
      np.testing.assert_array_equal(step_metrics["mode_participants"], counts)
      for m in range(3):
        old = jax.tree.map(lambda w: np.asarray(w[m]), state0.modes)
        new = jax.tree.map(lambda w: w[m], state1.modes)
        slots = [s for s in range(len(inputs.clients)) if inputs.modes[s] == m]
        if not slots:
          assert_trees_close(new, old, rtol=0, atol=0)  # idle mode untouched
          continue
        w = np.array([1.0 if weights == "uniform" else sizes[inputs.clients[s]] for s in slots])
        want = jax.tree.map(
          lambda *ws: sum(wi * np.asarray(x) for wi, x in zip(w, ws)) / w.sum(),
          *[trained[s] for s in slots],
        )
        assert_trees_close(new, want)
      state0 = state1


def test_idle_modes_stay_and_modes_start_independent():
  config, fed = tiny(
    num_modes=5, clients_per_round=2
  )  # 2 participants: >= 3 modes idle every round
  algorithm = runner.make_algorithm(config, MODEL, fed)
  state0 = algorithm.init(jax.random.key(0))
  kernel = np.asarray(state0.modes["params"]["dense_0"]["kernel"])  # (biases start at zero)
  assert all(not np.array_equal(kernel[0], kernel[k]) for k in range(1, 5))
  np.testing.assert_array_equal(
    kernel[0], MODEL.init(jax.random.key(0))["params"]["dense_0"]["kernel"]
  )
  inputs = algorithm.round_inputs(0)
  state1, _ = algorithm.step(state0, inputs)
  for k in set(range(5)) - set(inputs.modes.tolist()):
    for a, b in zip(leaves(state0.modes), leaves(state1.modes)):
      np.testing.assert_array_equal(a[k], b[k])


def test_ntk_local_training_evolves_each_mode_on_its_pooled_participants():
  config, fed = tiny(
    sizes=(5, 3, 5, 4, 5, 2),
    num_modes=2,
    local_training="ntk",
    aggregation_weights="data_size",
    lr=0.5,
    taus=(2, 5, 9),
    seed=1,
  )
  algorithm = runner.make_algorithm(config, MODEL, fed)
  state0 = algorithm.init(jax.random.key(0))
  inputs = algorithm.round_inputs(0)
  state1, step_metrics = algorithm.step(state0, inputs)
  for m in range(2):
    members = inputs.clients[inputs.modes == m]
    x = np.concatenate([fed.x[c][fed.mask[c]] for c in members])  # pooled real samples only
    y = np.concatenate([fed.y[c][fed.mask[c]] for c in members])
    start = jax.tree.map(lambda w: w[m], state0.modes)
    reference = jax.jit(
      lambda p, x, t, mask: evolve.ntk_update(
        MODEL.apply, p, x, t, mask, lr=0.5, taus=(2, 5, 9), kernel_impl="jacobian"
      )
    )
    want, info = reference(start, x, jax.nn.one_hot(y, 3), np.ones(len(y), bool))
    assert_trees_close(jax.tree.map(lambda w: w[m], state1.modes), want, rtol=1e-4, atol=1e-5)
    assert int(step_metrics["tau"][m]) == int(info["tau"])


# ----------------------------------------------------------------------------- the mode-update hook


def _with_hook(config, fed, mode_update):
  settings = schema.validate_config(config)
  return fed_ensemble.make_fed_ensemble(
    MODEL, fed, None, settings.algorithm, settings, mode_update=mode_update
  )


def test_a_custom_mode_update_gets_the_rounds_data_and_replaces_the_training():
  # The hook moves every leaf of a mode by lr x its participants' count and reports the sum of each mode's
  # participants' real inputs and the key it got: all three checked against the round's inputs in numpy.
  sizes = (6, 3, 5, 6, 2, 6)
  config, fed = tiny(sizes=sizes, num_modes=3, clients_per_round=4, lr=0.25, seed=3)

  def hook(modes, assignment, key, x, y, mask, lr):
    del y
    counts = jnp.sum(assignment[:, None] == jnp.arange(3)[None, :], axis=0)
    moved = jax.tree.map(lambda m: m + lr * counts.reshape(-1, *([1] * (m.ndim - 1))), modes)
    per_client = jnp.sum(jnp.where(mask[..., None], x, 0.0), axis=(1, 2))  # [P]
    input_sum = jnp.zeros(3).at[assignment].add(per_client)
    return moved, {"input_sum": input_sum, "key_data": jax.random.key_data(key)}

  algorithm = _with_hook(config, fed, hook)
  state0 = algorithm.init(jax.random.key(0))
  inputs = algorithm.round_inputs(1)
  state1, step_metrics = algorithm.step(state0, inputs)
  lr = float(local.round_lr(config.algorithm, 1))
  counts = np.bincount(inputs.modes, minlength=3)
  for old, new in zip(leaves(state0.modes), leaves(state1.modes), strict=True):
    want = old.astype(np.float64) + lr * counts.reshape(-1, *([1] * (old.ndim - 1)))
    np.testing.assert_allclose(new, want, rtol=1e-6, atol=0)
  want_sums = np.zeros(3)
  for c, m in zip(inputs.clients, inputs.modes):
    want_sums[m] += np.asarray(fed.x[c], np.float64)[np.asarray(fed.mask[c])].sum()
  np.testing.assert_allclose(step_metrics["input_sum"], want_sums, rtol=1e-5)
  np.testing.assert_array_equal(step_metrics["key_data"], jax.random.key_data(inputs.key))
  np.testing.assert_array_equal(
    step_metrics["mode_participants"], counts
  )  # the method's own metrics stay
  assert float(step_metrics["lr"]) == np.float32(lr) and "loss" not in step_metrics


def test_the_default_mode_update_is_public_and_rebuilt_from_public_pieces():
  # Fed-ensemble's local-SGD training written as a hook from the public names alone (FedAvg's local update,
  # the transmission, Remark 3.1's aggregation) equals the method without a hook, bit for bit; so does the
  # public default, for the local-SGD and the NTK training.
  sizes = (6, 3, 5, 6, 2, 6)
  config, fed = tiny(
    sizes=sizes, num_modes=3, epochs=2, batch_size=4, lr=0.3, clients_per_round=5, seed=2
  )
  hparams = schema.validate_config(config).algorithm
  update = local.local_update_from_hparams(MODEL.apply, hparams)

  def by_hand(modes, assignment, key, x, y, mask, lr):
    train_key, quant_key = jax.random.split(key)
    start = jax.tree.map(lambda m: m[assignment], modes)
    result = jax.vmap(lambda p, xc, yc, mc, kc: update(p, xc, yc, mc, kc, lr, anchor=p))(
      start, x, y, mask, jax.random.split(train_key, mask.shape[0])
    )
    sent = local.transmit(result.params, hparams.quantize_bits, key=quant_key, stochastic=False)
    new_modes, _ = fed_ensemble.aggregate_modes(
      modes, sent, assignment, jnp.ones(mask.shape[0], jnp.float32)
    )
    return new_modes, {"loss": jnp.mean(result.loss)}

  assert hparams.aggregation_weights == "uniform" and not hparams.stochastic_rounding
  reference, ref_metrics = run_rounds(runner.make_algorithm(config, MODEL, fed), 3)
  for hook in (by_hand, fed_ensemble.make_mode_update(MODEL, hparams)):
    state, step_metrics = run_rounds(_with_hook(config, fed, hook), 3)
    for got, want in zip(leaves(state.modes), leaves(reference.modes), strict=True):
      np.testing.assert_array_equal(got, want)
    assert float(step_metrics["loss"]) == float(ref_metrics["loss"])

  config, fed = tiny(
    sizes=sizes, num_modes=2, local_training="ntk", aggregation_weights="data_size", taus=(2, 5)
  )
  hparams = schema.validate_config(config).algorithm
  reference, ref_metrics = run_rounds(runner.make_algorithm(config, MODEL, fed), 2)
  state, step_metrics = run_rounds(
    _with_hook(config, fed, fed_ensemble.make_mode_update(MODEL, hparams)), 2
  )
  for got, want in zip(leaves(state.modes), leaves(reference.modes), strict=True):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(step_metrics["tau"], ref_metrics["tau"])


# ----------------------------------------------------------------------------- evaluation


def _numpy_ensemble(stacked, x, y, aggregate):
  logits = np.stack(
    [
      np.asarray(MODEL.apply(jax.tree.map(lambda w: w[k], stacked), x), np.float64)
      for k in range(jax.tree.leaves(stacked)[0].shape[0])
    ]
  )
  softmax = lambda z: (
    np.exp(z - z.max(-1, keepdims=True))
    / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
  )
  probs = softmax(logits)
  q = probs.mean(0) if aggregate == "ensemble_probs" else softmax(logits.mean(0))
  entropy = lambda p: -(p * np.log(p)).sum(-1)
  return (
    (q.argmax(-1) == y).mean(),
    -np.log(q[np.arange(len(y)), y]).mean(),
    entropy(probs).mean(),
    entropy(q).mean(),
  )


@pytest.mark.parametrize("aggregate", ["ensemble_probs", "ensemble_logits"])
def test_ensemble_evaluator_matches_numpy(aggregate):
  stacked = fed_ensemble.init_modes(MODEL, jax.random.key(3), 4)
  stacked = jax.tree.map(lambda w: 3.0 * w, stacked)  # confident, diverse members
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(23, 5)).astype(np.float32), rng.integers(0, 3, size=23)
  ev = metrics.make_evaluator(MODEL.apply, x, y, batch_size=7, chunk_size=3, aggregate=aggregate)
  assert ev.extra_names == ("mode_entropy", "ensemble_entropy")
  acc, loss, dev, mode_entropy, ensemble_entropy = ev.aggregate(stacked)
  want = _numpy_ensemble(stacked, x, y, aggregate)
  assert float(acc) == pytest.approx(want[0], abs=1e-6)
  for got, expected in zip((loss, mode_entropy, ensemble_entropy), want[1:]):
    assert float(got) == pytest.approx(expected, rel=RTOL)
  assert float(dev) == pytest.approx(float(metrics.model_deviation(stacked)), rel=RTOL)
  # One member: the ensemble is that model.
  one = jax.tree.map(lambda w: w[:1], stacked)
  acc1, loss1, *_ = ev.aggregate(one)
  acc_p, loss_p, _ = metrics.make_evaluator(MODEL.apply, x, y, batch_size=7).aggregate(one)
  assert float(acc1) == float(acc_p)
  assert float(loss1) == pytest.approx(float(loss_p), rel=RTOL)


def test_evaluator_rejects_unknown_aggregate():
  with pytest.raises(ValueError, match="aggregate"):
    metrics.make_evaluator(
      MODEL.apply, np.zeros((2, 5), np.float32), np.zeros(2, np.int32), aggregate="mean"
    )


# ----------------------------------------------------------------------------- config and runner


@pytest.mark.parametrize(
  "change, match",
  [
    (("num_modes", 0), "num_modes"),
    (("sampling", "random"), "sampling"),
    (("prox_mu", 0.1), "prox_mu"),
    (("local_training", "fedprox"), "prox_mu"),
    (("aggregation_weights", "median"), "aggregation_weights"),
    (("prediction", "vote"), "prediction"),
    (
      ("clients_per_round", 7),
      "clients_per_round",
    ),  # stratified below: 7 is not a multiple of Q = 10
    (("taus", (5, 3)), "taus"),
    (("unknown_key", 1), "unknown key"),
  ],
)
def test_bad_config_values_raise_before_any_work(change, match):
  config = load("stratified")
  setattr(config.algorithm, *change)
  with pytest.raises(ValueError, match=match):
    schema.validate_config(config)


def test_config_consistency_rules():
  config = load("ntk")
  config.algorithm.aggregation_weights = "uniform"
  with pytest.raises(ValueError, match="data_size"):
    schema.validate_config(config)
  config = load()
  config.eval.selection = True
  with pytest.raises(ValueError, match="selection"):
    schema.validate_config(config)
  with pytest.raises(ValueError, match="unknown config variant 'toy'"):
    load("toy")


def test_variants_validate():
  for arg in (
    None,
    "paper",
    "iid",
    "k1,data_size",
    "k1,data_size,fedprox",
    "k80",
    "ntk",
    "stratified",
    "logits",
    "cnn",
    "fmnist",
    "smoke",
  ):
    schema.validate_config(load(arg))
  toy = config_lib.load_config(str(REPO / "configs" / "fed_ensemble_toy.py"))
  assert toy.method == "fed_ensemble_toy" and toy.modes == (1, 2, 10, 20, 40)


def test_smoke_config_runs_through_the_runner(tmp_path):
  config = load("smoke")
  config.data.name = "synthetic"
  config.data.partition = "iid"
  config.data.num_clients = 8
  config.data.samples_per_client = 0
  config.data.max_train = config.data.max_test = (
    0  # the synthetic set is smaller than the smoke slices
  )
  config.model.hidden = (8,)
  config.algorithm.clients_per_round = 4
  config.checkpoint_every = (
    config.rounds
  )  # one (final) checkpoint of the K-mode state is enough here
  summary = runner.run(config, str(tmp_path))
  lines = rundir.read_metrics(str(tmp_path))
  assert len(lines) == config.rounds
  last = lines[-1]
  assert len(last["clients"]["test_acc"]) == config.algorithm.num_modes  # per-mode metrics
  assert sum(last["clients"]["mode_participants"]) == 4
  assert 0 < last["mode_entropy"] <= np.log(10) + 1e-6
  assert last["ensemble_entropy"] >= last["mode_entropy"] - 1e-6  # entropy is concave
  assert summary["final_test_acc"] == last["test_acc"]
  assert (tmp_path / "checkpoints").is_dir() and any((tmp_path / "checkpoints").iterdir())


# ----------------------------------------------------------------------------- experiments


def test_toy_training_matches_the_closed_form_fedavg_bias_and_variance():
  toy = load_experiment("fed_ensemble_toy")
  config = config_lib.load_config(str(REPO / "configs" / "fed_ensemble_toy.py"))
  config.num_clients, config.num_features, config.rounds, config.local_steps = 5, 12, 3, 2
  x, y, centres = toy.make_data(config)
  phi = toy.rbf_features(jnp.asarray(x.reshape(-1)), centres, config.bandwidth).reshape(
    *x.shape, -1
  )
  grid = np.linspace(-1.0, 1.0, 33, dtype=np.float32)
  phi_grid = np.asarray(toy.rbf_features(jnp.asarray(grid), centres, config.bandwidth))
  truth = np.sin(2 * np.pi * grid)
  # Training is linear in w_0: from 0 it gives the mean over initialisations, from init_std * e_j (minus the
  # mean) the j-th column of init_std * Abar^R, whose squared norms sum to the variance.
  init = config.init_std * np.concatenate([np.zeros((1, 12)), np.eye(12)])[:, None, :].astype(
    np.float32
  )
  assignment = np.zeros((config.rounds, 13, config.num_clients), np.int32)
  modes = np.asarray(
    toy.train(config, phi, jnp.asarray(y), jnp.asarray(assignment), jnp.asarray(init)), np.float64
  )
  pred = phi_grid @ modes[:, 0].T  # [G, 1 + F]
  bias = np.mean((pred[:, 0] - truth) ** 2)
  variance = np.mean(np.sum((pred[:, 1:] - pred[:, :1]) ** 2, axis=1))
  exact = toy.fedavg_closed_form(config, phi, y, phi_grid, truth, (config.rounds,))[config.rounds]
  assert bias == pytest.approx(exact[0], rel=1e-4)
  assert variance == pytest.approx(exact[1], rel=1e-4)
  assert exact[0] > 0.01 and exact[1] > 0.01  # neither is trivially 0


def test_ntk_check_prediction_is_closed_form_gradient_descent():
  check = load_experiment("fed_ensemble_ntk_check")
  x, y, x_test = check.make_data(0)
  x1, y1 = x.reshape(1, -1, 2), y.reshape(1, -1)  # one client holding everything: centralised GD
  rounds, tau, lr = 5, 3, 0.7
  mean, variance, cross = check.linearised_prediction(
    x1, y1, x_test, np.zeros((1, rounds, 1), np.int64), 2, tau, lr
  )
  kxx, txx = check.kernels(x1[0], x1[0])
  ksx, tsx = check.kernels(x_test, x1[0])
  kss, _ = check.kernels(x_test, x_test)
  # f_t = f_0 + Theta(x, X) Theta^-1 (I - (I - lr Theta / n)^t) (Y - f_0(X)), t = rounds * tau steps.
  evals, evecs = np.linalg.eigh(txx)
  decay = evecs @ np.diag((1 - (1 - lr * evals / y1.size) ** (rounds * tau)) / evals) @ evecs.T
  a = tsx @ decay  # [T, n]
  np.testing.assert_allclose(mean[0, 0], a @ y1[0], rtol=1e-7, atol=1e-9)
  want_var = np.diag(kss) + np.einsum("ij,jk,ik->i", a, kxx, a) - 2 * np.einsum("ij,ij->i", a, ksx)
  np.testing.assert_allclose(variance[0, 0], want_var, rtol=1e-7, atol=1e-9)
  # Mode 1 never trained: its prior, GP(0, Kcal); the 2-mode average's variance is the sum over 4.
  np.testing.assert_allclose(mean[0, 1], 0.0, atol=1e-12)
  np.testing.assert_allclose(variance[0, 1], np.diag(kss), rtol=1e-9)
  np.testing.assert_allclose(cross[0], (want_var + np.diag(kss)) / 4, rtol=1e-7)
  assert np.all(want_var < 0.9 * np.diag(kss))  # training did shrink it
