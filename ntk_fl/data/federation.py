"""The clients' data as one stacked, padded pytree, ready for ``vmap`` over clients.

Clients hold different numbers of samples, but ``vmap``/``jit`` need one shape.
:func:`make_federation` pads every client to ``n_max`` rows and records which
rows are real in ``mask``; per-client computations weight by ``mask`` and
normalise by ``n`` so padding never changes a result.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = ["Federation", "make_federation"]


class Federation(NamedTuple):
  """Stacked client data (a pytree; leaves are numpy or jax arrays).

  Attributes:
    x: ``[M, n_max, *feature_shape]`` float32 inputs; padding rows are zeros.
    y: ``[M, n_max]`` int32 labels; padding entries are 0.
    mask: ``[M, n_max]`` bool, True for real samples (the first ``n[m]`` rows).
    n: ``[M]`` int32 number of real samples per client.
  """
  x: Any
  y: Any
  mask: Any
  n: Any


def make_federation(
    x: np.ndarray,
    y: np.ndarray,
    client_indices: Sequence[np.ndarray],
    *,
    n_max: int | None = None,
) -> Federation:
  """Gather each client's samples and pad them to a common length.

  Args:
    x: ``[N, *feature_shape]`` training inputs.
    y: ``[N]`` integer training labels.
    client_indices: ``M`` non-empty 1-D integer arrays of indices into ``x``/``y``
      (e.g. from :func:`ntk_fl.data.partition`); client ``m``'s samples keep
      this order in rows ``0 .. n[m]-1``.
    n_max: padded length; defaults to the largest client. Must be at least the
      largest client (a fixed value keeps shapes equal across partitions).

  Returns:
    A :class:`Federation` of numpy arrays (the runner moves them to device).

  Raises:
    ValueError: mismatched ``x``/``y``, no clients, an empty client, an index
      out of range, or a client larger than ``n_max``.
  """
  x = np.asarray(x)
  y = np.asarray(y)
  if x.ndim < 1 or y.shape != x.shape[:1]:
    raise ValueError(f"x [N, ...] and y [N] must share the sample axis, got {x.shape} and {y.shape}")
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
  indices = [_check_client(m, idx, x.shape[0]) for m, idx in enumerate(client_indices)]
  if not indices:
    raise ValueError("client_indices is empty; a federation needs at least one client")
  n = np.array([idx.size for idx in indices], dtype=np.int32)
  if n_max is None:
    n_max = int(n.max())
  elif isinstance(n_max, bool) or not isinstance(n_max, (int, np.integer)) or n_max < n.max():
    raise ValueError(f"n_max must be an int >= the largest client ({int(n.max())} samples, "
                     f"client {int(n.argmax())}), got {n_max!r}")

  mask = np.arange(n_max)[None, :] < n[:, None]                           # [M, n_max]
  # Padding slots point at sample 0 so the gather stays in range; the mask then zeroes them.
  gather = np.zeros((len(indices), n_max), dtype=np.int64)
  gather[mask] = np.concatenate(indices)
  expand = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
  x_fed = np.where(expand, x[gather], 0).astype(np.float32)
  y_fed = np.where(mask, y[gather], 0).astype(np.int32)
  return Federation(x=x_fed, y=y_fed, mask=mask, n=n)


def _check_client(m: int, idx, num_samples: int) -> np.ndarray:
  idx = np.asarray(idx)
  if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
    raise ValueError(f"client {m}: indices must be a 1-D integer array, got shape {idx.shape} "
                     f"dtype {idx.dtype}")
  if idx.size == 0:
    raise ValueError(f"client {m} has no samples; every client needs at least one")
  if idx.min() < 0 or idx.max() >= num_samples:
    raise ValueError(f"client {m}: indices must lie in [0, {num_samples}), got range "
                     f"[{idx.min()}, {idx.max()}]")
  return idx
