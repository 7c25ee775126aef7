"""NTK-FL's τ chosen on a validation set held out from the clients (§3 after eq. 11).

Reference: every candidate ``Δw_τ`` from its own single-τ step on the pooled training data (the evolution up to
τ gives the same ``S_τ``), each candidate network scored by a numpy cross-entropy over the held-out clients'
real samples, the argmin kept.
"""

from __future__ import annotations

import numpy as np
import pytest

from ntk_fl import evolve, rng, schema
from ntk_fl.config import load_config
from test_server_ntk import MODEL, TAUS, assert_trees_close, one_round, pooled, tiny

SIZES = (7, 5, 6, 7, 4, 6, 5)


def numpy_ce(logits, labels):
  z = np.asarray(logits, np.float64)
  z = z - z.max(axis=1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
  return -np.mean(logp[np.arange(len(labels)), labels])


def test_tau_is_the_candidate_best_on_the_held_out_clients():
  config, fed = tiny(sizes=SIZES, select="validation", validation_clients=2)
  held = np.sort(
    rng.numpy_rng(config.seed, rng.Stream.VALIDATION_CLIENTS).choice(len(SIZES), 2, replace=False)
  )
  vx = np.concatenate([fed.x[c, : int(fed.n[c])] for c in held])
  vy = np.concatenate([fed.y[c, : int(fed.n[c])] for c in held])
  chosen = set()  # the choices made (for a failing test's locals)
  for round_index in range(3):
    _, state, inputs, new_state, metrics = one_round(config, fed, round_index)
    assert not set(np.asarray(inputs.clients).tolist()) & set(
      held.tolist()
    )  # held-out clients never train
    x, t, m = pooled(fed, inputs.clients)
    candidates = [
      evolve.ntk_update(
        MODEL.apply, state.params, x, t, m, lr=0.5, taus=(tau,), dense_stack=MODEL.dense_stack
      )[0]
      for tau in TAUS
    ]
    scores = [numpy_ce(MODEL.apply(c, vx), vy) for c in candidates]
    best = int(np.argmin(scores))
    assert int(metrics["tau"]) == TAUS[best]
    np.testing.assert_allclose(float(metrics["loss"]), scores[best], rtol=1e-4)
    assert_trees_close(new_state.params, candidates[best])
    chosen.add(best)


def test_validation_selection_differs_from_training_loss_selection():
  taus = []
  for algo in (dict(select="validation", validation_clients=2), dict()):
    config, fed = tiny(sizes=SIZES, **algo)
    config.algorithm.taus = (1, 50, 400)
    config.algorithm.lr = 2.0
    _, _, _, _, metrics = one_round(config, fed)
    taus.append(int(metrics["tau"]))
  assert taus[0] != taus[1]


def test_validation_config_checks():
  config = load_config("cp_ntk_fl", "validation")
  assert (config.algorithm.select, config.algorithm.validation_clients) == ("validation", 10)
  schema.validate_config(config)
  config.algorithm.validation_clients = 0
  with pytest.raises(ValueError, match="validation_clients >= 1"):
    schema.validate_config(config)
  config = load_config("ntk_fl")
  config.algorithm.validation_clients = 3
  with pytest.raises(ValueError, match="needs select='validation'"):
    schema.validate_config(config)
  config = load_config("ntk_fl", "validation")
  config.algorithm.clients_per_round = 295
  with pytest.raises(ValueError, match="clients_per_round"):
    schema.validate_config(config)
