"""Local training's gradient with the convolutions' weight gradients from their input patches.

``local.minibatch_value_and_grad`` given a model's ``flax_apply`` forms each convolution's weight
gradient as ``Σ_t A_tᵀ G_t`` (``layerwise.patch_vjp``). It is checked against ``jax.value_and_grad``
of the minibatch loss in float64, to 1e-10 of each leaf's largest entry, on the library's CNN and on
convolutions with strides, padding, dilation and no bias; whole local updates (momentum, weight
decay, FedProx, SAM, padded clients, vmapped over clients) against the same update without it. A
model without convolutions (the MLP) traces the very same program as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from float64_checks import RTOL, Convs, rel
from ntk_fl import models
from ntk_fl._src import layerwise
from ntk_fl.algorithms import local

pytestmark = pytest.mark.usefixtures("x64")


MODELS = {
  "library_cnn": models.cnn((8, 8, 1), num_classes=5),
  "strides_padding_dilation": models.from_flax(Convs(), (7, 7, 2), 3, per_sample=True),
}


def setup(model, n, seed=0):
  """Float64 parameters (non-zero biases), inputs ``[n, *in]`` and labels ``[n]``."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = model.init(k1)
  params = jax.tree.map(
    lambda a: jnp.asarray(a, jnp.float64) + 0.1 * jax.random.normal(k2, a.shape, jnp.float64),
    params,
  )
  x = jax.random.normal(k3, (n, *model.input_shape), jnp.float64)
  y = jax.random.randint(k3, (n,), 0, model.num_classes)
  return params, x, y


def assert_trees_close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel(g, w) < RTOL


@pytest.mark.parametrize("name", sorted(MODELS))
def test_minibatch_gradient_matches_jax_grad(name, monkeypatch):
  model = MODELS[name]
  params, x, y = setup(model, 6)
  weights = jnp.array([1, 1, 0, 1, 0, 1], jnp.float64)  # a short minibatch's empty slots weigh 0
  calls = []
  patch_vjp = layerwise.patch_vjp
  monkeypatch.setattr(
    layerwise, "patch_vjp", lambda *a, **k: calls.append(a[-1]) or patch_vjp(*a, **k)
  )
  loss, grads = jax.jit(local.minibatch_value_and_grad(model.apply, local.patch_apply(model)))(
    params, x, y, weights
  )
  assert calls and all(layer.kind == "conv" for layer in calls[0])  # the patch route was taken

  def objective(p):
    return local.masked_cross_entropy(model.apply(p, x), y, weights)

  loss_ref, grads_ref = jax.value_and_grad(objective)(params)
  assert abs(float(loss) - float(loss_ref)) <= RTOL * abs(float(loss_ref))
  assert_trees_close(grads, grads_ref)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_local_update_matches_plain_gradient(name):
  """Two padded clients, vmapped, momentum + weight decay + FedProx + SAM over 2 epochs."""
  model = MODELS[name]
  params, x, y = setup(model, 14)
  x, y = x.reshape(2, 7, *x.shape[1:]), y.reshape(2, 7)
  mask = jnp.array([[True] * 7, [True] * 5 + [False] * 2])
  options = dict(epochs=2, batch_size=3, momentum=0.9, weight_decay=1e-3, prox_mu=0.1, sam_rho=0.05)
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  anchor = jax.tree.map(lambda a: a * 0.9, params)

  def run(flax_apply):
    update = local.make_local_update(model.apply, flax_apply=flax_apply, **options)
    client = lambda xc, yc, mc, kc: update(params, xc, yc, mc, kc, 0.05, anchor=anchor)
    return jax.jit(jax.vmap(client))(x, y, mask, keys)

  got, want = run(local.patch_apply(model)), run(None)
  assert_trees_close(got.params, want.params)
  assert rel(got.loss, want.loss) < RTOL
  np.testing.assert_array_equal(got.steps, want.steps)


def test_without_convolutions_the_program_is_unchanged():
  """The MLP (and any model without convolutions) keeps ``jax.value_and_grad``: the same jaxpr."""
  model = models.mlp(input_dim=5, hidden=(6,), num_classes=3)
  params = model.init(jax.random.PRNGKey(0))
  x = jnp.ones((4, 7, 5), jnp.float32)
  y = jnp.zeros((4, 7), jnp.int32)
  mask = jnp.ones((4, 7), bool)

  def jaxpr(flax_apply):
    update = local.make_local_update(
      model.apply, epochs=2, batch_size=3, momentum=0.9, flax_apply=flax_apply
    )
    client = lambda xc, yc, mc, kc: update(params, xc, yc, mc, kc, 0.1)
    return str(jax.make_jaxpr(jax.vmap(client))(x, y, mask, jax.random.split(jax.random.key(0), 4)))

  assert local.patch_apply(model) is model.flax_apply
  assert jaxpr(model.flax_apply) == jaxpr(None)


def test_patch_apply_needs_a_per_sample_flax_model():
  assert local.patch_apply(MODELS["library_cnn"]) is MODELS["library_cnn"].flax_apply
  batch_wide = models.from_flax(Convs(), (7, 7, 2), 3, per_sample=False)
  assert local.patch_apply(batch_wide) is None
