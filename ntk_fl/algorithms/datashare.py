"""DataShare (Zhao et al. 2018, as compared in NTK-FL): FedAvg plus a shared set for every client.

A global set ``G`` of ``share_fraction * sum_i n_i`` samples (NTK-FL: 10% of the total number of
local data points) is drawn once, uniformly without replacement from the clients' real samples
(stream ``Stream.SHARED_SET``), broadcast, and every participant trains on its own data *plus all
of G* (mixed into the same shuffled minibatches); aggregation as FedAvg, weights by own data size.
The round is :mod:`ntk_fl.algorithms.server_round`'s.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ntk_fl import models
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import ServerHParams
from ntk_fl.rng import Stream, numpy_rng

__all__ = ["DataShareHParams", "shared_set", "datashare_update", "make_datashare", "METHOD"]


@dataclasses.dataclass(frozen=True)
class DataShareHParams(ServerHParams):
  """DataShare: plus ``share_fraction`` in (0, 1], the global set's size relative to all data."""

  share_fraction: float

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"share_fraction": local.fraction})


def shared_set(federation, fraction: float, seed: int):
  """DataShare's global set ``(x, y)``: ``round(fraction * sum n)`` real samples, no repeats."""
  slots = np.argwhere(np.asarray(federation.mask))  # [sum n, 2] (client, row)
  size = max(1, int(round(fraction * slots.shape[0])))
  rng = numpy_rng(seed, Stream.SHARED_SET)
  pick = slots[np.sort(rng.choice(slots.shape[0], size=size, replace=False))]
  return federation.samples(np.asarray(federation.index)[pick[:, 0], pick[:, 1]])


def _append_shared_set(x, y, mask, shared):
  """Every participant's samples ``[K, n_max, ...]`` followed by all of ``G``."""
  shared_x, shared_y = shared
  k = mask.shape[0]
  x = jnp.concatenate([x, jnp.broadcast_to(shared_x, (k, *shared_x.shape))], axis=1)
  y = jnp.concatenate([y, jnp.broadcast_to(shared_y, (k, *shared_y.shape))], axis=1)
  mask = jnp.concatenate([mask, jnp.ones((k, shared_y.shape[0]), bool)], axis=1)
  return x, y, mask


def datashare_update(model: models.Model, hparams: DataShareHParams) -> server_round.ServerUpdate:
  """DataShare's round: FedAvg's, every participant training on its samples followed by the global set
  (``extra``)."""
  return server_round.federated_update(model, hparams, augment=_append_shared_set)


METHOD = server_round.server_method(
  "datashare",
  "DataShare",
  datashare_update,
  hyperparameters=DataShareHParams,
  extra=lambda federation, hparams, seed: shared_set(
    federation, float(hparams.share_fraction), seed
  ),
)
make_datashare = METHOD.make
