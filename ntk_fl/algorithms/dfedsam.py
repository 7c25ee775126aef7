"""DFedSAM (Shi et al. 2023): SAM or ASAM local steps, then one gossip step.

Local steps of radius ``sam_rho`` (adaptive with ``sam_adaptive``) with momentum and weight decay
(:func:`ntk_fl.algorithms.local.make_local_update`); the round is
:func:`ntk_fl.algorithms.gossip_round.make_local_sgd_gossip`'s.
"""

from __future__ import annotations

import dataclasses

from ntk_fl.algorithms import gossip_round
from ntk_fl.algorithms import local
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


METHOD = gossip_round.local_sgd_method("dfedsam", "DFedSAM", hyperparameters=DFedSAMHParams)
make_dfedsam = METHOD.make
