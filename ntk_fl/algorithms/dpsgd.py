"""D-PSGD (Lian et al. 2017) as the NTK-DFL authors coded it: an epoch of plain SGD, then gossip.

About 20 steps of batch 10 per round before the gossip step; the round is
:func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

from ntk_fl import models, topology
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import gossip_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.gossip_round import GossipHParams

__all__ = ["check", "make_dpsgd", "METHOD"]


def check(hparams: GossipHParams, run) -> None:
  """Plain SGD: ``momentum`` must be 0; raises ``ValueError``."""
  del run
  gossip_round.check_plain_sgd("dpsgd", hparams)


def make_dpsgd(
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
  """D-PSGD (arguments as :func:`~ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`)."""
  seed, mixing, shared_init, _ = run_options(
    run, "D-PSGD", graphs, seed=seed, mixing=mixing, shared_init=shared_init
  )
  return gossip_round.make_local_sgd_gossip(
    model, federation, graphs, hparams, seed=seed, mixing=mixing, shared_init=shared_init
  )


METHOD = Method(
  make=make_dpsgd, hyperparameters=GossipHParams, check=check, graph=True, replicas=True
)
