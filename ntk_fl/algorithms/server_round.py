"""The round of the server baselines: FedAvg, FedProx, FedNova, DataShare and centralised training.

One synchronous round ``r`` (0-based) of every method built on :func:`make_server_method` (registered
through :func:`server_method`, which gives each its factory and :class:`~ntk_fl.algorithms.Method`):

1. ``round_inputs(r)`` draws ``K = clients_per_round`` participants uniformly
   without replacement (``0`` = all ``M``; NTK-FL samples 20 of 300), from
   ``rng.numpy_rng(seed, Stream.PARTICIPATION, r)`` -- a function of the round only.
2. The method's ``update`` trains from the global model on the participants' data
   (:mod:`ntk_fl.algorithms.local`: ``epochs`` passes, minibatch ``batch_size``,
   learning rate ``lr * lr_gamma**r``), all ``K`` in one compiled program, and
   returns the new global model. :func:`federated_update` is the update of the
   methods whose participants train locally, upload their weights (optionally
   ``quantize_bits``-bit quantised) and are aggregated with data-size weights
   ``p_k = n_k / sum_K n`` (:func:`weighted_average`, FedAvg's rule, unless the
   method passes its own).

Communication (uplink only, as NTK-FL Table 1 counts): ``bits_per_client``,
``bits_sent_total`` (this round) and ``bits_cumulative`` (carried in the state,
float32, so relative rounding ~1e-7). The global model is the state's only
model, so ``client_params`` returns it with a client axis of length 1 (the
aggregated model the runner scores is then exactly the global model).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import compression, models, parallel
from ntk_fl.algorithms import local
from ntk_fl.algorithms.base import Method
from ntk_fl.algorithms.base import Algorithm, ParamsState, run_options
from ntk_fl.rng import Stream, jax_key, numpy_rng

__all__ = [
  "ServerRound",
  "ServerHParams",
  "ServerUpdate",
  "check",
  "make_server_method",
  "server_method",
  "federated_update",
  "weighted_average",
]


class ServerRound(NamedTuple):
  """Inputs of one round: ``round`` int32 (0-based), ``clients`` int32 ``[K]``, ``key``."""

  round: Any
  clients: Any
  key: Any


@dataclasses.dataclass(frozen=True)
class ServerHParams(local.LocalHParams):
  """FedAvg, FedNova and centralised training: local SGD plus ``clients_per_round`` (0 = all)."""

  clients_per_round: int

  def __post_init__(self):
    super().__post_init__()
    local.check_fields(self, {"clients_per_round": local.int_at_least(0)})


def check(hparams: ServerHParams, run) -> None:
  """The rule all server methods share: at most ``config.data.num_clients`` participants a round."""
  if hparams.clients_per_round > run.data.num_clients:
    raise ValueError(
      f"config.algorithm.clients_per_round = {hparams.clients_per_round} exceeds "
      f"config.data.num_clients = {run.data.num_clients} (0 = all clients)"
    )


ServerUpdate = Callable[..., tuple[Any, Any, Any]]
"""``update(params, x, y, mask, sizes, train_key, quant_key, lr, extra) -> (params, loss, bits)``.

``params``: the global model; ``x [K, n_max, ...]``, ``y [K, n_max]``, ``mask [K, n_max]``: the
participants' padded samples; ``sizes`` float32 ``[K]``: their sample counts; ``train_key``,
``quant_key``: the round's keys for training and for quantisation; ``lr``: the round's learning
rate; ``extra``: the method's own arrays (:func:`make_server_method`). Returns the new global
model, the round's scalar loss and the bits each participant sent (float32 scalar). Traced inside
the round's jit.
"""


def make_server_method(
  model: models.Model,
  federation,
  hparams: ServerHParams,
  *,
  seed: int,
  update: ServerUpdate,
  extra: Any = (),
  scored_params: Callable[[Any], Any] | None = None,
) -> Algorithm:
  """A server method's :class:`Algorithm`: the participants' draw, the global state, the bit count.

  Args:
    model: the model (one global copy).
    federation: a :class:`ntk_fl.data.Federation`.
    hparams: the method's hyperparameters (``clients_per_round``, ``lr``, ``lr_gamma`` read here).
    seed: the run seed (participants, round keys).
    update: the method's round (:data:`ServerUpdate`).
    extra: a pytree of arrays the update reads (e.g. DataShare's global set), passed to the compiled
      round as an argument.
    scored_params: optionally ``scored_params(params) -> params``: the global model as the runner scores
      it (``client_params``), when that is not the trained network itself (FedAvg' folds its input
      projection into the first layer); default the global model unchanged.

  Returns:
    An :class:`Algorithm` whose ``step`` is jit-compiled with the federation's
    arrays passed as arguments.
  """
  num_clients = federation.mask.shape[0]
  k = int(hparams.clients_per_round) or num_clients
  data = parallel.to_device((federation, extra))

  def init(key):
    params = jax.tree.map(lambda w: w[0], models.init_clients(model, key, 1))
    return ParamsState(params=params, bits_cumulative=jnp.float32(0))

  def round_inputs(round_index: int) -> ServerRound:
    rng = numpy_rng(seed, Stream.PARTICIPATION, round_index)
    clients = np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int32)
    return ServerRound(
      round=np.int32(round_index),
      clients=clients,
      key=jax_key(seed, Stream.ROUND_KEYS, round_index),
    )

  @jax.jit
  def _step(state, inputs, data):
    fed, extra_arrays = data
    lr = local.round_lr(hparams, inputs.round)
    (x, y), mask = fed.samples(fed.index[inputs.clients]), fed.mask[inputs.clients]
    sizes = jnp.sum(mask, axis=1).astype(jnp.float32)  # [K]
    train_key, quant_key = jax.random.split(inputs.key)
    new_params, loss, bits_per_client = update(
      state.params, x, y, mask, sizes, train_key, quant_key, lr, extra_arrays
    )
    total = bits_per_client * k
    new_state = ParamsState(params=new_params, bits_cumulative=state.bits_cumulative + total)
    metrics = {
      "loss": loss,
      "lr": lr,
      "bits_per_client": bits_per_client,
      "bits_sent_total": total,
      "bits_cumulative": new_state.bits_cumulative,
    }
    return new_state, metrics

  def step(state, inputs):
    return _step(state, inputs, data)

  def client_params(state):
    params = state.params if scored_params is None else scored_params(state.params)
    return jax.tree.map(lambda w: w[None], params)

  return Algorithm(init=init, round_inputs=round_inputs, step=step, client_params=client_params)


def server_method(
  name: str,
  label: str,
  update: Callable[[models.Model, Any], ServerUpdate],
  *,
  hyperparameters: type = ServerHParams,
  check: Callable[[Any, Any], None] | None = check,
  extra: Callable[[Any, Any, int], Any] | None = None,
  network: Callable[[models.Model, Any], models.Model] | None = None,
  scored_params: Callable[[Any, models.Model, Any], Any] | None = None,
) -> Method:
  """The registered :class:`~ntk_fl.algorithms.Method` of a server baseline built on :func:`make_server_method`.

  Its factory is ``make(model, federation, topology, hparams, run=None, *, seed=None)`` (a
  :class:`~ntk_fl.algorithms.MakeFn`; ``seed`` stands in for ``run`` as in
  :func:`~ntk_fl.algorithms.base.run_options`; the topology is unused): the round of
  :func:`make_server_method` with the method's ``update`` of the network it trains.

  Args:
    name: the registry name (``'fedavg'``); the factory is named ``make_<name>``.
    label: the display name (``'FedAvg'``), named by the factory's errors.
    update: ``update(model, hparams) -> ServerUpdate``, the method's round (e.g. :func:`federated_update`).
    hyperparameters: the method's dataclass (:class:`ServerHParams` or a subclass with its own fields).
    check: ``check(hparams, run)``, the rules across blocks (default :func:`check`, at most
      ``num_clients`` participants).
    extra: optionally ``extra(federation, hparams, seed) -> arrays``, what the update reads besides the
      participants' data (DataShare's global set, FedBE's server set, FedAvg''s input projection), drawn
      once from the run seed.
    network: optionally ``network(model, hparams) -> Model``, the network the participants train when it
      is not the run's model (FedAvg''s MLP on the projected inputs); ``update`` and the initial global
      model are of this network.
    scored_params: optionally ``scored_params(params, net, extra_arrays) -> params``: the global model
      ``params`` of the trained network ``net`` as the runner scores it on raw inputs (FedAvg' folds its
      projection into the first layer); default ``params`` unchanged.
  """

  def make(
    model: models.Model,
    federation,
    topology,
    hparams: ServerHParams,
    run=None,
    *,
    seed: int | None = None,
  ) -> Algorithm:
    del topology  # a server method mixes over no graph
    seed = run_options(run, label, needs_topology=False, seed=seed).seed
    arrays = () if extra is None else extra(federation, hparams, seed)
    net = model if network is None else network(model, hparams)
    scored = None if scored_params is None else lambda params: scored_params(params, net, arrays)
    return make_server_method(
      net,
      federation,
      hparams,
      seed=seed,
      update=update(net, hparams),
      extra=arrays,
      scored_params=scored,
    )

  make.__name__ = make.__qualname__ = f"make_{name}"
  make.__doc__ = (
    f"{label} for ``federation`` and ``model`` (arguments as :func:`make_server_method`; ``run`` or "
    "``seed``)."
  )
  return Method(make=make, hyperparameters=hyperparameters, check=check)


def weighted_average(params, result: local.LocalResult, sent, sizes):
  """FedAvg's aggregation (McMahan et al. 2017): ``w <- sum_k p_k w_k``, ``p_k = n_k / sum_K n``.

  Args:
    params: the global model (unused here; an aggregation may step from it).
    result: the participants' :class:`~ntk_fl.algorithms.local.LocalResult` (leaves ``[K, ...]``).
    sent: the weights the server received (``result.params`` or its quantisation), ``[K, ...]``.
    sizes: float32 ``[K]`` sample counts.
  """
  del params, result
  p = sizes / jnp.sum(sizes)
  return jax.tree.map(lambda w: jnp.tensordot(p, w, axes=1), sent)


def federated_update(
  model: models.Model,
  hparams: local.LocalHParams,
  *,
  aggregate: Callable[..., Any] = weighted_average,
  augment: Callable[..., tuple[Any, Any, Any]] | None = None,
) -> ServerUpdate:
  """The round of the methods whose participants train locally and upload their weights.

  Every participant trains from the global model (FedProx's proximal term, when ``hparams`` has
  ``prox_mu``, anchors it there), sends its weights (``quantize_bits``-bit quantised unless 32)
  and the server combines them with ``aggregate(params, result, sent, sizes)``
  (:func:`weighted_average`).

  Args:
    model: the model.
    hparams: the local-training hyperparameters (:class:`~ntk_fl.algorithms.local.LocalHParams`).
    aggregate: the server's rule (arguments as :func:`weighted_average`).
    augment: optionally ``augment(x, y, mask, extra) -> (x, y, mask)``: what each participant
      trains on besides its own samples (DataShare's global set).
  """
  bits, stochastic = int(hparams.quantize_bits), bool(hparams.stochastic_rounding)
  local_update = local.local_update_from_hparams(
    model.apply, hparams, flax_apply=local.patch_apply(model)
  )
  payload = compression.tree_payload_bits(jax.eval_shape(model.init, jax.random.key(0)), bits)

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, extra):
    k = mask.shape[0]
    if augment is not None:
      x, y, mask = augment(x, y, mask, extra)
    per_client = lambda xc, yc, mc, kc: local_update(params, xc, yc, mc, kc, lr, anchor=params)
    result = parallel.for_each_client(per_client)(x, y, mask, jax.random.split(train_key, k))
    sent = local.transmit(result.params, bits, key=quant_key, stochastic=stochastic)
    return aggregate(params, result, sent, sizes), jnp.mean(result.loss), jnp.float32(payload)

  return update
