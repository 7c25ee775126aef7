"""FedCOM (Haddadpour et al. 2021, Algorithm 1): local SGD whose uplink is the QSGD-quantised local update.

One round ``r`` (the participants' draw and the bit count are :mod:`ntk_fl.algorithms.server_round`'s):
every participant trains from the global model ``w`` exactly as FedAvg's do
(:mod:`ntk_fl.algorithms.local`: ``epochs`` passes, minibatch ``batch_size``, learning rate
``lr * lr_gamma**r``, keys ``split(train_key, K)``) to ``w_k``, uploads ``Q(w - w_k)``
(QSGD's uplink, :func:`ntk_fl.algorithms.server_round.transmit_qsgd`: ``quantize_bits`` bits per
coordinate and one float32 norm per bucket; client ``k``'s draws from ``split(quant_key, K)[k]``) and the server
steps ``w <- w - server_lr * sum_k p_k Q(w - w_k)`` with ``p_k = n_k / sum_K n`` (FedAvg's weights;
the paper's ``1/K`` on a fixed-size partition). With 32 bits and ``server_lr = 1`` it is FedAvg.
Uplink: :func:`ntk_fl.communication.qsgd_upload_bits`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ntk_fl import models, parallel
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import QsgdNorm, ServerHParams

__all__ = ["FedCOMHParams", "compressed_update", "make_fedcom", "METHOD"]


@dataclasses.dataclass(frozen=True)
class FedCOMHParams(ServerHParams):
  """FedCOM: FedAvg's local SGD, plus the server step ``server_lr`` (> 0, the paper's ``γ``) and the
  QSGD uplink (``quantize_bits`` in [2, 16] or 32, ``stochastic_rounding``, ``bucket_size``,
  ``qsgd_norm``: :class:`ntk_fl.algorithms.server_round.QsgdOptions`)."""

  server_lr: float
  bucket_size: int
  qsgd_norm: QsgdNorm

  def __post_init__(self):
    # LocalHParams' check allows 1-bit min-max codes; QSGD's code needs a sign bit and a level bit.
    server_round.check_qsgd_fields(self)
    super().__post_init__()
    local.check_fields(self, {"server_lr": local.positive})


def compressed_update(model: models.Model, hparams: FedCOMHParams) -> server_round.ServerUpdate:
  """FedCOM's round as a :data:`~ntk_fl.algorithms.server_round.ServerUpdate` (module docstring)."""
  options = server_round.QsgdOptions.of(hparams)
  payload = server_round.upload_bits(model, options)
  local_update = local.model_local_update(model, hparams)
  server_lr = float(hparams.server_lr)

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, extra):
    del extra
    k = mask.shape[0]
    per_client = lambda xc, yc, mc, kc: local_update(params, xc, yc, mc, kc, lr)
    result = parallel.for_each_client(per_client)(x, y, mask, jax.random.split(train_key, k))
    deltas = jax.tree.map(lambda w, wk: w[None] - wk, params, result.params)
    sent = server_round.transmit_qsgd(deltas, options, quant_key)
    p = sizes / jnp.sum(sizes)
    new_params = jax.tree.map(
      lambda w, d: w - server_lr * jnp.tensordot(p, d, axes=1), params, sent
    )
    return new_params, jnp.mean(result.loss), jnp.float32(payload)

  return update


METHOD = server_round.server_method(
  "fedcom", "FedCOM", compressed_update, hyperparameters=FedCOMHParams
)
make_fedcom = METHOD.make
