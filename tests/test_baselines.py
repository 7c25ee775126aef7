"""Gradient baselines on tiny federations, checked against independent computations.

* FedAvg / centralised / DataShare with one full-batch local step == gradient
  descent on the pooled data (``jax.grad`` of the pooled mean cross-entropy).
* FedProx with mu = 0, FedNova with equal step counts == FedAvg; FedNova's
  momentum coefficient == the brute-force sum of unrolled momentum weights.
* Gossip == the dense mixing matrix of :mod:`ntk_fl.topology` applied to the
  locally trained models (complete graph + uniform weights == exact mean), with
  and without quantised transmission; DFedAvgM with momentum 0 and DFedSAM with
  rho = 0 == DFedAvg.
* DisPFL's masked aggregation and mask evolution vs brute-force numpy loops.
* Quantisation error bounds, unbiasedness and bit counts.
* Reproducibility from the seed; every config's ``smoke`` variant runs.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ntk_fl import compression, models, runner, schema, topology
from ntk_fl import config as config_lib
from ntk_fl.algorithms import datashare, dispfl, fednova, local
from federations import ragged_federation

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = (
  "fedavg",
  "fedprox",
  "fednova",
  "datashare",
  "centralized",
  "dpsgd",
  "dfedavg",
  "dfedavgm",
  "dfedsam",
  "dispfl",
)
MODEL = models.mlp(input_dim=5, hidden=(6,), num_classes=3)
RTOL, ATOL = 2e-5, 2e-6


def load_config(name, arg=None):
  return config_lib.load_config(str(REPO / "configs" / f"{name}.py"), arg)


def tiny(name, *, sizes=(6, 6, 6, 6), seed=0, topology_name="regular", degree=2, **algo):
  """``name``'s config on a 4-client, 5-feature, 3-class federation (MLP 5-6-3)."""
  config = load_config(name)
  config.seed = seed
  config.rounds = 3
  config.data.num_clients = len(sizes)
  config.topology.name = topology_name
  config.topology.degree = degree
  config.chunk_size = 0
  config.algorithm.epochs = 1
  config.algorithm.batch_size = max(sizes)
  if "clients_per_round" in config.algorithm:
    config.algorithm.clients_per_round = 0
  for key, value in algo.items():
    setattr(config.algorithm, key, value)
  return config, ragged_federation(np.random.default_rng(seed), sizes)


def build(name, config, federation):
  return runner.make_algorithm(config, MODEL, federation)


def run_rounds(algorithm, rounds, key=0):
  state = algorithm.init(jax.random.PRNGKey(key))
  for r in range(rounds):
    state, metrics = algorithm.step(state, algorithm.round_inputs(r))
  return state, metrics


def pooled_ce(params, x, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(params, x), y))


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def stacked_to_list(stacked, m):
  return [jax.tree.map(lambda w: w[i], stacked) for i in range(m)]


# ----------------------------------------------------------------------------- centralised


@pytest.mark.parametrize("name", ["fedavg", "centralized"])
def test_one_full_batch_step_equals_gradient_descent_on_pooled_data(name):
  lr = 0.4
  config, fed = tiny(name, lr=lr, batch_size=100)  # >= the pooled 24 samples: one full-batch step
  algorithm = build(name, config, fed)
  w0 = algorithm.init(jax.random.PRNGKey(0)).params
  state, metrics = algorithm.step(algorithm.init(jax.random.PRNGKey(0)), algorithm.round_inputs(0))
  x, y = fed.x.reshape(-1, 5), fed.y.reshape(-1)  # equal sizes, no padding
  g = jax.grad(pooled_ce)(w0, x, y)
  assert_trees_close(state.params, jax.tree.map(lambda w, gi: w - lr * gi, w0, g))
  np.testing.assert_allclose(metrics["loss"], pooled_ce(w0, x, y), rtol=1e-5)


def test_fedavg_weights_by_data_size():
  # Unequal sizes, one full-batch step: sum_k (n_k/N) (w - lr g_k) == GD on the pooled data.
  lr = 0.4
  config, fed = tiny("fedavg", sizes=(3, 6, 2, 5), lr=lr)
  algorithm = build("fedavg", config, fed)
  w0 = algorithm.init(jax.random.PRNGKey(0)).params
  state, _ = algorithm.step(algorithm.init(jax.random.PRNGKey(0)), algorithm.round_inputs(0))
  g = jax.grad(pooled_ce)(w0, fed.x[fed.mask], fed.y[fed.mask])
  assert_trees_close(state.params, jax.tree.map(lambda w, gi: w - lr * gi, w0, g))


def test_fedprox_mu_zero_and_fednova_equal_steps_equal_fedavg():
  common = dict(
    epochs=3, batch_size=4, lr=0.2, clients_per_round=3
  )  # minibatches, partial participation
  reference, _ = run_rounds(build("fedavg", *tiny("fedavg", **common)), 2)
  prox, _ = run_rounds(build("fedprox", *tiny("fedprox", prox_mu=0.0, **common)), 2)
  nova, _ = run_rounds(build("fednova", *tiny("fednova", **common)), 2)
  assert_trees_close(prox.params, reference.params, rtol=0, atol=0)
  assert_trees_close(nova.params, reference.params)
  # (mu > 0 changing the step is checked against the formula in test_local.py.)


def test_fednova_normalises_by_step_counts():
  # Unequal sizes -> unequal step counts; compare with the formula on independently trained clients.
  lr, sizes = 0.3, (2, 6, 4, 6)
  config, fed = tiny("fednova", sizes=sizes, batch_size=2, epochs=2, lr=lr)
  algorithm = build("fednova", config, fed)
  state0 = algorithm.init(jax.random.PRNGKey(0))
  inputs = algorithm.round_inputs(0)
  state, _ = algorithm.step(state0, inputs)
  update = jax.jit(
    local.local_update_from_hparams(MODEL.apply, schema.validate_config(config).algorithm)
  )
  keys = jax.random.split(jax.random.split(inputs.key)[0], len(sizes))  # the step's key derivation
  w = state0.params
  trained = [
    update(w, fed.x[i], fed.y[i], fed.mask[i], keys[i], lr).params for i in range(len(sizes))
  ]
  p = np.asarray(sizes) / sum(sizes)
  a = np.asarray([2 * math.ceil(n / 2) for n in sizes], np.float32)
  tau_eff = float(np.sum(p * a))
  expected = jax.tree.map(
    lambda w0, *ws: w0 - tau_eff * sum(pi * (w0 - wi) / ai for pi, wi, ai in zip(p, ws, a)),
    w,
    *trained,
  )
  assert_trees_close(state.params, expected)


@pytest.mark.parametrize("rho, steps", [(0.0, 5), (0.9, 1), (0.9, 7), (0.5, 12)])
def test_nova_coefficient_is_the_total_momentum_weight(rho, steps):
  # Unroll heavy-ball with unit gradients: the summed step multipliers are a_k.
  buf, total = 0.0, 0.0
  for _ in range(steps):
    buf = rho * buf + 1.0
    total += buf
  # The closed form subtracts nearly equal float32 numbers (amplified by 1/(1 - rho)): a few float32 ulps * 10.
  np.testing.assert_allclose(fednova.nova_coefficient(steps, rho), total, rtol=1e-5)


def test_datashare_trains_on_own_data_plus_the_shared_set():
  lr, share = 0.4, 0.25
  config, fed = tiny("datashare", lr=lr, share_fraction=share, batch_size=100, clients_per_round=2)
  gx, gy = datashare.shared_set(fed, share, config.seed)
  assert gx.shape == (round(share * 24), 5)
  real = {tuple(np.round(r, 6)) for r in fed.x[fed.mask]}
  assert all(tuple(np.round(r, 6)) in real for r in gx)
  algorithm = build("datashare", config, fed)
  state0 = algorithm.init(jax.random.PRNGKey(0))
  inputs = algorithm.round_inputs(0)
  state, _ = algorithm.step(state0, inputs)
  trained = []
  for i in np.asarray(inputs.clients):  # one full-batch step on own ∪ G each
    g = jax.grad(pooled_ce)(
      state0.params, np.concatenate([fed.x[i], gx]), np.concatenate([fed.y[i], gy])
    )
    trained.append(jax.tree.map(lambda w, gi: w - lr * gi, state0.params, g))
  assert_trees_close(state.params, jax.tree.map(lambda *ws: sum(ws) / len(ws), *trained))


def test_participants_are_drawn_per_round_reproducibly():
  config, fed = tiny("fedavg", clients_per_round=2)
  a, b = build("fedavg", config, fed), build("fedavg", config, fed)
  draws = [tuple(a.round_inputs(r).clients) for r in range(8)]
  assert draws == [tuple(b.round_inputs(r).clients) for r in range(8)]
  assert all(len(set(d)) == 2 for d in draws) and len(set(draws)) > 1


# ----------------------------------------------------------------------------- decentralised


def trained_clients(config, fed, state, inputs):
  """Every client's local training, one by one, with the step's key derivation."""
  update = jax.jit(
    local.local_update_from_hparams(MODEL.apply, schema.validate_config(config).algorithm)
  )
  m = fed.x.shape[0]
  keys = jax.random.split(jax.random.split(inputs.key)[0], m)
  lr = config.algorithm.lr * config.algorithm.lr_gamma ** int(inputs.round)
  return [
    update(p, fed.x[i], fed.y[i], fed.mask[i], keys[i], lr).params
    for i, p in enumerate(stacked_to_list(state.params, m))
  ]


def test_complete_graph_uniform_gossip_is_exact_averaging():
  config, fed = tiny("dfedavg", topology_name="complete", epochs=2, batch_size=4, lr=0.3)
  config.model.init = "per_client"
  algorithm = build("dfedavg", config, fed)
  state0 = algorithm.init(jax.random.PRNGKey(0))
  inputs = algorithm.round_inputs(0)
  state, _ = algorithm.step(state0, inputs)
  mean = jax.tree.map(lambda *ws: sum(ws) / len(ws), *trained_clients(config, fed, state0, inputs))
  for client in stacked_to_list(state.params, 4):
    assert_trees_close(client, mean)


def test_gossip_equals_mixing_matrix_on_trained_models():
  # 8-bit transmission: neighbours' terms quantised, own term exact (32 bits is the complete-graph test above).
  bits = 8
  config, fed = tiny(
    "dfedavg",
    sizes=(5, 6, 3, 6, 4, 6),
    topology_name="ring",
    epochs=2,
    batch_size=4,
    lr=0.3,
    quantize_bits=bits,
  )
  config.topology.mixing = "metropolis"
  config.model.init = "per_client"
  algorithm = build("dfedavg", config, fed)
  state0 = algorithm.init(jax.random.PRNGKey(0))
  inputs = algorithm.round_inputs(1)
  state, metrics = algorithm.step(state0, inputs)
  trained = trained_clients(config, fed, state0, inputs)
  sent = trained if bits == 32 else [compression.quantize_tree(t, bits) for t in trained]
  w = topology.mixing_matrix(topology.Graph(inputs.neighbors, inputs.neighbor_mask), "metropolis")
  off = w - np.diag(np.diag(w))
  for i in range(6):  # own term exact, neighbours' terms as sent
    expected = jax.tree.map(
      lambda own, *others: w[i, i] * own + sum(off[i, j] * o for j, o in enumerate(others)),
      trained[i],
      *sent,
    )
    assert_trees_close(
      jax.tree.map(lambda leaf: leaf[i], state.params), expected, rtol=1e-5, atol=1e-5
    )
  d = models.num_params(MODEL.init(jax.random.key(0)))
  payload = d * 32 if bits == 32 else d * bits + 64 * 4
  np.testing.assert_array_equal(metrics["bits_sent"], 2.0 * payload)  # ring: two neighbours each
  np.testing.assert_allclose(metrics["bits_sent_total"], 12.0 * payload, rtol=1e-7)


def test_dfedavgm_momentum_zero_and_dfedsam_rho_zero_equal_dfedavg():
  common = dict(epochs=2, batch_size=4, lr=0.2)
  reference, _ = run_rounds(build("dfedavg", *tiny("dfedavg", **common)), 2)
  momentum0, _ = run_rounds(build("dfedavgm", *tiny("dfedavgm", momentum=0.0, **common)), 2)
  sam0, _ = run_rounds(
    build(
      "dfedsam",
      *tiny("dfedsam", momentum=0.0, weight_decay=0.0, lr_gamma=1.0, sam_rho=0.0, **common),
    ),
    2,
  )
  assert_trees_close(momentum0.params, reference.params, rtol=0, atol=0)
  assert_trees_close(sam0.params, reference.params, rtol=0, atol=0)
  # (momentum > 0 and rho > 0 are checked against hand-written updates in test_local.py.)


def test_runs_are_reproducible_from_the_seed():
  config, fed = tiny("dfedavg", epochs=2, batch_size=4)
  (a, ma), (b, mb) = (run_rounds(build("dfedavg", config, fed), 2) for _ in range(2))
  assert_trees_close(a.params, b.params, rtol=0, atol=0)
  np.testing.assert_array_equal(ma["loss"], mb["loss"])
  np.testing.assert_allclose(mb["bits_cumulative"], 2 * float(mb["bits_sent_total"]), rtol=1e-7)
  # Another seed: another graph sequence, initialisation and round keys.
  other, _ = tiny("dfedavg", seed=1, epochs=2, batch_size=4)
  first, second = build("dfedavg", config, fed), build("dfedavg", other, fed)
  assert any(
    not np.array_equal(first.round_inputs(r).neighbors, second.round_inputs(r).neighbors)
    for r in range(4)
  )
  assert not np.array_equal(
    jax.random.key_data(first.round_inputs(0).key), jax.random.key_data(second.round_inputs(0).key)
  )


# ----------------------------------------------------------------------------- DisPFL


def test_masked_neighbor_average_matches_brute_force():
  rng = np.random.default_rng(0)
  m, k, d = 5, 3, 7
  w = rng.normal(size=(m, d)).astype(np.float32)
  s = (w + rng.normal(scale=0.01, size=(m, d))).astype(np.float32)
  mk = (rng.random((m, d)) < 0.5).astype(np.float32)
  nbrs = rng.integers(0, m, size=(m, k)).astype(np.int32)
  nmask = rng.random((m, k)) < 0.7
  out = np.asarray(dispfl.masked_neighbor_average(w, mk, s, nbrs, nmask))
  for i in range(m):
    for c in range(d):
      if not mk[i, c]:
        assert out[i, c] == 0
        continue
      values = [w[i, c]] + [s[j, c] for j, real in zip(nbrs[i], nmask[i]) if real and mk[j, c]]
      np.testing.assert_allclose(out[i, c], np.mean(values), rtol=1e-6)


def test_evolve_mask_prunes_smallest_and_regrows_largest_gradients():
  rng = np.random.default_rng(1)
  w = rng.normal(size=(6, 5)).astype(np.float32)
  g = rng.normal(size=(6, 5)).astype(np.float32)
  mask = np.zeros(30, np.float32)
  mask[rng.permutation(30)[:15]] = 1
  mask = mask.reshape(6, 5)
  w = w * mask
  new = np.asarray(dispfl.evolve_mask(w, g, mask, 0.3))
  k = math.floor(0.3 * 15)
  active = np.flatnonzero(mask.ravel())
  inactive = np.flatnonzero(mask.ravel() == 0)
  pruned = set(active[np.argsort(np.abs(w.ravel()[active]))[:k]])
  grown = set(inactive[np.argsort(-np.abs(g.ravel()[inactive]))[:k]])
  expected = (set(active) - pruned) | grown
  assert set(np.flatnonzero(new.ravel())) == expected
  np.testing.assert_allclose(dispfl.mask_fraction(0.5, 0, 10), 0.5)
  np.testing.assert_allclose(dispfl.mask_fraction(0.5, 5, 10), 0.25, atol=1e-7)


def test_evolve_mask_breaks_ties_by_position():
  """Coarse weights and gradients (many equal magnitudes, zeros among the active weights): the pruned set is the
  k smallest active |w| and the regrown set the k largest inactive |g|, each lowest index first among equals,
  for every fraction, including 0 (no change) and 1 (capped by the inactive count)."""
  rng = np.random.default_rng(4)
  size = 60
  mask = np.zeros(size, np.float32)
  mask[rng.permutation(size)[:36]] = 1
  w = rng.choice([0.0, 0.5, -0.5, 1.0, -2.0], size=size).astype(np.float32) * mask
  g = rng.choice([0.0, 0.25, -0.25, 3.0], size=size).astype(np.float32)
  active, inactive = np.flatnonzero(mask), np.flatnonzero(mask == 0)
  for fraction in (0.0, 0.1, 0.3, 0.5, 1.0):
    k = min(math.floor(fraction * active.size), inactive.size)
    pruned = sorted(active, key=lambda i: (abs(w[i]), i))[:k]
    grown = sorted(inactive, key=lambda i: (-abs(g[i]), i))[:k]
    expected = np.zeros(size, np.float32)
    expected[sorted((set(active) - set(pruned)) | set(grown))] = 1
    new = jax.jit(dispfl.evolve_mask)(
      w.reshape(6, 10), g.reshape(6, 10), mask.reshape(6, 10), fraction
    )
    np.testing.assert_array_equal(np.asarray(new).ravel(), expected, err_msg=f"fraction={fraction}")


def test_dispfl_keeps_density_and_sparsity_and_counts_sparse_bits():
  config, fed = tiny("dispfl", epochs=2, batch_size=3, lr=0.2)
  state, metrics = run_rounds(build("dispfl", config, fed), 2)
  for path_w, mk in zip(
    jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(state.masks)
  ):
    path, w = path_w
    w, mk = np.asarray(w), np.asarray(mk)
    assert np.all(w[mk == 0] == 0)
    if path[-1].key == "kernel":
      per_client = mk.reshape(mk.shape[0], -1).sum(axis=1)
      np.testing.assert_array_equal(per_client, round(0.5 * mk[0].size))
    else:
      assert np.all(mk == 1)
  kernels = 5 * 6 + 6 * 3
  active = round(0.5 * 30) + round(0.5 * 18) + 6 + 3
  np.testing.assert_array_equal(metrics["bits_sent"], 2.0 * (active * 32 + kernels))


# ----------------------------------------------------------------------------- compression


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_quantize_error_bounds_and_levels(bits):
  x = jax.random.normal(jax.random.key(0), (1000,)) * 3
  step = float((x.max() - x.min()) / (2**bits - 1))
  q = np.asarray(compression.quantize(x, bits))
  assert np.max(np.abs(q - np.asarray(x))) <= step / 2 * (1 + 1e-5)
  assert len(np.unique(q)) <= 2**bits
  qs = np.asarray(compression.quantize(x, bits, key=jax.random.key(1), stochastic=True))
  assert np.max(np.abs(qs - np.asarray(x))) < step * (1 + 1e-5)
  assert len(np.unique(qs)) <= 2**bits


def test_stochastic_rounding_is_unbiased():
  x = jnp.asarray([0.0, 0.13, 0.5, 0.77, 1.0])  # step 1/3 at 2 bits
  draws = jax.vmap(lambda k: compression.quantize(x, 2, key=k, stochastic=True))(
    jax.random.split(jax.random.key(0), 4000)
  )
  # Per-entry std of one draw <= step/2; the mean of 4000 draws is within 5 standard errors.
  np.testing.assert_allclose(np.mean(draws, axis=0), x, atol=5 * (1 / 6) / math.sqrt(4000))


def test_quantize_constant_and_bad_input():
  np.testing.assert_array_equal(compression.quantize(jnp.full((4,), 2.5), 4), np.full((4,), 2.5))
  with pytest.raises(ValueError, match="bits"):
    compression.quantize(jnp.ones(3), 0)
  with pytest.raises(ValueError, match="key"):
    compression.quantize(jnp.ones(3), 4, stochastic=True)


def test_payload_bits():
  params = MODEL.init(jax.random.key(0))
  d = models.num_params(params)
  assert compression.tree_payload_bits(params) == 32 * d
  assert compression.tree_payload_bits(params, 8) == 8 * d + 64 * 4
  assert compression.payload_bits(10, 4, num_tensors=2, bitmap_size=20) == 40 + 128 + 20
  with pytest.raises(ValueError, match="bits"):
    compression.payload_bits(10, 17)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
  "name, change, match",
  [
    ("dfedavg", ("momentum", 0.9), "momentum"),
    ("dfedavg", ("prox_mu", 0.1), "unknown key"),
    ("fedavg", ("clients_per_round", 50), "clients_per_round"),
    ("fedavg", ("quantize_bits", 20), "quantize_bits"),
    ("dfedsam", ("sam_rho", -1.0), "sam_rho"),
    ("dispfl", ("dense_ratio", 0.0), "dense_ratio"),
    ("centralized", ("quantize_bits", 8), "quantize_bits"),
  ],
)
def test_bad_config_values_raise_before_any_work(name, change, match):
  config = load_config(name, "smoke")
  setattr(config.algorithm, *change)  # may add an unknown key, which must be rejected
  with pytest.raises(ValueError, match=match):
    schema.validate_config(config)


def test_dispfl_rejects_non_uniform_mixing_and_bad_degree():
  config = load_config("dispfl")
  config.topology.mixing = "data_size"
  with pytest.raises(ValueError, match="mixing"):
    schema.validate_config(config)
  config = load_config("dfedavg")
  config.topology.degree = 300  # must be < num_clients
  with pytest.raises(ValueError, match="degree"):
    schema.validate_config(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_smoke_variant_runs_on_synthetic_data(name):
  config = load_config(name, "smoke")
  schema.validate_config(config)
  for variant in ("paper", "iid", "alpha0.5"):
    schema.validate_config(load_config(name, variant))
  config.data.name = "synthetic"
  config.data.partition = "iid"
  config.data.num_clients = 8
  config.data.samples_per_client = 0
  config.data.max_train = config.data.max_test = (
    0  # the synthetic set is smaller than the smoke slices
  )
  config.model.hidden = (8,)
  config.algorithm.epochs = 1
  exp = runner.build_experiment(config)
  state, metrics = run_rounds(exp.algorithm, 2)
  assert np.isfinite(np.asarray(metrics["loss"])).all()
  assert float(metrics["bits_cumulative"]) > float(metrics["bits_sent_total"]) > 0
  params = exp.algorithm.client_params(state)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params))


def test_fednova_rejects_nesterov_momentum():
  config = load_config("fednova", "smoke")
  config.algorithm.momentum, config.algorithm.nesterov = 0.9, True
  with pytest.raises(ValueError, match="nesterov"):
    schema.validate_config(config)


@pytest.mark.parametrize(
  "name, plain_sgd", [("dfedavg", True), ("dpsgd", True), ("dfedavgm", False), ("dfedsam", False)]
)
def test_local_sgd_gossip_methods_check_their_optimiser(name, plain_sgd):
  """The four local-SGD gossip baselines are one builder's: the plain-SGD ones refuse momentum by name."""
  from ntk_fl.algorithms import get_method  # pylint: disable=import-outside-toplevel

  method = get_method(name)
  assert method.graph and method.make.__name__ == f"make_{name}"
  config = config_lib.load_config(name, "smoke")
  config.algorithm.momentum = 0.5
  if plain_sgd:
    with pytest.raises(ValueError, match=f"method '{name}' uses plain SGD"):
      schema.validate_config(config)
  else:
    assert schema.validate_config(config).algorithm.momentum == 0.5


@pytest.mark.parametrize(
  "name, label",
  [
    ("fedavg", "FedAvg"),
    ("fedprox", "FedProx"),
    ("fednova", "FedNova"),
    ("datashare", "DataShare"),
    ("centralized", "Centralized training"),
    ("fedbe", "FedBE"),
    ("fedcom", "FedCOM"),
    ("qsgd", "QSGD"),
  ],
)
def test_server_baselines_are_one_builders(name, label):
  """The server baselines are ``server_round.server_method``'s: the module's factory is the registered one,
  named ``make_<name>``; it refuses the run settings and a seed together, naming the method, and the shared
  participants rule holds."""
  import importlib  # pylint: disable=import-outside-toplevel

  from ntk_fl.algorithms import get_method  # pylint: disable=import-outside-toplevel

  method = get_method(name)
  assert not method.graph and method.make.__name__ == f"make_{name}"
  assert (
    getattr(importlib.import_module(f"ntk_fl.algorithms.{name}"), f"make_{name}") is method.make
  )
  config = config_lib.load_config(name, "smoke")
  settings = schema.validate_config(config)
  with pytest.raises(TypeError, match=f"^{label}: pass the run settings or the keywords"):
    method.make(None, None, None, settings.algorithm, settings, seed=1)
  config.algorithm.clients_per_round = config.data.num_clients + 1
  with pytest.raises(ValueError, match="clients_per_round"):
    schema.validate_config(config)
