"""FedBE's server against independent computations.

* The Gaussian's mean and variance == numpy's weighted average and weighted variance (float64).
* Its samples have that mean and variance over many draws (sampling-error bounds); SWAG's fit (mean,
  variance, deviations) == numpy's and its samples have SWAG's diagonal-plus-low-rank covariance.
* The ensemble's soft labels == numpy's mean of the members' softmax; one distillation step ==
  a hand-written gradient step of the cross-entropy to those soft labels (softmax regression's
  closed-form gradient); a whole distillation with momentum and SWA == a numpy loop.
* With no distillation the round is FedAvg's, bit for bit; the server set holds only samples no
  client holds, drawn from the seed; bad values give one clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import data, models
from ntk_fl.algorithms import fedbe

DIM, CLASSES = 5, 3


def hparams(**changes):
  values = dict(
    lr=0.1,
    lr_gamma=1.0,
    epochs=1,
    batch_size=4,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    quantize_bits=32,
    stochastic_rounding=False,
    clients_per_round=3,
    num_samples=4,
    server_set_size=12,
    distill_epochs=1,
    distill_batch_size=12,
    distill_lr=0.5,
    distill_momentum=0.0,
    swa_start=0,
    swa_every=0,
  )
  values.update(changes)
  return fedbe.FedBEHParams(**values)


def linear_apply(params, x):
  return x @ params["w"] + params["b"]


def np_softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def np_gradient(w, b, x, q):
  """Softmax regression's gradient of ``-(1/B) sum q log softmax(x w + b)``: ``(x^T (p - q) / B, mean(p - q))``."""
  residual = np_softmax(x @ w + b) - q
  return x.T @ residual / x.shape[0], residual.mean(axis=0)


# ----------------------------------------------------------------------------- the Gaussian


def test_gaussian_mean_and_variance_equal_numpy_weighted_moments():
  rng = np.random.default_rng(0)
  clients = {"a": rng.normal(size=(5, 4, 3)), "b": rng.normal(size=(5, 7))}
  weights = rng.uniform(0.5, 2.0, size=5)
  weights /= weights.sum()
  g = fedbe.fit_gaussian(jax.tree.map(jnp.float32, clients), jnp.float32(weights))
  for name, w in clients.items():
    mean = np.average(w, axis=0, weights=weights)
    var = np.average((w - mean) ** 2, axis=0, weights=weights)
    np.testing.assert_allclose(g.mean[name], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.var[name], var, rtol=1e-4, atol=1e-6)


def test_samples_have_the_gaussians_moments():
  rng = np.random.default_rng(1)
  mean = {"a": rng.normal(size=(6,)), "b": rng.normal(size=(2, 3))}
  var = {"a": rng.uniform(0.1, 2.0, size=(6,)), "b": rng.uniform(0.1, 2.0, size=(2, 3))}
  gaussian = fedbe.Gaussian(jax.tree.map(jnp.float32, mean), jax.tree.map(jnp.float32, var))
  n = 40_000
  draws = fedbe.sample_models(gaussian, jax.random.key(3), n)
  for name in mean:
    d = np.asarray(draws[name], np.float64)
    assert d.shape == (n, *mean[name].shape)
    sd = np.sqrt(var[name])
    # 5 standard errors: the sample mean's is sd / sqrt(n), the sample variance's var * sqrt(2 / n).
    assert np.all(np.abs(d.mean(0) - mean[name]) < 5 * sd / np.sqrt(n))
    assert np.all(np.abs(d.var(0) - var[name]) < 5 * var[name] * np.sqrt(2 / n))
  # Coordinates (and leaves) are independent: standardised draws are uncorrelated.
  z = np.concatenate(
    [((np.asarray(draws[k]) - mean[k]) / np.sqrt(var[k])).reshape(n, -1) for k in mean], axis=1
  )
  corr = np.corrcoef(z.T)
  assert np.max(np.abs(corr - np.eye(corr.shape[0]))) < 5 / np.sqrt(n)


def test_swag_fit_and_samples_have_swags_moments():
  """SWAG over 4 weighted client models of a two-leaf model (d = 12): the fitted mean, variance and
  deviations == numpy (float64); 40,000 samples have mean ``mu`` and covariance
  ``(diag(var) + D D^T / (K - 1)) / 2`` built in numpy, leaves coupled (5 standard errors per entry)."""
  rng = np.random.default_rng(4)
  k, n = 4, 40_000
  clients = {"a": rng.normal(size=(k, 6)), "b": rng.normal(size=(k, 2, 3))}
  weights = rng.uniform(0.5, 2.0, size=k)
  weights /= weights.sum()
  swag = fedbe.fit_swag(jax.tree.map(jnp.float32, clients), jnp.float32(weights))
  flat = np.concatenate([clients[name].reshape(k, -1) for name in ("a", "b")], axis=1)  # [K, d]
  mean = weights @ flat
  var = weights @ (flat - mean) ** 2
  deviations = flat - mean  # SWAG's D, one column per client
  got = lambda tree: np.concatenate([np.asarray(tree[name]).reshape(-1) for name in ("a", "b")])
  np.testing.assert_allclose(got(swag.mean), mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got(swag.var), var, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
    np.concatenate([np.asarray(swag.deviations[m]).reshape(k, -1) for m in ("a", "b")], axis=1),
    deviations,
    rtol=1e-5,
    atol=1e-6,
  )
  covariance = (np.diag(var) + deviations.T @ deviations / (k - 1)) / 2
  draws = fedbe.sample_swag(swag, jax.random.key(5), n)
  assert draws["a"].shape == (n, 6) and draws["b"].shape == (n, 2, 3)
  d = np.concatenate([np.asarray(draws[name], np.float64).reshape(n, -1) for name in ("a", "b")], 1)
  sd = np.sqrt(np.diag(covariance))
  assert np.all(np.abs(d.mean(0) - mean) < 5 * sd / np.sqrt(n))
  # A sample covariance entry's standard error: sqrt((S_ii S_jj + S_ij^2) / n) for a Gaussian.
  se = np.sqrt((np.outer(np.diag(covariance), np.diag(covariance)) + covariance**2) / n)
  assert np.all(np.abs(np.cov(d.T) - covariance) < 5 * se)
  # The low-rank part is real: across the leaves, some correlations are far from zero.
  assert np.max(np.abs(np.corrcoef(d.T) - np.eye(d.shape[1]))) > 0.2


def test_swag_with_one_client_is_the_half_variance_diagonal_gaussian():
  """K = 1 has no low-rank term (D D^T / (K - 1) is undefined): the samples are the diagonal draw at
  half the variance, exactly as :func:`fedbe.sample_models` makes it from the same key."""
  rng = np.random.default_rng(6)
  client = {"a": jnp.float32(rng.normal(size=(1, 5)))}
  swag = fedbe.fit_swag(client, jnp.ones(1, jnp.float32))
  swag = swag._replace(var={"a": jnp.float32(rng.uniform(0.1, 1.0, size=5))})
  key = jax.random.key(2)
  expected = fedbe.sample_models(
    fedbe.Gaussian(swag.mean, {"a": swag.var["a"] / 2}), jax.random.split(key)[0], 7
  )
  np.testing.assert_array_equal(fedbe.sample_swag(swag, key, 7)["a"], expected["a"])


def test_a_swag_round_differs_from_the_gaussian_round_only_by_its_samples():
  """posterior='swag' keeps FedAvg's loss and bits and the distillation; its model differs from the
  diagonal Gaussian's (other samples, other soft labels). A bad posterior name is one clear error."""
  fed, _ = federation_with_free_rows()
  made = {
    posterior: fedbe.make_fedbe(
      MODEL,
      fed,
      None,
      hparams(server_set_size=8, distill_batch_size=4, posterior=posterior),
      seed=7,
    )
    for posterior in ("gaussian", "swag")
  }
  (s1, m1), (s2, m2) = (a.step(a.init(jax.random.key(1)), a.round_inputs(0)) for a in made.values())
  for k in ("loss", "bits_per_client", "bits_cumulative"):
    np.testing.assert_array_equal(m1[k], m2[k])
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)))
  with pytest.raises(ValueError, match="posterior"):
    hparams(posterior="laplace")


def test_ensemble_is_mean_clients_samples_and_soft_labels_are_mean_softmax():
  rng = np.random.default_rng(2)
  mean = {"w": rng.normal(size=(DIM, CLASSES)), "b": rng.normal(size=(CLASSES,))}
  clients = jax.tree.map(lambda m: m[None] + rng.normal(size=(3, *m.shape)), mean)
  samples = jax.tree.map(lambda m: m[None] + rng.normal(size=(2, *m.shape)), mean)
  members = fedbe.ensemble_members(
    *(jax.tree.map(jnp.float32, t) for t in (mean, clients, samples))
  )
  x = rng.normal(size=(9, DIM))
  soft = fedbe.ensemble_soft_labels(linear_apply, members, jnp.float32(x))
  all_w = [mean["w"], *clients["w"], *samples["w"]]
  all_b = [mean["b"], *clients["b"], *samples["b"]]
  expected = np.mean([np_softmax(x @ w + b) for w, b in zip(all_w, all_b)], axis=0)
  np.testing.assert_allclose(soft, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- distillation


def test_one_distillation_step_is_a_gradient_step_on_the_soft_cross_entropy():
  rng = np.random.default_rng(3)
  w0, b0 = rng.normal(size=(DIM, CLASSES)), rng.normal(size=(CLASSES,))
  x = rng.normal(size=(12, DIM))
  q = np_softmax(rng.normal(size=(12, CLASSES)) * 2)
  hp = hparams(distill_lr=0.7, distill_momentum=0.9)  # one full batch: momentum has no history yet
  out = fedbe.distill(
    linear_apply,
    {"w": jnp.float32(w0), "b": jnp.float32(b0)},
    jnp.float32(x),
    jnp.float32(q),
    jax.random.key(0),
    hp,
  )
  gw, gb = np_gradient(w0, b0, x, q)
  np.testing.assert_allclose(out["w"], w0 - 0.7 * gw, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["b"], b0 - 0.7 * gb, rtol=1e-5, atol=1e-6)


def test_distillation_with_minibatches_momentum_and_swa_equals_a_numpy_loop():
  rng = np.random.default_rng(4)
  w, b = rng.normal(size=(DIM, CLASSES)), rng.normal(size=(CLASSES,))
  size, batch, epochs, lr, mom = 13, 4, 3, 0.3, 0.9  # 3 batches an epoch (one sample dropped)
  x = rng.normal(size=(size, DIM))
  q = np_softmax(rng.normal(size=(size, CLASSES)))
  hp = hparams(
    server_set_size=size,
    distill_batch_size=batch,
    distill_epochs=epochs,
    distill_lr=lr,
    distill_momentum=mom,
    swa_start=2,
    swa_every=3,
  )
  key = jax.random.key(5)
  params = {"w": jnp.float32(w), "b": jnp.float32(b)}
  out = fedbe.distill(linear_apply, params, jnp.float32(x), jnp.float32(q), key, hp)
  # numpy: heavy-ball SGD (v <- mom v + g, w <- w - lr v), SWA over steps t > 2 with t % 3 == 0.
  vw, vb, t, averaged = np.zeros_like(w), np.zeros_like(b), 0, []
  for epoch in range(epochs):
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), size))
    for i in range(size // batch):
      rows = order[i * batch : (i + 1) * batch]
      gw, gb = np_gradient(w, b, x[rows], q[rows])
      vw, vb = mom * vw + gw, mom * vb + gb
      w, b, t = w - lr * vw, b - lr * vb, t + 1
      if t > 2 and t % 3 == 0:
        averaged.append((w, b))
  assert [3, 6, 9] == fedbe.swa_steps(hp) and len(averaged) == 3
  np.testing.assert_allclose(out["w"], np.mean([a for a, _ in averaged], 0), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out["b"], np.mean([c for _, c in averaged], 0), rtol=1e-4, atol=1e-5)
  last = fedbe.distill(
    linear_apply,
    params,
    jnp.float32(x),
    jnp.float32(q),
    key,
    hparams(**{**hp.__dict__, "swa_every": 0}),
  )
  np.testing.assert_allclose(last["w"], w, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the round


def federation_with_free_rows(seed=0, sizes=(5, 7, 6, 4), free=10):
  """Clients hold the first ``sum(sizes)`` of ``sum(sizes) + free`` samples; the last ``free`` nobody holds."""
  rng = np.random.default_rng(seed)
  total = sum(sizes) + free
  x = rng.normal(size=(total, DIM)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=total)
  bounds = np.cumsum((0, *sizes))
  clients = [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
  return data.make_federation(x, y, clients), x[bounds[-1] :]


MODEL = models.mlp(input_dim=DIM, hidden=(6,), num_classes=CLASSES)


def fedavg_hparams(hp):
  from ntk_fl.algorithms.server_round import ServerHParams  # pylint: disable=g-import-not-at-top

  fields = ServerHParams.__dataclass_fields__
  return ServerHParams(**{k: v for k, v in hp.__dict__.items() if k in fields})


@pytest.mark.parametrize("num_samples", [0, 3])
def test_without_distillation_the_round_is_fedavgs_bit_for_bit(num_samples):
  from ntk_fl.algorithms import fedavg  # pylint: disable=g-import-not-at-top

  fed, _ = federation_with_free_rows()
  hp = hparams(num_samples=num_samples, distill_epochs=0, server_set_size=8, distill_batch_size=4)
  ours = fedbe.make_fedbe(MODEL, fed, None, hp, seed=7)
  theirs = fedavg.make_fedavg(MODEL, fed, None, fedavg_hparams(hp), seed=7)
  s1, s2 = ours.init(jax.random.key(1)), theirs.init(jax.random.key(1))
  for r in range(3):
    (s1, m1), (s2, m2) = (
      ours.step(s1, ours.round_inputs(r)),
      theirs.step(s2, theirs.round_inputs(r)),
    )
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
      np.testing.assert_array_equal(a, b)
    for k in m2:
      np.testing.assert_array_equal(m1[k], m2[k])


def test_distilled_round_starts_from_fedavgs_mean_and_reports_fedavgs_loss_and_bits():
  from ntk_fl.algorithms import fedavg  # pylint: disable=g-import-not-at-top

  fed, _ = federation_with_free_rows()
  hp = hparams(server_set_size=8, distill_batch_size=4, distill_epochs=2, swa_every=1)
  ours = fedbe.make_fedbe(MODEL, fed, None, hp, seed=7)
  theirs = fedavg.make_fedavg(MODEL, fed, None, fedavg_hparams(hp), seed=7)
  s1, m1 = ours.step(ours.init(jax.random.key(1)), ours.round_inputs(0))
  s2, m2 = theirs.step(theirs.init(jax.random.key(1)), theirs.round_inputs(0))
  for k in ("loss", "bits_per_client", "bits_cumulative"):
    np.testing.assert_array_equal(m1[k], m2[k])
  moved = [
    np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(*map(jax.tree.leaves, (s1, s2)))
  ]
  assert max(moved) > 1e-4  # the distillation moved the model away from the mean


def test_server_set_draws_only_unheld_samples_from_the_seed():
  fed, free_x = federation_with_free_rows(free=10)
  a = fedbe.server_set(fed, 6, seed=3)
  assert a.shape == (6, DIM)
  rows = [int(np.flatnonzero(np.all(free_x == s, axis=1))[0]) for s in a]  # each one a free sample
  assert len(set(rows)) == 6
  np.testing.assert_array_equal(a, fedbe.server_set(fed, 6, seed=3))
  assert not np.array_equal(a, fedbe.server_set(fed, 6, seed=4))
  np.testing.assert_array_equal(
    np.sort(fedbe.server_set(fed, 10, seed=3), axis=0), np.sort(free_x, axis=0)
  )
  with pytest.raises(ValueError, match=r"server_set_size = 11 exceeds the 10 training samples"):
    fedbe.server_set(fed, 11, seed=3)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(distill_batch_size=20), r"distill_batch_size = 20 exceeds .*server_set_size = 12"),
    (dict(swa_every=5, swa_start=1), r"swa_start = 1 with swa_every = 5 averages no iterate"),
    (dict(num_samples=-1), r"config.algorithm.num_samples"),
    (dict(distill_momentum=1.0), r"config.algorithm.distill_momentum"),
  ],
)
def test_bad_hyperparameters_name_the_value(changes, message):
  with pytest.raises(ValueError, match=message):
    hparams(**changes)


def test_table2_runs_fedbe_non_iid_on_two_label_clients_with_a_server_set():
  """``fed_ensemble:table2`` lists FedBE's non-iid run; its config's partition (MNIST's 60,000 labels, here a
  balanced stand-in) gives 100 two-label clients of 550 and leaves 5,000 samples to the server."""
  from ntk_fl.config import load_config  # pylint: disable=g-import-not-at-top
  from ntk_fl.reproduce.experiments import EXPERIMENTS  # pylint: disable=g-import-not-at-top

  runs = {v.name: v.config for v in EXPERIMENTS["fed_ensemble:table2"].variants}
  assert runs["fe_t2_fedbe_noniid"] == "fedbe:noniid" and runs["fe_t2_fedbe_iid"] == "fedbe"
  d = load_config("fedbe", "noniid").data
  labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 6_000))
  clients = data.partition(
    labels,
    d.partition,
    d.num_clients,
    seed=0,
    classes_per_client=d.classes_per_client,
    keep_per_client=d.keep_per_client,
  )
  assert len(clients) == 100 and {c.size for c in clients} == {550}
  assert max(np.unique(labels[c]).size for c in clients) == 2
  assert labels.size - np.unique(np.concatenate(clients)).size == 5_000
