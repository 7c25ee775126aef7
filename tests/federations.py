"""A tiny random federation shared by the algorithm tests (ragged clients, so padding is exercised)."""

import numpy as np

from ntk_fl.data import Federation, federation_from_padded


def ragged_federation(
  rng: np.random.Generator, sizes, n_max: int | None = None, *, dim: int = 5, num_classes: int = 3
) -> Federation:
  """Client ``i`` holds ``sizes[i]`` standard-normal ``dim``-feature samples with uniform labels.

  Draws client by client (features, then labels) from ``rng``; rows past a
  client's size are zero padding with ``mask`` False.
  """
  sizes = np.asarray(sizes)
  n_max = int(sizes.max()) if n_max is None else n_max
  x = np.zeros((len(sizes), n_max, dim), np.float32)
  y = np.zeros((len(sizes), n_max), np.int32)
  for i, n in enumerate(sizes):
    x[i, :n] = rng.normal(size=(n, dim))
    y[i, :n] = rng.integers(0, num_classes, size=n)
  mask = np.arange(n_max)[None] < sizes[:, None]
  return federation_from_padded(x, y, mask)
