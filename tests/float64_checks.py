"""What the float64 exactness tests of the layer-wise kernel and the patch gradient share: the relative
error they assert on, and a stack of convolutions that exercises every convolution option the patch
factorisation handles."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

RTOL = 1e-10  # float64 against a brute-force reference


def rel(a, b) -> float:
  """``max|a - b| / max|b|``, in float64; the shapes must agree."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


class Convs(nn.Module):
  """Convolutions with strides, VALID and explicit padding, dilation, no bias."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Conv(3, (3, 3), strides=2, padding="VALID", name="c0")(x))
    x = jnp.tanh(nn.Conv(4, (2, 2), padding=((1, 0), (0, 1)), use_bias=False, name="c1")(x))
    x = jnp.tanh(nn.Conv(2, (2, 2), padding="SAME", kernel_dilation=2, name="c2")(x))
    return nn.Dense(3, name="head")(x.reshape(x.shape[0], -1))
