"""QSGD (Alistarh et al. 2017): the participants' stochastic gradients, QSGD-quantised, averaged by the server.

One round ``r`` (the participants' draw and the bit count are :mod:`ntk_fl.algorithms.server_round`'s):
every participant ``k`` computes the gradient ``g_k`` of its mean cross-entropy at the global model ``w``
on ``min(batch_size, n_k)`` of its samples (a uniformly random subset, ``local.epoch_order`` keyed by
``split(train_key, K)[k]``; all of them when ``batch_size >= n_k``), uploads ``Q(g_k)``
(:func:`ntk_fl.compression.qsgd_quantize` per parameter tensor, ``quantize_bits`` bits per
coordinate, one float32 norm per bucket; client ``k``'s draws from ``split(quant_key, K)[k]``) and
the server steps ``w <- w - lr_r sum_k p_k Q(g_k)`` with ``p_k = n_k / sum_K n`` (Alistarh et al.'s
Algorithm 1 with the round's participants as the processors; data-size weights as FedAvg's, equal
weights on the fixed-size partition). Uplink: :func:`ntk_fl.communication.qsgd_upload_bits`.

The quantisation options (:class:`QsgdOptions`: bits, stochastic rounding, bucket size, norm) are
shared with FedCOM (:mod:`ntk_fl.algorithms.fedcom`), which sends its local update through the same
quantiser (:func:`transmit_qsgd`); that uplink lives with the server round both build on
(:mod:`ntk_fl.algorithms.server_round`), and this module re-exports it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ntk_fl import models, parallel
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import (  # re-exported: the uplink FedCOM shares
  QsgdNorm,
  QsgdOptions,
  check_qsgd_fields,
  transmit_qsgd,
  upload_bits,
)

__all__ = [
  "QsgdNorm",
  "QsgdOptions",
  "QSGDHParams",
  "check_qsgd_fields",
  "transmit_qsgd",
  "upload_bits",
  "make_qsgd",
  "METHOD",
]


@dataclasses.dataclass(frozen=True)
class QSGDHParams:
  """QSGD (``config.algorithm``; each value checked on construction).

  Attributes:
    clients_per_round: participants per round (0 = all).
    lr, lr_gamma: the server step of round ``r`` is ``lr * lr_gamma**r`` (lr > 0, lr_gamma in (0, 1]).
    batch_size: samples per participant's gradient (>= 1; ``>= n_k`` = all of them).
    quantize_bits, stochastic_rounding, bucket_size, qsgd_norm: :class:`QsgdOptions`.
  """

  clients_per_round: int
  lr: float
  lr_gamma: float
  batch_size: int
  quantize_bits: int
  stochastic_rounding: bool
  bucket_size: int
  qsgd_norm: QsgdNorm

  def __post_init__(self):
    local.check_fields(
      self,
      {
        "clients_per_round": local.int_at_least(0),
        "lr": local.positive,
        "lr_gamma": local.fraction,
        "batch_size": local.int_at_least(1),
      },
    )
    check_qsgd_fields(self)


def gradient_update(model: models.Model, hparams: QSGDHParams) -> server_round.ServerUpdate:
  """QSGD's round as a :data:`~ntk_fl.algorithms.server_round.ServerUpdate` (module docstring)."""
  options = QsgdOptions.of(hparams)
  payload = upload_bits(model, options)

  def client_gradient(params, x, y, mask, key):
    batch = min(int(hparams.batch_size), mask.shape[0])
    order = local.epoch_order(key, mask)[:batch]
    weights = mask[order].astype(jnp.float32)
    # Empty slots (a client with fewer than `batch` samples) read its first drawn sample at weight 0.
    order = jnp.where(weights > 0, order, order[0])
    loss_fn = lambda w: local.masked_cross_entropy(model.apply(w, x[order]), y[order], weights)
    loss, grad = jax.value_and_grad(loss_fn)(params)
    return grad, loss

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, extra):
    del extra
    k = mask.shape[0]
    per_client = lambda xc, yc, mc, kc: client_gradient(params, xc, yc, mc, kc)
    grads, losses = parallel.for_each_client(per_client)(x, y, mask, jax.random.split(train_key, k))
    sent = transmit_qsgd(grads, options, quant_key)
    p = sizes / jnp.sum(sizes)
    new_params = jax.tree.map(lambda w, g: w - lr * jnp.tensordot(p, g, axes=1), params, sent)
    return new_params, jnp.mean(losses), jnp.float32(payload)

  return update


METHOD = server_round.server_method("qsgd", "QSGD", gradient_update, hyperparameters=QSGDHParams)
make_qsgd = METHOD.make
