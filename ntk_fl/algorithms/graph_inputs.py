"""``round_inputs`` of a decentralized method: the round's graph, mixing weights and key.

Apart from the method interface (:mod:`ntk_fl.algorithms.base`, which holds :class:`GraphRound` and
imports no graph code), so that importing the interface -- as the run directory does -- loads neither
the topology nor the mixing code.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ntk_fl import rng, topology
from ntk_fl.algorithms.base import GraphRound

__all__ = ["GraphRound", "graph_round_inputs"]


def graph_round_inputs(graph_source, mixing: str, sizes, seed: int) -> Callable[[int], GraphRound]:
  """``round_inputs`` of a decentralized method: a function of the round index only.

  Args:
    graph_source: a :class:`ntk_fl.topology.Topology` (``sample(round) -> Graph``).
    mixing: mixing scheme for :func:`ntk_fl.topology.mixing_weights`.
    sizes: ``[M]`` client data sizes (data-size weights).
    seed: the config seed; round ``r``'s key is ``rng.jax_key(seed, Stream.ROUND_KEYS, r)``.
  """
  if graph_source is None:
    raise ValueError(
      "a decentralized method's rounds need a communication topology but got none: register "
      "its Method with graph=True (the schema then builds config.topology)"
    )

  def round_inputs(round_index: int) -> GraphRound:
    graph = graph_source.sample(round_index)
    self_w, nbr_w = topology.mixing_weights(graph, mixing, sizes)
    return GraphRound(
      round=np.int32(round_index),
      neighbors=graph.neighbors,
      neighbor_mask=graph.mask,
      self_weight=self_w,
      neighbor_weights=nbr_w,
      key=rng.jax_key(seed, rng.Stream.ROUND_KEYS, round_index),
    )

  return round_inputs
