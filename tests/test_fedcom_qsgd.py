"""FedCOM and QSGD: the QSGD quantiser, the uplink bit count and one round of each, against numpy.

The quantiser is checked against its definition (Alistarh et al. 2017, eq. (3.1)): exact levels,
unbiasedness over many draws, the closed-form variance and Lemma 3.1's bound. Each method's round is
re-implemented in float64 numpy (hand-written backpropagation of the MLP, the QSGD levels from the
same uniform draws the library makes) and compared with the compiled round.
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import communication, compression, models, runner, schema
from ntk_fl import config as config_lib
from ntk_fl.algorithms import local
from federations import ragged_federation

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = models.mlp(input_dim=5, hidden=(6,), num_classes=3)


def load_config(name, arg=None):
  return config_lib.load_config(str(REPO / "configs" / f"{name}.py"), arg)


# ----------------------------------------------------------------------------- the quantiser


def numpy_qsgd(v, bits, uniforms, bucket_size=0, norm="l2", stochastic=True):
  """Q_s of a flat float64 vector ``v`` with the given uniforms ``[num_buckets, bucket]``."""
  s = 2 ** (bits - 1) - 1
  n = v.size
  bucket = n if bucket_size == 0 or bucket_size >= n else bucket_size
  out = np.zeros(n)
  for b, start in enumerate(range(0, n, bucket)):
    chunk = v[start : start + bucket]
    scale = np.sqrt(np.sum(chunk**2)) if norm == "l2" else np.max(np.abs(chunk))
    if scale == 0:
      continue
    r = np.abs(chunk) / scale * s
    if stochastic:
      level = np.floor(r) + (uniforms[b, : chunk.size] < r - np.floor(r))
    else:
      level = np.floor(r + 0.5)
    out[start : start + bucket] = np.sign(chunk) * np.minimum(level, s) * scale / s
  return out


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("bucket_size,norm", [(0, "l2"), (7, "l2"), (7, "max")])
def test_qsgd_levels_are_exact(bits, bucket_size, norm):
  rng = np.random.default_rng(bits)
  v = rng.normal(size=(4, 5)).astype(np.float32)
  v[0, 0] = 0.0  # a zero entry stays zero
  s = compression.qsgd_levels(bits)
  assert s == 2 ** (bits - 1) - 1
  key = jax.random.key(3)
  q = np.asarray(
    compression.qsgd_quantize(jnp.asarray(v), bits, key=key, bucket_size=bucket_size, norm=norm)
  ).reshape(-1)
  flat = v.reshape(-1).astype(np.float64)
  bucket = flat.size if bucket_size == 0 else bucket_size
  num_buckets = math.ceil(flat.size / bucket)
  uniforms = np.asarray(jax.random.uniform(key, (num_buckets, bucket)), np.float64)
  np.testing.assert_allclose(q, numpy_qsgd(flat, bits, uniforms, bucket_size, norm), rtol=1e-6)
  for b in range(num_buckets):
    chunk, sent = flat[b * bucket : (b + 1) * bucket], q[b * bucket : (b + 1) * bucket]
    scale = np.linalg.norm(chunk) if norm == "l2" else np.abs(chunk).max()
    level = sent / scale * s
    np.testing.assert_allclose(level, np.round(level), atol=1e-4)  # integer levels in [-s, s]
    assert np.all(np.abs(np.round(level)) <= s)
    assert np.all(np.sign(np.round(level)) * np.sign(chunk) >= 0)  # never the opposite sign
    r = np.abs(chunk) / scale * s
    assert np.all(
      (np.abs(np.round(level)) == np.floor(r)) | (np.abs(np.round(level)) == np.ceil(r))
    )
  deterministic = compression.qsgd_quantize(
    jnp.asarray(v), bits, bucket_size=bucket_size, norm=norm, stochastic=False
  )
  np.testing.assert_allclose(
    np.asarray(deterministic).reshape(-1),
    numpy_qsgd(flat, bits, None, bucket_size, norm, stochastic=False),
    rtol=1e-6,
    atol=1e-7,
  )


@pytest.mark.parametrize("bucket_size,norm", [(0, "l2"), (16, "l2"), (16, "max")])
def test_qsgd_is_unbiased_with_lemma_3_1_variance(bucket_size, norm):
  bits, draws = 3, 40_000  # s = 3 levels: coarse, so the variance is far from 0
  s = compression.qsgd_levels(bits)
  v = np.random.default_rng(0).normal(size=50).astype(np.float32)
  keys = jax.random.split(jax.random.key(1), draws)
  quantize = lambda k: compression.qsgd_quantize(
    jnp.asarray(v), bits, key=k, bucket_size=bucket_size, norm=norm
  )
  samples = np.asarray(jax.jit(jax.vmap(quantize))(keys), np.float64)  # [draws, 50]
  flat = v.astype(np.float64)
  # Closed-form per-coordinate variance: (a/s)^2 p (1 - p), p the fractional part of r = |v| s / a.
  bucket = flat.size if bucket_size == 0 else bucket_size
  var = np.zeros_like(flat)
  for start in range(0, flat.size, bucket):
    chunk = flat[start : start + bucket]
    scale = np.linalg.norm(chunk) if norm == "l2" else np.abs(chunk).max()
    p = np.abs(chunk) / scale * s - np.floor(np.abs(chunk) / scale * s)
    var[start : start + bucket] = (scale / s) ** 2 * p * (1 - p)
    if norm == "l2":  # Lemma 3.1 per bucket: E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2
      n = chunk.size
      assert var[start : start + bucket].sum() <= min(n / s**2, math.sqrt(n) / s) * (chunk @ chunk)
  mean = samples.mean(axis=0)
  assert np.all(np.abs(mean - flat) <= 5 * np.sqrt(var / draws) + 1e-6)  # unbiased
  empirical = np.mean(np.sum((samples - flat) ** 2, axis=1))
  assert abs(empirical - var.sum()) <= 0.03 * var.sum()


def test_qsgd_rejects_bad_input():
  with pytest.raises(ValueError, match="QSGD bits"):
    compression.qsgd_levels(1)
  with pytest.raises(ValueError, match="norm"):
    compression.qsgd_quantize(jnp.ones(3), 4, key=jax.random.key(0), norm="l1")
  with pytest.raises(ValueError, match="PRNG key"):
    compression.qsgd_quantize(jnp.ones(3), 4)


# ----------------------------------------------------------------------------- the bit count


def test_upload_bits_against_a_hand_count():
  sizes = (78_400, 100, 1_000, 10)  # MLP 784-100-10: kernels and biases, d = 79,510
  d = 79_510
  # QSGD, 4 bits, buckets of 512: 154 + 1 + 2 + 1 = 158 buckets, one float32 norm each.
  assert communication.qsgd_upload_bits(sizes, 4, 512) == 4 * d + 32 * (154 + 1 + 2 + 1)
  # FedCOM, 8 bits, buckets of 8,192: 10 + 1 + 1 + 1 = 13 norms.
  assert communication.qsgd_upload_bits(sizes, 8, 8192) == 8 * d + 32 * 13
  assert communication.qsgd_upload_bits(sizes, 8, 0) == 8 * d + 32 * 4  # one norm per tensor
  assert communication.qsgd_upload_bits(sizes, 32, 512) == 32 * d  # float32, no norms
  # NTK-FL Table 1's arithmetic (norms not counted): 614 rounds x 20 clients x d x 4 bits ≈ 465 MiB.
  table_mib = 614 * 20 * d * 4 / 8 / 2**20
  ours_mib = 614 * 20 * communication.qsgd_upload_bits(sizes, 4, 512) / 8 / 2**20
  assert abs(table_mib - 465) < 1 and 1 < ours_mib / table_mib < 1.02
  with pytest.raises(ValueError, match="QSGD bits"):
    communication.qsgd_upload_bits(sizes, 1, 0)


# ----------------------------------------------------------------------------- one round against numpy


def tiny(name, sizes, **algo):
  config = load_config(name)
  config.seed = 0
  config.rounds = 1
  config.data.num_clients = len(sizes)
  config.chunk_size = 0
  for key, value in algo.items():
    setattr(config.algorithm, key, value)
  fed = ragged_federation(np.random.default_rng(0), sizes)
  return runner.make_algorithm(config, MODEL, fed), fed


def numpy_params(params):
  p = params["params"]
  return {
    "W1": np.asarray(p["dense_0"]["kernel"], np.float64),
    "b1": np.asarray(p["dense_0"]["bias"], np.float64),
    "W2": np.asarray(p["dense_1"]["kernel"], np.float64),
    "b2": np.asarray(p["dense_1"]["bias"], np.float64),
  }


def as_tree(w):
  """A numpy parameter dict in the library's pytree layout (so leaves come in the library's order)."""
  return {
    "params": {
      "dense_0": {"bias": w["b1"], "kernel": w["W1"]},
      "dense_1": {"bias": w["b2"], "kernel": w["W2"]},
    }
  }


def numpy_grad(w, x, y):
  """Mean cross-entropy of the ReLU MLP and its gradient, by hand (float64)."""
  h_pre = x @ w["W1"] + w["b1"]
  h = np.maximum(h_pre, 0)
  logits = h @ w["W2"] + w["b2"]
  z = logits - logits.max(axis=1, keepdims=True)
  probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  onehot = np.eye(logits.shape[1])[y]
  loss = -np.mean(np.sum(onehot * np.log(probs), axis=1))
  d_logits = (probs - onehot) / len(y)
  d_h = d_logits @ w["W2"].T * (h_pre > 0)
  grad = {"W2": h.T @ d_logits, "b2": d_logits.sum(0), "W1": x.T @ d_h, "b1": d_h.sum(0)}
  return loss, grad


def numpy_transmit(vectors, key, bits, bucket_size, norm):
  """QSGD of each client's vector, with the library's draws: client k keys ``split(key, K)[k]``, leaf j
  ``split(client_key, L)[j]``, uniforms ``[num_buckets, bucket]`` (float32, as the library draws them)."""
  out = []
  for vector, client_key in zip(vectors, jax.random.split(key, len(vectors))):
    leaves, treedef = jax.tree.flatten(as_tree(vector))
    sent = []
    for leaf, leaf_key in zip(leaves, jax.random.split(client_key, len(leaves))):
      n = leaf.size
      bucket = n if bucket_size == 0 or bucket_size >= n else bucket_size
      uniforms = np.asarray(jax.random.uniform(leaf_key, (math.ceil(n / bucket), bucket)))
      sent.append(
        numpy_qsgd(leaf.reshape(-1), bits, uniforms, bucket_size, norm).reshape(leaf.shape)
      )
    tree = jax.tree.unflatten(treedef, sent)["params"]
    out.append(
      {
        "W1": tree["dense_0"]["kernel"],
        "b1": tree["dense_0"]["bias"],
        "W2": tree["dense_1"]["kernel"],
        "b2": tree["dense_1"]["bias"],
      }
    )
  return out


def check_round(algorithm, expected, bits_expected):
  state = algorithm.init(jax.random.PRNGKey(0))
  new_state, metrics = algorithm.step(state, algorithm.round_inputs(0))
  got = numpy_params(new_state.params)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=2e-5, atol=2e-6)
  assert float(metrics["bits_per_client"]) == bits_expected
  return metrics


def round_setup(algorithm, fed):
  state = algorithm.init(jax.random.PRNGKey(0))
  inputs = algorithm.round_inputs(0)
  train_key, quant_key = jax.random.split(inputs.key)
  clients = np.asarray(inputs.clients)
  sizes = np.asarray(fed.mask).sum(axis=1)[clients].astype(np.float64)
  data = [
    (
      np.asarray(fed.x[c], np.float64)[np.asarray(fed.mask[c])],
      np.asarray(fed.y[c])[np.asarray(fed.mask[c])],
    )
    for c in clients
  ]
  return numpy_params(state.params), clients, sizes / sizes.sum(), data, train_key, quant_key


MODEL_SIZES = (30, 6, 18, 3)  # the tiny MLP's leaves in the library's order: W1, b1, W2, b2


def test_fedcom_round_matches_numpy():
  # Full-batch local steps (batch >= n), so each participant's training is `epochs` gradient steps.
  bits, bucket, lr, server_lr, epochs = 4, 7, 0.3, 0.7, 2
  algorithm, fed = tiny(
    "fedcom",
    (3, 6, 2, 5),
    clients_per_round=3,
    quantize_bits=bits,
    bucket_size=bucket,
    server_lr=server_lr,
    lr=lr,
    epochs=epochs,
    batch_size=8,
  )
  w, _, p, data, _, quant_key = round_setup(algorithm, fed)
  deltas = []
  for x, y in data:
    wk = dict(w)
    for _ in range(epochs):
      _, g = numpy_grad(wk, x, y)
      wk = {n: wk[n] - lr * g[n] for n in wk}
    deltas.append({n: w[n] - wk[n] for n in w})
  sent = numpy_transmit(deltas, quant_key, bits, bucket, "l2")
  expected = {n: w[n] - server_lr * sum(pk * s[n] for pk, s in zip(p, sent)) for n in w}
  hand = sum(size * bits + 32 * math.ceil(size / bucket) for size in MODEL_SIZES)
  check_round(algorithm, expected, hand)


@pytest.mark.parametrize("batch_size", [8, 4])
def test_qsgd_round_matches_numpy(batch_size):
  # batch 8 >= every client's n: full-batch gradients; batch 4: each client's 4 drawn samples (fewer
  # if it has fewer), drawn with the library's `local.epoch_order` from split(train_key, K)[k].
  bits, bucket, lr, norm = 3, 5, 0.4, "max"
  algorithm, fed = tiny(
    "qsgd",
    (3, 6, 2, 5),
    clients_per_round=3,
    quantize_bits=bits,
    bucket_size=bucket,
    qsgd_norm=norm,
    lr=lr,
    batch_size=batch_size,
  )
  w, clients, p, _, train_key, quant_key = round_setup(algorithm, fed)
  grads, losses = [], []
  for c, client_key in zip(clients, jax.random.split(train_key, len(clients))):
    n = int(np.asarray(fed.mask[c]).sum())
    order = np.asarray(local.epoch_order(client_key, fed.mask[c]))[: min(batch_size, n)]
    loss, g = numpy_grad(w, np.asarray(fed.x[c], np.float64)[order], np.asarray(fed.y[c])[order])
    grads.append(g)
    losses.append(loss)
  sent = numpy_transmit(grads, quant_key, bits, bucket, norm)
  expected = {n: w[n] - lr * sum(pk * s[n] for pk, s in zip(p, sent)) for n in w}
  hand = sum(size * bits + 32 * math.ceil(size / bucket) for size in MODEL_SIZES)
  metrics = check_round(algorithm, expected, hand)
  np.testing.assert_allclose(float(metrics["loss"]), np.mean(losses), rtol=1e-5)


def test_unquantised_fedcom_is_fedavg_and_qsgd_is_gradient_descent():
  common = dict(clients_per_round=3, lr=0.3, epochs=2, batch_size=4)
  fedavg, _ = tiny("fedavg", (3, 6, 2, 5), **common)
  fedcom, _ = tiny("fedcom", (3, 6, 2, 5), quantize_bits=32, server_lr=1.0, **common)
  a = fedavg.step(fedavg.init(jax.random.PRNGKey(0)), fedavg.round_inputs(0))[0].params
  b = fedcom.step(fedcom.init(jax.random.PRNGKey(0)), fedcom.round_inputs(0))[0].params
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
  # QSGD at 32 bits with full batches and everyone participating: one GD step on the pooled data.
  algorithm, fed = tiny(
    "qsgd", (3, 6, 2, 5), clients_per_round=0, quantize_bits=32, lr=0.5, batch_size=8
  )
  w = numpy_params(algorithm.init(jax.random.PRNGKey(0)).params)
  mask = np.asarray(fed.mask)
  _, g = numpy_grad(w, np.asarray(fed.x, np.float64)[mask], np.asarray(fed.y)[mask])
  expected = {n: w[n] - 0.5 * g[n] for n in w}
  check_round(algorithm, expected, 32 * sum(MODEL_SIZES))


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
  "name,change,match",
  [
    ("qsgd", ("quantize_bits", 1), "quantize_bits"),
    ("fedcom", ("quantize_bits", 1), "quantize_bits"),
    ("fedcom", ("server_lr", 0.0), "server_lr"),
    ("qsgd", ("qsgd_norm", "l1"), "qsgd_norm"),
    ("fedcom", ("bucket_size", -1), "bucket_size"),
    ("qsgd", ("epochs", 2), "epochs"),
  ],
)
def test_bad_config_values_raise_before_any_work(name, change, match):
  config = load_config(name, "smoke")
  setattr(config.algorithm, *change)
  with pytest.raises(ValueError, match=match):
    schema.validate_config(config)


@pytest.mark.parametrize("name", ["fedcom", "qsgd"])
def test_configs_validate_in_every_variant(name):
  for variant in (None, "smoke", "paper", "iid", "alpha0.5", "q8", "full", "busiest_node"):
    schema.validate_config(load_config(name, variant))


@pytest.mark.parametrize("name", ["fedcom", "qsgd"])
def test_quantiser_settings_without_quantisation_are_named(name):
  reference = load_config(name, "smoke")
  config = load_config(name, "smoke")
  config.algorithm.quantize_bits = 32
  config.algorithm.bucket_size = 64
  changed = schema.changed_fields(config, reference)
  messages = schema.ignored_settings(schema.validate_config(config), changed)
  assert messages == [
    "config.algorithm.bucket_size = 64 has no effect: algorithm.quantize_bits = 32 (nothing is "
    "quantised)"
  ]
  config.algorithm.quantize_bits = 8  # read now
  changed = schema.changed_fields(config, reference)
  assert schema.ignored_settings(schema.validate_config(config), changed) == []
