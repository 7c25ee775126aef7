"""FedNova (Wang et al. 2020): normalised averaging of the participants' local updates.

``w <- w - tau_eff sum_k p_k (w - w_k) / a_k`` with ``p_k = n_k / sum_K n``,
``tau_eff = sum_k p_k a_k`` and ``a_k`` the client's effective step count (``tau_k`` optimiser
steps; with heavy-ball momentum ``rho``: ``[tau_k - rho (1 - rho^tau_k)/(1 - rho)] / (1 - rho)``).
With equal step counts it is exactly FedAvg. The round is :mod:`ntk_fl.algorithms.server_round`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntk_fl.algorithms import server_round
from ntk_fl.algorithms.server_round import ServerHParams

__all__ = ["nova_coefficient", "nova_average", "nova_update", "check", "make_fednova", "METHOD"]


def nova_coefficient(steps, momentum: float):
  """FedNova's ``a_k`` for ``steps`` local SGD steps with heavy-ball ``momentum`` (0: ``steps``)."""
  steps = jnp.asarray(steps, jnp.float32)
  if not momentum:
    return steps
  rho = momentum
  return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


def nova_average(momentum: float):
  """FedNova's aggregation for heavy-ball ``momentum`` (arguments as ``weighted_average``'s)."""

  def aggregate(params, result, sent, sizes):
    p = sizes / jnp.sum(sizes)
    weighted_mean = lambda tree: jax.tree.map(lambda w: jnp.tensordot(p, w, axes=1), tree)
    a = nova_coefficient(result.steps, momentum)  # [K]
    tau_eff = jnp.sum(p * a)
    normalized = jax.tree.map(
      lambda w, s: (w[None] - s) / a.reshape(-1, *([1] * w.ndim)), params, sent
    )
    return jax.tree.map(lambda w, d: w - tau_eff * d, params, weighted_mean(normalized))

  return aggregate


def check(hparams: ServerHParams, run) -> None:
  """The server rule, and no Nesterov momentum (``a_k`` is heavy-ball's); raises ``ValueError``."""
  server_round.check(hparams, run)
  if hparams.nesterov:
    raise ValueError(
      "method 'fednova' normalises by the heavy-ball momentum coefficient; "
      "config.algorithm.nesterov must be False"
    )


def nova_update(model, hparams: ServerHParams) -> server_round.ServerUpdate:
  """FedNova's round: FedAvg's local training, then :func:`nova_average` of the uploads."""
  aggregate = nova_average(float(hparams.momentum))
  return server_round.federated_update(model, hparams, aggregate=aggregate)


METHOD = server_round.server_method("fednova", "FedNova", nova_update, check=check)
make_fednova = METHOD.make
