"""The layer-wise structured NTK of any flax model against brute-force float64 Jacobians.

Every kernel is compared with ``J Jᵀ`` contracted from ``jax.jacobian`` of the whole network with
respect to all of its parameters (flattened), in float64, to 1e-10 of the kernel's largest entry.
Both routes of every layer (factorisation and contraction) are forced on each model, so the test
does not depend on which the cost rule picks.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import evolve, models, ntk
from float64_checks import RTOL, Convs, rel
from ntk_fl._src import kernels
from ntk_fl._src.kernels import _blocked_kernel
from ntk_fl._src import layerwise
from ntk_fl.ntk import NtkImplementation, empirical_ntk, empirical_ntk_fn

pytestmark = pytest.mark.usefixtures("x64")


def jacobian(apply_fn, params, x, per_sample=True):
  """``J(x)`` ``[n, outputs, params]`` from ``jax.jacobian`` of the flattened parameters, in float64;
  ``per_sample=False``: the Jacobian of the whole batch's outputs at once."""
  flat, unravel = ravel_pytree(params)
  if per_sample:
    jac = lambda x: jax.vmap(
      lambda xi: jax.jacobian(lambda w: apply_fn(unravel(w), xi[None])[0])(flat)
    )(x)
  else:
    jac = lambda x: jax.jacobian(lambda w: apply_fn(unravel(w), x))(flat)
  return jax.jit(jac)(x)


def contract(j1, j2, trace_outputs):
  """``J1 J2ᵀ`` (mean over outputs when traced): ``[n1, n2]``, else ``[n1, n2, outputs, outputs]``."""
  if trace_outputs:
    return jnp.einsum("icd,jcd->ij", j1, j2) / j1.shape[1]
  return jnp.einsum("iad,jbd->ijab", j1, j2)


def brute_force(apply_fn, params, x1, x2, trace_outputs, per_sample=True):
  """``J(x1) J(x2)ᵀ`` (:func:`jacobian`, :func:`contract`)."""
  j1 = jacobian(apply_fn, params, x1, per_sample)
  return contract(j1, jacobian(apply_fn, params, x2, per_sample), trace_outputs)


def to64(tree):
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


def setup(module, in_shape, n1=4, n2=3, seed=0):
  """Float64 parameters (non-zero biases) and inputs ``x1 [n1, *in_shape]``, ``x2 [n2, *in_shape]``."""

  def draw(key):
    k1, k2, k3 = jax.random.split(key, 3)
    x1 = jax.random.normal(k1, (n1, *in_shape), jnp.float64)
    x2 = jax.random.normal(k2, (n2, *in_shape), jnp.float64)
    params = to64(module.init(k3, x1[:1]))
    # Non-zero biases, so that the bias terms are exercised.
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(k3, a.shape, a.dtype), params)
    return params, x1, x2

  # One compiled program: drawn op by op, every initialiser and shape is a compilation of its own.
  return jax.jit(draw)(jax.random.PRNGKey(seed))


def _kernel(apply_fn, params, x1, x2, trace_outputs, chunk, route):
  fn = jax.jit(
    lambda p, a, b: layerwise.layerwise_kernel(
      apply_fn, p, a, b, trace_outputs, chunk, route=route, blocked=_blocked_kernel
    )
  )
  return fn(params, x1, x2)


# The kernels check_routes compares, as (trace_outputs, route, x2 given, samples per block): every route
# unblocked with x2 and blocked (2 samples per block) with x2=None, and the factorised route blocked with x2.
_ROUTE_CASES = tuple(
  case
  for trace_outputs in (True, False)
  for case in (
    *(
      (trace_outputs, route, x2, chunk)
      for route in (None, "factorise", "contract")
      for x2, chunk in ((True, None), (False, 2))
    ),
    (trace_outputs, "factorise", True, 2),
  )
)


def _route_kernels(apply_fn, params, x1, x2):
  """Every kernel of ``_ROUTE_CASES``, in one compiled program: each is still its own route's
  computation (the routes differ in their operations, which XLA does not merge), but one compilation
  instead of 14: about 40 % less CPU time for the convolution stack's checks (benchmarks/RESULTS.md)."""

  def kernels_of(p, a, b):
    return [
      layerwise.layerwise_kernel(
        apply_fn, p, a, b if given else None, trace, chunk, route=route, blocked=_blocked_kernel
      )
      for trace, route, given, chunk in _ROUTE_CASES
    ]

  return jax.jit(kernels_of)(params, x1, x2)


def check_routes(module, in_shape, expect_factorised=None):
  """Every route, blocked (2 samples per block) and not, ``x2`` given and ``x2=None``.

  Returns the parameters, the inputs and the brute-force kernels ``{trace_outputs: (K(x1, x2),
  K(x1, x1))}`` (both from one Jacobian of each input, computed once).
  """
  params, x1, x2 = setup(module, in_shape)
  j1, j2 = jacobian(module.apply, params, x1), jacobian(module.apply, params, x2)
  refs = {
    trace_outputs: (contract(j1, j2, trace_outputs), contract(j1, j1, trace_outputs))
    for trace_outputs in (True, False)
  }
  for (trace_outputs, route, given, chunk), k in zip(
    _ROUTE_CASES, _route_kernels(module.apply, params, x1, x2)
  ):
    ref, ref_self = refs[trace_outputs]
    assert rel(k, ref if given else ref_self) < RTOL, (
      trace_outputs,
      route,
      "x2 given" if given else "x2=None",
      f"blocks of {chunk}" if chunk else "unblocked",
    )
  if expect_factorised is not None:
    plan = layerwise.make_plan(module.apply, params, x1[:1], True, "factorise")
    assert {layer.path for layer in plan.factorised} == set(expect_factorised)
  return params, x1, x2, refs


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(7, name="a")(x))
    x = jax.nn.relu(nn.Dense(5, use_bias=False, name="b")(x))
    return nn.Dense(3, name="c")(x)


class _Scaled(nn.Module):
  """A parameter that is not a layer's (a per-feature scale) and a LayerNorm between dense layers."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", lambda k, s: 1 + 0.3 * jax.random.normal(k, s), (x.shape[-1],))
    x = nn.Dense(6, name="a")(x * scale)
    x = nn.LayerNorm(name="norm")(jnp.tanh(x))
    return nn.Dense(3, name="b")(x)


class _Positions(nn.Module):
  """A dense layer applied at every position of ``[B, T, d]`` (its weights summed over positions)."""

  @nn.compact
  def __call__(self, x):  # [B, 12] -> [B, 4, 3]
    h = jnp.tanh(nn.Dense(5, name="token")(x.reshape(x.shape[0], 4, 3)))  # [B, 4, 5]
    h = nn.Dense(2, use_bias=False, name="token_out")(h).reshape(x.shape[0], -1)
    return nn.Dense(3, name="head")(jnp.tanh(h))


class _Shared(nn.Module):
  """One dense module called twice (shared weights)."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(4, name="shared")
    h = shared(jnp.tanh(shared(x)))
    return nn.Dense(3, name="head")(h)


def test_mlp():
  check_routes(_Mlp(), (6,), {("a",), ("b",), ("c",)})


def test_library_cnn():
  module = models.cnn((8, 8, 1), 5)
  # The same network and draws as ``module``: its brute-force kernels serve both checks.
  params, x1, x2, refs = check_routes(
    models._CNN(num_classes=5, kernel_size=3),
    (8, 8, 1),
    {("conv_0",), ("conv_1",), ("dense_0",), ("dense_1",)},
  )
  cases = [(t, impl) for t in (True, False) for impl in ("structured", "auto")]

  def kernels_of(p, a, b):  # the four kernels in one compiled program, not one each
    return [
      empirical_ntk(
        module.apply, p, a, b, trace_outputs=t, implementation=impl, flax_apply=module.flax_apply
      )
      for t, impl in cases
    ]

  for (trace_outputs, impl), k in zip(cases, jax.jit(kernels_of)(params, x1, x2)):
    assert rel(k, refs[trace_outputs][0]) < RTOL, (trace_outputs, impl)


def test_library_cnn_routes_and_flops():
  """28x28x1 CNN: both dense layers factorised, both convolutions contracted, ~17x fewer FLOPs."""
  model = models.cnn((28, 28, 1), 10)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  x = jax.ShapeDtypeStruct((1, 28, 28, 1), jnp.float32)
  plan = layerwise.make_plan(model.flax_apply, params, x, True)
  assert [layer.path for layer in plan.factorised] == [("dense_0",), ("dense_1",)]
  assert [path for path, _ in plan.contracted] == [("conv_0",), ("conv_1",)]
  # contracted, but their Jacobians formed from their patches and cotangents
  assert [layer.path for layer in plan.from_factors] == [("conv_0",), ("conv_1",)]
  assert plan.num_rest == 320 + 18_496
  ratio = layerwise.contraction_flops(333_526, 10, True) / layerwise.plan_flops(plan, True, 1, 1)
  assert 15 < ratio < 20, ratio


def test_non_layer_parameters():
  params, x1, _, _ = check_routes(_Scaled(), (5,), {("a",), ("b",)})
  plan = layerwise.make_plan(_Scaled().apply, params, x1[:1], True)
  assert plan.num_rest == 5 + 2 * 6  # the scale and the LayerNorm's scale and bias


def test_dense_on_positions():
  params, x1, _, _ = check_routes(_Positions(), (12,), {("token",), ("token_out",), ("head",)})
  layer = {
    layer.path: layer
    for layer in layerwise.make_plan(
      _Positions().apply, params, x1[:1], True, "factorise"
    ).factorised
  }[("token",)]
  assert layer.positions == 4 and layer.d_in == 3


def test_shared_module_is_contracted():
  params, x1, _, _ = check_routes(_Shared(), (4,), {("head",)})
  plan = layerwise.make_plan(_Shared().apply, params, x1[:1], True, "factorise")
  assert dict(plan.contracted)[("shared",)] == "called 2 times"


def test_convolution_patches():
  check_routes(Convs(), (7, 7, 2), {("c0",), ("c1",), ("c2",), ("head",)})


@pytest.mark.parametrize(
  "module, in_shape, conv_paths",
  [
    (models._CNN(num_classes=5, kernel_size=3), (8, 8, 1), {("conv_0",), ("conv_1",)}),
    (Convs(), (7, 7, 2), {("c0",), ("c1",), ("c2",)}),
  ],
  ids=["library_cnn", "strides_padding_dilation"],
)
def test_patch_vjp_matches_jax_vjp(module, in_shape, conv_paths):
  """The weight update's pullback with the convolutions' weight gradients from their patches against
  ``jax.vjp`` of the whole network (float64), for a batch of cotangents (``vmap``, as the NTK step)."""
  params, x, _ = setup(module, in_shape)
  convs = layerwise.conv_layers(module.apply, params, x[:1])
  assert {layer.path for layer in convs} == conv_paths
  out_shape = jax.eval_shape(module.apply, params, x).shape
  cotangents = jax.random.normal(jax.random.PRNGKey(7), (3, *out_shape), jnp.float64)

  # Each side one compiled program (run op by op, every operation of the network compiles on its own).
  @jax.jit
  def tested(params, cotangents):
    out, pull = layerwise.patch_vjp(module.apply, params, x, convs)
    return out, jax.vmap(pull)(cotangents)

  @jax.jit
  def reference(params, cotangents):
    out_ref, pull_ref = jax.vjp(lambda p: module.apply(p, x), params)
    return out_ref, jax.vmap(pull_ref)(cotangents)

  out, got = tested(params, cotangents)
  out_ref, want = reference(params, cotangents)
  assert rel(out, out_ref) < RTOL
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel(g, w) < RTOL


def test_empirical_ntk_fn_structured_on_module_apply():
  module = _Scaled()
  params, x1, x2 = setup(module, (5,))
  j1, j2 = jacobian(module.apply, params, x1), jacobian(module.apply, params, x2)
  cases = [
    (trace_axes, impl)
    for trace_axes in ((-1,), ())
    for impl in (
      NtkImplementation.STRUCTURED_DERIVATIVES,
      NtkImplementation.AUTO,
      NtkImplementation.JACOBIAN_CONTRACTION,
    )
  ]

  def kernels_of(a, b, p):  # the six kernels in one compiled program, not one each
    return [
      empirical_ntk_fn(module.apply, trace_axes=trace_axes, vmap_axes=0, implementation=impl)(
        a, b, p
      )
      for trace_axes, impl in cases
    ]

  for (trace_axes, impl), k in zip(cases, jax.jit(kernels_of)(x1, x2, params)):
    assert rel(k, contract(j1, j2, trace_axes == (-1,))) < RTOL, (trace_axes, impl)


class _BatchDependent(nn.Module):
  """``h - h.mean(0)``: every output depends on the whole batch."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(5, name="a")(x))
    return nn.Dense(3, name="b")(h - h.mean(0))


def test_batch_dependent_model_default_vmap_axes_none():
  module = _BatchDependent()
  params, x1, _ = setup(module, (4,))
  ref = brute_force(module.apply, params, x1, x1, True, per_sample=False)
  # Both kernels in one compiled program (eager, each of their operations compiles on its own).
  k, per_sample = jax.jit(
    lambda a, p: (
      empirical_ntk_fn(module.apply)(a, None, p),  # default: vmap_axes=None
      empirical_ntk_fn(module.apply, vmap_axes=0)(a, None, p),
    )
  )(x1, params)
  assert rel(k, ref) < RTOL
  assert rel(per_sample, ref) > 0.1  # the per-sample kernel is a different (wrong) kernel here
  with pytest.raises(ValueError, match="depend on the rest of the batch"):
    models.from_flax(module, (4,), 3, per_sample=True)
  model = models.from_flax(module, (4,), 3)
  assert not model.per_sample


# The whole step as one compiled program (eager, each of its operations compiles on its own).
_ntk_step = jax.jit(
  evolve.ntk_step,
  static_argnums=0,
  static_argnames=("taus", "kernel_impl", "flax_apply", "per_sample"),
)


def test_from_flax_per_sample_and_structured_ntk_step():
  model = models.from_flax(_Scaled(), (5,), 3, per_sample=True)
  params = to64(model.init(jax.random.PRNGKey(0)))
  x = jax.random.normal(jax.random.PRNGKey(1), (6, 5), jnp.float64)
  y = jax.nn.one_hot(jnp.arange(6) % 3, 3, dtype=jnp.float64)
  mask = jnp.ones(6, bool)
  common = dict(lr=0.5, taus=(1, 2, 4))
  d_generic, info_generic = _ntk_step(
    model.apply, params, x, y, mask, kernel_impl="jacobian", **common
  )
  d_struct, info_struct = _ntk_step(
    model.apply, params, x, y, mask, flax_apply=model.flax_apply, kernel_impl="structured", **common
  )
  assert rel(ravel_pytree(d_struct)[0], ravel_pytree(d_generic)[0]) < 1e-9
  np.testing.assert_allclose(info_struct["losses"], info_generic["losses"], rtol=1e-10)


def test_ntk_step_whole_batch_model():
  """per_sample=False: the kernel of the whole batch (checked against its brute force)."""
  model = models.from_flax(_BatchDependent(), (4,), 3)
  params = to64(model.init(jax.random.PRNGKey(0)))
  x = jax.random.normal(jax.random.PRNGKey(1), (5, 4), jnp.float64)
  k = ntk.empirical_ntk_fn(model.apply, trace_axes=(-1,), vmap_axes=None)(x, None, params)
  flat, unravel = ravel_pytree(params)
  j = jax.jacobian(lambda w: model.apply(unravel(w), x))(flat)
  assert rel(k, jnp.einsum("icd,jcd->ij", j, j) / 3) < RTOL
  y = jax.nn.one_hot(jnp.arange(5) % 3, 3, dtype=jnp.float64)
  delta, info = _ntk_step(
    model.apply, params, x, y, jnp.ones(5, bool), lr=0.5, taus=(1, 2), per_sample=False
  )
  assert np.all(np.isfinite(info["losses"]))
  with pytest.raises(ValueError, match="per-sample model"):
    evolve.ntk_step(
      model.apply,
      params,
      x,
      y,
      jnp.ones(5, bool),
      lr=0.5,
      taus=(1, 2),
      per_sample=False,
      kernel_impl="structured",
    )


def test_wrong_dense_stack_is_an_error():
  relu_mlp = models._MLP(features=(7, 3), activation=jax.nn.relu)
  with pytest.raises(ValueError, match="activation tanh"):
    models.from_flax(
      relu_mlp,
      (6,),
      3,
      per_sample=True,
      dense_stack=models.DenseStack(("dense_0", "dense_1"), jnp.tanh),
    )
  with pytest.raises(ValueError, match="dense_stack layer 'dense_9'"):
    models.from_flax(
      relu_mlp,
      (6,),
      3,
      per_sample=True,
      dense_stack=models.DenseStack(("dense_0", "dense_9"), jax.nn.relu),
    )
  with pytest.raises(ValueError, match="does not compute"):  # the layers in the wrong order
    models.from_flax(
      models._MLP(features=(6, 6, 3), activation=jax.nn.relu),
      (6,),
      3,
      per_sample=True,
      dense_stack=models.DenseStack(("dense_1", "dense_0", "dense_2"), jax.nn.relu),
    )
  ok = models.from_flax(
    relu_mlp,
    (6,),
    3,
    per_sample=True,
    dense_stack=models.DenseStack(("dense_0", "dense_1"), jax.nn.relu),
  )
  assert ok.dense_stack is not None


def test_structured_needs_an_interceptable_function():
  model = models.cnn((8, 8, 1), 5)
  with pytest.raises(ValueError, match="not be jax.jit-compiled"):
    empirical_ntk(
      model.apply,
      None,
      jnp.zeros((2, 8, 8, 1)),
      implementation="structured",
      flax_apply=model.apply,
    )
  with pytest.raises(ValueError, match="not jax.jit-compiled"):
    empirical_ntk_fn(
      model.apply, vmap_axes=0, implementation=NtkImplementation.STRUCTURED_DERIVATIVES
    )


# ----------------------------------------------------------------------------
# The storage budget: every schedule of the blocked kernel gives the same kernel.


@pytest.mark.parametrize("budget", ["1", "20K"])
def test_every_storage_budget_gives_the_brute_force_kernel(monkeypatch, budget):
  """A budget too small for any block (recompute x2's features per x1 block), one that stores x2's
  features but blocks x1, and the machine's (everything stored): the same kernel, generic and
  layer-wise, ``x2`` given and not."""
  if budget is None:
    monkeypatch.delenv(kernels.MEMORY_ENV, raising=False)
  else:
    monkeypatch.setenv(kernels.MEMORY_ENV, budget)
  module = Convs()
  params, x1, x2 = setup(module, (7, 7, 2), n1=5, n2=3)
  j1, j2 = jacobian(module.apply, params, x1), jacobian(module.apply, params, x2)
  cases = [
    (trace_outputs, given, route)
    for trace_outputs in (True, False)
    for given in (True, False)
    for route in ("generic", "factorise", "contract")
  ]

  def kernels_of(
    p, a, b
  ):  # every case in one compiled program (the budget is read as it is traced)
    return [
      kernels.jacobian_implementation_kernel(module.apply, p, a, b if given else None, trace, 2)
      if route == "generic"
      else layerwise.layerwise_kernel(
        module.apply, p, a, b if given else None, trace, 2, route=route, blocked=_blocked_kernel
      )
      for trace, given, route in cases
    ]

  for (trace_outputs, given, route), k in zip(cases, jax.jit(kernels_of)(params, x1, x2)):
    ref = contract(j1, j2 if given else j1, trace_outputs)
    assert rel(k, ref) < RTOL, (budget, trace_outputs, 3 if given else 5, route)


def test_storage_budget_from_the_environment_or_the_machine(monkeypatch):
  monkeypatch.setenv(kernels.MEMORY_ENV, "3G")
  assert kernels.store_floats(4) == 3 * 2**30 // 4
  assert kernels.store_floats(8) == 3 * 2**30 // 8
  for text, value in (("512", 512), ("2k", 2048), ("5MiB", 5 * 2**20), ("1TB", 2**40)):
    assert kernels.parse_bytes(text) == value
  for bad in ("-1", "0", "1.5G", "8X", "lots"):
    monkeypatch.setenv(kernels.MEMORY_ENV, bad)
    with pytest.raises(ValueError, match=r"NTK_FL_KERNEL_MEMORY=.*positive number of bytes"):
      kernels.store_floats(4)
  monkeypatch.delenv(kernels.MEMORY_ENV)
  available = kernels.available_bytes()
  assert available is None or available > 0
  expected = max(2**28, (available or 0) // 2 // 4)
  # The machine's free memory moves between two reads: within 1 % of it.
  assert abs(kernels.store_floats(4) - expected) <= max(1, expected // 100)
  assert kernels.store_floats(4) >= 2**28
