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

Two pieces here are shared by a pair of server methods, so that neither imports the other: the
participants' inputs of CP-NTK-FL, which FedAvg' trains on (:func:`participant_inputs`: a β share of
each participant's samples, projected by the run's :func:`input_projection`), and the QSGD uplink of
QSGD and FedCOM (:class:`QsgdOptions`, :func:`transmit_qsgd`, :func:`upload_bits`).
:mod:`~ntk_fl.algorithms.server_ntk` and :mod:`~ntk_fl.algorithms.qsgd` re-export them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import communication, compression, jacobians, models, parallel, validation
from ntk_fl._src.options import Choice
from ntk_fl.algorithms import local
from ntk_fl.algorithms.base import Method
from ntk_fl.algorithms.base import Algorithm, ParamsState, parse_enums, run_options
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
  "check_input_options",
  "check_projection_model",
  "input_projection",
  "participant_inputs",
  "QsgdNorm",
  "QsgdOptions",
  "check_qsgd_fields",
  "transmit_qsgd",
  "upload_bits",
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
  local_update = local.model_local_update(model, hparams)
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


# ----------------------------------------------------------------------------
# The participants' inputs: CP-NTK-FL's β share and input projection, which FedAvg' trains on.


def check_input_options(hparams) -> None:
  """β (``subsample_fraction``) in (0, 1], ``projection_dim`` >= 0 and ``projection_scale`` a known
  scale: the client-side input options CP-NTK-FL shares with FedAvg'."""
  validation.check_choice(
    "config.algorithm.projection_scale", hparams.projection_scale, jacobians.PROJECTION_SCALES
  )
  validation.check_real(
    "config.algorithm.subsample_fraction (β; 1 = all samples)",
    hparams.subsample_fraction,
    low=0,
    high=1,
    low_open=True,
  )
  validation.check_int(
    "config.algorithm.projection_dim (d1'; 0 = no projection)", hparams.projection_dim, low=0
  )


def check_projection_model(hparams, run) -> None:
  """The input projection feeds the first dense layer of an MLP: refuse it for other models."""
  if hparams.projection_dim and run.model.name != "mlp":
    raise ValueError(
      "config.algorithm.projection_dim projects flattened inputs into the first dense layer; it "
      f"needs model.name='mlp', got {run.model.name!r}"
    )


def input_projection(seed: int, feature_shape: tuple[int, ...], hparams):
  """The run's shared secret projection ``P [d1, d1']``, or None when ``projection_dim`` is 0.

  Every participant and the evaluator derive the same ``P`` from the run seed
  (``Stream.INPUT_PROJECTION``), so CP-NTK-FL and FedAvg' runs of one seed share it.

  Raises:
    ValueError: the samples are not flat vectors ``[d1]``.
  """
  proj_dim = int(hparams.projection_dim)
  if not proj_dim:
    return None
  input_dim = math.prod(feature_shape)
  if len(feature_shape) != 1:
    raise ValueError(
      "config.algorithm.projection_dim needs flattened inputs [M, n, d1], got samples of shape "
      f"{feature_shape}"
    )
  return jacobians.projection_matrix(
    jax_key(seed, Stream.INPUT_PROJECTION), input_dim, proj_dim, scale=hparams.projection_scale
  )


def participant_inputs(x, y, mask, key, *, beta: float, projection=None):
  """What the participants train on: each keeps a random ``β`` share of its samples, projected by ``P``.

  Args:
    x: ``[K, n_max, ...]`` the participants' padded samples (``[K, n_max, d1]`` with a projection).
    y: ``[K, n_max]`` int labels. mask: ``[K, n_max]`` bool, True for real samples.
    key: the round's subsampling key (participant ``i`` draws with ``split(key, K)[i]``), or None
      to keep every sample.
    beta: ``β`` in (0, 1] (:func:`ntk_fl.jacobians.subsample`; 1 keeps every sample).
    projection: ``P [d1, d1']`` (:func:`input_projection`) or None.

  Returns:
    ``(x [K, n_slots, ...], y [K, n_slots], mask [K, n_slots])`` with ``n_slots =
    max(1, floor(β n_max))`` when subsampling (else ``n_max``), ``x`` projected to ``d1'``
    features when ``P`` is given; padded rows of ``x`` are zero.
  """
  if beta < 1 and key is not None:
    idx, mask = parallel.for_each_client(
      lambda kk, m: jacobians.subsample(kk, m, beta), chunk_size=0
    )(jax.random.split(key, mask.shape[0]), mask)
    x = jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)
    y = jnp.take_along_axis(y, idx, axis=1)
  if projection is not None:
    x = jacobians.project_inputs(x, projection)
  x = jnp.where(mask.reshape(*mask.shape, *([1] * (x.ndim - 2))), x, 0)
  return x, y, mask


# ----------------------------------------------------------------------------
# The QSGD uplink: QSGD's quantised gradients and FedCOM's quantised local updates.


class QsgdNorm(Choice):
  """The scale of a QSGD bucket: its Euclidean norm (``L2``, Alistarh et al.) or its largest magnitude
  (``MAX``, the max-abs scaling of the NTK-FL authors' unused quantiser: smaller variance, same bits)."""

  L2 = "l2"
  MAX = "max"


def _check_qsgd_bits(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or not (2 <= value <= 16 or value == 32):
    raise ValueError(
      f"config.algorithm.{name} must be 32 (float32, no quantisation) or an int in [2, 16] "
      f"(QSGD's code: a sign and at least one level bit), got {value!r}"
    )


def check_qsgd_fields(hparams) -> None:
  """Checks the QSGD fields of ``hparams`` (``quantize_bits``, ``stochastic_rounding``, ``bucket_size``,
  ``qsgd_norm``; the last becomes a :class:`QsgdNorm` member)."""
  local.check_fields(
    hparams,
    {
      "quantize_bits": _check_qsgd_bits,
      "stochastic_rounding": local.flag,
      "bucket_size": local.int_at_least(0),
    },
  )
  parse_enums(hparams)


@dataclasses.dataclass(frozen=True)
class QsgdOptions:
  """The uplink quantiser of FedCOM and QSGD (:func:`ntk_fl.compression.qsgd_quantize`).

  Attributes:
    quantize_bits: bits per coordinate, sign included (``s = 2**(b-1) - 1`` levels); 32 = float32.
    stochastic_rounding: QSGD's unbiased rounding (True) or the nearest level.
    bucket_size: entries per bucket, each with its own float32 norm (0 = one bucket per tensor).
    qsgd_norm: :class:`QsgdNorm`.
  """

  quantize_bits: int
  stochastic_rounding: bool
  bucket_size: int
  qsgd_norm: QsgdNorm

  @classmethod
  def of(cls, hparams) -> QsgdOptions:
    return cls(
      hparams.quantize_bits, hparams.stochastic_rounding, hparams.bucket_size, hparams.qsgd_norm
    )


def transmit_qsgd(stacked, options: QsgdOptions, key):
  """What the server receives of every client's vector: QSGD-quantised, or exact at 32 bits.

  Args:
    stacked: pytree with leaves ``[K, ...]`` (one vector per client).
    options: the quantiser.
    key: the round's quantisation key; client ``k`` quantises with ``split(key, K)[k]``
      (:func:`ntk_fl.compression.qsgd_quantize_tree` splits it per leaf).
  """
  if options.quantize_bits == compression.FLOAT_BITS:
    return stacked
  quantize = lambda tree, k: compression.qsgd_quantize_tree(
    tree,
    options.quantize_bits,
    key=k,
    bucket_size=options.bucket_size,
    norm=str(options.qsgd_norm),
    stochastic=options.stochastic_rounding,
  )
  num_clients = jax.tree.leaves(stacked)[0].shape[0]
  return parallel.for_each_client(quantize)(stacked, jax.random.split(key, num_clients))


def upload_bits(model: models.Model, options: QsgdOptions) -> int:
  """Bits one client uploads per round: :func:`ntk_fl.communication.qsgd_upload_bits` of the model's tensors."""
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  sizes = [leaf.size for leaf in jax.tree.leaves(shapes)]
  return communication.qsgd_upload_bits(sizes, options.quantize_bits, options.bucket_size)
