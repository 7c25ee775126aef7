"""DFedSAM (Shi et al. 2023): SAM or ASAM local steps, then one gossip step.

Local steps of radius ``sam_rho`` (adaptive with ``sam_adaptive``) with momentum and weight decay
(:func:`ntk_fl.algorithms.local.make_local_update`); the round is
:func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""
from __future__ import annotations

import dataclasses

from ntk_fl import models, topology
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import gossip_round
from ntk_fl.algorithms import local
from ntk_fl.algorithms.base import Algorithm
from ntk_fl.algorithms.gossip_round import GossipHParams

__all__ = ["DFedSAMHParams", "make_dfedsam", "METHOD"]


@dataclasses.dataclass(frozen=True)
class DFedSAMHParams(GossipHParams):
  """DFedSAM: plus SAM's radius ``sam_rho`` (>= 0) and ``sam_adaptive`` (ASAM)."""
  sam_rho: float
  sam_adaptive: bool

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"sam_rho": local.nonnegative, "sam_adaptive": local.flag})


def make_dfedsam(model: models.Model, federation, graphs: topology.Topology,
                 hparams: DFedSAMHParams, *, seed: int, mixing: str = "uniform",
                 shared_init: bool = True) -> Algorithm:
  """DFedSAM (arguments as :func:`~ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`)."""
  return gossip_round.make_local_sgd_gossip(model, federation, graphs, hparams, seed=seed,
                                            mixing=mixing, shared_init=shared_init)


METHOD = Method(make=lambda model, federation, graphs, hparams, run: make_dfedsam(
                    model, federation, graphs, hparams, seed=run.seed, mixing=run.topology.mixing,
                    shared_init=run.model.shared_init),
                hyperparameters=DFedSAMHParams, graph=True)
