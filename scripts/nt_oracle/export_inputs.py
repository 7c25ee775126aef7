"""Stage 1 of the neural-tangents oracle (runs in the library's environment).

Writes the parameters and inputs the reference kernels are computed on: the
library's 784-100-10 MLP and its small CNN (``ntk_fl.models``, fixed seeds) and
a two-layer fully convolutional net whose outputs keep the spatial axes
(``[N, 4, 4, 2]``, for ``trace_axes``/``diagonal_axes`` over several output
axes), plus the networks' outputs as a check that stage 2 rebuilds the same
functions. Usage: ``python scripts/nt_oracle/export_inputs.py OUT.npz``.
"""

import sys

import jax
import numpy as np

from ntk_fl import models


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
  np.savez(out_path, **arrays)


if __name__ == "__main__":
  main(sys.argv[1])
