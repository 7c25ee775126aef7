"""Jacobian random projections: unbiasedness, kernel convergence, back-projection, seeds, paper sizes."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import models, projection


def tiny_model():
  model = models.mlp(input_dim=12, hidden=(7,), num_classes=3)
  params = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (5, 12))
  return model, params, x


def full_jacobian(model, params, x):
  """``[N·C, d]`` Jacobian of the flattened parameters (jax.tree.leaves order, as ravel_pytree)."""
  flat, unravel = ravel_pytree(params)
  jac = jax.jacrev(lambda w: model.apply(unravel(w), x))(flat)  # [N, C, d]
  return jac.reshape(-1, flat.size)


def test_expected_outer_product_is_identity_monte_carlo():
  """E[P Pᵀ] = I: entries of P Pᵀ have variance 1/k (off-diagonal) and 2/k (diagonal)."""
  d_in, k, draws = 6, 4, 300
  plan = (projection.LeafSketch("w", (d_in, 2), "axis", 0, d_in, k),)
  total = np.zeros((d_in, d_in))
  for seed in range(draws):
    (p,) = projection.sample_matrices(plan, seed)
    total += np.asarray(p @ p.T, np.float64)
  mean = total / draws
  sigma = np.sqrt(2.0 / (k * draws))  # the larger (diagonal) standard error
  np.testing.assert_allclose(mean, np.eye(d_in), atol=5 * sigma)


def test_sketched_kernel_approaches_the_full_kernel():
  """J P Pᵀ Jᵀ -> J Jᵀ as k grows (relative error ~ 1/sqrt(k), Johnson-Lindenstrauss)."""
  d = 3000
  jac = (
    jax.random.normal(jax.random.key(0), (6, d)) + 0.5
  )  # correlated rows: a non-trivial Gram matrix
  exact = np.asarray(jac @ jac.T)
  errors = []
  for k in (20, 200, 2000):
    plan = (projection.LeafSketch("w", (d,), "flat", -1, d, k),)
    (p,) = projection.sample_matrices(plan, seed=3)
    sketched = np.asarray((jac @ p) @ (jac @ p).T)
    errors.append(np.linalg.norm(sketched - exact) / np.linalg.norm(exact))
  assert errors[2] < errors[0] / 3, errors
  assert errors[2] < 0.1, errors


@pytest.mark.parametrize("scheme, k_proj", [("layerwise", 5), ("flattened", 30)])
def test_lifted_network_jacobian_is_the_projected_jacobian(scheme, k_proj):
  model, params, x = tiny_model()
  plan = projection.make_plan(params, scheme, k_proj)
  mats = projection.sample_matrices(plan, seed=0)
  p = np.asarray(projection.dense_matrix(plan, mats))
  d_full, d_proj = projection.sketch_dims(plan)
  assert p.shape == (d_full, d_proj)
  g, u0 = projection.lift(model.apply, params, plan, mats)
  flat_u, unravel_u = ravel_pytree(u0)
  jac_g = jax.jacrev(lambda u: g(unravel_u(u), x))(flat_u).reshape(-1, d_proj)
  np.testing.assert_allclose(jac_g, full_jacobian(model, params, x) @ p, rtol=1e-4, atol=1e-5)
  # Leaf-wise J P agrees with the dense block-diagonal P too.
  per_leaf = jax.vmap(jax.jacrev(lambda w, xi: model.apply(w, xi[None])[0]), in_axes=(None, 0))(
    params, x
  )
  tilde = projection.project_jacobian(plan, mats, jax.tree.leaves(per_leaf))
  stacked = np.concatenate([np.asarray(t).reshape(x.shape[0] * 3, -1) for t in tilde], axis=1)
  np.testing.assert_allclose(stacked, jac_g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
  "scheme, k_proj, skip",
  [("none", 1, True), ("layerwise", 5, False), ("flattened", 30, False), ("flattened", 50, True)],
)
def test_sketched_dense_jacobian_from_factors_is_the_lifted_jacobian(scheme, k_proj, skip):
  """J̃ from the factors (A_l, M_l) == jacrev of g(u) = f(w̄ + P u), on a 12-8-6-3 MLP (two hidden layers).

  The cases cover every leaf kind: identity, axis-sketched and flattened kernels and biases ('flattened', 50
  sketches only dense_0's kernel, as the paper's k_proj = 10,000 does on the 784-100-10 MLP); a block of 2
  samples splits the 5 into uneven blocks.
  """
  model = models.mlp(input_dim=12, hidden=(8, 6), num_classes=3)
  params = model.init(jax.random.key(4))
  x = jax.random.normal(jax.random.key(5), (5, 12))
  plan = projection.make_plan(params, scheme, k_proj, skip_uncompressed=skip)
  mats = projection.sample_matrices(plan, seed=3)
  g, u0 = projection.lift(model.apply, params, plan, mats)
  reference = jax.vmap(jax.jacrev(lambda u, xi: g(u, xi[None])[0]), in_axes=(None, 0))(u0, x)
  got = projection.sketched_dense_jacobian(plan, mats, model.dense_stack, params, x, sample_block=2)
  assert len(got) == len(plan)
  for sketch, a, b in zip(plan, got, jax.tree.leaves(reference)):
    assert a.shape == (5, 3) + sketch.projected_shape, sketch
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=sketch.name)
  if scheme == "flattened":
    assert {s.kind for s in plan} == ({"flat"} if not skip else {"flat", "identity"})


def test_sketched_dense_jacobian_rejects_a_plan_of_other_params():
  model, params, x = tiny_model()
  other = models.mlp(input_dim=12, hidden=(5,), num_classes=3).init(jax.random.key(0))
  plan = projection.make_plan(other, "flattened", 10)
  with pytest.raises(ValueError, match="plan is for tensors of shapes"):
    projection.sketched_dense_jacobian(
      plan, projection.sample_matrices(plan, 0), model.dense_stack, params, x
    )


def test_back_projection_is_the_dense_matrix_product():
  _, params, _ = tiny_model()
  plan = projection.make_plan(params, "layerwise", 4)
  mats = projection.sample_matrices(plan, seed=1)
  rng = np.random.default_rng(0)
  tilde = tuple(jnp.asarray(rng.normal(size=(2,) + s.projected_shape), jnp.float32) for s in plan)
  full = projection.back_project(plan, mats, tilde, lead=1)
  p = np.asarray(projection.dense_matrix(plan, mats))
  for t in range(2):
    expected = p @ np.concatenate([np.asarray(v[t]).ravel() for v in tilde])
    np.testing.assert_allclose(
      np.concatenate([np.asarray(f[t]).ravel() for f in full]), expected, rtol=1e-5, atol=1e-5
    )


class BackProjectionTest(chex.TestCase):
  """Back-projection as a pytree function, called directly and under jit (chex.variants)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_back_projection_tree_matches_the_dense_matrix_product(self):
    _, params, _ = tiny_model()
    plan = projection.make_plan(params, "flattened", 6)
    mats = projection.sample_matrices(plan, seed=2)
    rng = np.random.default_rng(1)
    tilde = tuple(jnp.asarray(rng.normal(size=(3,) + s.projected_shape), jnp.float32) for s in plan)
    full = self.variant(functools.partial(projection.back_project, plan, lead=1))(mats, tilde)
    p = np.asarray(projection.dense_matrix(plan, mats), np.float64)
    flat = (
      p
      @ np.stack(
        [np.concatenate([np.asarray(v[t], np.float64).ravel() for v in tilde]) for t in range(3)]
      ).T
    )
    # The same numbers as a tree of the parameters' shapes (one leading axis of 3).
    sizes = np.cumsum([0] + [int(np.prod(f.shape[1:])) for f in full])
    want = tuple(flat[a:b].T.reshape(f.shape) for a, b, f in zip(sizes[:-1], sizes[1:], full))
    chex.assert_trees_all_close(tuple(full), want, rtol=1e-5, atol=1e-5)
    chex.assert_tree_shape_prefix(tuple(full), (3,))


def test_layerwise_projects_the_input_axis_and_skips_uncompressed_tensors():
  _, params, _ = tiny_model()
  plan = {s.name: s for s in projection.make_plan(params, "layerwise", 5)}
  kernel0 = plan["params/dense_0/kernel"]
  assert (kernel0.kind, kernel0.axis, kernel0.projected_shape) == (
    "axis",
    0,
    (5, 7),
  )  # [in, out] -> [k, out]
  assert plan["params/dense_1/kernel"].projected_shape == (5, 3)
  assert plan["params/dense_1/bias"].kind == "identity"  # 3 <= cap 5
  literal = {
    s.name: s for s in projection.make_plan(params, "layerwise", 5, skip_uncompressed=False)
  }
  assert literal["params/dense_1/bias"].kind == "axis" and literal["params/dense_1/bias"].k == 3


def test_dense_stack_projections_route_each_matrix_to_its_layer():
  """The plan's matrices become per-layer (kernel, bias) sketches; identity leaves become None."""
  model, params, _ = tiny_model()  # 12-7-3
  plan = projection.make_plan(params, "layerwise", 5)  # dense_0 kernel and bias, dense_1 kernel
  mats = projection.sample_matrices(plan, seed=2)
  by_name = {s.name: m for s, m in zip(plan, mats)}
  layers = projection.dense_stack_projections(plan, mats, model.dense_stack)
  assert len(layers) == 2
  assert layers[0].kernel is by_name["params/dense_0/kernel"] and layers[0].kernel.shape == (12, 5)
  assert layers[0].bias is by_name["params/dense_0/bias"] and layers[0].bias.shape == (7, 5)
  assert (
    layers[1].kernel is by_name["params/dense_1/kernel"] and layers[1].bias is None
  )  # 3 <= cap 5
  unsketched = projection.dense_stack_projections(
    projection.make_plan(params, "none", 1), (None,) * 4, model.dense_stack
  )
  assert all(p.kernel is None and p.bias is None for p in unsketched)


def test_paper_mlp_sketch_sizes():
  """spark.md §4: layer-wise caps 500/750/1000 and flattened 10,000 on the 784-100-10 MLP."""
  model = models.mlp(input_dim=784, hidden=(100,), num_classes=10)
  template = jax.eval_shape(model.init, jax.random.key(0))
  dims = lambda scheme, k: projection.sketch_dims(projection.make_plan(template, scheme, k))
  assert dims("layerwise", 500) == (79_510, 51_110)
  assert dims("layerwise", 750) == (79_510, 76_110)
  assert dims("layerwise", 1000) == (79_510, 79_510)
  assert dims("flattened", 10_000) == (79_510, 11_110)
  assert all(s.kind == "identity" for s in projection.make_plan(template, "layerwise", 1000))
  assert projection.compression_ratio(projection.make_plan(template, "none", 1)) == 1.0


def test_seeds_are_shared_by_all_clients_and_differ_across_layers_and_seeds():
  _, params, _ = tiny_model()
  plan = projection.make_plan(params, "flattened", 4, skip_uncompressed=False)
  a = projection.sample_matrices(plan, seed=7)
  b = projection.sample_matrices(plan, seed=7)
  c = projection.sample_matrices(plan, seed=8)
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(x, y)  # regenerated identically: nothing to transmit
    assert not np.allclose(x, z)
  k1 = jax.random.key_data(projection.layer_key(7, "params/dense_0/kernel"))
  k2 = jax.random.key_data(projection.layer_key(7, "params/dense_1/kernel"))
  assert not np.array_equal(k1, k2)


@pytest.mark.parametrize(
  "scheme, k_proj, match",
  [("gaussian", 5, "scheme"), ("layerwise", 0, "k_proj"), ("flattened", 2.5, "k_proj")],
)
def test_bad_arguments_fail_clearly(scheme, k_proj, match):
  _, params, _ = tiny_model()
  with pytest.raises(ValueError, match=match):
    projection.make_plan(params, scheme, k_proj)
