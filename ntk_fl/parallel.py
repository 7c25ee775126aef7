"""The one place that maps a per-client function over the stacked client axis.

Every algorithm in ``ntk_fl`` expresses its per-client work as a function of one
client's slice (no leading ``M`` axis) and lifts it with :func:`for_each_client`.
Keeping the mapping in one place means the memory/parallelism policy (full
``vmap``, chunked ``vmap``, later sharding over a device mesh) changes here and
nowhere else.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

__all__ = ["for_each_client"]


def for_each_client(fn: Callable[..., Any], *, chunk_size: int | None = None) -> Callable[..., Any]:
  """Lift ``fn(*client_args)`` to stacked arguments with a leading client axis ``M``.

  Args:
    fn: a pure function of one client's arguments (pytrees without the client axis).
    chunk_size: ``None`` or ``0`` maps all ``M`` clients at once (plain ``vmap``);
      a positive value maps ``chunk_size`` clients at a time (``lax.map`` with
      ``batch_size``), bounding peak memory by the chunk instead of ``M``.

  Returns:
    ``mapped(*stacked_args)``: every leaf of every argument has leading axis ``M``;
    outputs are stacked along a leading ``M`` axis. Use ``functools.partial`` or a
    closure for arguments shared by all clients.
  """
  if chunk_size is not None and chunk_size < 0:
    raise ValueError(f"chunk_size must be None or >= 0, got {chunk_size}")

  def mapped(*stacked_args):
    leaves = jax.tree_util.tree_leaves(stacked_args)
    if not leaves:
      raise ValueError("for_each_client needs at least one array argument with a client axis")
    num_clients = leaves[0].shape[0]
    if not chunk_size or chunk_size >= num_clients:
      return jax.vmap(fn)(*stacked_args)
    return jax.lax.map(lambda args: fn(*args), stacked_args, batch_size=chunk_size)

  return mapped
