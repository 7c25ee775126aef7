"""ntk_fl.metrics against independent numpy computations on hand-made linear models."""

from __future__ import annotations

import math

import chex
import jax
import numpy as np
import pytest

from ntk_fl import metrics
from ntk_fl.rng import Stream, numpy_rng

RTOL = 1e-5  # float32 sums of a few hundred terms


def linear_apply(params, x):
  p = params["params"]
  return x @ p["w"] + p["b"]


def make_clients(num_clients, dim=6, classes=4, seed=0):
  rng = np.random.default_rng(seed)
  return {
    "params": {
      "w": rng.normal(size=(num_clients, dim, classes)).astype(np.float32),
      "b": rng.normal(size=(num_clients, classes)).astype(np.float32),
    }
  }


def make_data(n, dim=6, classes=4, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, dim)).astype(np.float32)
  teacher = rng.normal(size=(dim, classes))
  y = np.argmax(x @ teacher, axis=1).astype(np.int32)
  return x, y


def client(stacked, i):
  return jax.tree.map(lambda w: w[i], stacked)


def numpy_acc_loss(params, x, y):
  logits = x.astype(np.float64) @ params["params"]["w"] + params["params"]["b"]
  shifted = logits - logits.max(axis=1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
  return np.mean(logits.argmax(axis=1) == y), -np.mean(log_probs[np.arange(len(y)), y])


@pytest.mark.parametrize("n,batch_size", [(37, 8), (37, 37), (37, 1000), (5, 1)])
def test_evaluate_matches_numpy(n, batch_size):
  params = client(make_clients(1), 0)
  x, y = make_data(n)
  acc, loss = metrics.evaluate(linear_apply, params, x, y, batch_size=batch_size)
  want_acc, want_loss = numpy_acc_loss(params, x, y)
  assert float(acc) == pytest.approx(want_acc, abs=1e-7)
  assert float(loss) == pytest.approx(want_loss, rel=RTOL)


def test_batch_test_set_pads_and_masks():
  x, y = make_data(10)
  b = metrics.batch_test_set(x, y, batch_size=4)
  assert b.x.shape == (3, 4, 6) and b.y.shape == (3, 4) and b.mask.shape == (3, 4)
  assert b.mask.sum() == 10 and not b.mask.reshape(-1)[10:].any()
  np.testing.assert_array_equal(b.x.reshape(12, 6)[:10], x)
  np.testing.assert_array_equal(b.y.reshape(12)[:10], y)


@pytest.mark.parametrize(
  "bad", [dict(x=np.zeros((3, 2)), y=np.zeros(4)), dict(x=np.zeros((0, 2)), y=np.zeros(0))]
)
def test_batch_test_set_rejects_bad_shapes(bad):
  with pytest.raises(ValueError):
    metrics.batch_test_set(bad["x"], bad["y"])


@pytest.mark.parametrize("chunk_size", [None, 2, 5, 100])
def test_evaluate_clients_matches_per_client_numpy(chunk_size):
  stacked = make_clients(5)
  x, y = make_data(23)
  acc, loss = metrics.evaluate_clients(
    linear_apply, stacked, x, y, batch_size=7, chunk_size=chunk_size
  )
  assert acc.shape == (5,) and loss.shape == (5,)
  for i in range(5):
    want_acc, want_loss = numpy_acc_loss(jax.tree.map(np.asarray, client(stacked, i)), x, y)
    assert float(acc[i]) == pytest.approx(want_acc, abs=1e-7)
    assert float(loss[i]) == pytest.approx(want_loss, rel=RTOL)


def test_make_evaluator_matches_functions():
  stacked = make_clients(4)
  x, y = make_data(19)
  ev = metrics.make_evaluator(linear_apply, x, y, batch_size=6, chunk_size=3)
  acc, loss, dev = ev.aggregate(stacked)
  want_acc, want_loss = numpy_acc_loss(
    jax.tree.map(np.asarray, metrics.average_params(stacked)), x, y
  )
  assert float(acc) == pytest.approx(want_acc, abs=1e-7)
  assert float(loss) == pytest.approx(want_loss, rel=RTOL)
  assert float(dev) == pytest.approx(float(metrics.model_deviation(stacked)), rel=RTOL)
  c_acc, c_loss = ev.clients(stacked)
  f_acc, f_loss = metrics.evaluate_clients(linear_apply, stacked, x, y)
  np.testing.assert_allclose(c_acc, f_acc, atol=1e-7)
  np.testing.assert_allclose(c_loss, f_loss, rtol=RTOL)


class AveragingTest(chex.TestCase):
  """average_params and model_deviation, called directly and under jit (chex.variants)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_average_params_uniform_and_weighted(self):
    stacked = make_clients(3)
    avg = self.variant(metrics.average_params)(stacked)
    # The uniform mean, leaf by leaf, in float64 numpy.
    want = jax.tree.map(lambda w: np.asarray(w, np.float64).mean(0), stacked)
    chex.assert_trees_all_close(avg, want, rtol=RTOL, atol=1e-7)
    chex.assert_trees_all_equal_shapes_and_dtypes(avg, jax.tree.map(lambda w: w[0], stacked))
    weights = np.array([1.0, 3.0, 0.0])
    wavg = self.variant(metrics.average_params)(stacked, weights)
    want = jax.tree.map(
      lambda w: (np.asarray(w[0], np.float64) * 1 + np.asarray(w[1], np.float64) * 3) / 4, stacked
    )
    chex.assert_trees_all_close(wavg, want, rtol=RTOL, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  def test_model_deviation_matches_eq12_numpy(self):
    stacked = make_clients(7, seed=3)
    flat = np.concatenate(
      [np.asarray(w).reshape(7, -1) for w in jax.tree_util.tree_leaves(stacked)], axis=1
    )
    flat = flat.astype(np.float64)
    want = np.mean(np.sqrt(np.sum((flat - flat.mean(0)) ** 2, axis=0)))
    got = self.variant(metrics.model_deviation)(stacked)
    chex.assert_shape(got, ())
    assert float(got) == pytest.approx(want, rel=RTOL)


def test_average_params_rejects_bad_weights_and_client_axes():
  stacked = make_clients(3)
  with pytest.raises(ValueError, match=r"\[M\]"):
    metrics.average_params(stacked, np.ones(4))
  # Leaves that disagree on the client axis M: chex names the shapes.
  ragged = {"w": np.zeros((3, 2), np.float32), "b": np.zeros((4,), np.float32)}
  for fn in (metrics.average_params, metrics.model_deviation):
    with pytest.raises(
      AssertionError, match=r"equal_shape_prefix.*different shape prefixes: \[\(4,\), \(3,\)\]"
    ):
      fn(ragged)


def test_model_deviation_closed_forms():
  w = np.random.default_rng(4).normal(size=(2, 5)).astype(np.float32)
  identical = {"a": np.stack([w, w])}
  assert float(metrics.model_deviation(identical)) == 0.0
  # Clients +w and -w: mean 0, so every coordinate contributes sqrt(2 w_j^2) = sqrt(2)|w_j|.
  opposite = {"a": np.stack([w, -w])}
  assert float(metrics.model_deviation(opposite)) == pytest.approx(
    math.sqrt(2) * np.abs(w).mean(), rel=RTOL
  )


def test_rounds_to_target_edge_cases():
  assert metrics.rounds_to_target([0.9, 0.95], 0.85) == 1
  assert metrics.rounds_to_target([0.5, 0.85, 0.9], 0.85) == 2  # equality counts
  assert metrics.rounds_to_target([0.5, 0.6], 0.85) is None
  assert metrics.rounds_to_target([], 0.85) is None
  assert (
    metrics.rounds_to_target([None, float("nan"), 0.9], 0.85) == 3
  )  # unevaluated rounds keep their index
  assert metrics.rounds_to_target([0.3, 1.0], 1.0) == 2
  for bad in (0.0, -0.1, 1.5):
    with pytest.raises(ValueError, match="target"):
      metrics.rounds_to_target([0.9], bad)


def _test_half(n, seed):
  perm = numpy_rng(seed, Stream.SELECTION).permutation(n)  # the documented split
  return perm[: n // 2], perm[n // 2 :]


def test_selection_curves_against_brute_force():
  num_clients, seed = 6, 11
  stacked = jax.tree.map(np.asarray, make_clients(num_clients, seed=5))
  x, y = make_data(41, seed=6)
  curves = metrics.selection_curves(
    linear_apply, stacked, x, y, seed=seed, batch_size=9, chunk_size=4
  )
  val_idx, test_idx = _test_half(len(y), seed)

  val_acc = np.array(
    [numpy_acc_loss(client(stacked, i), x[val_idx], y[val_idx])[0] for i in range(num_clients)]
  )
  test_acc = np.array(
    [numpy_acc_loss(client(stacked, i), x[test_idx], y[test_idx])[0] for i in range(num_clients)]
  )
  np.testing.assert_allclose(curves["validation_accuracy"], val_acc, atol=1e-7)
  np.testing.assert_allclose(curves["test_accuracy"], test_acc, atol=1e-7)

  # Orders: permutations; best-to-worst sorted by validation accuracy; worst-to-best its reverse.
  for name in metrics.SELECTION_ORDERS:
    order = curves[f"{name}_order"]
    assert sorted(order.tolist()) == list(range(num_clients))
    assert curves[name].shape == (num_clients,)
  assert np.all(np.diff(val_acc[curves["best_to_worst_order"]]) <= 0)
  np.testing.assert_array_equal(curves["worst_to_best_order"], curves["best_to_worst_order"][::-1])

  # First point of best-to-worst = the best validation model's test accuracy.
  assert curves["best_to_worst"][0] == pytest.approx(test_acc[np.argmax(val_acc)], abs=1e-7)
  # Every point = the numpy average of the first k models in that order, scored on the test half.
  for name in metrics.SELECTION_ORDERS:
    order = curves[f"{name}_order"]
    for k in range(1, num_clients + 1):
      avg = jax.tree.map(lambda w: w[order[:k]].astype(np.float64).mean(0), stacked)
      assert curves[name][k - 1] == pytest.approx(
        numpy_acc_loss(avg, x[test_idx], y[test_idx])[0], abs=1e-7
      )
  # All curves end at the all-client average.
  all_avg = jax.tree.map(lambda w: w.astype(np.float64).mean(0), stacked)
  end = numpy_acc_loss(all_avg, x[test_idx], y[test_idx])[0]
  for name in metrics.SELECTION_ORDERS:
    assert curves[name][-1] == pytest.approx(end, abs=1e-7)


def test_selection_random_order_is_seeded():
  stacked = make_clients(9, seed=7)
  x, y = make_data(20, seed=8)
  a = metrics.selection_curves(linear_apply, stacked, x, y, seed=1)
  b = metrics.selection_curves(linear_apply, stacked, x, y, seed=1)
  c = metrics.selection_curves(linear_apply, stacked, x, y, seed=2)
  np.testing.assert_array_equal(a["random_order"], b["random_order"])
  np.testing.assert_array_equal(a["random"], b["random"])
  assert not np.array_equal(a["random_order"], c["random_order"])


def test_selection_needs_two_samples():
  with pytest.raises(ValueError, match="at least 2"):
    metrics.selection_curves(linear_apply, make_clients(2), *make_data(1), seed=0)
