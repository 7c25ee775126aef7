"""Server-based gradient baselines: FedAvg, FedProx, FedNova, DataShare and centralised training.

One synchronous round ``r`` (0-based) of every method here:

1. ``round_inputs(r)`` draws ``K = clients_per_round`` participants uniformly
   without replacement (``0`` = all ``M``; NTK-FL samples 20 of 300), from
   ``rng.numpy_rng(seed, Stream.PARTICIPATION, r)`` -- a function of the round only.
2. The participants start from the global model and train locally
   (:mod:`ntk_fl.algorithms.local`: ``epochs`` passes, minibatch ``batch_size``,
   learning rate ``lr * lr_gamma**r``), all ``K`` in one compiled program.
3. They upload their weights (optionally ``quantize_bits``-bit quantised) and the
   server aggregates with data-size weights ``p_k = n_k / sum_K n``:

   * ``fedavg`` (McMahan et al. 2017): ``w <- sum_k p_k w_k``.
   * ``fedprox`` (Li et al. 2020): FedAvg whose local objective adds
     ``(mu/2) ||w - w_global||^2`` (``prox_mu``).
   * ``fednova`` (Wang et al. 2020): normalised averaging,
     ``w <- w - tau_eff sum_k p_k (w - w_k) / a_k`` with ``tau_eff = sum_k p_k a_k``
     and ``a_k`` the client's effective step count (``tau_k`` optimiser steps; with
     heavy-ball momentum ``rho``: ``[tau_k - rho (1 - rho^tau_k)/(1 - rho)] / (1 - rho)``).
     With equal step counts it is exactly FedAvg.
   * ``datashare`` (Zhao et al. 2018, as compared in NTK-FL): a global set ``G``
     of ``share_fraction * sum_i n_i`` samples (NTK-FL: 10% of the total number
     of local data points) is drawn once, uniformly without replacement from the
     clients' real samples (stream ``Stream.SHARED_SET``), broadcast, and every
     participant trains on its own data *plus all of G* (mixed into the same
     shuffled minibatches); aggregation as FedAvg, weights by own data size.
   * ``centralized``: the reference upper bound -- the server collects the
     participants' samples and trains the global model on their union with the
     same optimiser, epochs and batch size (NTK-FL's "centralized training
     simulation"); what is sent is the raw data.

Communication (uplink only, as NTK-FL Table 1 counts): ``bits_per_client``,
``bits_sent_total`` (this round) and ``bits_cumulative`` (carried in the state,
float32, so relative rounding ~1e-7). The global model is the state's only
model, so ``client_params`` returns it with a client axis of length 1 (the
aggregated model the runner scores is then exactly the global model).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import compression, models, parallel
from ntk_fl.algorithms import Method
from ntk_fl.algorithms import local
from ntk_fl.algorithms.base import Algorithm
from ntk_fl.rng import Stream, jax_key, numpy_rng

__all__ = ["ServerState", "ServerRound", "METHODS", "make_centralized", "check", "nova_coefficient",
           "ServerHParams", "FedProxHParams", "DataShareHParams", "HPARAMS",
           "FEDAVG", "FEDPROX", "FEDNOVA", "DATASHARE", "CENTRALIZED"]

METHODS = ("fedavg", "fedprox", "fednova", "datashare", "centralized")


class ServerState(NamedTuple):
  """``params``: the global model (no client axis); ``bits_cumulative``: float32 uplink bits so far."""
  params: Any
  bits_cumulative: Any


class ServerRound(NamedTuple):
  """Inputs of one round: ``round`` int32 (0-based), ``clients`` int32 ``[K]`` participants, ``key``."""
  round: Any
  clients: Any
  key: Any


def nova_coefficient(steps, momentum: float):
  """FedNova's ``a_k`` for ``steps`` local SGD steps with heavy-ball ``momentum`` (``steps`` if 0)."""
  steps = jnp.asarray(steps, jnp.float32)
  if not momentum:
    return steps
  rho = momentum
  return (steps - rho * (1.0 - rho ** steps) / (1.0 - rho)) / (1.0 - rho)


@dataclasses.dataclass(frozen=True)
class ServerHParams(local.LocalHParams):
  """FedAvg, FedNova and centralised training: local SGD plus ``clients_per_round`` (0 = all clients)."""
  clients_per_round: int

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"clients_per_round": local.int_at_least(0)})


@dataclasses.dataclass(frozen=True)
class FedProxHParams(ServerHParams):
  """FedProx: plus the proximal coefficient ``prox_mu`` (>= 0)."""
  prox_mu: float

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"prox_mu": local.nonnegative})


@dataclasses.dataclass(frozen=True)
class DataShareHParams(ServerHParams):
  """DataShare: plus ``share_fraction`` in (0, 1], the global set's size relative to all local data."""
  share_fraction: float

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"share_fraction": local.fraction})


HPARAMS = {"fedavg": ServerHParams, "fedprox": FedProxHParams, "fednova": ServerHParams,
           "datashare": DataShareHParams, "centralized": ServerHParams}
"""The hyperparameter dataclass of each method of :data:`METHODS`."""


def check(method: str, hparams: ServerHParams, run) -> None:
  """Rules across blocks for ``method`` (one of :data:`METHODS`); raises ``ValueError`` naming the values."""
  if hparams.clients_per_round > run.data.num_clients:
    raise ValueError(f"config.algorithm.clients_per_round = {hparams.clients_per_round} exceeds "
                     f"config.data.num_clients = {run.data.num_clients} (0 = all clients)")
  if method == "fednova" and hparams.nesterov:
    raise ValueError("method 'fednova' normalises by the heavy-ball momentum coefficient; "
                     "config.algorithm.nesterov must be False")
  if method == "centralized" and hparams.quantize_bits != compression.FLOAT_BITS:
    raise ValueError("method 'centralized' sends raw data, not weights: config.algorithm.quantize_bits must be "
                     f"32, got {hparams.quantize_bits!r}")


def _shared_set(federation, fraction: float, seed: int):
  """DataShare's global set: ``round(fraction * sum n)`` real samples drawn without replacement."""
  slots = np.argwhere(np.asarray(federation.mask))                 # [sum n, 2] (client, row)
  size = max(1, int(round(fraction * slots.shape[0])))
  rng = numpy_rng(seed, Stream.SHARED_SET)
  pick = slots[np.sort(rng.choice(slots.shape[0], size=size, replace=False))]
  return federation.samples(np.asarray(federation.index)[pick[:, 0], pick[:, 1]])


def make_centralized(method: str, model: models.Model, federation, hparams: ServerHParams, *,
                     seed: int) -> Algorithm:
  """Builds ``method`` (one of :data:`METHODS`) for ``federation`` and ``model``.

  Args:
    method: one of :data:`METHODS`.
    model: the model (one global copy).
    federation: a :class:`ntk_fl.data.Federation`.
    hparams: the method's :data:`HPARAMS` dataclass.
    seed: the run seed (participants, round keys, DataShare's global set).

  Returns:
    An :class:`Algorithm` whose ``step`` is jit-compiled with the federation's
    arrays passed as arguments.
  """
  if method not in METHODS:
    raise ValueError(f"unknown centralized method {method!r}; choose one of {METHODS}")
  algo = hparams
  num_clients, n_max = federation.mask.shape
  k = int(algo.clients_per_round) or num_clients
  bits, stochastic = int(algo.quantize_bits), bool(algo.stochastic_rounding)
  local_update = local.local_update_from_hparams(model.apply, algo)
  sample_bits = compression.FLOAT_BITS * (math.prod(federation.feature_shape) + 1)  # features + label
  if method == "datashare":
    shared = _shared_set(federation, float(algo.share_fraction), seed)
  else:
    shared = (np.zeros((0, *federation.feature_shape), np.float32), np.zeros((0,), np.int32))
  data = parallel.to_device((federation, *shared))
  payload = compression.tree_payload_bits(jax.eval_shape(model.init, jax.random.key(0)), bits)

  def init(key):
    params = jax.tree.map(lambda w: w[0], models.init_clients(model, key, 1))
    return ServerState(params=params, bits_cumulative=jnp.float32(0))

  def round_inputs(round_index: int) -> ServerRound:
    rng = numpy_rng(seed, Stream.PARTICIPATION, round_index)
    clients = np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int32)
    return ServerRound(round=np.int32(round_index), clients=clients,
                       key=jax_key(seed, Stream.ROUND_KEYS, round_index))

  def train_clients(params, x, y, mask, key, lr, shared_x, shared_y):
    """All participants' local training; DataShare appends ``G`` to every client's data."""
    if method == "datashare":
      x = jnp.concatenate([x, jnp.broadcast_to(shared_x, (k, *shared_x.shape))], axis=1)
      y = jnp.concatenate([y, jnp.broadcast_to(shared_y, (k, *shared_y.shape))], axis=1)
      mask = jnp.concatenate([mask, jnp.ones((k, shared_y.shape[0]), bool)], axis=1)
    per_client = lambda xc, yc, mc, kc: local_update(params, xc, yc, mc, kc, lr, anchor=params)
    return parallel.for_each_client(per_client)(x, y, mask, jax.random.split(key, k))

  def aggregate(params, result, sent, sizes):
    p = sizes / jnp.sum(sizes)
    weighted_mean = lambda tree: jax.tree.map(lambda w: jnp.tensordot(p, w, axes=1), tree)
    if method != "fednova":
      return weighted_mean(sent)
    a = nova_coefficient(result.steps, float(algo.momentum))                           # [K]
    tau_eff = jnp.sum(p * a)
    normalized = jax.tree.map(lambda w, s: (w[None] - s) / a.reshape(-1, *([1] * w.ndim)), params, sent)
    return jax.tree.map(lambda w, d: w - tau_eff * d, params, weighted_mean(normalized))

  @jax.jit
  def _step(state, inputs, data):
    fed, shared_x, shared_y = data
    lr = local.round_lr(algo, inputs.round)
    (x, y), mask = fed.samples(fed.index[inputs.clients]), fed.mask[inputs.clients]
    sizes = jnp.sum(mask, axis=1).astype(jnp.float32)                                   # [K]
    train_key, quant_key = jax.random.split(inputs.key)
    if method == "centralized":
      pooled = local_update(state.params, x.reshape(k * n_max, *x.shape[2:]), y.reshape(-1), mask.reshape(-1),
                            train_key, lr)
      new_params, loss = pooled.params, pooled.loss
      bits_per_client = jnp.mean(sizes) * sample_bits
    else:
      result = train_clients(state.params, x, y, mask, train_key, lr, shared_x, shared_y)
      sent = local.transmit(result.params, bits, key=quant_key, stochastic=stochastic)
      new_params, loss = aggregate(state.params, result, sent, sizes), jnp.mean(result.loss)
      bits_per_client = jnp.float32(payload)
    total = bits_per_client * k
    new_state = ServerState(params=new_params, bits_cumulative=state.bits_cumulative + total)
    metrics = {"loss": loss, "lr": lr, "bits_per_client": bits_per_client, "bits_sent_total": total,
               "bits_cumulative": new_state.bits_cumulative}
    return new_state, metrics

  def step(state, inputs):
    return _step(state, inputs, data)

  return Algorithm(init=init, round_inputs=round_inputs, step=step,
                   client_params=lambda state: jax.tree.map(lambda w: w[None], state.params))


def _method(name: str) -> Method:
  return Method(make=lambda model, federation, topology, hparams, run: make_centralized(
                    name, model, federation, hparams, seed=run.seed),
                hyperparameters=HPARAMS[name], check=lambda hparams, run: check(name, hparams, run))


FEDAVG, FEDPROX, FEDNOVA, DATASHARE, CENTRALIZED = (_method(name) for name in METHODS)
