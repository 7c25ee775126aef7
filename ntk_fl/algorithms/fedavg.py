"""FedAvg (McMahan et al. 2017): local SGD on the participants, then ``w <- sum_k p_k w_k``.

The round, the participants' draw and the bit count are :mod:`ntk_fl.algorithms.server_round`'s;
``p_k = n_k / sum_K n`` weighs each participant by its data size.
"""

from __future__ import annotations

from ntk_fl import models
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["make_fedavg", "METHOD"]


def make_fedavg(
  model: models.Model,
  federation,
  topology,
  hparams: ServerHParams,
  run=None,
  *,
  seed: int | None = None,
) -> Algorithm:
  """FedAvg for ``federation`` and ``model`` (arguments as ``server_round.make_server_method``)."""
  seed = run_options(run, "FedAvg", needs_topology=False, seed=seed).seed
  return server_round.make_server_method(
    model, federation, hparams, seed=seed, update=server_round.federated_update(model, hparams)
  )


METHOD = Method(make=make_fedavg, hyperparameters=ServerHParams, check=server_round.check)
