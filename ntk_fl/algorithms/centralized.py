"""Centralised training: the reference upper bound of the server-based comparisons.

The server collects the round's participants' samples and trains the global model on their union
with the same optimiser, epochs and batch size as the federated methods (NTK-FL's "centralized
training simulation"); what is sent is the raw data (features and label at 32 bits per value).
The round and the participants' draw are :mod:`ntk_fl.algorithms.server_round`'s.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ntk_fl import compression, models
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.base import Algorithm, run_options
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["check", "make_centralized", "METHOD"]


def check(hparams: ServerHParams, run) -> None:
  """The server rule, and unquantised uploads (raw data is sent); raises ``ValueError``."""
  server_round.check(hparams, run)
  if hparams.quantize_bits != compression.FLOAT_BITS:
    raise ValueError(
      "method 'centralized' sends raw data, not weights: "
      f"config.algorithm.quantize_bits must be 32, got {hparams.quantize_bits!r}"
    )


def make_centralized(
  model: models.Model,
  federation,
  topology,
  hparams: ServerHParams,
  run=None,
  *,
  seed: int | None = None,
) -> Algorithm:
  """Centralised training (arguments as ``server_round.make_server_method``)."""
  seed = run_options(run, "Centralized training", needs_topology=False, seed=seed).seed
  local_update = local.local_update_from_hparams(model.apply, hparams)
  # features + label
  sample_bits = compression.FLOAT_BITS * (math.prod(federation.feature_shape) + 1)

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, extra):
    del quant_key, extra
    k, n_max = mask.shape
    pooled = local_update(
      params, x.reshape(k * n_max, *x.shape[2:]), y.reshape(-1), mask.reshape(-1), train_key, lr
    )
    return pooled.params, pooled.loss, jnp.mean(sizes) * sample_bits

  return server_round.make_server_method(model, federation, hparams, seed=seed, update=update)


METHOD = Method(make=make_centralized, hyperparameters=ServerHParams, check=check)
