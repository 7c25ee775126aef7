"""The round of the decentralised gradient baselines: D-PSGD, DFedAvg, DFedAvgM, DFedSAM, DisPFL.

Every round ``r`` (0-based) is one synchronous "train locally, then one gossip
step" on the round's graph, as in the NTK-DFL authors' baseline code
(docs/CONVENTIONS.md, "The decentralized baselines"):

1. ``round_inputs(r)`` draws the round's graph (``config.topology``; a new
   random 5-regular graph every round in the paper setting) and its mixing
   weights (``config.topology.mixing``, uniform ``1/(deg+1)`` as coded) -- a
   function of ``(seed, r)`` only.
2. Every client trains on its own data (:mod:`ntk_fl.algorithms.local`; all
   ``M`` clients in one compiled, chunked ``vmap``), learning rate
   ``lr * lr_gamma**r``.
3. Every client sends its trained weights to each neighbour (optionally
   ``quantize_bits``-bit quantised, as the authors' quantised baselines) and
   replaces its weights by ``s_i w_i + sum_k a_ik q(w_{n_ik})`` (its own term is
   exact; :func:`ntk_fl.gossip.mix` is the gossip step).

:func:`make_local_sgd_gossip` is that round; D-PSGD, DFedAvg, DFedAvgM and
DFedSAM differ only in the local optimiser (their hyperparameters live in
``configs/<method>.py``), so each of their modules is one :func:`local_sgd_method`.
:func:`make_gossip_method` is the frame around a method's client round (DisPFL's
masked one included): the graph draw, the round's keys and the bit count.

Communication: every client sends one model per neighbour; ``bits_sent``
(``[M]``), ``bits_sent_total`` and ``bits_cumulative`` (carried in the state as
float32, relative rounding ~1e-7).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import compression, gossip, models, parallel, topology
from ntk_fl.algorithms import local
from ntk_fl.algorithms.base import Method
from ntk_fl.algorithms.graph_inputs import graph_round_inputs
from ntk_fl.algorithms.base import (
  Algorithm,
  ParamsState,
  Replicable,
  run_options,
)

__all__ = [
  "GossipHParams",
  "ClientRound",
  "check_plain_sgd",
  "local_sgd_method",
  "make_gossip_method",
  "make_local_sgd_gossip",
]


@dataclasses.dataclass(frozen=True)
class GossipHParams(local.LocalHParams):
  """D-PSGD, DFedAvg and DFedAvgM: local SGD (:class:`~ntk_fl.algorithms.local.LocalHParams`)."""


def check_plain_sgd(method: str, hparams: GossipHParams) -> None:
  """D-PSGD and DFedAvg train with plain SGD: ``momentum`` must be 0 (else a ``ValueError``)."""
  if hparams.momentum:
    raise ValueError(
      f"method {method!r} uses plain SGD: config.algorithm.momentum must be 0, got "
      f"{hparams.momentum!r} (use 'dfedavgm' for momentum)"
    )


ClientRound = Callable[..., tuple[Any, Any]]
"""``client_round(state, inputs, samples, rows, mask, client_keys, quant_key, lr)``.

``state``: the method's state (a NamedTuple with ``params`` and ``bits_cumulative``); ``inputs``:
the round's :class:`~ntk_fl.algorithms.base.GraphRound`; ``samples``: the federation's samples as
a :class:`ntk_fl.parallel.Shared` (a client's padded rows are ``samples.take(rows[i])``); ``rows``
int ``[M, n_max]``, ``mask`` bool ``[M, n_max]``; ``client_keys`` ``[M]`` training keys;
``quant_key``: the round's quantisation key; ``lr``: the round's learning rate. Returns the new
state (its ``bits_cumulative`` unchanged: the frame adds the round's bits) and the ``[M]`` losses.
Traced inside the round's jit.
"""


def make_gossip_method(
  federation,
  graphs: topology.Topology,
  hparams: local.LocalHParams,
  *,
  seed: int,
  mixing: str,
  payload: int,
  init: Callable[[Any], Any],
  client_round: ClientRound,
) -> Algorithm:
  """A decentralised method's :class:`Algorithm` around its ``init`` and ``client_round``.

  Args:
    federation: a :class:`ntk_fl.data.Federation` of ``M`` clients.
    graphs: the communication :class:`ntk_fl.topology.Topology` over the ``M`` clients.
    hparams: the method's hyperparameters (``lr``, ``lr_gamma`` are read here).
    seed: the run seed (round keys).
    mixing: mixing scheme (:data:`ntk_fl.topology.MIXING_SCHEMES`).
    payload: bits of one model sent to one neighbour.
    init: ``init(key) -> state``.
    client_round: the method's round (:data:`ClientRound`).

  Returns:
    An :class:`Algorithm`; ``step`` is jit-compiled with the federation's arrays
    passed as arguments (never baked in as constants).
  """
  num_clients = federation.mask.shape[0]
  if graphs.num_clients != num_clients:
    raise ValueError(
      f"the topology spans {graphs.num_clients} clients, the federation {num_clients}"
    )
  sizes = np.asarray(federation.n)
  # Samples held in per-device blocks (parallel.Shared)?
  split = parallel.is_client_split(federation.samples_x)
  data = parallel.to_device(federation)
  round_inputs = graph_round_inputs(graphs, mixing, sizes, seed)

  def round_fn(state, inputs, data):
    # Each client's samples are gathered in its chunk (samples.take).
    rows, ms = data.index, data.mask
    samples = parallel.Shared((data.samples_x, data.samples_y), split)
    lr = local.round_lr(hparams, inputs.round)
    train_key, quant_key = jax.random.split(inputs.key)
    client_keys = jax.random.split(train_key, num_clients)
    new_state, loss = client_round(state, inputs, samples, rows, ms, client_keys, quant_key, lr)
    bits_sent = jnp.sum(inputs.neighbor_mask, axis=1).astype(jnp.float32) * payload  # [M]
    total = jnp.sum(bits_sent)
    cumulative = state.bits_cumulative + total
    new_state = new_state._replace(bits_cumulative=cumulative)
    metrics = {
      "loss": loss,
      "lr": lr,
      "bits_sent": bits_sent,
      "bits_sent_total": total,
      "bits_cumulative": cumulative,
    }
    return new_state, metrics

  _step = jax.jit(round_fn)

  def step(state, inputs):
    return _step(state, inputs, data)

  return Algorithm(
    init=init,
    round_inputs=round_inputs,
    step=step,
    client_params=lambda state: state.params,
    replicable=None if split else Replicable(round_fn, data),
  )


def make_local_sgd_gossip(
  model: models.Model,
  federation,
  graphs: topology.Topology,
  hparams: local.LocalHParams,
  *,
  seed: int,
  mixing: str = "uniform",
  shared_init: bool = True,
) -> Algorithm:
  """Local training of every client, then one gossip step (D-PSGD, DFedAvg, DFedAvgM, DFedSAM).

  Args:
    model: the model.
    federation: a :class:`ntk_fl.data.Federation` of ``M`` clients.
    graphs: the communication :class:`ntk_fl.topology.Topology` over the ``M`` clients.
    hparams: the method's :class:`~ntk_fl.algorithms.local.LocalHParams` (with SAM's fields).
    seed: the run seed (round keys).
    mixing: mixing scheme (:data:`ntk_fl.topology.MIXING_SCHEMES`).
    shared_init: every client starts from the same initialisation.
  """
  num_clients = federation.mask.shape[0]
  bits, stochastic = int(hparams.quantize_bits), bool(hparams.stochastic_rounding)
  local_update = local.model_local_update(model, hparams)
  payload = compression.tree_payload_bits(jax.eval_shape(model.init, jax.random.key(0)), bits)

  def init(key):
    params = models.init_clients(model, key, num_clients, shared=shared_init)
    return ParamsState(params=params, bits_cumulative=jnp.float32(0))

  def client_round(state, inputs, samples, rows, ms, client_keys, quant_key, lr):
    per_client = lambda s, p, r, m, kk: local_update(p, *s.take(r), m, kk, lr)
    result = parallel.for_each_client(per_client)(samples, state.params, rows, ms, client_keys)
    sent = None  # the gossip step's own term is exact, the neighbours' terms are as sent
    if bits != compression.FLOAT_BITS:
      sent = local.transmit(result.params, bits, key=quant_key, stochastic=stochastic)
    params = gossip.mix(
      result.params, inputs.neighbors, inputs.self_weight, inputs.neighbor_weights, sent=sent
    )
    return state._replace(params=params), result.loss

  return make_gossip_method(
    federation,
    graphs,
    hparams,
    seed=seed,
    mixing=mixing,
    payload=payload,
    init=init,
    client_round=client_round,
  )


def local_sgd_method(
  name: str, label: str, *, hyperparameters: type = GossipHParams, plain_sgd: bool = False
) -> Method:
  """The registered :class:`~ntk_fl.algorithms.Method` of a local-SGD gossip baseline.

  Its factory is ``make(model, federation, graphs, hparams, run=None, *, seed=None, mixing=None,
  shared_init=None)`` (a :class:`~ntk_fl.algorithms.MakeFn`; the keywords stand in for ``run`` as in
  :func:`~ntk_fl.algorithms.base.run_options`), the round :func:`make_local_sgd_gossip`'s.

  Args:
    name: the registry name (``'dfedavg'``), named by the plain-SGD check's message.
    label: the display name (``'DFedAvg'``), named by the factory's errors.
    hyperparameters: the method's dataclass (:class:`GossipHParams` or a subclass with its own fields).
    plain_sgd: the method trains with plain SGD: ``check`` refuses ``momentum != 0``
      (:func:`check_plain_sgd`).
  """

  def make(
    model: models.Model,
    federation,
    graphs: topology.Topology,
    hparams: GossipHParams,
    run=None,
    *,
    seed: int | None = None,
    mixing: str | None = None,
    shared_init: bool | None = None,
  ) -> Algorithm:
    seed, mixing, shared_init, _ = run_options(
      run, label, graphs, seed=seed, mixing=mixing, shared_init=shared_init
    )
    return make_local_sgd_gossip(
      model, federation, graphs, hparams, seed=seed, mixing=mixing, shared_init=shared_init
    )

  def check(hparams: GossipHParams, run) -> None:
    del run
    check_plain_sgd(name, hparams)

  make.__name__ = make.__qualname__ = f"make_{name}"
  make.__doc__ = f"{label} (arguments as :func:`make_local_sgd_gossip`; ``run`` or the keywords)."
  check.__name__ = check.__qualname__ = "check"
  check.__doc__ = "Plain SGD: ``momentum`` must be 0; raises ``ValueError``."
  return Method(
    make=make,
    hyperparameters=hyperparameters,
    check=check if plain_sgd else None,
    graph=True,
    replicas=True,
  )
