"""SPARK: momentum closed form, schedules, NTK-DFL equivalence, a projected round by brute force, compression."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import compression, evolve, gossip, models, parallel, projection, rundir, runner, schema
from ntk_fl.algorithms import ntk_dfl, spark
from ntk_fl.config import load_config
from federations import ragged_federation

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny_setup(*, num_clients=6, n_max=6, variant="", **algo):
  """A 6-client federation with unequal sizes (padding) and a 5-6-3 MLP; SPARK config."""
  config = load_config(str(REPO / "configs" / "spark.py"), variant)
  config.data.num_clients = num_clients
  config.topology.degree = 2
  config.chunk_size = 0
  config.rounds = 4
  config.algorithm.lr = 0.05
  config.algorithm.taus = (5, 10, 20)
  config.algorithm.distill.warmup_rounds = 1
  config.algorithm.distill.temp_final = 3.0  # exercise T > 1 (the default holds T at 1)
  for key, value in algo.items():
    block = config.algorithm
    *parents, leaf = key.split("__")
    for parent in parents:
      block = block[parent]
    block[leaf] = value
  rng = np.random.default_rng(0)
  sizes = rng.integers(n_max - 2, n_max + 1, size=num_clients)
  federation = ragged_federation(rng, sizes, n_max)
  return config, models.mlp(input_dim=5, hidden=(6,), num_classes=3), federation


def test_nesterov_step_equals_the_closed_form():
  """w = w̄ + (1+μ)Δw + μ² v_old and v = μ v_old + Δw, over several rounds (Eqs. 12-13)."""
  mu = 0.9
  tx = spark.momentum_transform(mu)
  rng = np.random.default_rng(0)
  params = {
    "a": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=4), jnp.float32),
  }
  state = tx.init(params)
  velocity = jax.tree.map(np.zeros_like, params)
  for _ in range(4):
    wbar = jax.tree.map(
      lambda p: p + rng.normal(size=p.shape).astype(np.float32), params
    )  # a consensus step
    delta = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    params, state = spark.nesterov_step(tx, wbar, delta, state)
    expected = jax.tree.map(
      lambda w, d, v: np.asarray(w) + (1 + mu) * d + mu**2 * v, wbar, delta, velocity
    )
    velocity = jax.tree.map(lambda v, d: mu * v + d, velocity, delta)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_distillation_schedule_endpoints():
  kw = dict(
    warmup_rounds=10,
    anneal_rounds=30,
    alpha_init=1.0,
    alpha_final=0.6,
    temp_init=1.5,
    temp_final=3.0,
  )
  for r in range(10):  # rounds k = 1..10: warm-up, hard labels
    assert tuple(map(float, spark.distill_schedule(r, **kw))) == (1.0, 1.0)
  alpha, temp = spark.distill_schedule(29, **kw)  # k = R: p = 1
  np.testing.assert_allclose([alpha, temp], [0.6, 3.0], rtol=1e-6)
  alpha, temp = spark.distill_schedule(19, **kw)  # k = 20: p = 1/2, cosine midpoint
  np.testing.assert_allclose([alpha, temp], [0.8, 2.25], rtol=1e-6)
  alpha, temp = spark.distill_schedule(10, **kw)  # k = 11: p = 1/20
  np.testing.assert_allclose(
    [alpha, temp], [0.6 + 0.2 * (1 + np.cos(np.pi / 20)), 1.5 + 1.5 / 20], rtol=1e-6
  )
  np.testing.assert_allclose(
    spark.distill_schedule(40, **kw), [0.6, 3.0], rtol=1e-6
  )  # clipped after R
  logits = jnp.asarray([[2.0, 0.0, -1.0]])
  hard = jnp.asarray([[0.0, 1.0, 0.0]])
  soft = np.exp(np.array([2.0, 0.0, -1.0]) / 2) / np.exp(np.array([2.0, 0.0, -1.0]) / 2).sum()
  np.testing.assert_allclose(
    spark.distill_targets(logits, hard, 0.7, 2.0)[0], 0.7 * hard[0] + 0.3 * soft, rtol=1e-6
  )


@pytest.mark.parametrize("jacobian", ["implicit", "explicit"])
def test_without_momentum_and_distillation_spark_is_ntk_dfl(jacobian):
  """Table 4 row 1 (projection off): the NTK-DFL round, to float32 rounding on the matrix-free path."""
  config, model, federation = tiny_setup(variant="abl_none", jacobian=jacobian)
  config.model.init = "per_client"
  base = load_config(str(REPO / "configs" / "ntk_dfl.py"))
  base.data, base.model, base.topology, base.seed, base.chunk_size, base.rounds = (
    config.data,
    config.model,
    config.topology,
    config.seed,
    config.chunk_size,
    config.rounds,
  )
  for key in ("lr", "lr_decay", "taus"):
    base.algorithm[key] = config.algorithm[key]
  a = runner.make_algorithm(config, model, federation)
  b = runner.make_algorithm(base, model, federation)
  sa, sb = a.init(jax.random.key(0)), b.init(jax.random.key(0))
  for r in range(2):
    sa, ma = a.step(sa, a.round_inputs(r))
    sb, mb = b.step(sb, b.round_inputs(r))
    np.testing.assert_array_equal(np.asarray(ma["tau"]), np.asarray(mb["tau"]))
    for x, y in zip(jax.tree.leaves(sa.params), jax.tree.leaves(sb.params)):
      # Same operations; XLA fuses them differently inside the two programs, so the matrix-free path agrees
      # to float32 rounding (observed <= 1 ulp), the explicit-Jacobian path to accumulated rounding.
      tol = dict(rtol=1e-6, atol=1e-7) if jacobian == "implicit" else dict(rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(x, y, **tol)


# The reference's pieces compiled whole (eager, each operation compiles on its own for every neighbourhood
# size); what they compute is unchanged.
_evolve = jax.jit(evolve.evolve, static_argnames="taus")


@functools.partial(jax.jit, static_argnums=0)
def _flat_jacobian(apply_fn, params, x):
  """``d apply_fn(params, x) / dw`` with respect to the flattened parameters ``w``: ``[N, C, d]``."""
  flat, unravel = ravel_pytree(params)
  return jax.jacrev(lambda w: apply_fn(unravel(w), x))(flat)


def reference_round(config, model, federation, state, inputs, plan, mats):
  """One SPARK round client by client: explicit J, dense P, hard-label selection, closed-form momentum."""
  algo = config.algorithm
  taus = tuple(algo.taus)
  mu = algo.momentum
  alpha, temp = spark.distill_schedule(
    int(inputs.round),
    warmup_rounds=algo.distill.warmup_rounds,
    anneal_rounds=config.rounds,
    alpha_init=algo.distill.alpha_init,
    alpha_final=algo.distill.alpha_final,
    temp_init=algo.distill.temp_init,
    temp_final=algo.distill.temp_final,
  )
  p = np.asarray(projection.dense_matrix(plan, mats), np.float64)
  wbars = gossip.mix(state.params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights)
  velocities = -np.stack(
    [
      np.asarray(ravel_pytree(jax.tree.map(lambda leaf: leaf[i], state.momentum[0].trace))[0])
      for i in range(federation.n.shape[0])
    ]
  )
  if algo.velocity == "mixed":  # v̄_i = s_i v_i + Σ_k a_ik v_{n_ik}
    velocities = np.asarray(inputs.self_weight)[:, None] * velocities + np.einsum(
      "ik,ikp->ip", np.asarray(inputs.neighbor_weights), velocities[np.asarray(inputs.neighbors)]
    )
  new = []
  for i in range(federation.n.shape[0]):
    members = [i] + [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    x = jnp.asarray(np.concatenate([federation.x[j][federation.mask[j]] for j in members]))
    hard = jax.nn.one_hot(np.concatenate([federation.y[j][federation.mask[j]] for j in members]), 3)
    wbar = jax.tree.map(lambda leaf: leaf[i], wbars)
    flat, unravel = ravel_pytree(wbar)
    f0 = model.apply(wbar, x)
    jac = np.asarray(_flat_jacobian(model.apply, wbar, x), np.float64)  # [N, C, d]
    jt = jac @ p  # J̃ = J P
    kernel = np.einsum("icp,jcp->ij", jt, jt) / 3
    soft = np.asarray(jax.nn.softmax(f0 / temp))
    targets = float(alpha) * np.asarray(hard) + (1 - float(alpha)) * soft
    evo = _evolve(
      jnp.asarray(kernel, jnp.float32),
      f0,
      jnp.asarray(targets, jnp.float32),
      jnp.ones(len(x), bool),
      lr=algo.lr,
      taus=taus,
    )
    n = len(x)
    v_old = velocities[i]
    losses, deltas = [], []
    for t in range(len(taus)):
      dw = p @ (
        -(algo.lr / n) * np.einsum("icp,ic->p", jt, np.asarray(evo.residual_sums[t], np.float64))
      )
      scored = flat + (1 + mu) * dw + mu**2 * v_old if algo.select_momentum else flat + dw
      logits = model.apply(unravel(jnp.asarray(scored, jnp.float32)), x)
      losses.append(float(evolve.mean_loss(logits, hard, jnp.ones(n, bool))))
      deltas.append(dw)
    dw = deltas[int(np.argmin(losses))]
    new.append(np.asarray(flat) + (1 + mu) * dw + mu**2 * v_old)
  return np.stack(new)


@pytest.mark.parametrize(
  "projected_kernel,select_momentum,velocity,lr",
  [("structured", False, "local", 0.05), ("generic", True, "mixed", 0.5)],
)
def test_projected_round_equals_brute_force_reference(
  projected_kernel, select_momentum, velocity, lr
):
  """Layer-wise sketch + momentum + distillation, against explicit Jacobians and the dense P (rounds 1-2).

  k_proj = 3 sketches dense_0 (kernel and bias) and dense_1's kernel; 'structured' is the factorised kernel
  (ntk.projected_dense_ntk), 'generic' the per-sample Jacobians of the lifted network. The second case also
  scores τ on the post-momentum network and averages the velocities with the weights; at lr 0.5 that changes
  the chosen τ of some clients (checked when the test was written: up to 1.1 in the weights vs plain selection).
  """
  config, model, federation = tiny_setup(
    projection__scheme="layerwise",
    projection__k_proj=3,
    projected_kernel=projected_kernel,
    select_momentum=select_momentum,
    velocity=velocity,
    lr=lr,
  )
  algorithm = runner.make_algorithm(config, model, federation)
  template = jax.eval_shape(model.init, jax.random.key(0))
  plan = projection.make_plan(template, "layerwise", 3)
  mats = projection.sample_matrices(plan, config.seed)
  state = algorithm.init(jax.random.key(0))
  for r in range(2):  # round 2 has α < 1, T > 1 and a non-zero velocity
    inputs = algorithm.round_inputs(r)
    expected = reference_round(config, model, federation, state, inputs, plan, mats)
    state, metrics = algorithm.step(state, inputs)
    got = np.stack(
      [
        np.asarray(ravel_pytree(jax.tree.map(lambda leaf: leaf[i], state.params))[0])
        for i in range(federation.n.shape[0])
      ]
    )
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4)
  assert float(metrics["alpha"]) < 1 and float(metrics["temperature"]) > 1


@pytest.mark.parametrize("chunk", [3, 0])
def test_an_erdos_renyi_round_grouped_by_degree_equals_the_brute_force_reference(
  chunk, monkeypatch
):
  """On an Erdős–Rényi graph clients mapped in chunks (3: part-filled last chunks in some groups) take
  the fewest neighbour slots that hold their degree (the uncompressed, Option A update fits any slot
  count); all clients at once (chunk 0) keep k_max. Both are the client-by-client reference on real
  samples only, rounds 1-2 (α < 1, T > 1 and a velocity in round 2)."""
  config, model, federation = tiny_setup(
    num_clients=14, projection__scheme="layerwise", projection__k_proj=3
  )
  n_max = federation.mask.shape[1]
  traced = set()  # the neighbourhood sizes the client update is traced for, in slots

  def recording(*args, **kwargs):
    client = make_client_update(*args, **kwargs)

    def update(wbar, x, *rest):
      traced.add(x.shape[0] // n_max)
      return client.update(wbar, x, *rest)

    return client._replace(update=update)

  make_client_update = spark.make_client_update
  monkeypatch.setattr(spark, "make_client_update", recording)
  config.topology.name = "erdos_renyi"
  config.topology.mean_degree = 3.0
  run = schema.validate_config(config)
  assert run.algorithm.any_slot_count
  groups = run.built_topology.slot_groups
  algorithm = runner.make_algorithm(config, model, federation)
  degrees = np.asarray(algorithm.round_inputs(0).neighbor_mask.sum(axis=1))
  assert len(set(np.searchsorted(groups, degrees).tolist())) >= 3  # the grouping is exercised
  template = jax.eval_shape(model.init, jax.random.key(0))
  plan = projection.make_plan(template, "layerwise", 3)
  mats = projection.sample_matrices(plan, config.seed)
  state = algorithm.init(jax.random.key(0))
  for r in range(2):
    inputs = algorithm.round_inputs(r)
    expected = reference_round(config, model, federation, state, inputs, plan, mats)
    with parallel.use_devices(1, chunk_size=chunk):
      state, _ = algorithm.step(state, inputs)
    got = np.stack(
      [
        np.asarray(ravel_pytree(jax.tree.map(lambda leaf: leaf[i], state.params))[0])
        for i in range(federation.n.shape[0])
      ]
    )
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-4)
  k_max = run.built_topology.k_max
  assert traced == ({1 + g for g in groups} if chunk else {1 + k_max})


def test_compressed_packages_and_option_b_keep_every_slot():
  """Compressed packages and Option B's senders are per slot: those updates do not fit any slot count,
  so their rounds keep k_max slots (NTK-DFL's compressed update likewise)."""
  assert tiny_setup()[0].algorithm.linearise_at == "receiver"
  for algo, fits in (
    ({}, True),
    ({"compression__keep_fraction": 0.5}, False),
    ({"compression__bits": 8}, False),
    ({"linearise_at": "sender"}, False),
  ):
    config, _, _ = tiny_setup(**algo)
    assert schema.validate_config(config).algorithm.any_slot_count is fits, algo
  for keep, bits, fits in ((1.0, 32, True), (0.5, 32, False), (1.0, 6, False)):
    config = load_config(str(REPO / "configs" / "ntk_dfl.py"))
    config.algorithm.sparsify_keep, config.algorithm.quantize_bits = keep, bits
    assert schema.validate_config(config).algorithm.any_slot_count is fits


def test_explicit_and_matrix_free_sketched_paths_agree():
  outputs = []
  for mode in ("implicit", "explicit"):
    config, model, federation = tiny_setup(
      projection__scheme="flattened", projection__k_proj=8, jacobian=mode
    )
    algorithm = runner.make_algorithm(config, model, federation)
    state = algorithm.init(jax.random.key(0))
    for r in range(2):
      state, _ = algorithm.step(state, algorithm.round_inputs(r))
    outputs.append(state.params)
  for x, y in zip(jax.tree.leaves(outputs[0]), jax.tree.leaves(outputs[1])):
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4)


def test_one_update_per_clique_equals_every_member_evolving():
  """Clustered topology (7 clients: cliques of 4 and 3, a new partition every round), the full stack's pieces
  (flattened sketch, top-50 % packages, sub-sampling 2, momentum, distillation): one evolution per clique,
  given to every member, == each member evolving its own neighbourhood (rounds 1-3)."""
  runs = []
  for share in (True, False):
    config, model, federation = tiny_setup(
      num_clients=7,
      share_cliques=share,
      projection__scheme="flattened",
      projection__k_proj=8,
      compression__keep_fraction=0.5,
      subsample=2,
    )
    config.topology.name, config.topology.cluster_size = "clustered", 3
    algorithm = runner.make_algorithm(config, model, federation)
    state, taus = algorithm.init(jax.random.key(0)), []
    for r in range(3):
      state, metrics = algorithm.step(state, algorithm.round_inputs(r))
      taus.append(np.asarray(metrics["tau"]))
    runs.append((state, np.stack(taus), float(metrics["bits_cumulative"])))
  (shared, taus_shared, bits_shared), (own, taus_own, bits_own) = runs
  np.testing.assert_array_equal(taus_shared, taus_own)
  assert bits_shared == bits_own
  for x, y in zip(jax.tree.leaves(shared), jax.tree.leaves(own)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
  graph = algorithm.round_inputs(0)
  assert (
    len({tuple(sorted({i, *np.asarray(graph.neighbors[i]).tolist()})) for i in range(7)}) == 2
  )  # 2 cliques


def test_clique_sharing_needs_the_clustered_topology_and_plain_selection():
  config, model, federation = tiny_setup()
  graphs = schema.validate_config(config).built_topology  # a regular graph: no cliques to share
  with pytest.raises(ValueError, match="topology.name='clustered'"):
    ntk_dfl.make_neighbourhood_round(
      model,
      federation,
      graphs,
      seed=config.seed,
      lr=0.1,
      lr_decay=0.0,
      per_round_averaging=True,
      share_cliques=True,
    )
  config.topology.name, config.algorithm.select_momentum = "clustered", True
  with pytest.raises(ValueError, match="share_cliques=False"):
    schema.validate_config(config)
  config.algorithm.share_cliques = False
  schema.validate_config(config)


def test_package_compression_keeps_top_k_and_quantises():
  rng = np.random.default_rng(0)
  leaf = jnp.asarray(rng.normal(size=(12, 3, 5)), jnp.float32)  # 3 senders x 4 rows
  mask = jnp.asarray([True] * 10 + [False] * 2)
  (out,) = compression.compress_packages((leaf,), mask, 3, 0.5, 6)
  out, ref = (
    np.asarray(out).reshape(3, 4, 3, 5),
    np.asarray(jnp.where(mask[:, None, None], leaf, 0)).reshape(3, 4, 3, 5),
  )
  for s, real_rows in enumerate((4, 4, 2)):
    kept = out[s] != 0
    assert kept.sum() == compression.num_kept(real_rows * 15, 0.5)  # of the real rows' entries
    assert not out[s, real_rows:].any()  # padding rows send nothing
    threshold = np.sort(np.abs(ref[s]).ravel())[-kept.sum()]
    assert np.all(np.abs(ref[s][kept]) >= threshold - 1e-6)  # the largest magnitudes survive
    step = (ref[s].max() - ref[s].min()) / 63
    assert np.all(np.abs(out[s][kept] - ref[s][kept]) <= step / 2 + 1e-6)


def test_spark_packages_keep_the_top_fraction_of_their_real_entries(monkeypatch):
  """Unequal client sizes (padded package slots), flattened sketch, top-50 %, no quantisation: every package a
  SPARK client receives keeps ``num_kept(fraction, real entries)`` nonzero values -- the count its bits are
  charged for -- where its real entries hold at least that many nonzeros (padding slots count for nothing)."""
  config, model, federation = tiny_setup(
    projection__scheme="flattened", projection__k_proj=8, compression__keep_fraction=0.5
  )
  real = compression.compress_packages
  seen, padded = [], []

  def record(packages, mask, num_senders, keep):  # per package: real entries, nonzeros in and out
    rows = np.asarray(mask).reshape(-1, num_senders, np.asarray(mask).shape[-1] // num_senders)
    for leaf_in, leaf_out in packages:
      shape = (rows.shape[0], num_senders, rows.shape[2], -1)
      leaf_in, leaf_out = np.asarray(leaf_in).reshape(shape), np.asarray(leaf_out).reshape(shape)
      for c, s in np.ndindex(rows.shape[:2]):
        real_rows = rows[c, s]
        entries = int(real_rows.sum()) * leaf_in.shape[-1]
        nonzero_in = int(np.count_nonzero(leaf_in[c, s][real_rows]))
        seen.append((entries, nonzero_in, int(np.count_nonzero(leaf_out[c, s])), keep))
        padded.append(0 < real_rows.sum() < real_rows.size)

  def spy(leaves, mask, num_senders, keep_fraction, bits, **options):
    out = real(leaves, mask, num_senders, keep_fraction, bits, **options)
    jax.debug.callback(
      lambda m, *pairs: record(list(zip(pairs[::2], pairs[1::2])), m, num_senders, keep_fraction),
      mask,
      *[x for pair in zip(leaves, out) for x in pair],
    )
    return out

  monkeypatch.setattr(compression, "compress_packages", spy)
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  jax.block_until_ready(algorithm.step(state, algorithm.round_inputs(0)))
  checked = [(e, i, o, f) for e, i, o, f in seen if e > 0 and i >= compression.num_kept(e, f)]
  assert len(checked) > 10 and any(padded)
  for entries, _, kept, fraction in checked:
    assert kept == compression.num_kept(entries, fraction), (entries, kept)


def test_spark_package_and_round_bits_by_hand():
  """SPARK's recorded bits: 2·κ·d·32 weights + κ uncompressed packages, and the compressed stack's package."""
  config = load_config(str(REPO / "configs" / "spark.py"), "smoke")
  config.data.num_clients, config.data.samples_per_client, config.data.max_train = 6, 20, 600
  experiment = runner.build_experiment(config)
  algorithm = experiment.algorithm
  _, metrics = algorithm.step(algorithm.init(jax.random.key(0)), algorithm.round_inputs(0))
  d = sum(leaf.size for leaf in jax.tree.leaves(experiment.model.init(jax.random.key(0))))
  n = np.asarray(experiment.federation.n, np.float64)
  package = n * 10 * d * 32 + n * 10 * 32 + n * 4  # Jacobian, function values, 4-bit labels
  kappa = np.asarray(algorithm.round_inputs(0).neighbor_mask).sum(axis=1)
  expected = kappa * (2 * d * 32 + package)
  np.testing.assert_allclose(
    np.asarray(metrics["bits_sent"]), expected, rtol=1e-6
  )  # float32 metrics
  np.testing.assert_allclose(float(metrics["bits_cumulative"]), expected.sum(), rtol=1e-6)


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("momentum", 1.0, "momentum"),
    ("kernel", "diag", "kernel"),
    ("jacobian", "dense", "jacobian"),
    ("distill__warmup_rounds", 40, "anneal"),
    ("distill__alpha_final", 1.5, "alpha_final"),
    ("distill__temp_final", 0.5, "temp_final"),
    ("projection__scheme", "srht", "scheme"),
    ("compression__keep_fraction", 0.0, "keep_fraction"),
    ("compression__bits", 40, "bits"),
    ("lr_boost__rounds", (0,), "lr_boost"),
    ("projected_kernel", "fast", "projected_kernel"),
    ("velocity", "shared", "velocity"),
  ],
)
def test_validate_config_rejects_bad_values(field, value, match):
  config = load_config(str(REPO / "configs" / "spark.py"))
  block = config.algorithm
  *parents, leaf = field.split("__")
  for parent in parents:
    block = block[parent]
  block[leaf] = value
  with pytest.raises(ValueError, match=match):
    schema.validate_config(config)


def test_structured_flattened_sketch_needs_explicit_jacobians():
  config = load_config(str(REPO / "configs" / "spark.py"), "flat10000")
  config.algorithm.projected_kernel = "structured"
  schema.validate_config(config)  # J̃ from the dense stack's factors
  config.algorithm.jacobian = "implicit"
  with pytest.raises(ValueError, match="no per-layer factorisation"):
    schema.validate_config(config)


@pytest.mark.parametrize("compression", [{}, {"compression__keep_fraction": 0.5}])
def test_flattened_sketch_from_factors_equals_the_lifted_network(compression):
  """Flattened sketch (uncompressed, and top-50 % per package): J̃ from the dense stack's factors
  (projected_kernel='auto') == per-sample Jacobians of g(u) = f(w̄ + P u) ('generic'), over two rounds."""
  outputs = []
  for kernel in ("auto", "generic"):
    config, model, federation = tiny_setup(
      projection__scheme="flattened", projection__k_proj=8, projected_kernel=kernel, **compression
    )
    algorithm = runner.make_algorithm(config, model, federation)
    state = algorithm.init(jax.random.key(0))
    for r in range(2):
      state, metrics = algorithm.step(state, algorithm.round_inputs(r))
    outputs.append((state.params, metrics["tau"]))
  (params_a, tau_a), (params_b, tau_b) = outputs
  np.testing.assert_array_equal(tau_a, tau_b)
  for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def test_momentum_aware_selection_needs_the_network_score():
  config = load_config(str(REPO / "configs" / "spark.py"))
  config.algorithm.select_momentum, config.algorithm.select = True, "linearized"
  with pytest.raises(ValueError, match="needs select='network'"):
    schema.validate_config(config)


def test_config_variants():
  cfg = lambda v: load_config(str(REPO / "configs" / "spark.py"), v)
  schema.validate_config(cfg(None))
  assert cfg("iid,abl_momentum").algorithm.distill.enabled is False
  assert cfg("abl_distill").algorithm.momentum == 0.0
  stack = cfg("full_stack")
  assert (
    stack.algorithm.projection.scheme,
    stack.algorithm.projection.k_proj,
    stack.algorithm.compression.bits,
    stack.algorithm.compression.keep_fraction,
    stack.algorithm.subsample,
    stack.topology.name,
  ) == ("flattened", 10_000, 6, 0.5, 5, "clustered")
  assert cfg("proj750").algorithm.projection.k_proj == 750
  assert tuple(cfg("cyclic_lr").algorithm.lr_boost.rounds) == (10, 20)
  assert (cfg(None).algorithm.distill.temp_final, cfg("temp3").algorithm.distill.temp_final) == (
    1.0,
    3.0,
  )
  with pytest.raises(ValueError, match="unknown config variant"):
    cfg("proj600")


def test_lr_boost_scales_the_round_rate():
  config, model, federation = tiny_setup(lr_boost__rounds=(2,), lr_boost__factor=3.0)
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  state, m1 = algorithm.step(state, algorithm.round_inputs(0))
  _, m2 = algorithm.step(state, algorithm.round_inputs(1))
  np.testing.assert_allclose([float(m1["lr"]), float(m2["lr"])], [0.05, 0.15], rtol=1e-6)


# End to end, opt-in (CI: -m slow): the default suite still runs this config's smoke run in tests/test_golden.py
# (spark.json: every round's accuracy, losses, τ and bits).
@pytest.mark.slow
def test_smoke_variant_runs_through_the_runner_and_learns(tmp_path):
  from ntk_fl import runner

  summary = runner.run(load_config(str(REPO / "configs" / "spark.py"), "smoke"), str(tmp_path))
  assert summary["final_test_acc"] > 0.5  # chance is 0.1
  lines = rundir.read_metrics(str(tmp_path))
  assert [line["round"] for line in lines] == [1, 2, 3, 4]
  assert lines[-1]["bits_cumulative"] > lines[0]["bits_cumulative"] > 0


def _json_config(variant: str, **algo) -> dict:
  config = load_config(str(REPO / "configs" / "spark.py"), variant)
  for key, value in algo.items():
    config.algorithm.distill[key] = value
  return rundir.jsonable(config)


def test_shared_rounds_are_the_warm_up_of_rows_that_differ_only_in_distillation():
  spark_iid, momentum_only = _json_config("iid"), _json_config("iid,abl_momentum")
  assert spark.shared_rounds(spark_iid, momentum_only) == 10  # R_warm: hard labels in both
  assert spark.shared_rounds(_json_config("iid,abl_none"), _json_config("iid,abl_distill")) == 10
  assert spark.shared_rounds(spark_iid, _json_config("iid,temp3")) == 10  # T departs after warm-up
  assert spark.shared_rounds(spark_iid, _json_config("iid", warmup_rounds=4)) == 4
  assert spark.shared_rounds(spark_iid, spark_iid) == 30
  # Anything outside the distillation block (here the momentum, or the data) is not certified.
  assert spark.shared_rounds(spark_iid, _json_config("iid,abl_none")) == 0
  assert spark.shared_rounds(spark_iid, _json_config("alpha0.1")) == 0
  # A longer run anneals more slowly after the warm-up, so only the warm-up is shared.
  longer = dict(spark_iid, rounds=40)
  assert spark.shared_rounds(spark_iid, longer) == 10


def _smoke(variant: str, **overrides):
  config = load_config(
    str(REPO / "configs" / "spark.py"), f"smoke,{variant}" if variant else "smoke"
  )
  config.algorithm.distill.warmup_rounds = 2
  config.checkpoint_every = 2
  config.eval.selection = False  # final-only and unrelated to branching; saves ≈ 5 s per run
  for key, value in overrides.items():
    config[key] = value
  return config


@pytest.fixture(scope="module")
def spark_source(tmp_path_factory):
  """SPARK's 4-round smoke run with checkpoints after rounds 2 and 4: the source both branching tests
  branch from (one run instead of one per test; each test works on its own copy)."""
  source = str(tmp_path_factory.mktemp("spark_source") / "spark")
  runner.run(_smoke(""), source)
  return source


def _copy_of(source: str, tmp_path) -> str:
  import shutil  # pylint: disable=g-import-not-at-top

  return shutil.copytree(source, str(tmp_path / "spark"))


def test_ablation_row_branched_after_the_warm_up_equals_its_run_from_scratch(
  spark_source, tmp_path
):
  """Momentum only (abl_momentum) taken from SPARK's round-2 checkpoint == abl_momentum run from round 0."""
  source = _copy_of(spark_source, tmp_path)
  branched, scratch = (str(tmp_path / name) for name in ("branched", "scratch"))
  summary = runner.run(_smoke("abl_momentum"), branched, branch_from=source)
  runner.run(_smoke("abl_momentum"), scratch)
  assert summary["branched_from"] == {"source": source, "round": 2}
  numbers = lambda line: {
    k: v for k, v in line.items() if k not in ("step_time", "eval_time", "clients")
  }
  got, want, spark_lines = (rundir.read_metrics(d) for d in (branched, scratch, source))
  assert [line["round"] for line in got] == [1, 2, 3, 4]
  for g, w in zip(got, want):
    assert numbers(g).keys() == numbers(w).keys()
    for key in numbers(w):
      np.testing.assert_allclose(
        g[key], w[key], rtol=2e-5, atol=1e-6, err_msg=f"round {w['round']} {key}"
      )
  # The check can fail: after the warm-up SPARK's soft targets make round 3 differ from momentum only.
  assert abs(spark_lines[2]["loss_mean"] - want[2]["loss_mean"]) > 1e-4


def test_branch_refusals_name_the_reason(spark_source, tmp_path):
  source = _copy_of(spark_source, tmp_path)  # checkpoints after rounds 2 and 4
  with pytest.raises(
    ValueError, match=r"differs \(.*algorithm.momentum: 0.9 -> 0.0.*does not certify"
  ):
    runner.run(_smoke("abl_none"), str(tmp_path / "a"), branch_from=source)
  with pytest.raises(ValueError, match=r"after round 4: the two configs compute only rounds 1..2"):
    rundir.check_branch(_smoke("abl_momentum"), source, 4)
  with pytest.raises(
    FileNotFoundError, match=r"no finalised checkpoint for it \(checkpoints after rounds \[2, 4\]\)"
  ):
    rundir.check_branch(_smoke("abl_momentum"), source, 1)
  with pytest.raises(ValueError, match="exclude each other"):
    runner.run(_smoke("abl_momentum"), source, resume=True, branch_from=source)
  with pytest.raises(ValueError, match="needs branch_from"):
    runner.run(_smoke("abl_momentum"), str(tmp_path / "b"), branch_round=2)
  with pytest.raises(FileNotFoundError, match="cannot branch"):
    rundir.check_branch(_smoke("abl_momentum"), str(tmp_path / "nothing"))
  assert rundir.check_branch(_smoke("abl_momentum"), source) == 2  # not 4: past the warm-up
  # SPARK itself with more rounds anneals more slowly after the warm-up: again only the warm-up is shared.
  assert rundir.check_branch(_smoke("", rounds=5), source) == 2


# ------------------------------------------------------------------ the public client update and its hook


def _spark_with(config, model, federation, **hooks):
  settings = schema.validate_config(config)
  return spark.make_spark(
    model, federation, settings.built_topology, settings.algorithm, settings, **hooks
  )


def _states(algorithm, rounds=3):
  state, out = algorithm.init(jax.random.key(0)), []
  for r in range(rounds):
    state, metrics = algorithm.step(state, algorithm.round_inputs(r))
    out.append((state, metrics))
  return out


def _assert_identical(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "variant, algo",
  [("", {}), ("proj500", {"projection__k_proj": 8}), ("option_b", {})],
  ids=["plain", "sketched", "option_b"],
)
def test_a_targets_hook_equal_to_the_default_reproduces_the_round_bit_for_bit(variant, algo):
  config, model, federation = tiny_setup(variant=variant, **algo)
  config.model.init = "per_client"
  plain = _states(runner.make_algorithm(config, model, federation))
  hooked = _states(_spark_with(config, model, federation, targets_fn=spark.distill_targets))
  _assert_identical(plain, hooked)  # rounds 2-3 distil (warm-up 1, T > 1)


def test_a_targets_hook_of_hard_labels_is_spark_without_distillation():
  """Distillation on, the hook returns the hard labels: the rounds of the config with distillation off."""
  config, model, federation = tiny_setup()
  hard_only = _states(
    _spark_with(config, model, federation, targets_fn=lambda f0, hard, a, t: hard)
  )
  config.algorithm.distill.enabled = False
  undistilled = _states(runner.make_algorithm(config, model, federation))
  for (state, metrics), (state_u, metrics_u) in zip(hard_only, undistilled):
    np.testing.assert_array_equal(np.asarray(metrics["tau"]), np.asarray(metrics_u["tau"]))
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(state_u)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  assert float(hard_only[-1][1]["alpha"]) < 1  # the schedule did anneal: the hook alone kept Y hard


def test_the_public_client_update_composes_into_the_spark_round():
  """SPARK's round from public pieces only -- NTK-DFL's neighbourhood round, SPARK's client update and its
  distillation schedule, optax momentum state -- equals make_spark's (3 rounds): the same operations in
  another program, which XLA fuses differently, so to float32 rounding (observed: 1 ulp), τ exactly."""
  config, model, federation = tiny_setup()
  config.model.init = "per_client"
  settings = schema.validate_config(config)
  hparams, graphs = settings.algorithm, settings.built_topology
  core = ntk_dfl.make_neighbourhood_round(
    model,
    federation,
    graphs,
    seed=settings.seed,
    mixing=settings.topology.mixing,
    lr=hparams.lr,
    lr_decay=hparams.lr_decay,
    per_round_averaging=True,
  )
  client = spark.make_client_update(
    model, hparams, seed=settings.seed, neighbourhood_slots=1 + graphs.k_max
  )
  d = hparams.distill
  schedule = dict(
    warmup_rounds=d.warmup_rounds,
    anneal_rounds=d.anneal_rounds or settings.rounds,
    alpha_init=d.alpha_init,
    alpha_final=d.alpha_final,
    temp_init=d.temp_init,
    temp_final=d.temp_final,
  )

  @jax.jit
  def step(params, opt_state, inputs, data, mats):
    alpha, temp = spark.distill_schedule(inputs.round, **schedule)

    def client_fn(wbar, x, hard, mask, lr, opt_state_i):
      return client.update(wbar, x[0], hard[0], mask[0], lr, alpha, temp, mats, opt_state_i)

    (params, opt_state, info), _ = core.run(params, inputs, data, client_fn, opt_state)
    return params, opt_state, info["tau"]

  reference = _states(runner.make_algorithm(config, model, federation))
  algorithm = runner.make_algorithm(config, model, federation)
  start = algorithm.init(jax.random.key(0))
  params, opt_state = start.params, start.momentum
  _assert_identical(jax.vmap(client.momentum.init)(params), opt_state)
  for r, (state, metrics) in enumerate(reference):
    params, opt_state, taus = step(
      params, opt_state, algorithm.round_inputs(r), core.data, client.matrices
    )
    np.testing.assert_array_equal(np.asarray(taus), np.asarray(metrics["tau"]))
    for x, y in zip(
      jax.tree.leaves((params, opt_state)), jax.tree.leaves((state.params, state.momentum))
    ):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
