"""Tests for ntk_fl.ntk: every implementation against a brute-force Jacobian kernel, plus API properties."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import ntk
from ntk_fl._src import kernels as _kernels
from ntk_fl.models import DenseStack

IMPLS = ("jacobian", "ntvp", "structured")
GENERIC_IMPLS = ("jacobian", "ntvp")
# float32 contractions over at most a few thousand parameters: relative to the kernel's scale.
RTOL = 100 * float(jnp.finfo(jnp.float32).eps)


class DenseNet(nn.Module):
  """Dense stack with named layers ``dense_0..dense_L`` and random (non-zero) biases."""

  hidden: tuple[int, ...]
  num_classes: int
  activation: Callable = nn.relu

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    bias_init = nn.initializers.normal(0.5)
    for k, width in enumerate(self.hidden):
      x = self.activation(nn.Dense(width, name=f"dense_{k}", bias_init=bias_init)(x))
    return nn.Dense(self.num_classes, name=f"dense_{len(self.hidden)}", bias_init=bias_init)(x)

  def stack(self) -> DenseStack:
    return DenseStack(tuple(f"dense_{k}" for k in range(len(self.hidden) + 1)), self.activation)


class SmallCNN(nn.Module):
  num_classes: int = 3

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Dense(6)(x.reshape(x.shape[0], -1)))
    return nn.Dense(self.num_classes)(x)


MODELS = {
  "mlp_relu": (DenseNet((9,), 3, nn.relu), (6,)),
  "mlp_tanh_deep": (DenseNet((7, 6, 5), 4, jnp.tanh), (5,)),
  "cnn": (SmallCNN(3), (6, 6, 2)),
}


@functools.cache
def _setup(name, n1=5, n2=4, seed=0):
  """(module, params, x1 [n1, *in], x2 [n2, *in], dense_stack or None); cached, arrays are immutable."""
  module, in_shape = MODELS[name]
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  x1 = jax.random.normal(k1, (n1, *in_shape))
  x2 = jax.random.normal(k2, (n2, *in_shape))
  params = module.init(k3, x1)
  stack = module.stack() if isinstance(module, DenseNet) else None
  return module, params, x1, x2, stack


def _brute_full(apply_fn, params, x1, x2):
  """``[N1, N2, C, C]`` from the jacrev of the flattened outputs w.r.t. the flattened params (float64)."""
  flat, unravel = ravel_pytree(params)

  # One jacrev of both sets (one compile): [N1 + N2, C, d].
  jac = np.asarray(
    jax.jit(jax.jacrev(lambda w: apply_fn(unravel(w), jnp.concatenate([x1, x2]))))(flat), np.float64
  )
  return np.einsum("iap,jbp->ijab", jac[: x1.shape[0]], jac[x1.shape[0] :])


def _kernel(apply_fn, params, x1, x2=None, **options):
  """``empirical_ntk`` under ``jit`` (one compile instead of hundreds of eager op compiles)."""
  return jax.jit(lambda p, a, b: ntk.empirical_ntk(apply_fn, p, a, b, **options))(params, x1, x2)


@functools.cache
def _reference(name):
  """Brute-force full kernel of the default :func:`_setup` of ``name``."""
  module, params, x1, x2, _ = _setup(name)
  return _brute_full(module.apply, params, x1, x2)


def _assert_close(actual, expected, rtol=RTOL):
  actual = np.asarray(actual, np.float64)
  assert actual.shape == expected.shape
  scale = np.max(np.abs(expected))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def _cases():
  for name in MODELS:
    for impl in IMPLS:
      if impl == "structured" and name == "cnn":
        continue
      yield name, impl


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("name,impl", list(_cases()))
def test_matches_brute_force(name, impl, chunk_size):
  """Traced and full kernels (one jit for both) against the jacrev kernel; chunk 2 pads 5 -> 3 blocks."""
  module, params, x1, x2, stack = _setup(name)
  full = _reference(name)

  def both(p, a, b):
    kw = dict(implementation=impl, dense_stack=stack, chunk_size=chunk_size)
    return tuple(
      ntk.empirical_ntk(module.apply, p, a, b, trace_outputs=t, **kw) for t in (True, False)
    )

  traced, k_full = jax.jit(both)(params, x1, x2)
  assert traced.dtype == k_full.dtype == jnp.float32
  _assert_close(traced, np.einsum("ijcc->ij", full) / full.shape[-1])
  _assert_close(k_full, full)


def test_paper_mlp_784_100_10():
  """The hot path at the paper's size: structured kernel of the 784-100-10 ReLU MLP."""
  module = DenseNet((100,), 10, nn.relu)
  x = jax.random.normal(jax.random.key(1), (3, 784))
  params = module.init(jax.random.key(2), x)
  expected = np.einsum("ijcc->ij", _brute_full(module.apply, params, x, x)) / 10
  k = _kernel(module.apply, params, x, implementation="structured", dense_stack=module.stack())
  _assert_close(k, expected)


def _float64_jacobian_kernels(apply_fn, params, x):
  """Traced ``[N, N]`` and full ``[N, N, C, C]`` kernels of ``jax.jacobian`` computed in float64
  throughout (parameters and inputs cast up, the Jacobian and its products in float64)."""
  with jax.enable_x64(True):
    flat, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params))
    x64 = jnp.asarray(x, jnp.float64)
    jac = np.asarray(jax.jit(jax.jacobian(lambda w: apply_fn(unravel(w), x64)))(flat))
  assert jac.dtype == np.float64
  full = np.einsum("iap,jbp->ijab", jac, jac)
  return np.einsum("ijcc->ij", full) / full.shape[-1], full


@pytest.mark.parametrize("n", [3, 40])
def test_generic_float32_kernel_long_sums_match_float64(n):
  """The generic ``'jacobian'`` kernel in float32 on the 784-100-10 MLP (79,510 parameters: a
  traced entry sums 795,100 products) against the float64 ``jax.jacobian`` kernel, traced and full.

  The tolerance is 16 float32 epsilons relative: on the diagonal (sums of squares, no
  cancellation) each entry against its own value, elsewhere against the largest entry. A
  float32 sum of ``K`` terms in one sequential loop is off by up to ``K·eps`` (about ``√K·eps``
  typically: 3e-4 relative at ``N = 3``, where XLA's CPU backend sums a tiny ``Fᵀ F`` that way);
  summed in parameter blocks and then pairwise it stays within a few ``eps``.
  """
  module = DenseNet((100,), 10, nn.relu)
  x = jax.random.normal(jax.random.key(3), (n, 784))
  params = module.init(jax.random.key(4), x)
  want_traced, want_full = _float64_jacobian_kernels(module.apply, params, x)
  both = jax.jit(
    lambda p, a: tuple(
      ntk.empirical_ntk(module.apply, p, a, trace_outputs=t, implementation="jacobian")
      for t in (True, False)
    )
  )
  traced, full = (np.asarray(k, np.float64) for k in both(params, x))
  rtol = 16 * float(jnp.finfo(jnp.float32).eps)
  for got, want, diag in (
    (traced, want_traced, lambda k: np.einsum("ii->i", k)),
    (full, want_full, lambda k: np.einsum("iiaa->ia", k)),
  ):
    np.testing.assert_allclose(diag(got), diag(want), rtol=rtol, atol=0)
    _assert_close(got, want, rtol=rtol)


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_is_mean_of_full_diagonal(impl):
  module, params, x1, x2, stack = _setup("mlp_tanh_deep")
  kw = dict(implementation=impl, dense_stack=stack)
  traced = _kernel(module.apply, params, x1, x2, trace_outputs=True, **kw)
  full = _kernel(module.apply, params, x1, x2, trace_outputs=False, **kw)
  np.testing.assert_allclose(
    traced,
    jnp.mean(jnp.diagonal(full, axis1=2, axis2=3), -1),
    rtol=0,
    atol=RTOL * float(jnp.max(jnp.abs(traced))),
  )


@pytest.mark.parametrize("trace_outputs", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_self_kernel_symmetric_psd_and_equal_to_explicit_x2(impl, trace_outputs):
  module, params, x1, _, stack = _setup("mlp_relu", n1=7)
  kw = dict(trace_outputs=trace_outputs, implementation=impl, dense_stack=stack, chunk_size=3)
  k_none = _kernel(module.apply, params, x1, **kw)
  k_same = _kernel(module.apply, params, x1, x1, **kw)
  scale = float(jnp.max(jnp.abs(k_same)))
  np.testing.assert_allclose(k_none, k_same, rtol=0, atol=RTOL * scale)
  mat = np.asarray(k_none if trace_outputs else ntk.full_to_matrix(k_none), np.float64)
  np.testing.assert_allclose(mat, mat.T, rtol=0, atol=RTOL * scale)
  assert np.linalg.eigvalsh((mat + mat.T) / 2).min() >= -RTOL * scale * mat.shape[0]


def test_full_to_matrix_is_sample_major_gram():
  module, params, x1, x2, _ = _setup("mlp_relu")
  flat, unravel = ravel_pytree(params)
  jac = jax.jit(jax.jacrev(lambda w, x: module.apply(unravel(w), x).reshape(-1)))
  expected = (
    np.asarray(jac(flat, x1), np.float64) @ np.asarray(jac(flat, x2), np.float64).T
  )  # (sample, output) rows
  full = _kernel(module.apply, params, x1, x2, trace_outputs=False, implementation="jacobian")
  _assert_close(ntk.full_to_matrix(full), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_param_sets_equals_loop(impl):
  module, _, x1, x2, stack = _setup("mlp_relu")
  param_sets = [module.init(jax.random.key(10 + s), x1) for s in range(3)]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *param_sets)
  fn = lambda p: ntk.empirical_ntk(
    module.apply, p, x1, x2, implementation=impl, dense_stack=stack, chunk_size=2
  )
  batched = jax.jit(jax.vmap(fn))(stacked)
  looped = jnp.stack([fn(p) for p in param_sets])
  np.testing.assert_allclose(batched, looped, rtol=0, atol=RTOL * float(jnp.max(jnp.abs(looped))))


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_compiles_once_per_shape(impl):
  traces = []

  def counting_tanh(z):
    traces.append(None)  # Python side effect: runs only while tracing
    return jnp.tanh(z)

  module = DenseNet((5,), 3, counting_tanh)
  x = jax.random.normal(jax.random.key(0), (4, 6))
  params = module.init(jax.random.key(1), x)
  traces.clear()
  fn = ntk.make_ntk_fn(module.apply, implementation=impl, dense_stack=module.stack(), chunk_size=2)
  k1 = fn(params, x)
  num_traces = len(traces)
  assert num_traces > 0
  x_new = jax.random.normal(jax.random.key(5), x.shape)
  k2 = fn(params, x_new)
  assert len(traces) == num_traces
  assert fn._cache_size() == 1
  assert not np.allclose(k1, k2)  # really recomputed for the new data


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_padding_rows_leave_other_entries_unchanged(impl):
  module, params, x1, x2, stack = _setup("mlp_relu")
  pad = lambda x, k: jnp.concatenate([x, jnp.zeros((k, *x.shape[1:]), x.dtype)])
  kw = dict(implementation=impl, dense_stack=stack, chunk_size=3)
  k = _kernel(module.apply, params, x1, x2, **kw)
  k_padded = _kernel(module.apply, params, pad(x1, 3), pad(x2, 2), **kw)
  assert k_padded.shape == (x1.shape[0] + 3, x2.shape[0] + 2)
  np.testing.assert_allclose(
    k_padded[: x1.shape[0], : x2.shape[0]], k, rtol=0, atol=RTOL * float(jnp.max(jnp.abs(k)))
  )


def test_auto_picks_structured_when_dense_stack_given():
  module, params, x1, x2, stack = _setup("mlp_relu")

  def must_not_be_called(p, x):
    raise AssertionError("structured NTK must not call apply_fn")

  k = ntk.empirical_ntk(must_not_be_called, params, x1, x2, dense_stack=stack)  # eager on purpose
  expected = np.einsum("ijcc->ij", _reference("mlp_relu")) / 3
  _assert_close(k, expected)


@pytest.mark.parametrize("n,chunk", [(7, 3), (6, 3), (5, 1), (4, 10)])
def test_map_blocks_covers_every_row_once(n, chunk):
  x = jnp.arange(n * 2, dtype=jnp.float32).reshape(n, 2)
  seen = []

  def fn(block):
    seen.append(block.shape[0])
    return {"y": block * 2 + 1}

  out = _kernels.map_blocks(fn, x, chunk)
  np.testing.assert_array_equal(out["y"], x * 2 + 1)
  assert seen[0] <= chunk


# ----------------------------------------------------------------------------
# Errors.


def test_unknown_implementation_lists_choices():
  module, params, x1, _, _ = _setup("mlp_relu")
  with pytest.raises(ValueError, match=r"'fast'.*'jacobian', 'ntvp', 'structured'"):
    ntk.empirical_ntk(module.apply, params, x1, implementation="fast")
  with pytest.raises(ValueError, match="'fast'"):
    ntk.make_ntk_fn(module.apply, implementation="fast")


def test_structured_needs_dense_stack():
  module, params, x1, _, _ = _setup("mlp_relu")
  with pytest.raises(ValueError, match="dense_stack"):
    ntk.empirical_ntk(module.apply, params, x1, implementation="structured")
  with pytest.raises(ValueError, match="dense_stack"):
    ntk.make_ntk_fn(module.apply, implementation="structured")


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_feature_shapes(impl):
  module, params, x1, _, stack = _setup("mlp_relu")
  with pytest.raises(ValueError, match="same feature shape"):
    ntk.empirical_ntk(
      module.apply, params, x1, jnp.zeros((3, 7)), implementation=impl, dense_stack=stack
    )


def test_structured_rejects_wrong_input_width_and_missing_layer():
  module, params, _, _, stack = _setup("mlp_relu")
  with pytest.raises(ValueError, match="7 features.*takes 6"):
    ntk.empirical_ntk(module.apply, params, jnp.zeros((3, 7)), dense_stack=stack)
  bad_stack = DenseStack(("dense_0", "nope"), nn.relu)
  with pytest.raises(ValueError, match="'nope' not found"):
    ntk.empirical_ntk(module.apply, params, jnp.zeros((3, 6)), dense_stack=bad_stack)


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5])
def test_bad_chunk_size(chunk_size):
  module, params, x1, _, _ = _setup("mlp_relu")
  with pytest.raises(ValueError, match="chunk_size"):
    ntk.empirical_ntk(module.apply, params, x1, implementation="jacobian", chunk_size=chunk_size)


def test_outputs_must_be_batch_by_classes():
  module, params, x1, _, _ = _setup("mlp_relu")
  with pytest.raises(ValueError, match=r"\[B, C\]"):
    ntk.empirical_ntk(lambda p, x: module.apply(p, x).sum(-1), params, x1, implementation="ntvp")


def test_full_to_matrix_rejects_non_4d():
  with pytest.raises(ValueError, match=r"\[N1, N2, C, C\]"):
    ntk.full_to_matrix(jnp.zeros((3, 3)))


# ----------------------------------------------------------------------------
# With the library's own models (ntk_fl.models).


def test_library_mlp_dense_stack():
  """``ntk_fl.models.mlp``'s ``dense_stack`` drives the structured kernel correctly (jitted apply inside)."""
  from ntk_fl import models

  model = models.mlp(5, (7, 6), 3, "tanh")
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  x1 = jax.random.normal(k1, (3, 5))
  x2 = jax.random.normal(k2, (2, 5))
  params = model.init(k3)
  params = jax.tree.map(lambda w: w + 0.1, params)  # non-zero biases
  full = _brute_full(model.apply, params, x1, x2)
  k = _kernel(model.apply, params, x1, x2, dense_stack=model.dense_stack)
  _assert_close(k, np.einsum("ijcc->ij", full) / 3)


def test_one_enum_for_the_implementation():
  # neural-tangents' values, this library's names as aliases and strings, one class under both names.
  impl = ntk.NtkImplementation
  assert impl is ntk.Implementation
  assert [(m.name, int(m)) for m in impl] == [
    ("AUTO", 0),
    ("JACOBIAN_CONTRACTION", 1),
    ("NTK_VECTOR_PRODUCTS", 2),
    ("STRUCTURED_DERIVATIVES", 3),
  ]
  assert impl.JACOBIAN is impl.JACOBIAN_CONTRACTION and impl("ntvp") is impl.NTK_VECTOR_PRODUCTS
  assert (
    tuple(m.short_name for m in impl)
    == ntk.IMPLEMENTATIONS
    == ("auto", "jacobian", "ntvp", "structured")
  )
  module, params, x1, _, _ = _setup("mlp_relu")
  by_name = ntk.empirical_ntk(module.apply, params, x1, implementation="ntvp")
  by_member = ntk.empirical_ntk(module.apply, params, x1, implementation=impl.NTK_VECTOR_PRODUCTS)
  np.testing.assert_array_equal(by_name, by_member)
  with pytest.raises(ValueError, match="unknown NTK implementation True"):
    ntk.empirical_ntk(module.apply, params, x1, implementation=True)


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("name", ["mlp_tanh_deep", "cnn"])
def test_ntvp_float64_matches_jax_jacobian(name, chunk):
  """``'ntvp'`` in float64 (the Jacobian rows of ``x2`` pushed through the ``jvp`` at ``x1``),
  traced and full, with ``x2`` given and ``x2=None``, against the float64 ``jax.jacobian`` kernel
  to 1e-10 relative. ``chunk_size=2`` takes blocks of 2 samples on both sides (the ``x1`` and
  ``x2`` blocks zero-padded where the counts are odd, the rows of ``x2`` recomputed per ``x1``
  block); ``None`` one ``x1`` block and the ``x2`` samples in blocks of the row budget."""
  module, params, x1, x2, _ = _setup(name)
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    a64, b64 = jnp.asarray(x1, jnp.float64), jnp.asarray(x2, jnp.float64)
    flat, unravel = ravel_pytree(p64)
    jac = np.asarray(
      jax.jit(jax.jacobian(lambda w: module.apply(unravel(w), jnp.concatenate([a64, b64]))))(flat)
    )
    j1, j2 = jac[: x1.shape[0]], jac[x1.shape[0] :]

    def both(p, a, b):
      kw = dict(implementation="ntvp", chunk_size=chunk)
      return tuple(
        ntk.empirical_ntk(module.apply, p, a, b, trace_outputs=t, **kw) for t in (True, False)
      )

    for left, right, b in ((j1, j2, b64), (j1, j1, None)):
      want_full = np.einsum("iap,jbp->ijab", left, right)
      want_traced = np.einsum("ijcc->ij", want_full) / want_full.shape[-1]
      traced, full = jax.jit(both)(p64, a64, b)
      assert traced.dtype == full.dtype == jnp.float64
      _assert_close(traced, want_traced, rtol=1e-10)
      _assert_close(full, want_full, rtol=1e-10)


@pytest.mark.parametrize(
  "name,traced,full",
  [
    ("mlp_relu", "ntvp", "ntvp"),
    ("mlp_tanh_deep", "ntvp", "ntvp"),
    ("cnn", "jacobian", "jacobian"),
  ],
)
def test_auto_generic_choice_by_forward_flops(name, traced, full):
  """``'auto'``'s generic kernel (no dense stack, no ``flax_apply``) from one sample's forward FLOPs
  ``F``: traced ``'ntvp'`` when ``F <= 2.5·d`` and ``N1·N2 <= 256²``, full when ``F <= C·d`` (any
  ``N``). The dense nets use each weight once per sample (``F`` between the ``2·w`` of their weight
  matrices and ``2·d`` plus one operation per hidden unit), the conv net reuses its kernel over the
  36 positions (``F`` above ``16·2·w_conv``, the 16 inner ones). ``'auto'`` computes the chosen
  kernel bit for bit, and it is the brute-force one (float32 here; float64 to 1e-10 in
  :func:`test_auto_generic_kernels_float64`)."""
  module, params, x1, x2, _ = _setup(name)
  c = _reference(name).shape[-1]
  flops = _kernels.forward_flops(module.apply, params, x1[:1])
  d = ravel_pytree(params)[0].size
  tree = params["params"]
  if name == "cnn":  # at least the whole 3x3 kernel at each of the 4x4 inner positions of 6x6
    assert flops >= 16 * 2 * tree["Conv_0"]["kernel"].size > 2.5 * d
  else:
    weights = sum(layer["kernel"].size for layer in tree.values())
    hidden = sum(layer["bias"].size for layer in tree.values()) - c
    assert 2 * weights <= flops <= 2 * d + hidden <= 2.5 * d
  assert (flops <= 2.5 * d) == (traced == "ntvp") and (flops <= c * d) == (full == "ntvp")
  for t, want in ((True, traced), (False, full)):
    choice = lambda pairs: _kernels.generic_choice(module.apply, params, x1[:1], c, t, pairs)
    assert choice(x1.shape[0] * x2.shape[0]) == choice(256**2) == ntk.NtkImplementation(want)
    assert choice(256**2 + 1) == ntk.NtkImplementation("jacobian" if t else want)
    got = _kernel(module.apply, params, x1, x2, trace_outputs=t)
    np.testing.assert_array_equal(
      got, _kernel(module.apply, params, x1, x2, trace_outputs=t, implementation=want)
    )
    ref = _reference(name)
    _assert_close(got, np.einsum("ijcc->ij", ref) / c if t else ref)


def test_auto_whole_batch_takes_the_contraction():
  """A batch differentiated as one sample (``empirical_ntk_fn``'s ``vmap_axes=None``: ``N`` samples'
  outputs as one sample's ``N·C``) costs ``N`` forward passes per ``jvp``, ``F = N·F_1 > 2.5·d``:
  traced, ``'auto'`` takes the ``'jacobian'`` contraction even for a dense net, whose single samples
  take ``'ntvp'``."""
  module, params, x1, _, _ = _setup("mlp_relu")
  whole = lambda p, xb: module.apply(p, xb[0]).reshape(1, -1)
  c = x1.shape[0] * _reference("mlp_relu").shape[-1]
  jacobian, ntvp = ntk.NtkImplementation.JACOBIAN, ntk.NtkImplementation.NTVP
  assert _kernels.generic_choice(whole, params, x1[None], c, True, 1) == jacobian
  assert _kernels.generic_choice(module.apply, params, x1[:1], c, True, 1) == ntvp


@pytest.mark.parametrize("name", ["mlp_tanh_deep", "cnn"])
def test_auto_generic_kernels_float64(name, x64):
  """The kernels ``'auto'`` computes without structure (traced and full, ``x2`` given and ``None``;
  ``'ntvp'`` for the dense net, ``'jacobian'`` for the conv net), in float64, against the float64
  ``jax.jacobian`` kernel to 1e-10 relative."""
  del x64
  module, params, x1, x2, _ = _setup(name)
  p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
  a64, b64 = jnp.asarray(x1, jnp.float64), jnp.asarray(x2, jnp.float64)
  for b in (b64, None):
    want = _brute_full(module.apply, p64, a64, a64 if b is None else b)
    for t in (True, False):
      got = _kernel(module.apply, p64, a64, b, trace_outputs=t)
      assert got.dtype == jnp.float64
      _assert_close(got, np.einsum("ijcc->ij", want) / want.shape[-1] if t else want, rtol=1e-10)
