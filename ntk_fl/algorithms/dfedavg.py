"""DFedAvg (Sun et al. 2021): several local epochs of plain SGD, then one gossip step.

The round is :func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl import models, topology
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import gossip_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.gossip_round import GossipHParams

__all__ = ["check", "make_dfedavg", "METHOD"]


def check(hparams: GossipHParams, run) -> None:
  """Plain SGD: ``momentum`` must be 0 (DFedAvgM has momentum); raises ``ValueError``."""
  del run
  gossip_round.check_plain_sgd("dfedavg", hparams)


def make_dfedavg(
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
  """DFedAvg (arguments as :func:`~ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`)."""
  seed, mixing, shared_init, _ = run_options(
    run, "DFedAvg", graphs, seed=seed, mixing=mixing, shared_init=shared_init
  )
  return gossip_round.make_local_sgd_gossip(
    model, federation, graphs, hparams, seed=seed, mixing=mixing, shared_init=shared_init
  )


METHOD = Method(
  make=make_dfedavg, hyperparameters=GossipHParams, check=check, graph=True, replicas=True
)
