"""Stage 1 of the neural-tangents oracle (runs in the library's environment).

Writes the parameters and inputs the reference kernels are computed on: the
library's 784-100-10 MLP and its small CNN (``ntk_fl.models``, fixed seeds), a
two-layer fully convolutional net whose outputs keep the spatial axes
(``[N, 4, 4, 2]``, for ``trace_axes``/``diagonal_axes`` over several output
axes) and a conv+dense net with strided and padded convolutions
(:class:`ConvDense`, the layer-wise structured kernel's patch factorisation), plus
the networks' outputs as a check that stage 2 rebuilds the same functions.
Usage: ``python scripts/nt_oracle/export_inputs.py OUT.npz``.
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import models


class ConvDense(nn.Module):
  """``[N, 7, 7, 2]`` -> conv3x3 stride 2, padding 1 (4 ch.) -> relu -> conv3x3 stride 2 'SAME' (3 ch.)
  -> tanh -> dense 8 -> relu -> dense 3 (``tests/test_neural_tangents_oracle.py`` holds the same)."""

  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(nn.Conv(4, (3, 3), strides=2, padding=((1, 1), (1, 1)), name="conv_0")(x))
    x = jnp.tanh(nn.Conv(3, (3, 3), strides=2, padding="SAME", name="conv_1")(x))
    x = jax.nn.relu(nn.Dense(8, name="dense_0")(x.reshape(x.shape[0], -1)))
    return nn.Dense(3, name="dense_1")(x)


def flat_params(prefix, params):
  """``{'prefix/layer/kernel': array}`` from a flax variables dict."""
  out = {}
  for layer, leaves in params["params"].items():
    for name, value in leaves.items():
      out[f"{prefix}/params/{layer}/{name}"] = np.asarray(value, np.float32)
  return out


def conv_features_params(rng):
  """``conv3x3(1 -> 4) -> relu -> conv3x3(4 -> 2)``, He-normal kernels, small random biases."""
  return {
    "conv_features/params/conv_0/kernel": rng.normal(0, np.sqrt(2 / 9), (3, 3, 1, 4)),
    "conv_features/params/conv_0/bias": rng.normal(0, 0.1, (4,)),
    "conv_features/params/conv_1/kernel": rng.normal(0, np.sqrt(2 / 36), (3, 3, 4, 2)),
    "conv_features/params/conv_1/bias": rng.normal(0, 0.1, (2,)),
  }


def conv_dense_params(rng):
  """:class:`ConvDense`'s parameters: He-normal kernels, small random biases."""
  shapes = {"conv_0": (3, 3, 2, 4), "conv_1": (3, 3, 4, 3), "dense_0": (12, 8), "dense_1": (8, 3)}
  out = {}
  for layer, shape in shapes.items():
    fan_in = int(np.prod(shape[:-1]))
    out[f"conv_dense/params/{layer}/kernel"] = rng.normal(0, np.sqrt(2 / fan_in), shape)
    out[f"conv_dense/params/{layer}/bias"] = rng.normal(0, 0.1, shape[-1:])
  return out


def main(out_path):
  rng = np.random.default_rng(0)
  mlp = models.mlp(784, (100,), 10)
  cnn = models.cnn((4, 4, 1), num_classes=5)
  arrays = {}
  mlp_params = mlp.init(jax.random.PRNGKey(0))
  cnn_params = cnn.init(jax.random.PRNGKey(1))
  arrays.update(flat_params("mlp", mlp_params))
  arrays.update(flat_params("cnn", cnn_params))
  arrays.update({k: v.astype(np.float32) for k, v in conv_features_params(rng).items()})
  # Pixel-like inputs in [0, 1): x1 and x2 differ in batch size so that N1 != N2 is covered.
  arrays["mlp/x1"] = rng.uniform(size=(4, 784)).astype(np.float32)
  arrays["mlp/x2"] = rng.uniform(size=(3, 784)).astype(np.float32)
  arrays["cnn/x1"] = rng.uniform(size=(3, 4, 4, 1)).astype(np.float32)
  arrays["cnn/x2"] = rng.uniform(size=(2, 4, 4, 1)).astype(np.float32)
  arrays["conv_features/x1"] = rng.uniform(size=(3, 4, 4, 1)).astype(np.float32)
  arrays["conv_features/x2"] = rng.uniform(size=(2, 4, 4, 1)).astype(np.float32)
  arrays["mlp/f_x1"] = np.asarray(mlp.apply(mlp_params, arrays["mlp/x1"]))
  arrays["cnn/f_x1"] = np.asarray(cnn.apply(cnn_params, arrays["cnn/x1"]))
  # The conv+dense net draws from its own generator: the arrays above stay those of earlier files.
  rng = np.random.default_rng(1)
  arrays.update({k: v.astype(np.float32) for k, v in conv_dense_params(rng).items()})
  arrays["conv_dense/x1"] = rng.uniform(size=(4, 7, 7, 2)).astype(np.float32)
  arrays["conv_dense/x2"] = rng.uniform(size=(3, 7, 7, 2)).astype(np.float32)
  tree = {}
  for key, value in arrays.items():
    if key.startswith("conv_dense/params/"):
      layer, name = key.split("/")[2:]
      tree.setdefault(layer, {})[name] = value
  f_x1 = ConvDense().apply({"params": tree}, arrays["conv_dense/x1"])
  arrays["conv_dense/f_x1"] = np.asarray(f_x1)
  np.savez(out_path, **arrays)


if __name__ == "__main__":
  main(sys.argv[1])
