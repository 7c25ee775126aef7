"""The smoke slice of every NTK method, with the MLP and with the CNN (either token order)."""

from __future__ import annotations

import pytest

from ntk_fl import config as config_lib
from tests.golden_runs import CONFIG_DIR

METHODS = ("ntk_dfl", "ntk_fl", "cp_ntk_fl", "spark", "fed_ensemble")


def _slice(method: str, variant: str) -> tuple:
  config = config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), variant)
  data = config.data
  return data.num_clients, data.samples_per_client, data.max_test, config.eval.batch_size


@pytest.mark.parametrize("method", METHODS)
def test_cnn_smoke_slice_is_smaller_in_either_order_and_the_mlp_slice_is_unchanged(method):
  cnn = (
    config_lib.SMOKE_CNN_CLIENTS,
    config_lib.SMOKE_CNN_SAMPLES,
    config_lib.SMOKE_CNN_TEST,
    config_lib.SMOKE_CNN_TEST,
  )
  assert _slice(method, "smoke,cnn") == cnn
  assert _slice(method, "cnn,smoke") == cnn
  assert _slice(method, "smoke") == (20, 100, 2_000, 2_000)


def test_cnn_without_smoke_keeps_the_full_data():
  full = _slice("ntk_dfl", "")
  assert _slice("ntk_dfl", "cnn") == full


@pytest.mark.parametrize("method", METHODS)
def test_cnn_smoke_runs_clients_one_at_a_time_with_minibatches_within_a_client(method):
  mlp = config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), "smoke")
  for variant in ("smoke,cnn", "cnn,smoke"):
    config = config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), variant)
    assert config.chunk_size == 1
    if "batch_size" in config.algorithm:
      assert config.algorithm.batch_size == min(
        mlp.algorithm.batch_size, config_lib.SMOKE_CNN_SAMPLES
      )
  assert config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), "cnn").chunk_size == (
    config_lib.load_config(str(CONFIG_DIR / f"{method}.py"), "").chunk_size
  )


def test_a_minibatch_above_the_samples_is_the_same_full_batch_step():
  """What the CNN smoke slice's smaller ``batch_size`` relies on: with ``batch_size >= n`` local training is
  full-batch gradient descent, so ``n`` and ``5 n`` give the same weights (up to float rounding), and both
  match one plain gradient step on the mean loss (float64)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from ntk_fl import models
  from ntk_fl.algorithms import local

  with jax.enable_x64(True):
    model = models.mlp(12, (8,), 3)
    params = jax.tree.map(lambda w: w.astype(jnp.float64), model.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 12)), rng.integers(0, 3, size=10)
    mask = np.ones(10, bool)
    out = {
      b: local.make_local_update(model.apply, epochs=1, batch_size=b)(
        params, x, y, mask, jax.random.key(1), 0.1
      ).params
      for b in (10, 50)
    }
    loss = lambda p: -jnp.mean(jax.nn.log_softmax(model.apply(p, x))[jnp.arange(10), y])
    grads = jax.grad(loss)(params)
    plain = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
    for b in (10, 50):
      for got, want in zip(jax.tree.leaves(out[b]), jax.tree.leaves(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
