"""ntk.projected_dense_ntk: the structured kernel in layer-wise sketch coordinates vs (J P)(J P)ᵀ by brute force."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import models, ntk, projection

# float32 contractions over a few hundred parameters, relative to the kernel's scale (as tests/test_ntk.py).
RTOL = 100 * float(jnp.finfo(jnp.float32).eps)


@functools.cache
def _setup(activation="tanh", hidden=(7, 5), input_dim=6, num_classes=4):
  """A dense stack with random (non-zero) biases, inputs x1 [5, in] and x2 [4, in]."""
  model = models.mlp(
    input_dim=input_dim, hidden=hidden, num_classes=num_classes, activation=activation
  )
  params = model.init(jax.random.key(0))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(
    treedef, [w + 0.3 * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
  )
  x1 = jax.random.normal(jax.random.key(2), (5, input_dim))
  x2 = jax.random.normal(jax.random.key(3), (4, input_dim))
  return model, params, x1, x2


def _sketch(params, k_proj, skip_uncompressed, seed=7):
  plan = projection.make_plan(params, "layerwise", k_proj, skip_uncompressed=skip_uncompressed)
  return plan, projection.sample_matrices(plan, seed)


def _brute(model, params, plan, matrices, x1, x2):
  """Full ``[N1, N2, C, C]`` kernel of ``J̃ = J P`` from explicit Jacobians and the dense ``P`` (float64)."""
  flat, unravel = ravel_pytree(params)  # jax.tree.leaves order, as dense_matrix
  jac = np.asarray(
    jax.jacrev(lambda w: model.apply(unravel(w), jnp.concatenate([x1, x2])))(flat), np.float64
  )
  p = np.asarray(projection.dense_matrix(plan, matrices), np.float64)  # [d, d_proj]
  sketched = jac @ p  # [N1 + N2, C, d_proj]
  n1 = x1.shape[0]
  return np.einsum("iap,jbp->ijab", sketched[:n1], sketched[n1:])


def _kernels(model, params, projections, x1, x2, chunk_size=None):
  """Traced and full projected kernels under one jit."""

  def both(p, a, b, proj):
    return tuple(
      ntk.projected_dense_ntk(
        model.dense_stack, p, a, b, projections=proj, trace_outputs=t, chunk_size=chunk_size
      )
      for t in (True, False)
    )

  return jax.jit(both)(params, x1, x2, projections)


def _assert_close(actual, expected, rtol=RTOL):
  actual = np.asarray(actual, np.float64)
  assert actual.shape == expected.shape
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * np.max(np.abs(expected)))


# k_proj=4, skip: hidden biases (7, 5) and every kernel sketched, the last bias (4 = k) not;
# k_proj=3, literal: every tensor sketched, the output bias included (its M is the identity).
@pytest.mark.parametrize("k_proj,skip", [(4, True), (3, False)])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_matches_brute_force_sketched_kernel(k_proj, skip, activation, chunk_size):
  model, params, x1, x2 = _setup(activation)
  plan, matrices = _sketch(params, k_proj, skip)
  kinds = [s.kind for s in plan]
  assert kinds.count("axis") == (5 if skip else 6)
  projections = projection.dense_stack_projections(plan, matrices, model.dense_stack)
  expected = _brute(model, params, plan, matrices, x1, x2)
  traced, full = _kernels(model, params, projections, x1, x2, chunk_size)
  _assert_close(full, expected)
  _assert_close(traced, np.einsum("ijcc->ij", expected) / expected.shape[-1])


def test_symmetric_call_equals_the_cross_kernel():
  """``x2=None`` shares the factors and gives the same ``K(x1, x1)``."""
  model, params, x1, _ = _setup()
  plan, matrices = _sketch(params, 3, False)
  projections = projection.dense_stack_projections(plan, matrices, model.dense_stack)
  fn = jax.jit(
    lambda p, a, b, proj: ntk.projected_dense_ntk(model.dense_stack, p, a, b, projections=proj)
  )
  _assert_close(
    fn(params, x1, None, projections), np.asarray(fn(params, x1, x1, projections), np.float64)
  )


def test_no_sketch_is_the_structured_kernel():
  """All projections ``None`` -> the structured kernel (same terms in the same order)."""
  model, params, x1, x2 = _setup()
  none = (None,) * len(model.dense_stack.layers)
  traced, full = _kernels(model, params, none, x1, x2)
  for t, got in ((True, traced), (False, full)):
    want = jax.jit(
      lambda p, a, b, t=t: ntk.empirical_ntk(
        model.apply,
        p,
        a,
        b,
        trace_outputs=t,
        implementation="structured",
        dense_stack=model.dense_stack,
      )
    )(params, x1, x2)
    np.testing.assert_allclose(got, want, rtol=4 * float(jnp.finfo(jnp.float32).eps), atol=0)


def test_paper_mlp_cap_500_matches_the_lifted_network():
  """784-100-10 at k_proj = 500 (only dense_0's kernel is sketched): vs the generic kernel of g(u) = f(w̄ + P u)."""
  model = models.mlp()
  params = model.init(jax.random.key(4))
  x = jax.random.normal(jax.random.key(5), (3, 784))
  plan, matrices = _sketch(params, 500, True)
  assert [s.kind for s in plan] == [
    "identity",
    "axis",
    "identity",
    "identity",
  ]  # leaves: bias, kernel, ...
  projections = projection.dense_stack_projections(plan, matrices, model.dense_stack)
  got = jax.jit(
    lambda p, a, proj: ntk.projected_dense_ntk(model.dense_stack, p, a, projections=proj)
  )(params, x, projections)
  g, u0 = projection.lift(model.apply, params, plan, matrices)
  want = jax.jit(lambda u, a: ntk.empirical_ntk(g, u, a, implementation="jacobian"))(u0, x)
  _assert_close(got, np.asarray(want, np.float64))


def test_bad_projections_raise():
  model, params, x1, _ = _setup()
  plan, matrices = _sketch(params, 3, False)
  projections = projection.dense_stack_projections(plan, matrices, model.dense_stack)
  with pytest.raises(ValueError, match="one DenseProjection per dense_stack layer"):
    ntk.projected_dense_ntk(model.dense_stack, params, x1, projections=projections[:2])
  wrong = (ntk.DenseProjection(kernel=jnp.ones((5, 3))),) + projections[
    1:
  ]  # dense_0 takes 6 inputs
  with pytest.raises(ValueError, match=r"projections\['dense_0'\].kernel must be \[6, k\]"):
    ntk.projected_dense_ntk(model.dense_stack, params, x1, projections=wrong)
  with pytest.raises(ValueError, match="DenseProjection or None"):
    ntk.projected_dense_ntk(model.dense_stack, params, x1, projections=("p",) + projections[1:])


def test_flattened_sketch_has_no_layer_factorisation():
  model, params, _, _ = _setup()
  plan = projection.make_plan(params, "flattened", 10)
  with pytest.raises(ValueError, match="flattened sketch"):
    projection.dense_stack_projections(plan, projection.sample_matrices(plan, 0), model.dense_stack)
