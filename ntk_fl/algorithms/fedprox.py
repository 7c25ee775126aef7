"""FedProx (Li et al. 2020): FedAvg whose local objective adds ``(mu/2) ||w - w_global||^2``.

``mu`` is ``prox_mu``; the proximal term is :func:`ntk_fl.algorithms.local.make_local_update`'s
(anchored at the global model); the round and the aggregation are FedAvg's
(:mod:`ntk_fl.algorithms.server_round`).
"""

from __future__ import annotations

import dataclasses

from ntk_fl import models
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["FedProxHParams", "make_fedprox", "METHOD"]


@dataclasses.dataclass(frozen=True)
class FedProxHParams(ServerHParams):
  """FedProx: plus the proximal coefficient ``prox_mu`` (>= 0)."""

  prox_mu: float

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"prox_mu": local.nonnegative})


def make_fedprox(
  model: models.Model,
  federation,
  topology,
  hparams: FedProxHParams,
  run=None,
  *,
  seed: int | None = None,
) -> Algorithm:
  """FedProx for ``federation`` and ``model`` (arguments as ``server_round.make_server_method``)."""
  seed = run_options(run, "FedProx", needs_topology=False, seed=seed).seed
  return server_round.make_server_method(
    model, federation, hparams, seed=seed, update=server_round.federated_update(model, hparams)
  )


METHOD = Method(make=make_fedprox, hyperparameters=FedProxHParams, check=server_round.check)
