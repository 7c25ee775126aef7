"""Local training: vmapped clients vs a per-client Python reference, padding, SAM, FedProx, masks.

The reference loop below is written independently of ``local.py``'s scans: it
walks each client's real samples in the epoch order, takes ``jax.grad`` of the
mean cross-entropy of each minibatch and applies PyTorch's SGD update by hand
(``d = g + wd w``; ``buf = mu buf + d`` (``buf = d`` on the first step);
``w -= lr buf``). Only the epoch order helper is shared (and tested on its own).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ntk_fl import models, parallel
from ntk_fl.algorithms import local

MODEL = models.mlp(input_dim=5, hidden=(6,), num_classes=3)
RTOL, ATOL = 2e-5, 2e-6  # float32, a few dozen sequential steps


def make_clients(sizes, n_max, seed=0, pad_value=0.0):
  rng = np.random.default_rng(seed)
  x = np.full((len(sizes), n_max, 5), pad_value, np.float32)
  y = np.zeros((len(sizes), n_max), np.int32)
  mask = np.zeros((len(sizes), n_max), bool)
  for i, n in enumerate(sizes):
    x[i, :n] = rng.normal(size=(n, 5))
    y[i, :n] = rng.integers(0, 3, size=n)
    mask[i, :n] = True
  return x, y, mask


def ce(params, x, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(MODEL.apply(params, x), y))


# The reference's gradient, jitted: one program per minibatch size instead of every operation of the
# backward pass compiled on its own (the same gradient; the loop and the SGD update stay plain Python).
_ce_grad = jax.jit(jax.grad(ce))


def reference_client(
  params, x, y, mask, key, lr, *, epochs, batch_size, momentum=0.0, weight_decay=0.0
):
  """Plain Python SGD over real samples only (see the module docstring)."""
  n = int(mask.sum())
  buf = None
  for epoch_key in jax.random.split(key, epochs):
    order = np.asarray(local.epoch_order(epoch_key, jnp.asarray(mask)))[:n]
    for start in range(0, n, batch_size):
      idx = order[start : start + batch_size]
      g = _ce_grad(params, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
      d = jax.tree.map(lambda gi, w: gi + weight_decay * w, g, params)
      buf = d if buf is None else jax.tree.map(lambda b, di: momentum * b + di, buf, d)
      params = jax.tree.map(lambda w, b: w - lr * b, params, buf if momentum else d)
  return params


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def test_epoch_order_is_a_permutation_of_real_samples_first():
  mask = jnp.asarray([True, False, True, True, False, True, False])
  orders = [np.asarray(local.epoch_order(jax.random.key(s), mask)) for s in range(20)]
  for order in orders:
    assert sorted(order[:4]) == [0, 2, 3, 5]
    assert sorted(order[4:]) == [1, 4, 6]
  assert len({tuple(o[:4]) for o in orders}) > 5  # the order changes with the key


def test_vmapped_local_training_matches_per_client_reference():
  sizes, n_max, epochs, batch = (
    (7, 4, 10),
    10,
    2,
    3,
  )  # ragged: 3, 2 and 4 real minibatches per epoch
  x, y, mask = make_clients(sizes, n_max)
  params = models.init_clients(MODEL, jax.random.key(1), len(sizes), shared=False)
  keys = jax.random.split(jax.random.key(2), len(sizes))
  lr, momentum, wd = 0.3, 0.9, 0.01
  update = local.make_local_update(
    MODEL.apply, epochs=epochs, batch_size=batch, momentum=momentum, weight_decay=wd
  )
  # chunk_size=2 < M exercises the chunked (lax.map) path as well as vmap inside a chunk.
  result = jax.jit(
    parallel.for_each_client(lambda p, a, b, c, k: update(p, a, b, c, k, lr), chunk_size=2)
  )(params, x, y, mask, keys)
  for i, n in enumerate(sizes):
    client = jax.tree.map(lambda w: w[i], params)
    expected = reference_client(
      client,
      x[i],
      y[i],
      mask[i],
      keys[i],
      lr,
      epochs=epochs,
      batch_size=batch,
      momentum=momentum,
      weight_decay=wd,
    )
    assert_trees_close(jax.tree.map(lambda w: w[i], result.params), expected)
    assert int(result.steps[i]) == epochs * math.ceil(n / batch)


def test_final_epoch_loss_is_mean_minibatch_loss():
  x, y, mask = make_clients((6,), 6)
  params = MODEL.init(jax.random.key(0))
  update = local.make_local_update(MODEL.apply, epochs=1, batch_size=6)
  result = update(params, x[0], y[0], mask[0], jax.random.key(3), 0.1)
  np.testing.assert_allclose(result.loss, ce(params, x[0], y[0]), rtol=1e-6)


def test_padded_samples_are_never_used():
  sizes, n_max = (5, 3), 8
  x0, y0, mask = make_clients(sizes, n_max, pad_value=0.0)
  x1, _, _ = make_clients(sizes, n_max, pad_value=np.nan)
  y1 = np.where(mask, y0, 10**6)  # out-of-range labels in padding would poison the loss
  params = models.init_clients(MODEL, jax.random.key(0), 2)
  keys = jax.random.split(jax.random.key(5), 2)
  update = local.make_local_update(MODEL.apply, epochs=3, batch_size=2, momentum=0.5)
  run = jax.jit(parallel.for_each_client(lambda p, a, b, c, k: update(p, a, b, c, k, 0.2)))
  clean, dirty = run(params, x0, y0, mask, keys), run(params, x1, y1, mask, keys)
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(dirty))
  for u, v in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def full_batch_step(**kwargs):
  x, y, mask = make_clients((8,), 8, seed=4)
  params = MODEL.init(jax.random.key(7))
  update = local.make_local_update(MODEL.apply, epochs=1, batch_size=8, **kwargs)
  return params, x[0], y[0], mask[0], update


def test_sam_with_zero_radius_is_sgd():
  params, x, y, mask, update = full_batch_step(sam_rho=0.0, sam_adaptive=True)
  _, _, _, _, plain = full_batch_step()
  key = jax.random.key(0)
  assert_trees_close(
    update(params, x, y, mask, key, 0.5).params,
    plain(params, x, y, mask, key, 0.5).params,
    rtol=0,
    atol=0,
  )


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_step_matches_formula(adaptive):
  rho, lr = 0.05, 0.5
  params, x, y, mask, update = full_batch_step(sam_rho=rho, sam_adaptive=adaptive)
  g = jax.grad(ce)(params, x, y)
  t = (lambda w: jnp.abs(w)) if adaptive else (lambda w: 1.0)
  norm = math.sqrt(
    sum(
      float(jnp.sum((t(w) * gi) ** 2)) for w, gi in zip(jax.tree.leaves(params), jax.tree.leaves(g))
    )
  )
  perturbed = jax.tree.map(lambda w, gi: w + rho * t(w) ** 2 * gi / norm, params, g)
  g_sam = jax.grad(ce)(perturbed, x, y)
  expected = jax.tree.map(lambda w, gi: w - lr * gi, params, g_sam)
  assert_trees_close(update(params, x, y, mask, jax.random.key(0), lr).params, expected)


def test_fedprox_step_adds_proximal_gradient():
  mu, lr = 0.7, 0.3
  params, x, y, mask, update = full_batch_step(prox_mu=mu)
  anchor = jax.tree.map(lambda w: w + 0.1, params)
  g = jax.grad(ce)(params, x, y)
  expected = jax.tree.map(lambda w, gi, a: w - lr * (gi + mu * (w - a)), params, g, anchor)
  assert_trees_close(
    update(params, x, y, mask, jax.random.key(0), lr, anchor=anchor).params, expected
  )
  with pytest.raises(ValueError, match="anchor"):
    update(params, x, y, mask, jax.random.key(0), lr)


def test_param_mask_keeps_masked_weights_at_zero():
  params, x, y, mask, update = full_batch_step(momentum=0.9, weight_decay=0.1)
  rng = np.random.default_rng(0)
  pmask = jax.tree.map(lambda w: jnp.asarray(rng.random(w.shape) < 0.5, jnp.float32), params)
  params = jax.tree.map(jnp.multiply, params, pmask)
  out = update(params, x, y, mask, jax.random.key(0), 0.5, param_mask=pmask).params
  for w, m, w0 in zip(jax.tree.leaves(out), jax.tree.leaves(pmask), jax.tree.leaves(params)):
    assert np.all(np.asarray(w)[np.asarray(m) == 0] == 0)
    assert np.any(np.asarray(w)[np.asarray(m) == 1] != np.asarray(w0)[np.asarray(m) == 1])


def test_sgd_matches_torch_semantics_with_lr_gamma_and_weight_decay():
  # optax chain vs the hand-written PyTorch rule on a quadratic, three steps.
  w = jnp.asarray([1.0, -2.0])
  opt = local.sgd(0.1, momentum=0.9, weight_decay=0.05)
  state, w_opt, w_ref, buf = opt.init(w), w, w, None
  for g in (jnp.asarray([0.5, 0.1]), jnp.asarray([-0.2, 0.3]), jnp.asarray([0.4, 0.4])):
    updates, state = opt.update(g, state, w_opt)
    w_opt = optax.apply_updates(w_opt, updates)
    d = g + 0.05 * w_ref
    buf = d if buf is None else 0.9 * buf + d
    w_ref = w_ref - 0.1 * buf
  np.testing.assert_allclose(w_opt, w_ref, rtol=1e-6)
  hparams = local.LocalHParams(
    lr=0.01,
    lr_gamma=0.95,
    epochs=1,
    batch_size=1,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    quantize_bits=32,
    stochastic_rounding=False,
  )
  np.testing.assert_allclose(local.round_lr(hparams, 3), 0.01 * 0.95**3, rtol=1e-6)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(epochs=0, batch_size=2), "epochs"),
    (dict(epochs=1, batch_size=0), "batch_size"),
    (dict(epochs=1, batch_size=2, momentum=1.0), "momentum"),
    (dict(epochs=1, batch_size=2, sam_rho=-0.1), "sam_rho"),
  ],
)
def test_bad_hyperparameters_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    local.make_local_update(MODEL.apply, **kwargs)
