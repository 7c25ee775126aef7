"""experiments/euler_vs_ode.py: its neighbourhoods and its solver comparison on a small problem."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ntk_fl import models
from scripts import load_experiment


@pytest.fixture(scope="module")
def script():
  return load_experiment("euler_vs_ode")


def test_neighbourhoods_sizes_and_class_shares(script):
  labels = np.repeat(np.arange(10), 100)
  sets = script.neighbourhoods(labels, 120, seed=3)
  assert sets["IID"].size == 120 and np.unique(sets["IID"]).size == 120
  counts = np.bincount(labels[sets["skewed"]], minlength=10)
  assert counts.tolist() == [70, 0, 0, 40, 0, 0, 0, 10, 0, 0]  # 7 : 4 : 1 of 120


def test_solvers_agree_when_the_step_is_small(script):
  """η λ_max / N ≪ 1: Euler is a converged discretisation of the flow, so both give the same Δw and τ."""
  model = models.mlp(12, (8,), 3)
  params = model.init(jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (30, 12))
  y = jax.nn.one_hot(jax.random.randint(jax.random.PRNGKey(2), (30,), 0, 3), 3)
  result = script.compare(model, params, x, y, lr=1e-4)
  assert result["eta_lambda_over_n"][0] < 1e-3
  assert result["relative_dw_difference"] < 1e-3
  assert result["euler"]["tau"] == result["ode"]["tau"]
  np.testing.assert_allclose(result["euler"]["losses"], result["ode"]["losses"], rtol=1e-5)
