"""FedProx (Li et al. 2020): FedAvg whose local objective adds ``(mu/2) ||w - w_global||^2``.

``mu`` is ``prox_mu``; the proximal term is :func:`ntk_fl.algorithms.local.make_local_update`'s
(anchored at the global model); the round and the aggregation are FedAvg's
(:mod:`ntk_fl.algorithms.server_round`).
"""

from __future__ import annotations

import dataclasses

from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["FedProxHParams", "make_fedprox", "METHOD"]


@dataclasses.dataclass(frozen=True)
class FedProxHParams(ServerHParams):
  """FedProx: plus the proximal coefficient ``prox_mu`` (>= 0)."""

  prox_mu: float

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"prox_mu": local.nonnegative})


METHOD = server_round.server_method(
  "fedprox", "FedProx", server_round.federated_update, hyperparameters=FedProxHParams
)
make_fedprox = METHOD.make
