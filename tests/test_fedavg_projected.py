"""FedAvg' (NTK-FL Fig. 3): FedAvg on each participant's β share of its samples, projected by the shared P.

The library's first two rounds are checked against a hand computation in float64 numpy: ``P``
regenerated from its documented draw (i.i.d. standard normal from ``Stream.INPUT_PROJECTION``, scaled by
``1/sqrt(d1)``), each participant's share read off the round's documented key and checked to be
``max(1, floor(β n))`` distinct real samples (and redrawn in the second round), then full-batch gradient
descent on ``Z = X P`` through a hand-written MLP forward/backward pass, then FedAvg's data-size average
over the shares' sizes. The evaluated network is checked against the hand network on projected test
inputs.
"""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np
import pytest

from ntk_fl import jacobians, models, rng, runner, schema
from ntk_fl import config as config_lib
from federations import ragged_federation

REPO = pathlib.Path(__file__).resolve().parents[1]
D_IN, HIDDEN, CLASSES = 12, 6, 3
MODEL = models.mlp(input_dim=D_IN, hidden=(HIDDEN,), num_classes=CLASSES)
SIZES = (7, 10, 5, 9, 8)
RTOL, ATOL = 2e-5, 2e-6  # float32 library against the float64 hand computation, a few GD steps


def tiny(seed=0, **algo):
  """FedAvg on a 5-client, 12-feature, 3-class ragged federation, 3 participants a round."""
  config = config_lib.load_config(str(REPO / "configs" / "fedavg.py"))
  config.seed = seed
  config.rounds = 2
  config.data.num_clients = len(SIZES)
  config.chunk_size = 0
  config.algorithm.clients_per_round = 3
  config.algorithm.epochs = 3
  config.algorithm.batch_size = max(SIZES)  # >= every share: full-batch gradient descent
  config.algorithm.lr = 0.3
  for key, value in algo.items():
    config.algorithm[key] = value
  fed = ragged_federation(np.random.default_rng(seed), SIZES, dim=D_IN, num_classes=CLASSES)
  return config, fed


def _hand_projection(seed, proj_dim):
  key = rng.jax_key(seed, rng.Stream.INPUT_PROJECTION)
  return np.asarray(jax.random.normal(key, (D_IN, proj_dim)), np.float64) / math.sqrt(D_IN)


def _hand_shares(seed, round_, clients, fed, beta):
  """Each participant's kept sample indices: ``split(split(split(round key)[0])[0], K)[i]``."""
  train_key, _ = jax.random.split(rng.jax_key(seed, rng.Stream.ROUND_KEYS, round_))
  sub_key, _ = jax.random.split(train_key)
  keys = jax.random.split(sub_key, len(clients))
  shares = []
  for key, c in zip(keys, clients):
    n = int(fed.mask[c].sum())
    if beta == 1:
      shares.append(np.arange(n))
      continue
    idx, keep = jacobians.subsample(key, np.asarray(fed.mask[c]), beta)
    kept = np.asarray(idx)[np.asarray(keep)]
    # An independent check of the share: max(1, floor(β n)) distinct real samples.
    assert len(kept) == max(1, math.floor(beta * n)) and len(set(kept.tolist())) == len(kept)
    assert kept.max() < n
    shares.append(kept)
  return shares


def _forward(w, z):
  h = np.maximum(z @ w["w1"] + w["b1"], 0)
  return h, h @ w["w2"] + w["b2"]


def _hand_gd(w, z, y, lr, epochs):
  """``epochs`` steps of full-batch GD on the mean cross-entropy of the MLP (float64, by hand)."""
  w = {k: v.copy() for k, v in w.items()}
  onehot = np.eye(CLASSES)[y]
  for _ in range(epochs):
    h, logits = _forward(w, z)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    d_logits = (p - onehot) / len(y)
    d_h = (d_logits @ w["w2"].T) * (h > 0)
    grads = {
      "w2": h.T @ d_logits,
      "b2": d_logits.sum(0),
      "w1": z.T @ d_h,
      "b1": d_h.sum(0),
    }
    w = {k: w[k] - lr * grads[k] for k in w}
  return w


def _as_hand(params):
  p = params["params"]
  return {
    "w1": np.asarray(p["dense_0"]["kernel"], np.float64),
    "b1": np.asarray(p["dense_0"]["bias"], np.float64),
    "w2": np.asarray(p["dense_1"]["kernel"], np.float64),
    "b2": np.asarray(p["dense_1"]["bias"], np.float64),
  }


def _hand_round(w, p, seed, round_, clients, fed, beta):
  """One FedAvg' round by hand: GD on every participant's projected share, averaged by share size."""
  trained, sizes = [], []
  shares = _hand_shares(seed, round_, clients, fed, beta)
  for c, kept in zip(clients, shares):
    z = np.asarray(fed.x[c], np.float64)[kept] @ p
    trained.append(_hand_gd(w, z, np.asarray(fed.y[c])[kept], 0.3, 3))
    sizes.append(len(kept))
  weights = np.asarray(sizes, np.float64) / sum(sizes)
  return {k: sum(q * t[k] for q, t in zip(weights, trained)) for k in w}, dict(zip(clients, shares))


@pytest.mark.parametrize("beta,proj_dim", [(0.5, 4), (0.4, 0), (1.0, 4)])
def test_two_rounds_equal_hand_fedavg_on_the_projected_shares(beta, proj_dim):
  seed = 3
  config, fed = tiny(seed, subsample_fraction=beta, projection_dim=proj_dim)
  schema.validate_config(config)
  algorithm = runner.make_algorithm(config, MODEL, fed)
  state = algorithm.init(jax.random.key(0))
  p = _hand_projection(seed, proj_dim) if proj_dim else np.eye(D_IN)
  want = _as_hand(state.params)
  assert want["w1"].shape == (proj_dim or D_IN, HIDDEN)  # the global model is the d1'-input MLP
  shares = []
  for r in range(2):
    inputs = algorithm.round_inputs(r)
    state, metrics = algorithm.step(state, inputs)
    want, round_shares = _hand_round(want, p, seed, r, inputs.clients.tolist(), fed, beta)
    shares.append(round_shares)
    got = _as_hand(state.params)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=f"round {r}: {k}")
    # The upload is the d1'-input model.
    assert float(metrics["bits_per_client"]) == sum(v.size for v in want.values()) * 32
  if beta < 1:  # the shares are redrawn: a client in both rounds keeps another subset
    both = set(shares[0]) & set(shares[1])
    assert both and any(set(shares[0][c]) != set(shares[1][c]) for c in both)

  # Evaluation: the scored raw-input network is the hand network on test inputs projected by P.
  x_test = np.random.default_rng(9).normal(size=(16, D_IN))
  scored = jax.tree.map(lambda w: w[0], algorithm.client_params(state))
  logits = np.asarray(MODEL.apply(scored, x_test.astype(np.float32)), np.float64)
  np.testing.assert_allclose(logits, _forward(want, x_test @ p)[1], rtol=1e-4, atol=1e-5)


def test_runs_are_reproducible_from_the_seed():
  config, fed = tiny(subsample_fraction=0.5, projection_dim=4)
  runs = []
  for _ in range(2):
    algorithm = runner.make_algorithm(config, MODEL, fed)
    state = algorithm.init(jax.random.key(0))
    for r in range(2):
      state, _ = algorithm.step(state, algorithm.round_inputs(r))
    runs.append(state.params)
  jax.tree.map(np.testing.assert_array_equal, *runs)


def test_fig3_variant_is_cp_ntk_fl_fig3_inputs():
  fedavg = config_lib.load_config(str(REPO / "configs" / "fedavg.py"), "fig3")
  cp = config_lib.load_config(str(REPO / "configs" / "cp_ntk_fl.py"), "fig3")
  for key in ("subsample_fraction", "projection_dim", "projection_scale"):
    assert fedavg.algorithm[key] == cp.algorithm[key], key
  assert (fedavg.algorithm.subsample_fraction, fedavg.algorithm.projection_dim) == (0.4, 100)
  plain = config_lib.load_config(str(REPO / "configs" / "fedavg.py"))
  assert (plain.algorithm.subsample_fraction, plain.algorithm.projection_dim) == (1.0, 0)


@pytest.mark.parametrize(
  "field,value,message",
  [
    (
      "subsample_fraction",
      0.0,
      r"subsample_fraction \(β; 1 = all samples\) must be a finite number in \(0, 1\]",
    ),
    (
      "subsample_fraction",
      1.5,
      r"subsample_fraction \(β; 1 = all samples\) must be a finite number in \(0, 1\]",
    ),
    (
      "subsample_fraction",
      -0.2,
      r"subsample_fraction \(β; 1 = all samples\) must be a finite number in \(0, 1\]",
    ),
    ("projection_dim", -1, r"projection_dim \(d1'; 0 = no projection\) must be"),
    ("projection_scale", "unit", "projection_scale"),
  ],
)
def test_bad_input_options_give_one_clear_error(field, value, message):
  config, _ = tiny()
  config.algorithm[field] = value
  with pytest.raises(ValueError, match=message):
    schema.validate_config(config)


def test_projection_needs_the_mlp():
  config, _ = tiny(projection_dim=4)
  config.model.name = "cnn"
  with pytest.raises(ValueError, match="needs model.name='mlp'"):
    schema.validate_config(config)
