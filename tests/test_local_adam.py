"""The Adam client optimiser of the local-training methods, against Adam written out by hand.

Adam (Kingma & Ba, 2015, Alg. 1) with PyTorch's L2 ``weight_decay`` (added to the gradient), in float64
numpy: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g²``, ``w -= lr (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import runner, schema
from ntk_fl.algorithms import local
from ntk_fl.config import load_config
from test_local import MODEL, ce, make_clients


def hand_adam(params, x, y, lr, steps, *, b1, b2, eps, weight_decay):
  """Full-batch Adam on ``x, y`` for ``steps`` steps (gradients by ``jax.grad`` of the plain mean CE)."""
  flat, unravel = ravel_pytree(params)
  w = np.asarray(flat, np.float64)
  m, v = np.zeros_like(w), np.zeros_like(w)
  for t in range(1, steps + 1):
    g, _ = ravel_pytree(
      jax.grad(ce)(unravel(jnp.asarray(w, jnp.float32)), jnp.asarray(x), jnp.asarray(y))
    )
    g = np.asarray(g, np.float64) + weight_decay * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  return unravel(jnp.asarray(w, jnp.float32))


@pytest.mark.parametrize("steps, weight_decay", [(1, 0.0), (3, 0.01)])
def test_adam_steps_equal_the_hand_written_update(steps, weight_decay):
  x, y, mask = make_clients((6,), 8, seed=3)  # 6 real samples, 2 padding slots
  params = MODEL.init(jax.random.key(1))
  hyper = dict(b1=0.8, b2=0.99, eps=1e-6)
  update = local.make_local_update(
    MODEL.apply,
    epochs=steps,
    batch_size=8,
    optimizer="adam",
    adam_b1=hyper["b1"],
    adam_b2=hyper["b2"],
    adam_eps=hyper["eps"],
    weight_decay=weight_decay,
  )
  got = update(params, x[0], y[0], mask[0], jax.random.key(0), 0.01).params
  want = hand_adam(params, x[0][:6], y[0][:6], 0.01, steps, weight_decay=weight_decay, **hyper)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  # The first Adam step moves every weight with a nonzero gradient by about lr: not an SGD step.
  sgd = local.make_local_update(MODEL.apply, epochs=steps, batch_size=8)(
    params, x[0], y[0], mask[0], jax.random.key(0), 0.01
  ).params
  assert (
    max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(sgd)))
    > 1e-3
  )


def test_adam_is_an_option_of_every_local_training_method():
  for name in (
    "fedavg",
    "fedprox",
    "fednova",
    "dfedavg",
    "dpsgd",
    "dfedsam",
    "dispfl",
    "fed_ensemble",
  ):
    config = load_config(name, "smoke,adam")
    assert config.algorithm.optimizer == "adam" and config.algorithm.momentum == 0.0
    assert schema.validate_config(config).algorithm.optimizer == "adam"


def test_adam_config_errors_name_the_field():
  config = load_config("fedavg", "smoke")
  config.algorithm.optimizer = "rmsprop"
  with pytest.raises(ValueError, match="optimizer"):
    schema.validate_config(config)
  config = load_config("dfedavgm", "smoke")
  config.algorithm.optimizer = "adam"
  with pytest.raises(ValueError, match="momentum=0"):
    schema.validate_config(config)
  config = load_config("fedavg", "smoke,adam")
  config.algorithm.adam_b2 = 1.0
  with pytest.raises(ValueError, match="adam_b2"):
    schema.validate_config(config)


def test_fedavg_with_adam_clients_runs_a_round():
  config = load_config("fedavg", "smoke,adam")
  config.data.num_clients, config.data.max_train, config.data.samples_per_client = 6, 600, 20
  config.algorithm.clients_per_round = 3
  experiment = runner.build_experiment(config)
  algorithm = experiment.algorithm
  state, metrics = algorithm.step(algorithm.init(jax.random.key(0)), algorithm.round_inputs(0))
  assert np.isfinite(float(np.mean(np.asarray(metrics["loss"]))))
