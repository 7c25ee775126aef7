"""ntk_fl.ntk.empirical_ntk_fn against neural-tangents 0.6.5 itself, and against brute-force Jacobians.

tests/data/neural_tangents_reference.npz holds kernels that neural-tangents
computed in its own environment (scripts/nt_oracle/build_references.sh; the
versions are recorded in the file) for the library's 784-100-10 MLP, its small
CNN, a fully convolutional net with ``[N, H, W, K]`` outputs and a conv+dense net
with strided and padded convolutions, together with the parameters and inputs.
The references are float64; the library's kernels are compared in float32
(relative to the kernel's largest entry) and, for a few cases, in float64.
Settings the file does not cover (batch axes other than 0, ``x1`` and ``x2`` of
different shapes without a batch axis, a trace or diagonal over the batch axis
with ``x2`` given, scalar outputs) are checked against a kernel contracted from
``jax.jacrev`` Jacobians of the whole batch.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from ntk_fl import models
from ntk_fl._src import layerwise
from ntk_fl._src.kernels import _blocked_kernel
from ntk_fl.ntk import NtkImplementation, empirical_ntk, empirical_ntk_fn

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "neural_tangents_reference.npz")
# float32 kernels are sums of up to ~10^5 products: measured errors are below 2e-6 of the kernel's
# largest entry; the tolerance leaves a factor of ~10 for other CPUs' summation orders.
RTOL32 = 200 * float(jnp.finfo(jnp.float32).eps)
RTOL64 = 1e-11
IMPL = NtkImplementation


@functools.cache
def _reference():
  data = np.load(REFERENCE)
  return {k: data[k] for k in data.files}


def _cases():
  return json.loads(str(_reference()["cases"]))


def _params(net, dtype=jnp.float32):
  prefix = f"{net}/params/"
  tree = {}
  for key, value in _reference().items():
    if key.startswith(prefix):
      layer, name = key[len(prefix) :].split("/")
      tree.setdefault(layer, {})[name] = jnp.asarray(value, dtype)
  return {"params": tree}


def _conv_same(p, x):
  y = jax.lax.conv_general_dilated(
    x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + p["bias"]


def conv_features(params, x):
  """conv3x3(1 -> 4)-relu-conv3x3(4 -> 2): ``[N, H, W, 1] -> [N, H, W, 2]`` (as the oracle script)."""
  p = params["params"]
  return _conv_same(p["conv_1"], jax.nn.relu(_conv_same(p["conv_0"], x)))


class ConvDense(nn.Module):
  """``[N, 7, 7, 2]`` -> conv3x3 stride 2, padding 1 (4 ch.) -> relu -> conv3x3 stride 2 'SAME' (3 ch.)
  -> tanh -> dense 8 -> relu -> dense 3 (as the oracle script's; its outputs are in the file)."""

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Conv(4, (3, 3), strides=2, padding=((1, 1), (1, 1)), name="conv_0")(x))
    x = jnp.tanh(nn.Conv(3, (3, 3), strides=2, padding="SAME", name="conv_1")(x))
    x = jax.nn.relu(nn.Dense(8, name="dense_0")(x.reshape(x.shape[0], -1)))
    return nn.Dense(3, name="dense_1")(x)


MLP = models.mlp(784, (100,), 10)
CNN = models.cnn((4, 4, 1), num_classes=5)
NETWORKS = {
  "mlp": MLP.apply,
  "cnn": CNN.apply,
  "conv_features": conv_features,
  "conv_dense": ConvDense().apply,
}


def _max_rel(actual, expected):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def _ntk_fn(case, implementation, vmap_axes=0):
  return empirical_ntk_fn(
    NETWORKS[case["network"]],
    case["trace_axes"],
    case["diagonal_axes"],
    vmap_axes,
    implementation,
    dense_stack=MLP.dense_stack if case["network"] == "mlp" else None,
  )


@functools.cache
def _kernels_in_one_program(runs, dtype_name="float32"):
  """``{(name, implementation, vmap_axes): kernel}`` for ``runs``, cases of one network, computed in one
  compiled program (compiling is most of a small kernel's time; one program per case compiled the
  network's fixed parts once per case). Each kernel is still its own case's ``empirical_ntk_fn``, and
  each test compares its own kernel with the reference."""
  dtype = jnp.dtype(dtype_name)
  cases = [next(c for c in _cases() if c["name"] == name) for name, _, _ in runs]
  (net,) = {c["network"] for c in cases}
  ref = _reference()
  second = {c["x2"] for c in cases} - {None}
  with jax.enable_x64(dtype == jnp.float64):
    x1 = jnp.asarray(ref[f"{net}/x1"], dtype)
    others = {key: jnp.asarray(ref[f"{net}/{key}"], dtype) for key in sorted(second)}
    fns = [_ntk_fn(c, impl, axes) for c, (_, impl, axes) in zip(cases, runs)]

    def kernels(params, x1, others):
      return [
        fn(x1, None if c["x2"] is None else others[c["x2"]], params) for fn, c in zip(fns, cases)
      ]

    return dict(zip(runs, jax.jit(kernels)(_params(net, dtype), x1, others)))


# ----------------------------------------------------------------------------
# The reference file.


def test_reference_file_is_small_and_records_its_versions():
  assert os.path.getsize(REFERENCE) < 600_000
  versions = json.loads(str(_reference()["versions"]))
  assert versions["neural_tangents"] == "0.6.5"
  assert {"jax", "jaxlib", "tensorflow", "numpy", "python"} <= set(versions)
  assert {c["network"] for c in _cases()} == {"mlp", "cnn", "conv_features", "conv_dense"}


@pytest.mark.parametrize("net", ["mlp", "cnn", "conv_dense"])
def test_references_were_computed_on_the_library_networks(net):
  ref = _reference()
  fx = NETWORKS[net](_params(net), jnp.asarray(ref[f"{net}/x1"]))
  np.testing.assert_allclose(np.asarray(fx), ref[f"{net}/f_x1"], rtol=1e-5, atol=1e-5)


def test_neural_tangents_trace_is_the_mean_over_outputs():
  """neural-tangents' trace_axes=(-1,) is one C-th of the summed trace of its full kernel: this library's
  traced kernel, which matches neural-tangents' own float32 result to float32 precision."""
  ref = _reference()
  full, traced = ref["mlp/full/kernel"], ref["mlp/trace_last/kernel"]
  np.testing.assert_allclose(np.einsum("ijcc->ij", full) / 10, traced, rtol=1e-12)
  traced_kernel = jax.jit(
    functools.partial(empirical_ntk, MLP.apply, trace_outputs=True, implementation="jacobian")
  )
  ours = traced_kernel(_params("mlp"), jnp.asarray(ref["mlp/x1"]), jnp.asarray(ref["mlp/x2"]))
  assert _max_rel(ours, ref["mlp/trace_last/kernel_float32"]) < RTOL32
  assert _max_rel(ours, traced) < RTOL32


# ----------------------------------------------------------------------------
# empirical_ntk_fn against the references.

ORACLE_RUNS = (
  # every case of the cheap networks with every implementation
  [
    (c["name"], impl)
    for c in _cases()
    if c["network"] == "mlp"
    for impl in (IMPL.JACOBIAN_CONTRACTION, IMPL.NTK_VECTOR_PRODUCTS, IMPL.STRUCTURED_DERIVATIVES)
  ]
  + [
    (c["name"], impl)
    for c in _cases()
    if c["network"] == "conv_features"
    for impl in (IMPL.JACOBIAN_CONTRACTION, IMPL.NTK_VECTOR_PRODUCTS)
  ]
  # the CNN (slow to compile): each implementation once
  + [
    ("cnn/trace_last", IMPL.JACOBIAN_CONTRACTION),
    ("cnn/full", IMPL.NTK_VECTOR_PRODUCTS),
    ("cnn/diag_batch", IMPL.AUTO),
  ]
  + [("mlp/trace_last", IMPL.AUTO), ("conv_features/trace_spatial", IMPL.AUTO)]
  # the conv+dense net's generic kernels (its layer-wise ones: below)
  + [
    ("conv_dense/trace_last", IMPL.JACOBIAN_CONTRACTION),
    ("conv_dense/full_self", IMPL.NTK_VECTOR_PRODUCTS),
  ]
)


WITHOUT_VMAP_AXES = [
  "mlp/full",
  "mlp/diag_batch",
  "conv_features/trace_spatial",
  "conv_features/diag_batch_last_trace_rows",
]
FLOAT64_RUNS = [
  ("mlp/full", IMPL.STRUCTURED_DERIVATIVES),
  ("mlp/diag_outputs", IMPL.NTK_VECTOR_PRODUCTS),
  ("conv_features/diag_spatial_trace_last", IMPL.JACOBIAN_CONTRACTION),
]
# (name, implementation, vmap_axes) of every kernel the three tests below compare, per dtype.
RUNS = {
  "float32": [(n, i, 0) for n, i in ORACLE_RUNS]
  + [(n, IMPL.JACOBIAN_CONTRACTION, None) for n in WITHOUT_VMAP_AXES],
  "float64": [(n, i, 0) for n, i in FLOAT64_RUNS],
}


def _oracle_kernel(name, implementation, vmap_axes=0, dtype_name="float32"):
  """The kernel of one run, from its network's one program for every run of that network and dtype."""
  net = name.split("/")[0]
  group = tuple(r for r in RUNS[dtype_name] if r[0].split("/")[0] == net)
  return _kernels_in_one_program(group, dtype_name)[(name, implementation, vmap_axes)]


@pytest.mark.parametrize(
  "name,implementation", ORACLE_RUNS, ids=[f"{n}-{i.name}" for n, i in ORACLE_RUNS]
)
def test_matches_neural_tangents(name, implementation):
  assert _max_rel(_oracle_kernel(name, implementation), _reference()[f"{name}/kernel"]) < RTOL32


@pytest.mark.parametrize("name", WITHOUT_VMAP_AXES)
def test_matches_neural_tangents_without_vmap_axes(name):
  kernel = _oracle_kernel(name, IMPL.JACOBIAN_CONTRACTION, vmap_axes=None)
  assert _max_rel(kernel, _reference()[f"{name}/kernel"]) < RTOL32


@pytest.mark.parametrize("name,implementation", FLOAT64_RUNS)
def test_matches_neural_tangents_in_float64(name, implementation):
  kernel = _oracle_kernel(name, implementation, dtype_name="float64")
  assert kernel.dtype == jnp.float64
  assert _max_rel(kernel, _reference()[f"{name}/kernel"]) < RTOL64


CNN_LAYERWISE = ["cnn/trace_last", "cnn/full", "cnn/diag_batch"]


@functools.cache
def _cnn_layerwise_kernels(dtype_name):
  """The CNN's layer-wise structured kernels of every case of :data:`CNN_LAYERWISE` in one program per
  dtype, on the float32 inputs (cast up for float64) and the parameters in that dtype."""
  dtype = jnp.dtype(dtype_name)
  ref = _reference()
  cases = [next(c for c in _cases() if c["name"] == name) for name in CNN_LAYERWISE]
  fns = [
    empirical_ntk_fn(
      CNN.flax_apply, c["trace_axes"], c["diagonal_axes"], 0, IMPL.STRUCTURED_DERIVATIVES
    )
    for c in cases
  ]
  with jax.enable_x64(dtype == jnp.float64):
    cast = lambda key: jnp.asarray(np.asarray(ref[f"cnn/{key}"], np.float32), dtype)
    x1, others = cast("x1"), {c["x2"]: cast(c["x2"]) for c in cases if c["x2"] is not None}

    def kernels(params, x1, others):
      return [
        fn(x1, None if c["x2"] is None else others[c["x2"]], params) for fn, c in zip(fns, cases)
      ]

    return dict(zip(CNN_LAYERWISE, jax.jit(kernels)(_params("cnn", dtype), x1, others)))


@pytest.mark.parametrize("name", CNN_LAYERWISE)
def test_cnn_layerwise_structured_matches_neural_tangents(name):
  """The layer-wise structured kernel of the CNN (its flax layers intercepted, no declaration)."""
  expected = _reference()[f"{name}/kernel"]
  assert _max_rel(_cnn_layerwise_kernels("float32")[name], expected) < RTOL32
  kernel = _cnn_layerwise_kernels("float64")[name]
  assert kernel.dtype == jnp.float64
  assert _max_rel(kernel, expected) < RTOL64


CONV_DENSE = [
  "conv_dense/trace_last",
  "conv_dense/full",
  "conv_dense/trace_last_self",
  "conv_dense/full_self",
]


def _conv_dense_inputs(case, dtype):
  ref = _reference()
  x1 = jnp.asarray(ref["conv_dense/x1"], dtype)
  x2 = None if case["x2"] is None else jnp.asarray(ref[f"conv_dense/{case['x2']}"], dtype)
  return x1, x2, _params("conv_dense", dtype)


@pytest.mark.parametrize("name", CONV_DENSE)
def test_conv_dense_layerwise_matches_neural_tangents(name):
  """Strided and padded convolutions and dense layers, all factorised (the convolutions on their
  input patches, whatever the cost rule would pick), in one batch and in blocks of 2 samples; and
  as ``empirical_ntk_fn`` routes them. float32 and float64."""
  case = next(c for c in _cases() if c["name"] == name)
  ref = _reference()
  expected = ref[f"{name}/kernel"]
  trace_outputs = bool(case["trace_axes"])
  apply_fn = ConvDense().apply
  x1, _, params = _conv_dense_inputs(case, jnp.float32)
  plan = layerwise.make_plan(apply_fn, params, x1[:1], trace_outputs, "factorise")
  assert [layer.path for layer in plan.factorised] == [
    ("conv_0",),
    ("conv_1",),
    ("dense_0",),
    ("dense_1",),
  ]
  assert [layer.positions for layer in plan.factorised] == [16, 4, 1, 1]  # 7x7 -> 4x4 -> 2x2
  assert plan.num_rest == 0
  ntk_fn = empirical_ntk_fn(
    apply_fn, case["trace_axes"], case["diagonal_axes"], 0, IMPL.STRUCTURED_DERIVATIVES
  )
  chunks = (None, 2)

  def kernels_of(p, a, b):  # one compiled program per dtype for the three kernels, not one each
    factorised = [
      layerwise.layerwise_kernel(
        apply_fn, p, a, b, trace_outputs, chunk, route="factorise", blocked=_blocked_kernel
      )
      for chunk in chunks
    ]
    return factorised, ntk_fn(a, b, p)

  for dtype, rtol in ((jnp.float32, RTOL32), (jnp.float64, RTOL64)):
    with jax.enable_x64(dtype == jnp.float64):
      x1, x2, params = _conv_dense_inputs(case, dtype)
      factorised, routed = jax.jit(kernels_of)(params, x1, x2)
      for chunk, kernel in zip(chunks, factorised):
        assert kernel.dtype == dtype
        assert _max_rel(kernel, expected) < rtol, (dtype, chunk)
      assert _max_rel(routed, expected) < rtol, dtype
  # neural-tangents' own float32 kernel is as close to the float64 reference as the tolerance says.
  assert _max_rel(ref[f"{name}/kernel_float32"], expected) < RTOL32


# ----------------------------------------------------------------------------
# Brute force: Jacobians of the whole batch, contracted entry by entry.


def _brute_force(f, params, x1, x2, trace_axes, diagonal_axes):
  """NTK from ``jax.jacrev`` of ``f`` on the whole batches, traces and diagonals taken entry by entry."""
  x2 = x1 if x2 is None else x2
  flat, unravel = ravel_pytree(params)
  # Jitted: op by op, every operation of the network's reverse pass compiles on its own.
  j1 = jax.jit(jax.jacrev(lambda w: f(unravel(w), x1)))(flat)  # [*fx1, P]
  j2 = jax.jit(jax.jacrev(lambda w: f(unravel(w), x2)))(flat)
  full = np.tensordot(np.asarray(j1, np.float64), np.asarray(j2, np.float64), axes=(-1, -1))
  shape1, shape2 = j1.shape[:-1], j2.shape[:-1]
  nd = len(shape1)
  trace = {a % nd for a in trace_axes}
  diagonal = {a % nd for a in diagonal_axes}
  out_shape = []
  for k in range(nd):
    out_shape += [] if k in trace else [shape1[k]] if k in diagonal else [shape1[k], shape2[k]]
  out = np.zeros(out_shape)
  for i1 in itertools.product(*map(range, shape1)):
    for i2 in itertools.product(*map(range, shape2)):
      if any(i1[k] != i2[k] for k in trace | diagonal):
        continue
      index = []
      for k in range(nd):
        index += [] if k in trace else [i1[k]] if k in diagonal else [i1[k], i2[k]]
      out[tuple(index)] += full[i1 + i2]
  return out / math.prod(shape1[k] for k in trace)


def _batch_last_mlp(params, x):
  """A dense net on ``x [D, N]`` (samples along the last axis) returning ``[C, N]``."""
  return (jnp.tanh(x.T @ params["w1"] + params["b1"]) @ params["w2"].T).T


@functools.cache
def _small_problem():
  k = jax.random.split(jax.random.PRNGKey(3), 6)
  params = {
    "w1": jax.random.normal(k[0], (5, 7)) / 2,
    "b1": jax.random.normal(k[1], (7,)),
    "w2": jax.random.normal(k[2], (3, 7)) / 2,
  }
  return (
    params,
    jax.random.normal(k[3], (5, 4)),
    jax.random.normal(k[4], (5, 4)),
    jax.random.normal(k[5], (5, 2)),
  )


BATCH_LAST_IMPLS = [IMPL.JACOBIAN_CONTRACTION, IMPL.NTK_VECTOR_PRODUCTS]
BATCH_LAST_AXES = [
  ((0,), (), "x2"),  # trace over outputs (axis 0 here), batch pairs kept
  ((), (1,), "x2"),  # diagonal over the batch with x2 != x1
  ((1,), (), "x2"),  # trace over the batch with x2 != x1: mean over i of K(x1_i, x2_i)
  ((), (), "x3"),  # full kernel, N1 = 4, N2 = 2
  ((-2, -1), (), None),  # negative axes: trace over everything
]
UNBATCHED_AXES = [((), ()), ((), (0,)), ((0,), ())]
# (vmap_axes, implementation, trace_axes, diagonal_axes, second input) of every kernel of the two tests below.
SMALL_RUNS = [
  ((1, 1, {}), impl, t, d, second) for impl in BATCH_LAST_IMPLS for t, d, second in BATCH_LAST_AXES
] + [(None, IMPL.NTK_VECTOR_PRODUCTS, t, d, "x3") for t, d in UNBATCHED_AXES]


@functools.cache
def _small_problem_kernels():
  """Every kernel of :data:`SMALL_RUNS` on :func:`_small_problem`, in one compiled program (not one each),
  keyed by its run without ``vmap_axes`` (``None`` or ``'batched'`` in its place)."""
  params, x1, x2, x3 = _small_problem()
  fns = [empirical_ntk_fn(_batch_last_mlp, t, d, axes, impl) for axes, impl, t, d, _ in SMALL_RUNS]

  def kernels(params, x1, x2, x3):
    other = {"x2": x2, "x3": x3, None: None}
    return [fn(x1, other[run[-1]], params) for fn, run in zip(fns, SMALL_RUNS)]

  keys = [(axes and "batched", *rest) for axes, *rest in SMALL_RUNS]
  return dict(zip(keys, jax.jit(kernels)(params, x1, x2, x3)))


@functools.cache
def _small_problem_brute_force(trace_axes, diagonal_axes, second):
  params, x1, x2, x3 = _small_problem()
  other = {"x2": x2, "x3": x3, None: None}[second]
  return _brute_force(_batch_last_mlp, params, x1, other, trace_axes, diagonal_axes)


@pytest.mark.parametrize("implementation", BATCH_LAST_IMPLS)
@pytest.mark.parametrize("trace_axes,diagonal_axes,second", BATCH_LAST_AXES)
def test_batch_axis_elsewhere_matches_brute_force(
  implementation, trace_axes, diagonal_axes, second
):
  kernel = _small_problem_kernels()[("batched", implementation, trace_axes, diagonal_axes, second)]
  expected = _small_problem_brute_force(trace_axes, diagonal_axes, second)
  assert _max_rel(kernel, expected) < RTOL32


@pytest.mark.parametrize("trace_axes,diagonal_axes", UNBATCHED_AXES)
def test_unbatched_inputs_of_different_shapes_match_brute_force(trace_axes, diagonal_axes):
  """vmap_axes=None with x1 [5, 4] and x2 [5, 2]: f's outputs [3, 4] and [3, 2] are one sample each."""
  kernel = _small_problem_kernels()[
    (None, IMPL.NTK_VECTOR_PRODUCTS, trace_axes, diagonal_axes, "x3")
  ]
  expected = _small_problem_brute_force(trace_axes, diagonal_axes, "x3")
  assert _max_rel(kernel, expected) < RTOL32


def test_scalar_outputs_and_keyword_arguments_match_brute_force():
  params, x1, x2, _ = _small_problem()

  def f(p, x, scale):  # [N, D] -> [N]
    return scale * _batch_last_mlp(p, x.T)[0]

  ntk_fn = empirical_ntk_fn(f, trace_axes=(), implementation=IMPL.JACOBIAN_CONTRACTION)
  expected = _brute_force(functools.partial(f, scale=2.0), params, x1.T, x2.T, (), ())
  assert _max_rel(jax.jit(ntk_fn)(x1.T, x2.T, params, scale=2.0), expected) < RTOL32


def test_default_is_the_library_traced_kernel():
  ref = _reference()
  x1, x2 = jnp.asarray(ref["mlp/x1"]), jnp.asarray(ref["mlp/x2"])
  expected = jax.jit(functools.partial(empirical_ntk, MLP.apply, dense_stack=MLP.dense_stack))(
    _params("mlp"), x1, x2
  )
  kernel = jax.jit(empirical_ntk_fn(MLP.apply, dense_stack=MLP.dense_stack))(x1, x2, _params("mlp"))
  assert _max_rel(kernel, expected) < RTOL32


# ----------------------------------------------------------------------------
# Errors, early and naming the bad value.


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(implementation=7), "unknown implementation 7"),
    (dict(implementation="jacobian"), "must be an NtkImplementation"),
    (dict(implementation=IMPL.STRUCTURED_DERIVATIVES), "needs dense_stack"),
    (dict(trace_axes="last"), "trace_axes must be an int"),
    (dict(diagonal_axes=(0.5,)), "diagonal_axes must be an int"),
    (dict(vmap_axes=(0, 0, {"mask": 0})), "batched keyword arguments"),
    (dict(vmap_axes="batch"), "vmap_axes must be None"),
    (dict(chunk_size=0), "chunk_size must be"),
  ],
)
def test_bad_options_are_rejected_when_the_function_is_made(kwargs, match):
  with pytest.raises(ValueError, match=match):
    empirical_ntk_fn(MLP.apply, **kwargs)


@pytest.mark.parametrize(
  "kwargs,x2_rows,match",
  [
    (dict(trace_axes=(-1,), diagonal_axes=(1,)), 3, "share an output axis"),
    (dict(trace_axes=(2,)), 3, "out of range"),
    (dict(trace_axes=(0,)), 3, r"must agree on it; got shapes \(4, 10\) and \(3, 10\)"),
    (dict(diagonal_axes=(0,)), 3, "must agree on it"),
    (dict(vmap_axes=(2, 0, {})), 3, "in_axis 2 is out of range"),
  ],
)
def test_bad_axes_are_rejected_when_called(kwargs, x2_rows, match):
  ref = _reference()
  ntk_fn = empirical_ntk_fn(MLP.apply, **kwargs)
  with pytest.raises(ValueError, match=match):
    ntk_fn(jnp.asarray(ref["mlp/x1"]), jnp.asarray(ref["mlp/x2"])[:x2_rows], _params("mlp"))


def test_mismatched_inputs_and_pytrees_are_rejected():
  ref = _reference()
  ntk_fn = empirical_ntk_fn(MLP.apply, vmap_axes=0)
  x1 = jnp.asarray(ref["mlp/x1"])
  with pytest.raises(ValueError, match="must agree on every axis but the batch axis"):
    ntk_fn(x1, x1[:, :100], _params("mlp"))
  with pytest.raises(ValueError, match="x1 must be an array"):
    ntk_fn({"image": x1}, None, _params("mlp"))
  two_outputs = lambda p, x: {"logits": MLP.apply(p, x), "probs": jax.nn.softmax(MLP.apply(p, x))}
  for vmap_axes in (0, None):
    with pytest.raises(ValueError, match="pytree outputs are not supported"):
      empirical_ntk_fn(two_outputs, vmap_axes=vmap_axes)(x1, None, _params("mlp"))
  structured = empirical_ntk_fn(
    conv_features,
    vmap_axes=0,
    implementation=IMPL.STRUCTURED_DERIVATIVES,
    dense_stack=MLP.dense_stack,
  )
  with pytest.raises(ValueError, match=r"outputs \[C\] per sample"):
    structured(jnp.asarray(ref["conv_features/x1"]), None, _params("conv_features"))
