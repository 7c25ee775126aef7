"""DFedAvgM (Sun et al. 2021): DFedAvg with heavy-ball momentum (PyTorch semantics) in local steps.

The round is :func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl import models, topology
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import gossip_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.gossip_round import GossipHParams

__all__ = ["make_dfedavgm", "METHOD"]


def make_dfedavgm(
  model: models.Model,
  federation,
  graphs: topology.Topology,
  hparams: GossipHParams,
  run=None,
  *,
  seed: int | None = None,
  mixing: str | None = None,
  shared_init: bool | None = None,
) -> Algorithm:
  """DFedAvgM (arguments as :func:`~ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`)."""
  seed, mixing, shared_init, _ = run_options(
    run, "DFedAvgM", graphs, seed=seed, mixing=mixing, shared_init=shared_init
  )
  return gossip_round.make_local_sgd_gossip(
    model, federation, graphs, hparams, seed=seed, mixing=mixing, shared_init=shared_init
  )


METHOD = Method(make=make_dfedavgm, hyperparameters=GossipHParams, graph=True, replicas=True)
