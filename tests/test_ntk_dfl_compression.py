"""NTK-DFL's communication compression (App. E.3): top-k packages, b-bit values, input projection.

The references are written here independently of the algorithm's vectorised code: per-sample Jacobians by
``jax.jacrev`` on one sample at a time, each sender's package sparsified with a numpy sort and quantised with
the min-max formula by hand, and the client's step on its real samples only
(:func:`ntk_fl.evolve.ntk_update` with the explicit ``jacobian``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import compression, evolve, jacobians, models, parallel, runner, schema
from ntk_fl.rng import Stream, jax_key
from test_ntk_dfl import assert_trees_close, ntk_dfl_config, reference_round, tiny_setup


def numpy_package(package: np.ndarray, keep: float, bits: int) -> np.ndarray:
  """Top ``ceil(keep·size)`` magnitudes (stable: lower index first on ties), then min-max ``bits`` levels."""
  flat = package.ravel().astype(np.float64)
  out = flat.copy()
  kept = np.ones(flat.size, bool)
  if keep < 1:
    k = max(1, math.ceil(keep * flat.size - 1e-9))
    order = np.argsort(-np.abs(flat), kind="stable")
    kept = np.zeros(flat.size, bool)
    kept[order[:k]] = True
    out = np.where(kept, flat, 0.0)
  if bits != 32:
    lo, hi = out.min(), out.max()
    step = (hi - lo) / (2**bits - 1)
    level = np.clip(np.round((out - lo) / step), 0, 2**bits - 1) if step > 0 else np.zeros_like(out)
    out = np.where(kept, lo + level * step, 0.0)
  return out.reshape(package.shape)


def one_jacobian(model, params, x):
  """``[N, C, *leaf]`` per-sample Jacobian, one sample at a time."""
  rows = [jax.jacrev(lambda p, xi=xi: model.apply(p, xi[None])[0])(params) for xi in x]
  return jax.tree.map(lambda *leaves: np.stack([np.asarray(l) for l in leaves]), *rows)


def compressed_reference_round(config, model, federation, params, inputs):
  """One compressed NTK-DFL round client by client, on real samples only (averaging on)."""
  algo = config.algorithm
  num_clients = federation.n.shape[0]
  flat = [jax.tree.map(lambda leaf: np.asarray(leaf[i]), params) for i in range(num_clients)]
  new, taus = [], []
  for i in range(num_clients):
    nbrs = [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    weights = [float(inputs.self_weight[i])] + [
      float(w) for w, m in zip(inputs.neighbor_weights[i], inputs.neighbor_mask[i]) if m
    ]
    wbar = jax.tree.map(
      lambda *leaves: sum(w * l for w, l in zip(weights, leaves)),
      *([flat[i]] + [flat[j] for j in nbrs]),
    )
    xs, ys, jac_parts = [], [], []
    for slot, j in enumerate([i] + nbrs):
      xj = federation.x[j][federation.mask[j]]
      jac = one_jacobian(model, wbar, xj)
      if slot > 0:  # a neighbour's package is compressed; the own rows are not
        jac = jax.tree.map(
          lambda leaf: numpy_package(leaf, algo.sparsify_keep, algo.quantize_bits), jac
        )
      xs.append(xj)
      ys.append(federation.y[j][federation.mask[j]])
      jac_parts.append(jac)
    jac = jax.tree.map(lambda *leaves: jnp.asarray(np.concatenate(leaves), jnp.float32), *jac_parts)
    x, y = np.concatenate(xs), np.concatenate(ys)
    updated, info = evolve.ntk_update(
      model.apply,
      wbar,
      jnp.asarray(x),
      jax.nn.one_hot(y, model.num_classes),
      jnp.ones(len(y), bool),
      lr=algo.lr,
      taus=tuple(algo.taus),
      loss=algo.loss,
      solver=algo.solver,
      kernel=algo.kernel,
      select=algo.select,
      jacobian=jac,
    )
    new.append(updated)
    taus.append(int(info["tau"]))
  return jax.tree.map(lambda *leaves: np.stack(leaves), *new), np.array(taus)


@pytest.mark.parametrize(
  "keep, bits, chunks", [(0.3, 32, (0,)), (1.0, 4, (0,)), (0.5, 6, (0, 4, 1))]
)
def test_compressed_round_equals_client_by_client_reference(keep, bits, chunks):
  """All clients in one vmap (chunk 0, the GPU setting), chunks of 4 of 6 clients (a remainder), one by one.

  Every chunking steps from the same state and is held to the same reference round (the reference does
  not depend on the chunking: it is computed once per round, not once per chunking)."""
  config, model, federation = tiny_setup(sparsify_keep=keep, quantize_bits=bits, lr_decay=0.0)
  config.model.init = "per_client"
  # One algorithm per chunking: the policy is read when its step is traced.
  algorithms = [runner.make_algorithm(config, model, federation) for _ in chunks]
  state = algorithms[0].init(jax.random.key(0))
  for round_index in range(2):
    inputs = algorithms[0].round_inputs(round_index)
    expected, expected_taus = compressed_reference_round(
      config, model, federation, state.params, inputs
    )
    stepped = []
    for chunk, algorithm in zip(chunks, algorithms):
      with parallel.use_devices(1, chunk_size=chunk):
        new_state, metrics = algorithm.step(jax.tree.map(jnp.copy, state), inputs)
      assert_trees_close(new_state.params, expected, rtol=1e-3, atol=1e-4)
      np.testing.assert_array_equal(np.asarray(metrics["tau"]), expected_taus)
      stepped.append(new_state)
    state = stepped[0]


def test_package_compression_under_vmap_is_each_clients_own_bit_for_bit():
  """Clients mapped in one vmap (chunk 0) compress exactly as each alone: the selection and the
  quantiser's range are per package, never across the client axis."""
  rng = np.random.default_rng(3)
  senders, slots, shapes = 3, 4, [(2, 5), (5,)]
  leaves = [rng.normal(size=(6, senders * slots, 3) + s).astype(np.float32) for s in shapes]
  mask = rng.random((6, senders * slots)) < 0.7
  sent = np.arange(senders) > 0

  def compress(client_leaves, client_mask):
    return compression.compress_packages(client_leaves, client_mask, senders, 0.4, 5, sent=sent)

  batched = jax.jit(jax.vmap(compress))(leaves, mask)
  for client in range(6):
    alone = jax.jit(compress)([leaf[client] for leaf in leaves], mask[client])
    for got, want in zip(batched, alone):
      np.testing.assert_array_equal(np.asarray(got[client]), np.asarray(want))


def test_compression_changes_the_round():
  """The compressed kernel is not the exact one: the test above could fail."""
  results = []
  for keep in (1.0, 0.3):
    config, model, federation = tiny_setup(sparsify_keep=keep)
    algorithm = runner.make_algorithm(config, model, federation)
    state, _ = algorithm.step(algorithm.init(jax.random.key(0)), algorithm.round_inputs(0))
    results.append(np.concatenate([np.asarray(l).ravel() for l in jax.tree.leaves(state.params)]))
  assert np.max(np.abs(results[0] - results[1])) > 1e-4


def test_package_compression_counts_only_real_rows_and_spares_unsent_packages():
  rng = np.random.default_rng(1)
  leaf = rng.normal(size=(3 * 4, 2, 5)).astype(np.float32)  # 3 senders x 4 slots
  mask = np.array([True] * 4 + [True, True, False, False] + [False] * 4)
  sent = np.array([False, True, True])
  (out,) = compression.compress_packages(
    (jnp.asarray(leaf),), jnp.asarray(mask), 3, 0.25, 32, sent=jnp.asarray(sent)
  )
  out = np.asarray(out).reshape(3, 4, 2, 5)
  ref = np.where(mask[:, None, None], leaf, 0).reshape(3, 4, 2, 5)
  np.testing.assert_array_equal(out[0], ref[0])  # the own package: exact
  np.testing.assert_allclose(
    out[1], numpy_package(ref[1][:2], 0.25, 32).tolist() + [np.zeros((2, 5))] * 2
  )
  assert np.count_nonzero(out[1]) == compression.num_kept(
    2 * 2 * 5, 0.25
  )  # k of the 2 real rows, not 4
  np.testing.assert_array_equal(out[2], 0)  # an empty slot sends nothing


def test_compressed_bits_by_hand():
  """κ_i·(2·d·32 + package): per tensor ``k`` values of ``b`` bits + 64 side bits + the cheaper support."""
  config, model, federation = tiny_setup(sparsify_keep=0.5, quantize_bits=6)
  algorithm = runner.make_algorithm(config, model, federation)
  inputs = algorithm.round_inputs(0)
  _, metrics = algorithm.step(algorithm.init(jax.random.key(0)), inputs)
  leaf_sizes = [5 * 8, 8, 8 * 3, 3]
  d = sum(leaf_sizes)
  expected = []
  for n in np.asarray(federation.n):
    jac = 0
    for size in leaf_sizes:
      entries = int(n) * 3 * size
      k = math.ceil(0.5 * entries)
      jac += k * 6 + 64 + min(entries, k * math.ceil(math.log2(entries)))
    expected.append(jac + int(n) * 3 * 32 + int(n) * 2)
  kappa = np.asarray(inputs.neighbor_mask).sum(axis=1)
  np.testing.assert_allclose(
    np.asarray(metrics["bits_sent"]), kappa * (2 * d * 32 + np.array(expected)), rtol=1e-6
  )


def test_projected_round_is_the_round_on_projected_inputs_and_scores_raw_inputs():
  config, model, federation = tiny_setup(projection_dim=3)
  config.model.init = "per_client"
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  p = np.asarray(jacobians.projection_matrix(jax_key(config.seed, Stream.INPUT_PROJECTION), 5, 3))
  np.testing.assert_allclose(p.std() * np.sqrt(5), 1.0, atol=0.5)
  projected = federation._replace(samples_x=np.asarray(federation.samples_x) @ p)
  small = models.mlp_on_inputs(model, 3)
  assert jax.tree.leaves(state.params)[-1].shape[-2] == 8 and state.params["params"]["dense_0"][
    "kernel"
  ].shape[1:] == (3, 8)
  inputs = algorithm.round_inputs(0)
  expected, taus = reference_round(config, small, projected, state.params, inputs)
  state, metrics = algorithm.step(state, inputs)
  assert_trees_close(state.params, expected)
  np.testing.assert_array_equal(np.asarray(metrics["tau"]), taus)
  # client_params: P folded into the first layer, so the raw-input network gives the projected model's logits.
  raw = algorithm.client_params(state)
  x = np.asarray(federation.x[0])
  for i in range(2):
    on_raw = model.apply(jax.tree.map(lambda w: w[i], raw), x)
    on_projected = small.apply(jax.tree.map(lambda w: w[i], state.params), x @ p)
    np.testing.assert_allclose(on_raw, on_projected, rtol=1e-4, atol=1e-5)
  d = 3 * 8 + 8 + 8 * 3 + 3  # the d1' = 3 model's parameters
  kappa = np.asarray(inputs.neighbor_mask).sum(axis=1)
  n = np.asarray(federation.n)
  np.testing.assert_allclose(
    np.asarray(metrics["bits_sent"]),
    kappa * (2 * d * 32 + n * 3 * d * 32 + n * 3 * 32 + n * 2),
    rtol=1e-6,
  )


def test_variants_set_the_fields_and_bad_values_fail_clearly():
  config = ntk_dfl_config("topk0.5,bits6,subsample,proj200,clustered")
  assert (
    config.algorithm.sparsify_keep,
    config.algorithm.quantize_bits,
    config.algorithm.subsample,
    config.algorithm.projection_dim,
    config.topology.name,
  ) == (0.5, 6, 5, 200, "clustered")
  schema.validate_config(config)
  assert ntk_dfl_config("compressed").algorithm.projection_dim == 200
  with pytest.raises(ValueError, match="topk"):
    ntk_dfl_config("topkhalf")
  for variant, message in (
    ("topk1.5", "sparsify_keep"),
    ("bits40", "quantize_bits"),
    ("proj-1", "projection_dim"),
  ):
    with pytest.raises(ValueError, match=message):
      schema.validate_config(ntk_dfl_config(variant))
  with pytest.raises(ValueError, match="jacobian_batches=1"):
    schema.validate_config(ntk_dfl_config("topk0.5,batched"))
  config = ntk_dfl_config("proj200")
  config.model.name = "cnn"
  with pytest.raises(ValueError, match="model.name='mlp'"):
    schema.validate_config(config)


def test_a_config_stored_before_the_compression_keys_reads_as_uncompressed(tmp_path):
  """Resume and branch compare configs: a stored NTK-DFL config without the keys ran uncompressed."""
  import json
  from ntk_fl import rundir

  current = json.loads(json.dumps(rundir.jsonable(ntk_dfl_config())))
  stored = json.loads(json.dumps(current))
  for key in ("sparsify_keep", "quantize_bits", "projection_dim", "projection_scale"):
    del stored["algorithm"][key]
  (tmp_path / rundir.CONFIG_FILE).write_text(json.dumps(stored))
  assert rundir.read_config(str(tmp_path))["algorithm"] == current["algorithm"]


def test_a_current_config_without_the_keys_compares_equal_to_a_stored_one_with_them(tmp_path):
  """Resume compares the stored config with the current one; a missing defaulted key means its default."""
  import json
  from ntk_fl import rundir

  full = ntk_dfl_config()
  (tmp_path / rundir.CONFIG_FILE).write_text(json.dumps(rundir.jsonable(full)))
  lean = ntk_dfl_config()
  for key in ("sparsify_keep", "quantize_bits", "projection_dim", "projection_scale"):
    del lean.algorithm[key]
  stored, current = rundir._experiment_configs(lean, str(tmp_path), "resume")  # pylint: disable=protected-access
  assert stored == current


@pytest.mark.parametrize("hidden, activation", [((), "relu"), ((7,), "relu"), ((7,), "tanh")])
def test_dense_stack_jacobian_is_jacrev_of_each_sample_bit_for_bit(hidden, activation):
  """The compressed client's Jacobian of an MLP from its layer factors: every entry the float that
  ``jax.jacrev`` under ``vmap`` gives on the same batch (the route it replaced), zero signs included (the
  packages' top-k and quantisation read the exact bits); a deeper MLP, whose backward pass sums, is left
  to ``per_sample_jacobian``. Against ``jax.jacrev`` of one sample at a time it agrees to a few units in
  the last place: a batch's hidden layer is a matrix product, one sample's a vector-matrix product, and
  on some CPUs (AVX2 without AVX-512) XLA rounds the two differently."""
  from ntk_fl._src.kernels import dense_stack_jacobian

  model = models.mlp(input_dim=5, hidden=hidden, num_classes=3, activation=activation)
  params = model.init(jax.random.key(3))
  x = jax.random.normal(jax.random.key(4), (6, 5))
  x = (
    x.at[2].set(0.0).at[4, :2].set(-x[4, :2])
  )  # a padding row and mixed signs: relu's inactive units
  got = jax.jit(lambda p, x: dense_stack_jacobian(model.dense_stack, p, x))(params, x)

  def one_sample(p, xi):
    return jax.jacrev(lambda p: model.apply(p, xi[None])[0])(p)

  batched = jax.jit(jax.vmap(one_sample, in_axes=(None, 0)))(params, x)
  rows = [one_sample(params, xi) for xi in x]
  sample_by_sample = jax.tree.map(lambda *leaves: np.stack([np.asarray(v) for v in leaves]), *rows)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
  for name, a, b, c in zip(
    names, jax.tree.leaves(batched), jax.tree.leaves(got), jax.tree.leaves(sample_by_sample)
  ):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape == c.shape, name
    np.testing.assert_array_equal(b.view(np.int32), a.view(np.int32), err_msg=name)
    ulps = 4 * np.finfo(np.float32).eps * max(np.abs(c).max(), np.finfo(np.float32).tiny)
    np.testing.assert_allclose(b, c, rtol=0, atol=ulps, err_msg=name)
  deep = models.mlp(input_dim=5, hidden=(4, 4), num_classes=3)
  assert dense_stack_jacobian(deep.dense_stack, deep.init(jax.random.key(0)), x) is None
