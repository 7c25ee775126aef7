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
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["check", "centralized_update", "make_centralized", "METHOD"]


def check(hparams: ServerHParams, run) -> None:
  """The server rule, and unquantised uploads (raw data is sent); raises ``ValueError``."""
  server_round.check(hparams, run)
  if hparams.quantize_bits != compression.FLOAT_BITS:
    raise ValueError(
      "method 'centralized' sends raw data, not weights: "
      f"config.algorithm.quantize_bits must be 32, got {hparams.quantize_bits!r}"
    )


def centralized_update(model: models.Model, hparams: ServerHParams) -> server_round.ServerUpdate:
  """Centralised training's round (:data:`~ntk_fl.algorithms.server_round.ServerUpdate`): the server trains on
  the union of the participants' samples; each participant sends its samples (features and label, 32 bits
  a value)."""
  local_update = local.model_local_update(model, hparams)

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, extra):
    del quant_key, extra
    k, n_max = mask.shape
    sample_bits = compression.FLOAT_BITS * (math.prod(x.shape[2:]) + 1)  # features + label
    pooled = local_update(
      params, x.reshape(k * n_max, *x.shape[2:]), y.reshape(-1), mask.reshape(-1), train_key, lr
    )
    return pooled.params, pooled.loss, jnp.mean(sizes) * sample_bits

  return update


METHOD = server_round.server_method(
  "centralized", "Centralized training", centralized_update, check=check
)
make_centralized = METHOD.make
