"""On-device mixing: one gossip / neighbour-averaging step for all clients at once.

The graphs and their mixing weights are generated host-side by :mod:`ntk_fl.topology`
(``Graph(neighbors [M, k_max], mask)``, :func:`ntk_fl.topology.mixing_weights`); this module
is what a jitted round does with them: :func:`mix` (NTK-DFL's eq. 1, every gossip baseline's
averaging, SPARK's mixed velocity), its per-client row :func:`mix_one` (formed inside the mapped
client function) and :func:`consensus` (the models a round starts from).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ntk_fl import parallel

__all__ = ["mix", "mix_one", "consensus"]


def mix(stacked_params, neighbors, self_weight, neighbor_weights, *, sent=None):
  """One mixing (gossip / neighbour-averaging) step for all clients at once.

  ``w_i ← s_i w_i + Σ_k a_ik v_{n_ik}`` where ``v`` is what the neighbours sent
  (``sent``; default: their exact weights ``stacked_params``, as in NTK-DFL's
  eq. (1)). A client's own term always uses its exact weights, so lossy
  transmission (quantisation) only affects the neighbours' terms.

  Args:
    stacked_params: pytree with leaves ``[M, ...]``.
    neighbors: int ``[M, k]`` neighbour indices (padding = own index).
    self_weight: ``[M]``; neighbor_weights: ``[M, k]`` (zero in padded slots, so
      padding contributes nothing) -- from :func:`ntk_fl.topology.mixing_weights`.
    sent: optional pytree like ``stacked_params``: the transmitted weights.

  Returns:
    Pytree like ``stacked_params``.
  """
  sent = stacked_params if sent is None else sent
  neighbors = jnp.asarray(neighbors)
  neighbor_weights = jnp.asarray(neighbor_weights)
  chex.assert_rank(neighbors, 2)
  num_clients = neighbors.shape[0]
  chex.assert_shape(neighbor_weights, neighbors.shape)
  chex.assert_shape(self_weight, (num_clients,))
  chex.assert_tree_shape_prefix(stacked_params, (num_clients,))
  chex.assert_trees_all_equal_shapes(stacked_params, sent)

  def one(own, transmitted):
    extra = (1,) * (own.ndim - 1)
    total = jnp.asarray(self_weight).reshape(-1, *extra).astype(own.dtype) * own
    # One neighbour slot at a time (k is static and small): XLA fuses each [M, ...]
    # gather into the running sum. Gathering all slots at once materialised an
    # [M, k, ...] buffer -- 454 MiB at M = 300, k = 5, d = 79,510 -- and was 5-14x
    # slower on CPU (benchmarks/RESULTS.md, "Gossip step").
    for slot in range(neighbors.shape[1]):
      weight = neighbor_weights[:, slot].reshape(-1, *extra).astype(own.dtype)
      total = total + weight * transmitted[neighbors[:, slot]]
    return total

  return jax.tree.map(one, stacked_params, sent)


def mix_one(stacked_params, own, neighbors, self_weight, neighbor_weights):
  """One client's row of :func:`mix`, for use inside the function ``for_each_client`` maps.

  ``w̄_i = s_i w_i + Σ_k a_ik w_{n_ik}`` with the same operations in the same
  order as :func:`mix`, so the result is the same; formed per chunk of clients,
  no ``[M, ...]`` copy of the averages is ever held.

  Args:
    stacked_params: pytree with leaves ``[M, ...]`` (every client's weights), or
      a :class:`ntk_fl.parallel.Shared` of it (the neighbours' rows are then
      fetched from the devices that hold them).
    own: the client's weights (``stacked_params``' leaves without the ``M`` axis).
    neighbors: int ``[k]``; self_weight: scalar; neighbor_weights: ``[k]`` -- the
      client's rows of :func:`ntk_fl.topology.mixing_weights`.

  Returns:
    Pytree like ``own``.
  """
  chex.assert_rank(neighbors, 1)
  chex.assert_shape(neighbor_weights, neighbors.shape)

  if not isinstance(stacked_params, parallel.Shared):
    stacked_params = parallel.Shared(stacked_params)
  rows = stacked_params.take(neighbors)

  def one(neighbour_rows, w):  # neighbour_rows [k, ...]
    total = jnp.asarray(self_weight).astype(w.dtype) * w
    for slot in range(neighbors.shape[0]):
      total = total + neighbor_weights[slot].astype(w.dtype) * neighbour_rows[slot]
    return total

  return jax.tree.map(one, rows, own)


def consensus(stacked_params, round_inputs):
  """Every client's neighbourhood average ``w̄_i`` under one round's graph and weights (:func:`mix`).

  What a decentralized round starts from (NTK-DFL's eq. 1, SPARK's consensus, a
  gossip step): ``round_inputs`` is a decentralized method's ``round_inputs(r)``
  (:class:`ntk_fl.algorithms.base.GraphRound`: ``neighbors``, ``self_weight``,
  ``neighbor_weights``).

  Raises:
    ValueError: ``round_inputs`` has no graph (a server method's inputs).
  """
  missing = [
    name
    for name in ("neighbors", "self_weight", "neighbor_weights")
    if not hasattr(round_inputs, name)
  ]
  if missing:
    raise ValueError(
      f"consensus models need a decentralized method's round inputs (a graph and mixing weights); "
      f"{type(round_inputs).__name__} has no {', '.join(missing)}"
    )
  return mix(
    stacked_params, round_inputs.neighbors, round_inputs.self_weight, round_inputs.neighbor_weights
  )
