"""The clients' data: one copy of the samples plus each client's padded index list.

Clients hold different numbers of samples, but ``vmap``/``jit`` need one shape.
A :class:`Federation` keeps the training samples **once** (``samples_x``,
``samples_y``; partitions may give a sample to several clients) and, per client,
``n_max`` row numbers into them (``index``) with a ``mask`` saying which rows
are real. Padding slots point at an all-zero sample appended after the real
ones, so a gathered client (:meth:`Federation.samples`) equals a zero-padded
``[n_max, ...]`` copy of its data; per-client computations weight by ``mask`` and
normalise by ``n`` so padding never changes a result.

Algorithms gather a client's inputs where the client is processed -- inside the
function that :func:`ntk_fl.parallel.for_each_client` maps, so per chunk of
clients -- and never hold a ``[M, n_max, ...]`` copy of every client's inputs:
memory grows with the dataset and the chunk, not with the number of clients.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Sequence

import numpy as np

__all__ = [
  "Federation",
  "make_federation",
  "federation_from_padded",
  "BlockLayout",
  "block_layout",
  "check_samples",
]


class Federation(NamedTuple):
  """Client data as index lists into one copy of the samples (a pytree; numpy or jax leaves).

  Attributes:
    samples_x: ``[S + 1, *feature_shape]`` float32 samples; the last row is zeros
      (where padding slots point).
    samples_y: ``[S + 1]`` int32 labels; the last entry is 0.
    index: ``[M, n_max]`` int32 rows of ``samples_*``: client ``m``'s samples in
      slots ``0 .. n[m]-1``, the zero row ``S`` after them.
    mask: ``[M, n_max]`` bool, True for real samples (the first ``n[m]`` slots).
    n: ``[M]`` int32 number of real samples per client.
  """

  samples_x: Any
  samples_y: Any
  index: Any
  mask: Any
  n: Any

  @property
  def feature_shape(self) -> tuple[int, ...]:
    """The shape of one input sample."""
    return tuple(self.samples_x.shape[1:])

  def samples(self, index):
    """The inputs and labels at ``index`` (any shape ``[...]``): ``(x [..., *feature_shape], y [...])``.

    Works on numpy and on jax arrays (inside ``jit``): a client's data is
    ``federation.samples(federation.index[m])``, zero in its padding slots.
    """
    return self.samples_x[index], self.samples_y[index]

  @property
  def x(self):
    """Every client's inputs ``[M, n_max, *feature_shape]``, gathered on each access (tests, small federations)."""
    return self.samples_x[self.index]

  @property
  def y(self):
    """Every client's labels ``[M, n_max]``, gathered on each access."""
    return self.samples_y[self.index]


def make_federation(
  x: np.ndarray,
  y: np.ndarray,
  client_indices: Sequence[np.ndarray],
  *,
  n_max: int | None = None,
) -> Federation:
  """Index lists of every client into one copy of ``x``/``y``, padded to a common length.

  Args:
    x: ``[N, *feature_shape]`` training inputs.
    y: ``[N]`` integer training labels.
    client_indices: ``M`` non-empty 1-D integer arrays of indices into ``x``/``y``
      (e.g. from :func:`ntk_fl.data.partition`); client ``m``'s samples keep
      this order in slots ``0 .. n[m]-1``.
    n_max: padded length; defaults to the largest client. Must be at least the
      largest client (a fixed value keeps shapes equal across partitions).

  Returns:
    A :class:`Federation` of numpy arrays: ``samples_x`` is ``x`` as float32 with
    one zero row appended (``S = N``), ``samples_y`` likewise.

  Raises:
    ValueError: mismatched ``x``/``y``, no clients, an empty client, an index
      out of range, or a client larger than ``n_max``.
  """
  x = np.asarray(x)
  y = check_samples(x, y)
  indices, mask, n = _check_clients(client_indices, x.shape[0], n_max)
  zero_row = x.shape[0]
  index = np.full(mask.shape, zero_row, dtype=np.int32)
  index[mask] = np.concatenate(indices)
  samples_x = np.concatenate(
    [x.astype(np.float32, copy=False), np.zeros((1, *x.shape[1:]), np.float32)]
  )
  samples_y = np.concatenate([y.astype(np.int32, copy=False), np.zeros((1,), np.int32)])
  return Federation(samples_x=samples_x, samples_y=samples_y, index=index, mask=mask, n=n)


def federation_from_padded(x, y, mask) -> Federation:
  """A :class:`Federation` holding already padded client arrays as they are (tests, hand-built federations).

  Args:
    x: ``[M, n_max, *feature_shape]`` inputs (padding rows may hold anything).
    y: ``[M, n_max]`` integer labels.
    mask: ``[M, n_max]`` bool, True for real samples.

  Returns:
    A federation whose :attr:`Federation.x`/``y`` equal ``x``/``y`` exactly (every
    slot, padding included, gets its own sample row) and ``n = mask.sum(1)``.
  """
  x, y, mask = np.asarray(x, np.float32), np.asarray(y, np.int32), np.asarray(mask, bool)
  if x.shape[:2] != y.shape or y.shape != mask.shape:
    raise ValueError(
      f"x [M, n_max, ...], y and mask [M, n_max] must share their first two axes, got "
      f"{x.shape}, {y.shape}, {mask.shape}"
    )
  num_clients, n_max = mask.shape
  samples_x = np.concatenate(
    [x.reshape(num_clients * n_max, *x.shape[2:]), np.zeros((1, *x.shape[2:]), np.float32)]
  )
  samples_y = np.concatenate([y.reshape(-1), np.zeros((1,), np.int32)])
  index = np.arange(num_clients * n_max, dtype=np.int32).reshape(num_clients, n_max)
  return Federation(
    samples_x=samples_x,
    samples_y=samples_y,
    index=index,
    mask=mask,
    n=mask.sum(axis=1).astype(np.int32),
  )


class BlockLayout(NamedTuple):
  """Where each client's samples live when the samples are split into per-device blocks.

  Clients are dealt to ``num_blocks`` devices the way
  :func:`ntk_fl.parallel.for_each_client` deals them (contiguous runs of
  ``ceil(M / num_blocks)``); block ``b`` holds, once each, the samples its
  clients use (``rows[b]``, sorted), then zero rows up to ``block_size``. The
  samples array is ``[num_blocks * block_size, ...]`` and ``index`` holds
  *global* row numbers ``b * block_size + position``, so a client's samples are
  still ``samples_x[index[m]]`` and every block ends in a zero row that its
  clients' padding slots point at.

  Attributes:
    rows: ``num_blocks`` sorted int arrays of dataset rows (block ``b``'s samples).
    block_size: rows per block, the largest block's sample count plus one zero row.
    index: ``[M, n_max]`` int32 global rows of each client's samples.
    mask: ``[M, n_max]`` bool, True for real samples.
    n: ``[M]`` int32 samples per client.
  """

  rows: list
  block_size: int
  index: np.ndarray
  mask: np.ndarray
  n: np.ndarray

  def block_samples(
    self, x: np.ndarray, y: np.ndarray, block: int
  ) -> tuple[np.ndarray, np.ndarray]:
    """Block ``block``'s samples ``([block_size, ...] float32, [block_size] int32)`` from the dataset ``x``/``y``."""
    rows = self.rows[block]
    pad = self.block_size - rows.size
    bx = np.concatenate(
      [np.asarray(x[rows], np.float32), np.zeros((pad, *x.shape[1:]), np.float32)]
    )
    by = np.concatenate([np.asarray(y[rows], np.int32), np.zeros((pad,), np.int32)])
    return bx, by


def block_layout(
  client_indices: Sequence[np.ndarray],
  num_samples: int,
  num_blocks: int,
  *,
  n_max: int | None = None,
) -> BlockLayout:
  """The per-device block layout of ``client_indices`` (see :class:`BlockLayout`); reads no samples.

  Args:
    client_indices: ``M`` non-empty 1-D integer arrays of dataset rows.
    num_samples: rows in the dataset (indices must lie in ``[0, num_samples)``).
    num_blocks: devices the clients are split over (>= 1).
    n_max: padded length per client, as in :func:`make_federation`.

  Raises:
    ValueError: as :func:`make_federation`, or ``num_blocks`` < 1.
  """
  if (
    isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1
  ):
    raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
  indices, mask, n = _check_clients(client_indices, num_samples, n_max)
  per_block = -(-len(indices) // num_blocks)
  groups = [indices[b * per_block : (b + 1) * per_block] for b in range(num_blocks)]
  rows = [np.unique(np.concatenate(g)) if g else np.zeros((0,), np.int64) for g in groups]
  block_size = max(r.size for r in rows) + 1
  index = np.empty(mask.shape, np.int32)
  for b, group in enumerate(groups):
    for j, idx in enumerate(group):
      m = b * per_block + j
      index[m] = b * block_size + block_size - 1  # padding slots: the block's zero row
      index[m, : idx.size] = b * block_size + np.searchsorted(rows[b], idx)
  return BlockLayout(rows=rows, block_size=block_size, index=index, mask=mask, n=n)


def check_samples(x, y) -> np.ndarray:
  """Checks that ``x`` ``[N, ...]`` (anything with a ``shape``) and integer ``y`` ``[N]`` pair up; returns ``y``."""
  y = np.asarray(y)
  if len(x.shape) < 1 or y.shape != tuple(x.shape[:1]):
    raise ValueError(
      f"x [N, ...] and y [N] must share the sample axis, got {tuple(x.shape)} and {y.shape}"
    )
  if not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
  return y


def _check_clients(
  client_indices, num_samples: int, n_max
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
  """The checked index arrays, ``mask [M, n_max]`` (True on real slots) and ``n [M]`` int32."""
  indices = [_check_client(m, idx, num_samples) for m, idx in enumerate(client_indices)]
  if not indices:
    raise ValueError("client_indices is empty; a federation needs at least one client")
  n = np.array([idx.size for idx in indices], dtype=np.int32)
  if n_max is None:
    n_max = int(n.max())
  elif isinstance(n_max, bool) or not isinstance(n_max, (int, np.integer)) or n_max < n.max():
    raise ValueError(
      f"n_max must be an int >= the largest client ({int(n.max())} samples, "
      f"client {int(n.argmax())}), got {n_max!r}"
    )
  return indices, np.arange(n_max)[None, :] < n[:, None], n


def _check_client(m: int, idx, num_samples: int) -> np.ndarray:
  idx = np.asarray(idx)
  if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
    raise ValueError(
      f"client {m}: indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}"
    )
  if idx.size == 0:
    raise ValueError(f"client {m} has no samples; every client needs at least one")
  if idx.min() < 0 or idx.max() >= num_samples:
    raise ValueError(
      f"client {m}: indices must lie in [0, {num_samples}), got range [{idx.min()}, {idx.max()}]"
    )
  return idx
