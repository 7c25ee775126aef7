"""NTK-FL / CP-NTK-FL on tiny federations, checked against independent computations.

* Explicit Jacobians (chunked, flat or per leaf) == ``jax.jacrev`` of the batch;
  their kernel == the structured / generic empirical NTK of :mod:`ntk_fl.ntk`.
* An uncompressed round == :func:`ntk_fl.evolve.ntk_update` on the concatenated
  participants' data; the explicit-Jacobian path == the VJP path (CE and MSE).
* The shuffling server leaves the update unchanged (with and without compression).
* Projection: ``P`` comes from the seed's ``INPUT_PROJECTION`` stream, the model's
  input layer is d1', the round == ``ntk_update`` of the d1' model on ``X P``,
  and the folded evaluation model == the projected model.
* Subsampling keeps ``floor(β n)`` distinct real samples.
* A compressed round == a numpy reference (row top-k, min-max quantisation of
  the survivors, kernel and ``Jᵀ S`` by brute force).
* Uplink/downlink bits == a hand count; bad configs fail early; the smoke
  variants run through the runner and learn.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import config as config_lib
from ntk_fl import communication, evolve, jacobians, models, ntk, rng, rundir, runner, schema
from ntk_fl.configs import _presets as presets
from ntk_fl.data import federation_from_padded

REPO = pathlib.Path(__file__).resolve().parents[1]
D_IN, HIDDEN, C = 8, (6,), 3
MODEL = models.mlp(D_IN, HIDDEN, C)
TAUS = (5, 10, 20)
RTOL, ATOL = 2e-4, 2e-5


def tiny(*, sizes=(7, 5, 6, 7, 4), clients_per_round=3, seed=0, **algo):
  """A 5-client federation (8 features, 3 classes, unequal sizes) and a matching NTK-FL config."""
  config = presets.server_ntk_config(clients_per_round=clients_per_round, taus=TAUS, lr=0.5, **algo)
  config.seed = seed
  config.data.num_clients = len(sizes)
  config.model.hidden = HIDDEN
  data_rng = np.random.default_rng(seed)
  n_max = max(sizes)
  x = np.zeros((len(sizes), n_max, D_IN), np.float32)
  y = np.zeros((len(sizes), n_max), np.int32)
  for i, n in enumerate(sizes):
    x[i, :n] = data_rng.normal(size=(n, D_IN))
    y[i, :n] = data_rng.integers(0, C, size=n)
  mask = np.arange(n_max)[None] < np.asarray(sizes)[:, None]
  return config, federation_from_padded(x, y, mask)


def one_round(config, federation, round_index=0):
  algorithm = runner.make_algorithm(config, MODEL, federation)
  state = algorithm.init(jax.random.key(config.seed))
  inputs = algorithm.round_inputs(round_index)
  new_state, metrics = algorithm.step(state, inputs)
  return algorithm, state, inputs, new_state, metrics


def pooled(federation, clients):
  """Participants' real samples concatenated (no padding): the server's pooled data."""
  xs, ys = [], []
  for c in np.asarray(clients):
    n = int(federation.n[c])
    xs.append(federation.x[c, :n])
    ys.append(federation.y[c, :n])
  x, y = np.concatenate(xs), np.concatenate(ys)
  return jnp.asarray(x), jax.nn.one_hot(y, C), jnp.ones(len(y), bool)


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
  jax.tree.map(
    lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol),
    a,
    b,
  )


# ----------------------------------------------------------------------------- jacobians


def test_per_sample_jacobian_equals_jacrev_of_the_batch_chunked_or_not():
  params = MODEL.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (7, D_IN))
  reference = jax.jacrev(lambda p: MODEL.apply(p, x))(params)  # leaves [N, C, *leaf]
  for chunk in (None, 1, 3, 7):
    assert_trees_close(
      jacobians.per_sample_jacobian(MODEL.apply, params, x, chunk_size=chunk),
      reference,
      rtol=1e-6,
      atol=1e-6,
    )
  flat = jacobians.flat_jacobian(MODEL.apply, params, x, chunk_size=3)
  assert flat.shape == (7, C, models.num_params(params))
  row = ravel_pytree(jax.tree.map(lambda leaf: leaf[4, 2], reference))[0]
  np.testing.assert_allclose(flat[4, 2], row, rtol=1e-6, atol=1e-6)
  assert_trees_close(jacobians.unflatten_jacobian(flat, params), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trace", [True, False])
def test_jacobian_kernel_equals_empirical_ntk(trace):
  params = MODEL.init(jax.random.key(3))
  x1 = jax.random.normal(jax.random.key(4), (6, D_IN))
  x2 = jax.random.normal(jax.random.key(5), (4, D_IN))
  j1, j2 = (jacobians.flat_jacobian(MODEL.apply, params, x) for x in (x1, x2))
  expected = ntk.empirical_ntk(
    MODEL.apply, params, x1, x2, trace_outputs=trace, implementation="jacobian"
  )
  np.testing.assert_allclose(
    jacobians.jacobian_kernel(j1, j2, trace_outputs=trace), expected, rtol=1e-5, atol=1e-5
  )


def test_projection_is_seeded_gaussian_and_folds_into_the_first_layer():
  key = jax.random.key(9)
  p = jacobians.projection_matrix(key, D_IN, 4)
  np.testing.assert_allclose(p, jax.random.normal(key, (D_IN, 4)) / math.sqrt(D_IN), rtol=1e-6)
  np.testing.assert_array_equal(
    jacobians.projection_matrix(key, D_IN, 4, scale="none"), jax.random.normal(key, (D_IN, 4))
  )
  small = models.mlp(4, HIDDEN, C)
  params = small.init(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (5, D_IN))
  np.testing.assert_allclose(
    MODEL.apply(jacobians.fold_projection(params, p), x),
    small.apply(params, x @ p),
    rtol=1e-5,
    atol=1e-5,
  )


def test_subsample_keeps_floor_beta_n_distinct_real_samples():
  mask = jnp.arange(20) < 13
  for seed in range(5):
    idx, keep = jacobians.subsample(jax.random.key(seed), mask, 0.4)
    assert idx.shape == keep.shape == (8,)  # floor(0.4 * 20) slots
    chosen = np.asarray(idx)[np.asarray(keep)]
    assert len(chosen) == 5 and len(set(chosen)) == 5  # floor(0.4 * 13) distinct samples
    assert np.all(chosen < 13)  # all real
  # Every real sample gets drawn by some key (uniform, not a fixed prefix).
  seen = set()
  for seed in range(40):
    idx, keep = jacobians.subsample(jax.random.key(seed), mask, 0.4)
    seen |= set(np.asarray(idx)[np.asarray(keep)].tolist())
  assert seen == set(range(13))


def _numpy_topk_rows(a, keep):
  k = math.ceil(keep * a.shape[-1] - 1e-9)
  order = np.argsort(-np.abs(a), axis=-1, kind="stable")[..., :k]
  mask = np.zeros(a.shape, bool)
  np.put_along_axis(mask, order, True, axis=-1)
  return np.where(mask, a, 0), mask


def _numpy_quantize(a, mask, bits):
  lo, hi = a[mask].min(), a[mask].max()
  step = (hi - lo) / (2**bits - 1)
  q = lo + np.clip(np.round((a - lo) / step), 0, 2**bits - 1) * step
  return np.where(mask, q, 0)


def test_sparsify_rows_and_quantize_kept_match_numpy():
  a = np.asarray(jax.random.normal(jax.random.key(0), (4, 3, 50)))
  sparse, mask = jacobians.sparsify_rows(jnp.asarray(a), 0.1)
  ref_sparse, ref_mask = _numpy_topk_rows(a, 0.1)
  np.testing.assert_array_equal(mask, ref_mask)
  np.testing.assert_array_equal(sparse, ref_sparse)
  assert mask.sum(axis=-1).min() == mask.sum(axis=-1).max() == 5
  q = jacobians.quantize_kept(sparse, mask, 4)
  np.testing.assert_allclose(q, _numpy_quantize(ref_sparse, ref_mask, 4), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(q)[~ref_mask] == 0)
  # The range spans the kept values only: the dropped zeros would not change a signed range, so check it on
  # one-signed values, where including them would widen [lo, hi] and coarsen every level.
  pos = jnp.abs(sparse) + 1.0
  q_pos = jacobians.quantize_kept(jnp.where(mask, pos, 0), mask, 4)
  step = (pos[mask].max() - pos[mask].min()) / 15
  assert np.max(np.abs(np.asarray(q_pos - pos)[np.asarray(mask)])) <= step / 2 + 1e-6


def test_payload_bits_match_a_hand_count():
  # Table 1's setting: 59 samples x 10 outputs, d' = 21,110 (MLP 200-100-10), top-2 %, 8 bits.
  rows, d = 59 * 10, 200 * 100 + 100 + 100 * 10 + 10
  assert d == 21_110
  k = math.ceil(0.02 * d)  # 423 per row
  index_bits = math.ceil(math.log2(d))  # 15 (index list beats the 21,110-bit bitmap)
  assert (
    communication.jacobian_payload_bits(rows, d, keep_fraction=0.02, bits=8)
    == rows * k * (8 + index_bits) + 64
  )
  # Dense float32 and dense 8-bit payloads.
  assert communication.jacobian_payload_bits(rows, d) == rows * d * 32
  assert communication.jacobian_payload_bits(rows, d, bits=8) == rows * d * 8 + 64
  # Keeping half of a row: the bitmap (d bits) is cheaper than d/2 indices.
  assert communication.jacobian_payload_bits(2, 1000, keep_fraction=0.5) == 2 * (500 * 32 + 1000)


def test_shuffle_rows_permutes_every_leaf_together():
  a, b = jnp.arange(6), jnp.arange(12).reshape(6, 2)
  (pa, pb), perm = jacobians.shuffle_rows(jax.random.key(0), (a, b))
  np.testing.assert_array_equal(pa, perm)
  np.testing.assert_array_equal(pb, b[perm])
  assert sorted(np.asarray(perm).tolist()) == list(range(6))


# ----------------------------------------------------------------------------- rounds


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_uncompressed_round_is_ntk_update_on_the_pooled_data(loss):
  config, fed = tiny(loss=loss)
  _, state, inputs, new_state, metrics = one_round(config, fed)
  x, t, m = pooled(fed, inputs.clients)
  expected, info = evolve.ntk_update(
    MODEL.apply, state.params, x, t, m, lr=0.5, taus=TAUS, loss=loss, dense_stack=MODEL.dense_stack
  )
  assert_trees_close(new_state.params, expected)
  assert int(metrics["tau"]) == int(info["tau"])
  assert int(metrics["num_samples"]) == len(t)


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_explicit_jacobian_path_equals_the_vjp_path(loss):
  _, _, _, implicit, m_implicit = one_round(*tiny(loss=loss, jacobian="implicit"))
  _, _, _, explicit, m_explicit = one_round(*tiny(loss=loss, jacobian="explicit", jacobian_chunk=4))
  assert int(m_implicit["tau"]) == int(m_explicit["tau"])
  assert_trees_close(implicit.params, explicit.params)


@pytest.mark.parametrize("compress", [{}, {"sparsify_keep": 0.3, "quantize_bits": 6}])
def test_shuffling_server_leaves_the_update_unchanged(compress):
  _, _, _, plain, m_plain = one_round(*tiny(**compress))
  _, _, _, shuffled, m_shuffled = one_round(*tiny(shuffle=True, **compress))
  assert int(m_plain["tau"]) == int(m_shuffled["tau"])
  assert_trees_close(plain.params, shuffled.params)


def test_projected_round_is_the_d1_prime_model_on_projected_data():
  config, fed = tiny(projection_dim=4)
  algorithm, state, inputs, new_state, _ = one_round(config, fed)
  assert new_state.params["params"]["dense_0"]["kernel"].shape == (
    4,
    HIDDEN[0],
  )  # input layer is d1'
  p = jacobians.projection_matrix(rng.jax_key(config.seed, rng.Stream.INPUT_PROJECTION), D_IN, 4)
  small = models.mlp(4, HIDDEN, C)
  x, t, m = pooled(fed, inputs.clients)
  expected, _ = evolve.ntk_update(
    small.apply, state.params, x @ p, t, m, lr=0.5, taus=TAUS, dense_stack=small.dense_stack
  )
  assert_trees_close(new_state.params, expected)
  # The runner scores client_params with the raw-input model: P folded into the first layer.
  x_test = jnp.asarray(np.random.default_rng(1).normal(size=(9, D_IN)), jnp.float32)
  folded = jax.tree.map(lambda w: w[0], algorithm.client_params(new_state))
  np.testing.assert_allclose(
    MODEL.apply(folded, x_test), small.apply(new_state.params, x_test @ p), rtol=1e-4, atol=1e-5
  )


def test_subsampled_round_sends_floor_beta_n_samples_per_client():
  config, fed = tiny(subsample_fraction=0.5)
  _, _, inputs, _, metrics = one_round(config, fed)
  assert int(metrics["num_samples"]) == sum(int(fed.n[c]) // 2 for c in inputs.clients)


def test_compressed_round_equals_a_numpy_reference():
  keep, bits = 0.25, 5
  config, fed = tiny(sparsify_keep=keep, quantize_bits=bits)
  _, state, inputs, new_state, metrics = one_round(config, fed)
  params = state.params
  d = models.num_params(params)
  # Each client: Jacobian of its real rows (jacrev of the batch), per-row top-k, one min-max range per client.
  jac_rows, xs, ys = [], [], []
  for c in np.asarray(inputs.clients):
    n = int(fed.n[c])
    x = jnp.asarray(fed.x[c, :n])
    jac = jax.jacrev(lambda p: MODEL.apply(p, x))(params)
    flat = np.concatenate(
      [np.asarray(leaf).reshape(n, C, -1) for leaf in jax.tree.leaves(jac)], axis=-1
    )
    sparse, mask = _numpy_topk_rows(flat, keep)
    jac_rows.append(_numpy_quantize(sparse, mask, bits))
    xs.append(x)
    ys.append(fed.y[c, :n])
  jac = np.concatenate(jac_rows).astype(np.float64)
  x, y = jnp.concatenate(xs), np.concatenate(ys)
  targets, n_total = jax.nn.one_hot(y, C), len(y)
  kernel = np.einsum("icp,jcp->ij", jac, jac) / C
  evo = evolve.evolve(
    jnp.asarray(kernel, jnp.float32),
    MODEL.apply(params, x),
    targets,
    jnp.ones(n_total, bool),
    lr=0.5,
    taus=TAUS,
  )
  deltas = -0.5 / n_total * np.einsum("tic,icp->tp", np.asarray(evo.residual_sums, np.float64), jac)
  flat0, unravel = ravel_pytree(params)
  losses = [
    float(evolve.mean_loss(MODEL.apply(unravel(flat0 + dt), x), targets, jnp.ones(n_total, bool)))
    for dt in deltas
  ]
  best = int(np.argmin(losses))
  assert int(metrics["tau"]) == TAUS[best]
  np.testing.assert_allclose(
    ravel_pytree(new_state.params)[0], flat0 + deltas[best], rtol=RTOL, atol=ATOL
  )
  assert d == flat0.size


def test_bit_accounting_matches_a_hand_count_and_accumulates():
  keep, bits = 0.25, 6
  config, fed = tiny(sparsify_keep=keep, quantize_bits=bits)
  algorithm = runner.make_algorithm(config, MODEL, fed)
  state = algorithm.init(jax.random.key(0))
  d = models.num_params(state.params)  # 8*6 + 6 + 6*3 + 3 = 75
  k = math.ceil(keep * d)
  support = min(d, k * math.ceil(math.log2(d)))  # bitmap (75) vs 19 indices of 7 bits (133)
  uplink, cumulative = 0.0, 0.0
  for r in range(2):
    inputs = algorithm.round_inputs(r)
    state, metrics = algorithm.step(state, inputs)
    sizes = [int(fed.n[c]) for c in inputs.clients]
    per_client = [
      n * C * (k * bits + support) + 64 + n * C * 32 + n * 2 for n in sizes
    ]  # labels: 2 bits
    uplink = sum(per_client)
    cumulative += uplink
    assert float(metrics["bits_sent_total"]) == pytest.approx(uplink, rel=1e-6)
    assert float(metrics["bits_per_client"]) == pytest.approx(uplink / 3, rel=1e-6)
    assert float(metrics["bits_cumulative"]) == pytest.approx(cumulative, rel=1e-6)
    assert float(metrics["downlink_bits_total"]) == 3 * d * 32
    assert float(metrics["uplink_mb_cumulative"]) == pytest.approx(cumulative / 8 / 2**20, rel=1e-6)
  assert float(metrics["downlink_bits_cumulative"]) == 2 * 3 * d * 32


def test_round_inputs_sample_clients_from_the_participation_stream():
  config, fed = tiny()
  algorithm = runner.make_algorithm(config, MODEL, fed)
  a, b = algorithm.round_inputs(3), algorithm.round_inputs(3)
  np.testing.assert_array_equal(a.clients, b.clients)
  expected = np.sort(rng.numpy_rng(0, rng.Stream.PARTICIPATION, 3).choice(5, size=3, replace=False))
  np.testing.assert_array_equal(a.clients, expected)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
  "field,value,message",
  [
    ("clients_per_round", 9, "clients_per_round"),
    ("subsample_fraction", 0.0, "subsample_fraction"),
    ("sparsify_keep", 1.5, "sparsify_keep"),
    ("quantize_bits", 20, "quantize_bits"),
    ("stochastic_rounding", True, "stochastic_rounding needs quantisation"),
    ("jacobian", "dense", "config.algorithm.jacobian"),
    ("projection_scale", "unit", "projection_scale"),
    ("taus", (10, 5), "taus"),
    ("solver", "ode_mse", "solver"),
  ],
)
def test_validate_config_rejects_bad_values(field, value, message):
  config, _ = tiny()
  config.algorithm[field] = value
  with pytest.raises(ValueError, match=message):
    schema.validate_config(config)


def test_validate_config_rejects_impossible_combinations():
  config, _ = tiny(jacobian="implicit", sparsify_keep=0.5)
  with pytest.raises(ValueError, match="must be materialised"):
    schema.validate_config(config)
  config, _ = tiny(projection_dim=4)
  config.model.name = "cnn"
  with pytest.raises(ValueError, match="needs model.name='mlp'"):
    schema.validate_config(config)
  config, _ = tiny()
  config.algorithm.extra = 1
  with pytest.raises(ValueError, match="unknown key\\(s\\) \\['extra'\\]"):
    schema.validate_config(config)


@pytest.mark.parametrize(
  "name,variant",
  [
    ("ntk_fl", None),
    ("ntk_fl", "busiest_node,iid"),
    ("ntk_fl", "mse"),
    ("cp_ntk_fl", None),
    ("cp_ntk_fl", "table1,shuffle,stochastic"),
  ],
)
def test_config_variants_validate(name, variant):
  config = config_lib.load_config(str(REPO / "configs" / f"{name}.py"), variant)
  schema.validate_config(config)
  if name == "cp_ntk_fl":
    assert (config.algorithm.projection_dim, config.algorithm.subsample_fraction) == (200, 0.3)
  with pytest.raises(ValueError, match="unknown config variant"):
    config_lib.load_config(str(REPO / "configs" / f"{name}.py"), "no_such_variant")


def test_cp_ntk_fl_smoke_runs_through_the_runner_and_learns(tmp_path):
  config = config_lib.load_config(str(REPO / "configs" / "cp_ntk_fl.py"), "smoke,table1,shuffle")
  config.rounds = 2
  summary = runner.run(config, str(tmp_path))
  lines = rundir.read_metrics(str(tmp_path))
  assert summary["final_test_acc"] > 0.25  # chance is 0.10
  assert lines[-1]["uplink_mb_cumulative"] == pytest.approx(
    lines[-1]["bits_cumulative"] / 8 / 2**20, rel=1e-6
  )
  assert lines[1]["bits_cumulative"] == pytest.approx(
    lines[0]["bits_sent_total"] + lines[1]["bits_sent_total"], rel=1e-6
  )


# ----------------------------------------------------------------------------- the public server update


@pytest.mark.parametrize("jacobian", ["implicit", "explicit"])
def test_the_public_server_update_on_the_pooled_uploads_is_the_round(jacobian):
  """``make_server_update`` on the participants' real samples (and, explicit, their flat Jacobians taken
  here): the round's weights and τ."""
  from ntk_fl.algorithms import server_ntk  # pylint: disable=import-outside-toplevel

  config, fed = tiny(jacobian=jacobian)
  _, state, inputs, new_state, metrics = one_round(config, fed)
  update = server_ntk.make_server_update(MODEL, schema.validate_config(config).algorithm)
  x, t, m = pooled(fed, inputs.clients)
  jac = jacobians.flat_jacobian(MODEL.apply, state.params, x) if jacobian == "explicit" else None
  params, info = jax.jit(update)(state.params, x, t, m, 0.5, jacobian=jac)
  assert_trees_close(params, new_state.params)
  assert int(info["tau"]) == int(metrics["tau"])


def test_the_server_update_takes_a_validation_score_exactly_with_select_validation():
  from ntk_fl.algorithms import server_ntk  # pylint: disable=import-outside-toplevel

  config, fed = tiny()
  params = MODEL.init(jax.random.key(0))
  x, t, m = pooled(fed, np.arange(3))
  update = server_ntk.make_server_update(MODEL, schema.validate_config(config).algorithm)
  with pytest.raises(ValueError, match="select='validation'"):
    update(params, x, t, m, 0.5, score_fn=lambda w: 0.0)
  # On the held-out data itself, the validation score is the network selection's training loss.
  config.algorithm.select, config.algorithm.validation_clients = "validation", 1
  by_validation = server_ntk.make_server_update(MODEL, schema.validate_config(config).algorithm)
  score = lambda w: evolve.mean_loss(MODEL.apply(w, x), t, m, evolve.Loss.CE)
  a, info_a = by_validation(params, x, t, m, 0.5, score_fn=score)
  b, info_b = update(params, x, t, m, 0.5)
  assert int(info_a["tau"]) == int(info_b["tau"])
  assert_trees_close(a, b)
