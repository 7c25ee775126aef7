"""Stage 2 of the neural-tangents oracle (runs in the oracle environment, not the library's).

Reads stage 1's parameters and inputs, rebuilds the four networks as plain JAX
functions ``f(params, x)`` (the same computations as the flax modules of
``ntk_fl.models`` and stage 1's ``ConvDense``, checked against the outputs stage 1
stored), and computes reference kernels with ``neural_tangents.empirical_ntk_fn``
for every case in :data:`CASES`: in float64 (the stored reference) and, for the
MLP and the conv+dense net without diagonal axes, also in float32
(neural-tangents' own single-precision result), with ``NtkImplementation.JACOBIAN_CONTRACTION``;
the other two implementations and ``vmap_axes=None`` are run as well and must
agree. Writes the references, the parameters, the inputs and the versions of
neural-tangents, JAX, jaxlib, TensorFlow, NumPy and Python to ``OUT.npz``.

Usage: ``python compute_references.py INPUTS.npz OUT.npz``.
"""

import json
import platform
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import neural_tangents as nt  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import jaxlib  # noqa: E402

# (name, network, trace_axes, diagonal_axes, second input: "x2" or None for x2=None)
CASES = [
  ("mlp/trace_last", "mlp", (-1,), (), "x2"),
  ("mlp/full", "mlp", (), (), "x2"),
  ("mlp/trace_last_self", "mlp", (-1,), (), None),
  ("mlp/diag_batch_trace_last", "mlp", (-1,), (0,), None),
  ("mlp/diag_batch", "mlp", (), (0,), None),
  ("mlp/diag_outputs", "mlp", (), (-1,), "x2"),
  ("mlp/trace_batch", "mlp", (0,), (), None),
  ("mlp/trace_all", "mlp", (0, 1), (), None),
  ("cnn/trace_last", "cnn", (-1,), (), "x2"),
  ("cnn/full", "cnn", (), (), "x2"),
  ("cnn/diag_batch", "cnn", (), (0,), None),
  ("conv_features/trace_last", "conv_features", (-1,), (), "x2"),
  ("conv_features/trace_outputs", "conv_features", (1, 2, 3), (), "x2"),
  ("conv_features/trace_spatial", "conv_features", (1, 2), (), "x2"),
  ("conv_features/diag_spatial_trace_last", "conv_features", (-1,), (1, 2), "x2"),
  ("conv_features/diag_batch_last_trace_rows", "conv_features", (1,), (0, -1), None),
  ("conv_features/full", "conv_features", (), (), "x2"),
  ("conv_dense/trace_last", "conv_dense", (-1,), (), "x2"),
  ("conv_dense/full", "conv_dense", (), (), "x2"),
  ("conv_dense/trace_last_self", "conv_dense", (-1,), (), None),
  ("conv_dense/full_self", "conv_dense", (), (), None),
]


def dense(p, x):
  return x @ p["kernel"] + p["bias"]


def conv_same(p, x):  # NHWC inputs, HWIO kernels, stride 1, 'SAME' padding (flax nn.Conv)
  y = jax.lax.conv_general_dilated(
    x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + p["bias"]


def max_pool_2x2(x):  # flax nn.max_pool(x, (2, 2), strides=(2, 2)), 'VALID'
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def mlp(params, x):  # 784-100-10, ReLU
  p = params["params"]
  return dense(p["dense_1"], jax.nn.relu(dense(p["dense_0"], x)))


def cnn(params, x):  # conv32-relu-pool-conv64-relu-pool-fc100-relu-fc(C)
  p = params["params"]
  x = max_pool_2x2(jax.nn.relu(conv_same(p["conv_0"], x)))
  x = max_pool_2x2(jax.nn.relu(conv_same(p["conv_1"], x)))
  x = jax.nn.relu(dense(p["dense_0"], x.reshape(x.shape[0], -1)))
  return dense(p["dense_1"], x)


def conv_features(params, x):  # conv3x3(1 -> 4)-relu-conv3x3(4 -> 2): [N, H, W, 1] -> [N, H, W, 2]
  p = params["params"]
  return conv_same(p["conv_1"], jax.nn.relu(conv_same(p["conv_0"], x)))


def conv(p, x, strides, padding):  # NHWC inputs, HWIO kernels (flax nn.Conv)
  y = jax.lax.conv_general_dilated(
    x, p["kernel"], strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + p["bias"]


def conv_dense(
  params, x
):  # export_inputs.ConvDense: strided/padded convolutions, then dense layers
  p = params["params"]
  x = jax.nn.relu(conv(p["conv_0"], x, (2, 2), ((1, 1), (1, 1))))
  x = jnp.tanh(conv(p["conv_1"], x, (2, 2), "SAME"))
  x = jax.nn.relu(dense(p["dense_0"], x.reshape(x.shape[0], -1)))
  return dense(p["dense_1"], x)


NETWORKS = {"mlp": mlp, "cnn": cnn, "conv_features": conv_features, "conv_dense": conv_dense}


def nested_params(arrays, net, dtype):
  tree = {}
  prefix = f"{net}/params/"
  for key in arrays.files:
    if key.startswith(prefix):
      layer, name = key[len(prefix) :].split("/")
      tree.setdefault(layer, {})[name] = jnp.asarray(arrays[key], dtype)
  return {"params": tree}


def kernel(net, arrays, trace_axes, diagonal_axes, second, dtype, implementation, vmap_axes=0):
  f = NETWORKS[net]
  params = nested_params(arrays, net, dtype)
  x1 = jnp.asarray(arrays[f"{net}/x1"], dtype)
  x2 = None if second is None else jnp.asarray(arrays[f"{net}/{second}"], dtype)
  ntk_fn = nt.empirical_ntk_fn(
    f,
    trace_axes=trace_axes,
    diagonal_axes=diagonal_axes,
    vmap_axes=vmap_axes,
    implementation=implementation,
  )
  return np.asarray(jax.jit(ntk_fn)(x1, x2, params))


def max_rel(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main(inputs_path, out_path):
  arrays = np.load(inputs_path)
  for net in ("mlp", "cnn", "conv_dense"):  # stage 2 rebuilds the library's networks exactly
    f_x1 = NETWORKS[net](nested_params(arrays, net, jnp.float32), jnp.asarray(arrays[f"{net}/x1"]))
    err = float(np.max(np.abs(np.asarray(f_x1) - arrays[f"{net}/f_x1"])))
    print(f"{net}: max |f(x1) - ntk_fl's f(x1)| = {err:.2e}")
    assert err < 1e-5, err

  impl = nt.NtkImplementation
  out = {k: arrays[k] for k in arrays.files}
  cases = []
  for name, net, trace_axes, diagonal_axes, second in CASES:
    args = (net, arrays, trace_axes, diagonal_axes, second)
    ref = kernel(*args, jnp.float64, impl.JACOBIAN_CONTRACTION)
    single = kernel(*args, jnp.float32, impl.JACOBIAN_CONTRACTION)
    others = {
      "ntk_vector_products": kernel(*args, jnp.float64, impl.NTK_VECTOR_PRODUCTS),
      "structured_derivatives": kernel(*args, jnp.float64, impl.STRUCTURED_DERIVATIVES),
      "vmap_axes_none": kernel(*args, jnp.float64, impl.JACOBIAN_CONTRACTION, vmap_axes=None),
    }
    agree = {k: max_rel(v, ref) for k, v in others.items()}
    assert max(agree.values()) < 1e-12, (name, agree)
    f32_err = max_rel(single, ref)
    print(
      f"{name}: shape {ref.shape}; float32 vs float64 max rel {f32_err:.1e}; "
      f"other implementations / vmap_axes=None vs float64 max rel {max(agree.values()):.1e}"
    )
    out[f"{name}/kernel"] = ref
    if net in ("mlp", "conv_dense") and not diagonal_axes:
      out[f"{name}/kernel_float32"] = single  # neural-tangents' own float32 result, for comparison
    cases.append(
      dict(
        name=name,
        network=net,
        trace_axes=list(trace_axes),
        diagonal_axes=list(diagonal_axes),
        x2=second,
      )
    )

  # The normalisation of trace_axes, measured: the traced kernel is the mean over the outputs.
  full = out["mlp/full/kernel"]
  traced = out["mlp/trace_last/kernel"]
  ratio = np.einsum("ijcc->ij", full) / traced
  print(
    f"mlp: summed trace of the full kernel / trace_axes=(-1,) kernel: {ratio.min():.12f} .. "
    f"{ratio.max():.12f}"
  )

  versions = {
    "neural_tangents": nt.__version__,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "tensorflow": tf.__version__,
    "numpy": np.__version__,
    "python": platform.python_version(),
  }
  print("versions:", versions)
  out["cases"] = np.array(json.dumps(cases))
  out["versions"] = np.array(json.dumps(versions))
  np.savez_compressed(out_path, **out)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
