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
from ntk_fl.algorithms.base import Algorithm, run_options
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


def make_dfedsam(
  model: models.Model,
  federation,
  graphs: topology.Topology,
  hparams: DFedSAMHParams,
  run=None,
  *,
  seed: int | None = None,
  mixing: str | None = None,
  shared_init: bool | None = None,
) -> Algorithm:
  """DFedSAM (arguments as :func:`~ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`)."""
  seed, mixing, shared_init, _ = run_options(
    run, "DFedSAM", graphs, seed=seed, mixing=mixing, shared_init=shared_init
  )
  return gossip_round.make_local_sgd_gossip(
    model, federation, graphs, hparams, seed=seed, mixing=mixing, shared_init=shared_init
  )


METHOD = Method(make=make_dfedsam, hyperparameters=DFedSAMHParams, graph=True, replicas=True)
