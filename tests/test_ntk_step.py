"""The one NTK client step and its single-home helpers: options parsed once, explicit-Jacobian and VJP paths
agree, targets as a function of f0, scoring labels, the Jacobian -> kernel contraction on pytrees, the
random-subset order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import evolve, jacobians, models, ntk, rng

N, C, D = 8, 3, 5


def _setup():
  model = models.mlp(input_dim=D, hidden=(6,), num_classes=C)
  params = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (N, D))
  targets = jax.nn.one_hot(jnp.arange(N) % C, C)
  mask = jnp.arange(N) < N - 2  # two padded rows
  return model, params, x, targets, mask


def _leaves_close(a, b, rtol=2e-5, atol=1e-7):
  for got, want in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_options_are_enums_parsed_once():
  assert evolve.Loss("mse") is evolve.Loss.MSE and evolve.Loss.CE == "ce"
  grid = evolve.check_taus((2, 5))
  assert isinstance(grid, evolve.TauGrid) and grid == (2, 5)
  assert evolve.check_taus(grid) is grid  # a checked grid is not checked again
  model, params, x, targets, mask = _setup()
  with pytest.raises(ValueError, match=r"select='best' is not one of \('network', 'linearized'\)"):
    evolve.ntk_step(model.apply, params, x, targets, mask, lr=0.1, taus=grid, select="best")
  with pytest.raises(ValueError, match="only defined for loss='ce'"):
    evolve.ntk_step(
      model.apply, params, x, targets, mask, lr=0.1, taus=grid, loss="mse", solver="ode"
    )


@pytest.mark.parametrize("kernel", ["traced", "full"])
def test_explicit_jacobian_path_equals_vjp_path(kernel):
  """Kernel and candidates from an explicit flat J (CP-NTK-FL's server) == the implicit kernel + VJP."""
  model, params, x, targets, mask = _setup()
  taus = evolve.check_taus((3, 7, 15))
  implicit, info_i = evolve.ntk_step(
    model.apply, params, x, targets, mask, lr=0.5, taus=taus, kernel=kernel, kernel_impl="jacobian"
  )
  x_real = jnp.where(mask[:, None], x, 0)
  flat = jacobians.flat_jacobian(model.apply, params, x_real)  # [N, C, d]
  coords = evolve.ParamMap(model.apply, params, lambda d: jacobians.unflatten_jacobian(d, params))
  explicit, info_e = evolve.ntk_step(
    model.apply,
    params,
    x,
    targets,
    mask,
    lr=0.5,
    taus=taus,
    kernel=kernel,
    jacobian=flat,
    param_map=coords,
  )
  assert int(info_i["tau"]) == int(info_e["tau"])
  np.testing.assert_allclose(info_e["losses"], info_i["losses"], rtol=1e-5)
  _leaves_close(explicit, implicit)


def test_targets_as_function_of_f0_and_scoring_labels():
  """``targets(f0)`` sees the starting outputs; the scores are the loss against ``labels`` of w + Δw_τ."""
  model, params, x, hard, mask = _setup()
  taus = (2, 6, 12)
  f0 = model.apply(params, jnp.where(mask[:, None], x, 0))
  soft = 0.5 * hard + 0.5 * jax.nn.softmax(f0)
  by_fn, info_fn = evolve.ntk_step(
    model.apply,
    params,
    x,
    lambda f: 0.5 * hard + 0.5 * jax.nn.softmax(f),
    mask,
    lr=0.5,
    taus=taus,
    labels=hard,
  )
  by_rows, _ = evolve.ntk_step(model.apply, params, x, soft, mask, lr=0.5, taus=taus, labels=hard)
  _leaves_close(by_fn, by_rows, rtol=0, atol=0)
  np.testing.assert_allclose(info_fn["f0"], f0, rtol=1e-6)
  # Brute force: every candidate from the evolution against the soft targets, scored on the hard labels.
  kernel = ntk.empirical_ntk(model.apply, params, jnp.where(mask[:, None], x, 0))
  evo = evolve.evolve(kernel, f0, soft, mask, lr=0.5, taus=taus)
  deltas = evolve.weight_update_vjp(
    model.apply, params, jnp.where(mask[:, None], x, 0), evo.residual_sums, 0.5, float(mask.sum())
  )
  losses = [
    float(
      evolve.mean_loss(
        model.apply(jax.tree.map(lambda w, d: w + d[k], params, deltas), x), hard, mask
      )
    )
    for k in range(len(taus))
  ]
  np.testing.assert_allclose(info_fn["losses"], losses, rtol=1e-5)
  assert int(info_fn["tau"]) == taus[int(np.argmin(losses))]


def test_jacobian_kernel_of_a_pytree_equals_the_flat_one():
  leaves = {
    "a": jax.random.normal(jax.random.key(2), (4, C, 3, 2)),
    "b": jax.random.normal(jax.random.key(3), (4, C, 5)),
  }
  other = {
    "a": jax.random.normal(jax.random.key(4), (6, C, 3, 2)),
    "b": jax.random.normal(jax.random.key(5), (6, C, 5)),
  }
  flat1, flat2 = jacobians.flatten_jacobian(leaves), jacobians.flatten_jacobian(other)
  for traced in (True, False):
    np.testing.assert_allclose(
      jacobians.jacobian_kernel(leaves, other, trace_outputs=traced),
      jacobians.jacobian_kernel(flat1, flat2, trace_outputs=traced),
      rtol=1e-5,
      atol=1e-6,
    )
  brute = np.einsum("icp,jcp->ij", np.asarray(flat1, np.float64), np.asarray(flat2, np.float64)) / C
  np.testing.assert_allclose(jacobians.jacobian_kernel(leaves, other), brute, rtol=1e-5, atol=1e-5)


def test_masked_permutation_lists_real_entries_first_in_random_order():
  mask = jnp.asarray(
    [[True, False, True, True, False, True], [False, True, False, False, False, True]]
  )
  orders = [np.asarray(rng.masked_permutation(jax.random.key(s), mask)) for s in range(20)]
  for order in orders:
    for row, m in zip(order, np.asarray(mask)):
      n_real = int(m.sum())
      assert sorted(row.tolist()) == list(range(6))
      assert set(row[:n_real].tolist()) == set(np.flatnonzero(m).tolist())
  assert (
    len({tuple(o[0, :4]) for o in orders}) > 1
  )  # the order of the real entries varies with the key
