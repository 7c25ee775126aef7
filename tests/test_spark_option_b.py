"""SPARK's Option B of Alg. 1 (``linearise_at='sender'``): each sender's Jacobian and logits at its own w̄_j.

The reference is independent of the library's NTK step: per-sample Jacobians by ``jax.jacrev`` at each
member's own consensus weights, the traced kernel ``(1/C) J Jᵀ`` and the cross-entropy Euler evolution
``f ← f − (η/N) K (softmax f − Y)`` in float64 numpy, ``Δw_τ = −(η/N) Jᵀ S_τ``, τ* by the network's
hard-label cross-entropy at ``w̄_i + Δw_τ``; no momentum and hard targets (distillation off), so the update
is ``w ← w̄_i + Δw_τ*``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import runner, schema
from test_spark import tiny_setup


def reference_option_b(model, federation, params, inputs, lr, taus):
  num_clients = federation.n.shape[0]
  clients = [
    jax.tree.map(lambda leaf: np.asarray(leaf[i], np.float64), params) for i in range(num_clients)
  ]
  wbars = []
  for i in range(num_clients):
    nbrs = [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    weights = [float(inputs.self_weight[i])] + [
      float(w) for w, m in zip(inputs.neighbor_weights[i], inputs.neighbor_mask[i]) if m
    ]
    wbars.append(
      jax.tree.map(
        lambda *ls: sum(w * l for w, l in zip(weights, ls)),
        *([clients[i]] + [clients[j] for j in nbrs]),
      )
    )
  new, chosen = [], []
  for i in range(num_clients):
    members = [i] + [int(j) for j, m in zip(inputs.neighbors[i], inputs.neighbor_mask[i]) if m]
    rows, logits, labels = [], [], []
    for j in members:
      w32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), wbars[j])
      flat, unravel = ravel_pytree(w32)
      xj = np.asarray(federation.x[j][federation.mask[j]])
      jac = jax.jacrev(lambda v: model.apply(unravel(v), jnp.asarray(xj)))(flat)  # [n, C, d]
      rows.append(np.asarray(jac, np.float64))
      logits.append(np.asarray(model.apply(w32, jnp.asarray(xj)), np.float64))
      labels.append(np.asarray(federation.y[j][federation.mask[j]]))
    jac, f, y = np.concatenate(rows), np.concatenate(logits), np.concatenate(labels)
    n, c = f.shape
    target = np.eye(c)[y]
    kernel = np.einsum("icp,jcp->ij", jac, jac) / c
    step = lr / n
    s_run, sums = np.zeros_like(f), {}
    for t in range(1, max(taus) + 1):
      p = np.exp(f - f.max(axis=1, keepdims=True))
      r = p / p.sum(axis=1, keepdims=True) - target
      s_run = s_run + r
      f = f - step * kernel @ r
      if t in taus:
        sums[t] = s_run.copy()
    flat_bar, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), wbars[i]))
    x_all = jnp.asarray(
      np.concatenate([np.asarray(federation.x[j][federation.mask[j]]) for j in members])
    )
    best = None
    for t in taus:
      delta = -step * np.einsum("ic,icp->p", sums[t], jac)
      candidate = unravel(jnp.asarray(np.asarray(flat_bar, np.float64) + delta, jnp.float32))
      out = np.asarray(model.apply(candidate, x_all), np.float64)
      logp = out - out.max(axis=1, keepdims=True)
      logp = logp - np.log(np.exp(logp).sum(axis=1, keepdims=True))
      loss = -np.mean(logp[np.arange(n), y])
      if best is None or loss < best[0]:
        best = (loss, t, candidate)
    new.append(best[2])
    chosen.append(best[1])
  return jax.tree.map(lambda *ls: np.stack([np.asarray(l) for l in ls]), *new), np.array(chosen)


def test_option_b_round_equals_an_independent_reference():
  config, model, federation = tiny_setup(
    momentum=0.0, distill__enabled=False, linearise_at="sender"
  )
  config.model.init = "per_client"  # distinct consensus weights: the two options differ
  config.algorithm.share_cliques = False
  algorithm = runner.make_algorithm(config, model, federation)
  state = algorithm.init(jax.random.key(0))
  for round_index in range(2):
    inputs = algorithm.round_inputs(round_index)
    expected, taus = reference_option_b(model, federation, state.params, inputs, 0.05, (5, 10, 20))
    state, metrics = algorithm.step(state, inputs)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(metrics["tau"]), taus)


def test_option_b_differs_from_option_a_and_broadcasts_one_package():
  results = {}
  for at in ("receiver", "sender"):
    config, model, federation = tiny_setup(momentum=0.0, distill__enabled=False, linearise_at=at)
    config.model.init = "per_client"
    algorithm = runner.make_algorithm(config, model, federation)
    inputs = algorithm.round_inputs(0)
    state, metrics = algorithm.step(algorithm.init(jax.random.key(0)), inputs)
    results[at] = (
      np.concatenate([np.asarray(l).ravel() for l in jax.tree.leaves(state.params)]),
      np.asarray(metrics["bits_sent"]),
      np.asarray(inputs.neighbor_mask).sum(axis=1),
    )
  assert np.max(np.abs(results["receiver"][0] - results["sender"][0])) > 1e-4
  d = 5 * 6 + 6 + 6 * 3 + 3
  kappa = results["sender"][2]
  package = (results["receiver"][1] - kappa * 2 * d * 32) / kappa  # Option A: κ·(2·d·32 + package)
  np.testing.assert_allclose(results["sender"][1], kappa * d * 32 + package, rtol=1e-6)


def test_option_b_config_checks():
  config, _, _ = tiny_setup(linearise_at="sender", jacobian="implicit")
  with pytest.raises(ValueError, match="linearise_at='sender'"):
    schema.validate_config(config)
  config, _, _ = tiny_setup(linearise_at="middle")
  with pytest.raises(ValueError, match="linearise_at"):
    schema.validate_config(config)
  from ntk_fl.config import load_config

  assert load_config("spark", "option_b").algorithm.linearise_at == "sender"
