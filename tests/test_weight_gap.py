"""experiments/weight_gap.py (NTK-FL Fig. 9): its three weight trajectories against independent
computations, and the script end to end on a small round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import models
from scripts import load_experiment

REPO = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def script():
  return load_experiment("weight_gap")


def _problem(n=24, d=6, hidden=(7,), classes=3):
  model = models.mlp(d, hidden, classes)
  params = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (n, d))
  y = jax.nn.one_hot(jax.random.randint(jax.random.key(2), (n,), 0, classes), classes)
  return model, params, x, y


def _flat(trajectory):
  return np.asarray(jax.vmap(lambda p: ravel_pytree(p)[0])(trajectory), np.float64)


def test_gd_is_plain_gradient_descent(script):
  model, params, x, y = _problem()
  w, unravel = ravel_pytree(params)
  loss = lambda v: -jnp.mean(jnp.sum(y * jax.nn.log_softmax(model.apply(unravel(v), x)), -1))
  expected = []
  for t in range(1, 7):
    w = w - 0.3 * jax.grad(loss)(w)
    if t in (2, 6):
      expected.append(w)
  got = _flat(script.gd_trajectory(model.apply, params, x, y, 0.3, (2, 6)))
  np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_linearised_is_gradient_descent_on_the_explicit_jacobian(script):
  # Brute force: the Jacobian J [N·C, P] materialised at w0, GD on f0 + J (w - w0) in float64.
  model, params, x, y = _problem()
  w0, unravel = ravel_pytree(params)
  f0 = np.asarray(model.apply(params, x), np.float64)
  jac = np.asarray(jax.jacrev(lambda v: model.apply(unravel(v), x))(w0), np.float64)  # [N, C, P]
  w, ys, n, lr = np.asarray(w0, np.float64), np.asarray(y, np.float64), x.shape[0], 0.5
  expected = []
  for t in range(1, 9):
    logits = f0 + np.einsum("ncp,p->nc", jac, w - np.asarray(w0, np.float64))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = w - lr / n * np.einsum("ncp,nc->p", jac, p - ys)
    if t in (3, 8):
      expected.append(w)
  got = _flat(script.linearised_trajectory(model.apply, params, x, y, lr, (3, 8)))
  np.testing.assert_allclose(got, np.asarray(expected), rtol=2e-5, atol=2e-6)


def test_all_three_agree_on_a_linear_model_and_part_on_a_network(script):
  # A linear model is its own linearisation and its full kernel is (x xᵀ) ⊗ I: the traced kernel is
  # exact, so the three trajectories coincide. An MLP's differ once t > 1.
  taus = (1, 5, 20)
  n, d, c = 24, 6, 3
  x = jax.random.normal(jax.random.key(1), (n, d))
  y = jax.nn.one_hot(jax.random.randint(jax.random.key(2), (n,), 0, c), c)
  params = {"w": 0.3 * jax.random.normal(jax.random.key(3), (d, c)), "b": jnp.zeros(c)}
  apply_fn = lambda p, v: v @ p["w"] + p["b"]
  runs = {
    "gd": script.gd_trajectory(apply_fn, params, x, y, 0.5, taus),
    "linearised": script.linearised_trajectory(apply_fn, params, x, y, 0.5, taus),
    "ntk_fl": script.ntk_fl_trajectory(apply_fn, params, x, y, 0.5, taus),
  }
  rows = script.gap_rows(apply_fn, params, x, y, taus, runs)
  for row in rows:
    assert row["gd_moved_l1"] > 0
    assert row["linearised_gap_relative"] < 1e-5 and row["ntk_fl_gap_relative"] < 1e-5, row
  model, params, x, y = _problem()
  runs = {
    name: getattr(script, f"{name}_trajectory")(model.apply, params, x, y, 0.5, taus)
    for name in ("gd", "linearised", "ntk_fl")
  }
  rows = script.gap_rows(model.apply, params, x, y, taus, runs)
  assert rows[0]["linearised_gap_relative"] < 1e-5 and rows[0]["ntk_fl_gap_relative"] < 1e-5
  assert rows[-1]["linearised_gap_relative"] > 1e-3 and rows[-1]["ntk_fl_gap_relative"] > 1e-3
  np.testing.assert_allclose(  # the losses in the rows are the network's, at each weight
    rows[-1]["gd_loss"],
    float(
      -jnp.mean(
        jnp.sum(
          y * jax.nn.log_softmax(model.apply(jax.tree.map(lambda a: a[-1], runs["gd"]), x)), -1
        )
      )
    ),
    rtol=1e-5,
  )


def test_the_script_writes_its_table_for_a_small_round(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "experiments", "weight_gap.py"),
      f"--out={tmp_path}",
      "--max_samples=64",
      "--t_max=20",
      "--every=10",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert sorted(os.listdir(tmp_path)) == ["weight_gap.json", "weight_gap.md", "weight_gap.png"]
  result = json.loads((tmp_path / "weight_gap.json").read_text())
  assert result["settings"]["samples"] == 64 and len(result["settings"]["clients"]) == 20
  assert [r["t"] for r in result["rows"]] == [10, 20]
  table = (tmp_path / "weight_gap.md").read_text()
  for r in result["rows"]:
    assert f"| {r['t']} | {r['linearised_gap_l1']:.4g} |" in table


@pytest.mark.parametrize(
  "args, message",
  [
    (["--t_max=0"], "--t_max must be a positive integer, got 0"),
    (["--t_max=150", "--every=100"], "--t_max (150) must be a multiple of --every (100)"),
    (["--config=dfedavg"], "the gap is measured for NTK-FL's cross-entropy evolution"),
  ],
)
def test_bad_arguments_stop_with_one_error_line(tmp_path, args, message):
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, "experiments", "weight_gap.py"),
      f"--out={tmp_path}",
      *args,
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=300,
  )
  assert proc.returncode != 0 and message in proc.stderr
  assert not os.listdir(tmp_path)
