"""FedAvg (McMahan et al. 2017): local SGD on the participants, then ``w <- sum_k p_k w_k``.

The round, the participants' draw and the bit count are :mod:`ntk_fl.algorithms.server_round`'s;
``p_k = n_k / sum_K n`` weighs each participant by its data size.

FedAvg' (NTK-FL, Yue et al. 2022, Fig. 3): FedAvg on the inputs CP-NTK-FL's clients send. With
``subsample_fraction`` = β < 1 every participant trains on a random β share of its samples, redrawn
every round (``n_k`` is then the share's size), and with ``projection_dim`` = d1' > 0 on ``Z = X P``,
``P [d1, d1']`` the run's shared seeded projection; the global model is then the MLP on d1' inputs.
Both are CP-NTK-FL's own pieces, kept with the server round both build on
(:func:`ntk_fl.algorithms.server_round.input_projection`,
:func:`~ntk_fl.algorithms.server_round.participant_inputs`), so a CP-NTK-FL run and a FedAvg' run of
one seed project with the same ``P``. The round key's training half is split once more: its first
half draws the shares (participant ``i`` with ``split(sub_key, K)[i]``), its second half trains. The
test set is projected with the same ``P``: ``client_params`` folds ``P`` into the first dense layer
(``(X P) W = X (P W)``), so the runner scores the raw-input network. β = 1 and d1' = 0 (the
defaults) are plain FedAvg, unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ntk_fl import jacobians, models
from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["FedAvgHParams", "check", "fedavg_update", "make_fedavg", "METHOD"]


@dataclasses.dataclass(frozen=True)
class FedAvgHParams(ServerHParams):
  """FedAvg: :class:`~ntk_fl.algorithms.server_round.ServerHParams` plus FedAvg''s input options.

  Attributes:
    subsample_fraction: β in (0, 1], each participant's share of its samples per round (1 = all).
    projection_dim: d1' of the shared input projection (0 = none; MLP only).
    projection_scale: :data:`ntk_fl.jacobians.PROJECTION_SCALES`, as CP-NTK-FL's.
  """

  subsample_fraction: float = 1.0
  projection_dim: int = 0
  projection_scale: str = "sqrt_input"

  def __post_init__(self):
    super().__post_init__()
    server_round.check_input_options(self)


def check(hparams: FedAvgHParams, run) -> None:
  """At most ``num_clients`` participants; the input projection needs the MLP."""
  server_round.check(hparams, run)
  server_round.check_projection_model(hparams, run)


def _input_options(hparams) -> tuple[float, int]:
  """``(β, d1')``; a plain :class:`ServerHParams` (no input options) is plain FedAvg."""
  return float(getattr(hparams, "subsample_fraction", 1.0)), int(
    getattr(hparams, "projection_dim", 0)
  )


def _network(model: models.Model, hparams) -> models.Model:
  """The network the participants train: the MLP on the d1' projected inputs, or the run's model."""
  proj_dim = _input_options(hparams)[1]
  return models.mlp_on_inputs(model, proj_dim) if proj_dim else model


def _projection(federation, hparams, seed: int):
  """The update's extra arrays: the shared input projection ``P [d1, d1']``, or ``()`` without one."""
  if not _input_options(hparams)[1]:
    return ()
  return server_round.input_projection(seed, federation.feature_shape, hparams)


def _scored_params(params, net: models.Model, projection):
  """The global model on raw inputs: ``P`` folded into the first dense layer (``(X P) W = X (P W)``)."""
  if isinstance(projection, tuple):  # no projection: the trained network is the raw-input one
    return params
  return jacobians.fold_projection(params, projection, layer=net.dense_stack.layers[0])


def fedavg_update(net: models.Model, hparams) -> server_round.ServerUpdate:
  """FedAvg's round of ``net``: :func:`~ntk_fl.algorithms.server_round.federated_update`, on each
  participant's β share of its samples projected by ``P`` (the update's extra arrays) for FedAvg'."""
  beta, proj_dim = _input_options(hparams)
  train = server_round.federated_update(net, hparams)
  if beta == 1 and not proj_dim:
    return train

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, proj):
    del sizes  # of the whole data; the participants train on their shares
    sub_key, train_key = jax.random.split(train_key)
    x, y, mask = server_round.participant_inputs(
      x, y, mask, sub_key, beta=beta, projection=proj if proj_dim else None
    )
    sizes = jnp.sum(mask, axis=1).astype(jnp.float32)  # [K] the shares' sizes
    return train(params, x, y, mask, sizes, train_key, quant_key, lr, ())

  return update


METHOD = server_round.server_method(
  "fedavg",
  "FedAvg",
  fedavg_update,
  hyperparameters=FedAvgHParams,
  check=check,
  extra=_projection,
  network=_network,
  scored_params=_scored_params,
)
make_fedavg = METHOD.make
