"""NTK-FL and CP-NTK-FL (Yue et al., ICML 2022): server-side NTK evolution from client Jacobians.

One synchronous round ``r`` (0-based; Yue et al. 2022, Sec. 4.1 and Fig. 1; CP-NTK-FL: Sec. 4.2):

1. **Participants.** ``round_inputs(r)`` draws ``K = clients_per_round``
   clients uniformly without replacement (paper: 20 of 300) from
   ``rng.numpy_rng(seed, Stream.PARTICIPATION, r)``, as the FedAvg family does.
2. **Client side** (all at the broadcast global weights ``w``). Each participant
   optionally keeps a random fraction ``β`` of its samples (``subsample_fraction``,
   redrawn every round), projects its inputs with the shared seeded ``P``
   (``projection_dim`` = d1'; the model's input layer is then d1'), and uploads
   its Jacobians ``J_m [n_m, C, d]``, one-hot labels and logits
   ``f(w; X_m)``. CP-NTK-FL compresses ``J_m`` before sending: magnitude top-k
   of every ``(sample, output)`` row (``sparsify_keep``) and ``b``-bit min-max
   quantisation of the survivors (``quantize_bits``, nearest or stochastic
   rounding; one range per client upload).
3. **Shuffling server** (``shuffle``): one random permutation of the pooled
   sample axis applied to ``J``, labels, logits together (the update is
   invariant -- tested).
4. **Server.** Pooled kernel ``H = (1/C) Σ_c J_c J_cᵀ`` over the ``N_k`` pooled
   samples, function-space evolution (cross-entropy by default: exact Euler GD
   or diffrax ODE; MSE closed form), every ``Δw_τ = -(η/N_k) Jᵀ S_τ`` on the
   ``τ`` grid (paper: 100, 200, ..., 2000), and the ``τ`` whose *non-linear*
   network has the lowest training loss on the pooled data (the authors' code;
   ``select='linearized'`` scores ``f_τ`` instead) becomes ``w ← w + Δw_τ``.
   ``select='validation'`` (§3 after eq. 11: "a validation set from held-out
   clients") scores the candidate networks by their mean cross-entropy on the
   pooled data of ``validation_clients`` clients drawn once from the seed
   (``Stream.VALIDATION_CLIENTS``); those clients never train (participants are
   drawn from the others), and their data pass through the same projection.

Two numerically equivalent server paths (``jacobian``):

* ``'implicit'`` -- the uncompressed protocol never needs ``J``: the kernel is
  the structured / blocked NTK of :mod:`ntk_fl.ntk` on the pooled inputs and the
  update one VJP (:func:`ntk_fl.evolve.ntk_step`), exactly NTK-DFL's client
  update on the pooled data. Subsampling, projection and shuffling act on the
  data, so they keep this path.
* ``'explicit'`` -- ``J`` materialised (:mod:`ntk_fl.jacobians`, in chunks of
  ``jacobian_chunk`` samples) as the server would receive it; required once
  sparsification or quantisation alter it. Memory ``N_k·C·d`` floats: 1.0 GB in
  the Table 1 setting (20 clients x 59 samples, d1' = 200, d = 21,110); 12.7 GB
  for uncompressed paper-scale NTK-FL (hence ``'implicit'`` there).

``'auto'`` (default) picks ``'explicit'`` exactly when ``sparsify_keep < 1`` or
``quantize_bits < 32``.

Communication (per round; ``MB`` = MiB, as Table 1): uplink per client = the
Jacobian payload (dense float32, or per row ``k`` values of ``b`` bits plus the
cheaper of a bitmap / index list, plus 64 quantiser side bits per client) plus
logits (32 bits x C per sample) and labels (``ceil(log2 C)`` bits per sample);
downlink per participant = the float32 model. Metrics: ``bits_per_client`` (mean
uplink over the participants), ``bits_sent_total``, ``bits_cumulative`` (uplink,
the names the FedAvg family uses), ``downlink_bits_total``,
``downlink_bits_cumulative``, ``uplink_mb_cumulative``,
``downlink_mb_cumulative``; plus ``tau``, ``loss`` (selected training loss),
``lr`` and ``num_samples`` (``N_k``).

The server's step on the pooled uploads (item 4, both paths) is public, :func:`make_server_update`, for a
variant that changes what happens around it.

With a projection, the state holds the d1'-input model; ``client_params``
returns it with ``P`` folded into the first dense layer
(:func:`ntk_fl.jacobians.fold_projection`), so the runner scores it on raw
test inputs with the unmodified network.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import communication, compression, jacobians, models, parallel, validation
from ntk_fl.algorithms.base import Method
from ntk_fl._src import ntk_step
from ntk_fl._src.options import Choice, JacobianPath, Kernel, Loss, Select, Solver, check_taus
from ntk_fl.algorithms.base import Algorithm, check_evolution, parse_enums, run_options
from ntk_fl.algorithms.server_round import (  # re-exported: the inputs FedAvg' shares
  check_input_options,
  check_projection_model,
  input_projection,
  participant_inputs,
)
from ntk_fl.rng import Stream, jax_key, numpy_rng

__all__ = [
  "ServerNTKState",
  "ServerNTKRound",
  "JacobianPath",
  "NTKFLHParams",
  "make_server_ntk",
  "make_server_update",
  "check",
  "check_input_options",
  "check_projection_model",
  "input_projection",
  "participant_inputs",
  "uses_explicit_jacobian",
  "METHOD",
]


class ServerSelect(Choice):
  """How the server scores the ``τ`` candidates: the :class:`~ntk_fl.evolve.Select` choices, plus
  ``VALIDATION``: the non-linear network's loss on clients held out of training (NTK-FL §3, after eq. 11)."""

  NETWORK = "network"
  LINEARIZED = "linearized"
  VALIDATION = "validation"


_MIB_BITS = 8 * 2**20


class ServerNTKState(NamedTuple):
  """``params``: the global model (d1'-input when projecting); cumulative float32 bit counts."""

  params: Any
  uplink_bits: Any
  downlink_bits: Any


class ServerNTKRound(NamedTuple):
  """Inputs of one round: ``round`` int32 (0-based), ``clients`` int32 ``[K]``, ``key`` (subsampling,
  stochastic rounding, shuffling)."""

  round: Any
  clients: Any
  key: Any


def uses_explicit_jacobian(hparams) -> bool:
  """Whether the server must hold explicit Jacobians (compression alters them, or it was asked to)."""
  compressed = hparams.sparsify_keep < 1 or hparams.quantize_bits != compression.FLOAT_BITS
  return hparams.jacobian == JacobianPath.EXPLICIT or (
    hparams.jacobian == JacobianPath.AUTO and compressed
  )


@dataclasses.dataclass(frozen=True)
class NTKFLHParams:
  """NTK-FL / CP-NTK-FL (``config.algorithm``; every value checked on construction).

  Attributes:
    clients_per_round: participants per round (0 = all).
    lr, lr_decay, taus, loss, solver, select, kernel: the server's NTK evolution
      (:func:`ntk_fl.algorithms.base.check_evolution`).
    jacobian: :class:`JacobianPath` -- ``'auto'`` materialises J only when
      compression alters it.
    jacobian_chunk: samples per explicit-Jacobian chunk (0 = automatic).
    subsample_fraction: β in (0, 1], each participant's share of its samples.
    projection_dim: d1' of the secret input projection (0 = none; MLP only).
    projection_scale: :data:`ntk_fl.jacobians.PROJECTION_SCALES`.
    sparsify_keep: top-k fraction per Jacobian row in (0, 1] (1 = dense).
    quantize_bits: 32 (float32) or [1, 16] bits per kept Jacobian value.
    stochastic_rounding: unbiased rounding (needs quantisation).
    shuffle: the shuffling server (synchronised row permutation).
    validation_clients: clients held out from training whose pooled data score τ; >= 1 exactly when
      ``select='validation'`` (configs stored before it existed had none).
  """

  clients_per_round: int
  lr: float
  lr_decay: float
  taus: tuple[int, ...]
  loss: Loss
  solver: Solver
  select: ServerSelect
  kernel: Kernel
  jacobian: JacobianPath
  jacobian_chunk: int
  subsample_fraction: float
  projection_dim: int
  projection_scale: str
  sparsify_keep: float
  quantize_bits: int
  stochastic_rounding: bool
  shuffle: bool
  validation_clients: int = 0

  def __post_init__(self):
    validation.check_int(
      "config.algorithm.clients_per_round (0 = all clients)", self.clients_per_round, low=0
    )
    parse_enums(self)
    by_validation = self.select == ServerSelect.VALIDATION
    # 'validation' is the evolution's 'network' scoring on other data: check the rest as such.
    check_evolution(
      types.SimpleNamespace(**{**vars(self), "select": Select.NETWORK}) if by_validation else self
    )
    validation.check_int("config.algorithm.validation_clients", self.validation_clients, low=0)
    if by_validation != (self.validation_clients > 0):
      raise ValueError(
        "config.algorithm.select='validation' needs validation_clients >= 1, and validation_clients "
        f"needs select='validation' (got select={self.select!r}, "
        f"validation_clients={self.validation_clients})"
      )
    check_input_options(self)
    validation.check_int(
      "config.algorithm.jacobian_chunk (0 = automatic)", self.jacobian_chunk, low=0
    )
    validation.check_real(
      "config.algorithm.sparsify_keep (top-k fraction per Jacobian row; 1 = dense)",
      self.sparsify_keep,
      low=0,
      high=1,
      low_open=True,
    )
    bits = self.quantize_bits
    if bits != compression.FLOAT_BITS:
      validation.check_int(
        "config.algorithm.quantize_bits (32 = float32, no quantisation)", bits, low=1, high=16
      )
    validation.check_bool("config.algorithm.stochastic_rounding", self.stochastic_rounding)
    if self.stochastic_rounding and bits == compression.FLOAT_BITS:
      raise ValueError(
        "config.algorithm.stochastic_rounding needs quantisation: set quantize_bits in [1, 16] "
        "(it is 32, i.e. float32)"
      )
    validation.check_bool("config.algorithm.shuffle", self.shuffle)
    if self.jacobian == JacobianPath.IMPLICIT and (
      self.sparsify_keep < 1 or bits != compression.FLOAT_BITS
    ):
      raise ValueError(
        "config.algorithm.jacobian='implicit' cannot apply sparsify_keep < 1 or quantize_bits < 32: "
        "compressed Jacobians must be materialised -- use jacobian='auto' or 'explicit'"
      )


def check(hparams: NTKFLHParams, run) -> None:
  """Rules across blocks: participants within the clients; the input projection needs the MLP."""
  validation.check_int(
    "config.algorithm.clients_per_round (0 = all clients)",
    hparams.clients_per_round,
    low=0,
    high=run.data.num_clients - hparams.validation_clients,
  )
  validation.check_int(
    "config.algorithm.validation_clients",
    hparams.validation_clients,
    low=0,
    high=run.data.num_clients - 1,
  )
  check_projection_model(hparams, run)


def _compress_client(jac, mask, key, *, keep: float, bits: int, stochastic: bool):
  """One client's upload ``jac [n, C, d]``: padded rows zeroed, row top-k, quantised survivors."""
  jac = jnp.where(mask[:, None, None], jac, 0)
  support = jnp.broadcast_to(mask[:, None, None], jac.shape)
  if keep < 1:
    jac, kept = jacobians.sparsify_rows(jac, keep)
    support = support & kept
  if bits != compression.FLOAT_BITS:
    jac = jacobians.quantize_kept(jac, support, bits, key=key, stochastic=stochastic)
  return jac


def make_server_update(net: models.Model, hparams: NTKFLHParams):
  """NTK-FL's server update: one NTK step on the pooled uploads, every setting of ``hparams`` forwarded.

  ``taus``, ``loss``, ``solver``, ``select`` (``'validation'`` scores the candidate networks with the
  ``score_fn`` given to the update), ``kernel`` and the network's kernel structure go to
  :func:`ntk_fl.evolve.ntk_step`; with explicit Jacobians (:func:`uses_explicit_jacobian`) the kernel and the
  candidates come from the uploaded flat ``J``, whose coordinates are the flat parameter vector.

  Args:
    net: the network the server trains (with ``projection_dim``, the MLP on the d1'-dimensional inputs).
    hparams: :class:`NTKFLHParams`.

  Returns:
    ``server_update(params, x [N, ...], targets [N, C], mask [N], lr, *, jacobian=None, score_fn=None) ->
    (params, info)``: ``params`` the global weights; ``x``, ``targets`` (one-hot), ``mask`` the participants'
    pooled (shuffled) samples; ``jacobian`` their uploaded (possibly compressed) flat Jacobians ``[N, C, d]``
    on the explicit path, else None (the kernel from ``net``, matrix-free); ``score_fn(candidate) -> loss``
    with ``select='validation'``. Returns the new weights and the step's ``info`` (``tau``, ``loss``, ...).
  """
  by_validation = hparams.select == ServerSelect.VALIDATION
  # The step's options, parsed (and the τ grid checked) once here rather than on every trace.
  step_options = dict(
    taus=check_taus(tuple(hparams.taus)),
    loss=hparams.loss,
    solver=hparams.solver,
    select=Select.NETWORK if by_validation else Select(hparams.select.value),
    kernel=hparams.kernel,
  )

  def server_update(params, x, targets, mask, lr, *, jacobian=None, score_fn=None):
    if by_validation != (score_fn is not None):
      raise ValueError(
        "the server update scores on held-out clients exactly when select='validation': pass their "
        f"score_fn then and only then (select={hparams.select.value!r})"
      )
    evolve_kwargs = dict(lr=lr, **step_options)
    if score_fn is not None:
      evolve_kwargs["score_fn"] = score_fn
    if jacobian is not None:
      # The kernel and the candidates come from the uploaded (possibly compressed) flat J [N, C, d], whose
      # coordinates are the flat parameter vector.
      flat = ntk_step.ParamMap(net.apply, params, lambda d: jacobians.unflatten_jacobian(d, params))
      delta, info = ntk_step.ntk_step(
        net.apply, params, x, targets, mask, jacobian=jacobian, param_map=flat, **evolve_kwargs
      )
    else:
      delta, info = ntk_step.ntk_step(
        net.apply,
        params,
        x,
        targets,
        mask,
        dense_stack=net.dense_stack,
        flax_apply=net.flax_apply,
        per_sample=net.per_sample,
        **evolve_kwargs,
      )
    return jax.tree.map(jnp.add, params, delta), info

  return server_update


def make_server_ntk(
  model: models.Model,
  federation,
  topology,
  hparams: NTKFLHParams,
  run=None,
  *,
  seed: int | None = None,
) -> Algorithm:
  """Builds NTK-FL / CP-NTK-FL for ``federation`` and ``model`` (the raw-input model of the runner).

  Args:
    model: the model on raw inputs (with ``projection_dim``, an MLP: the server
      trains the same MLP on the d1'-dimensional projected inputs).
    federation: a :class:`ntk_fl.data.Federation`.
    hparams: :class:`NTKFLHParams`.
    seed: the run seed (participants, round keys, the secret input projection).

  Returns:
    An :class:`~ntk_fl.algorithms.base.Algorithm`; ``step`` is jit-compiled here
    with the federation's arrays (and ``P``) passed as arguments.
  """
  seed = run_options(run, "NTK-FL", needs_topology=False, seed=seed).seed
  num_clients, n_max = federation.mask.shape
  num_val = int(hparams.validation_clients)
  # Held-out validation clients (select='validation'), drawn once; the others train.
  held_out = (
    np.sort(
      numpy_rng(seed, Stream.VALIDATION_CLIENTS).choice(num_clients, size=num_val, replace=False)
    )
    if num_val
    else np.zeros((0,), np.int64)
  )
  training_clients = np.setdiff1d(np.arange(num_clients), held_out)
  k = int(hparams.clients_per_round) or len(training_clients)
  by_validation = hparams.select == ServerSelect.VALIDATION
  beta, proj_dim = float(hparams.subsample_fraction), int(hparams.projection_dim)
  keep, bits, stochastic = (
    float(hparams.sparsify_keep),
    int(hparams.quantize_bits),
    bool(hparams.stochastic_rounding),
  )
  explicit = uses_explicit_jacobian(hparams)
  num_classes = model.num_classes
  jac_chunk = int(hparams.jacobian_chunk) or None

  projection = input_projection(seed, federation.feature_shape, hparams)
  net = models.mlp_on_inputs(model, proj_dim) if proj_dim else model
  first_layer = net.dense_stack.layers[0] if net.dense_stack else None
  server_update = make_server_update(net, hparams)
  num_params = models.num_params(jax.eval_shape(net.init, jax.random.key(0)))
  model_bits = num_params * compression.FLOAT_BITS
  n_slots = jacobians.num_subsampled(n_max, beta) if beta < 1 else n_max
  data = parallel.to_device(
    (federation, projection if projection is not None else jnp.zeros((0,), jnp.float32))
  )
  held = jnp.asarray(held_out, jnp.int32)

  def init(key):
    return ServerNTKState(
      params=net.init(key), uplink_bits=jnp.float32(0), downlink_bits=jnp.float32(0)
    )

  def round_inputs(round_index: int) -> ServerNTKRound:
    rng = numpy_rng(seed, Stream.PARTICIPATION, round_index)
    if num_val:
      clients = np.sort(rng.choice(training_clients, size=k, replace=False)).astype(np.int32)
    else:
      clients = np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int32)
    return ServerNTKRound(
      round=np.int32(round_index),
      clients=clients,
      key=jax_key(seed, Stream.ROUND_KEYS, round_index),
    )

  def client_data(fed, proj, clients, key, subsample=True):
    """Participants' (subsampled, projected) data ``[K, n_slots, ...]``; padded rows zeroed."""
    (x, y), mask = fed.samples(fed.index[clients]), fed.mask[clients]
    x, y, mask = participant_inputs(
      x, y, mask, key if subsample else None, beta=beta, projection=proj if proj_dim else None
    )
    return x, jax.nn.one_hot(y, num_classes, dtype=jnp.float32), mask

  @jax.jit
  def _step(state, inputs, data):
    fed, proj = data
    sub_key, quant_key, shuffle_key = jax.random.split(inputs.key, 3)
    lr = hparams.lr * jnp.exp(-hparams.lr_decay * inputs.round.astype(jnp.float32))
    x, targets, mask = client_data(fed, proj, inputs.clients, sub_key)  # [K, n_slots, ...]
    pool = lambda a: a.reshape(k * n_slots, *a.shape[2:])
    score_fn = None
    if by_validation:
      # The validation clients' pooled data, as a participant would send it (projected; no subsampling).
      vx, vt, vm = (
        a.reshape(num_val * n_max, *a.shape[2:]) for a in client_data(fed, proj, held, None, False)
      )
      score_fn = lambda w: ntk_step.mean_loss(net.apply(w, vx), vt, vm, Loss.CE)
    if explicit:
      jac = jacobians.flat_jacobian(net.apply, state.params, pool(x), chunk_size=jac_chunk)
      jac = jac.reshape(k, n_slots, *jac.shape[1:])
      compress = lambda j, m, kk: _compress_client(
        j, m, kk, keep=keep, bits=bits, stochastic=stochastic
      )
      jac = parallel.for_each_client(compress, chunk_size=0)(
        jac, mask, jax.random.split(quant_key, k)
      )
      pooled = (pool(x), pool(targets), pool(mask), pool(jac))
    else:
      pooled = (pool(x), pool(targets), pool(mask))
    if hparams.shuffle:
      pooled, _ = jacobians.shuffle_rows(shuffle_key, pooled)
    jac = None
    if explicit:
      *pooled, jac = pooled
    params, info = server_update(state.params, *pooled, lr, jacobian=jac, score_fn=score_fn)

    sizes = mask.sum(axis=1)  # [K] samples sent
    up = communication.server_upload_bits(
      sizes.astype(jnp.float32),
      num_params,
      num_classes,  # [K]
      keep_fraction=hparams.sparsify_keep,
      bits=hparams.quantize_bits,
    )
    up_total, down_total = jnp.sum(up), jnp.float32(k * model_bits)
    new_state = ServerNTKState(
      params=params,
      uplink_bits=state.uplink_bits + up_total,
      downlink_bits=state.downlink_bits + down_total,
    )
    metrics = {
      "tau": info["tau"],
      "loss": info["loss"],
      "lr": lr,
      "num_samples": jnp.sum(sizes),
      "bits_per_client": jnp.mean(up),
      "bits_sent_total": up_total,
      "bits_cumulative": new_state.uplink_bits,
      "downlink_bits_total": down_total,
      "downlink_bits_cumulative": new_state.downlink_bits,
      "uplink_mb_cumulative": new_state.uplink_bits / _MIB_BITS,
      "downlink_mb_cumulative": new_state.downlink_bits / _MIB_BITS,
    }
    return new_state, metrics

  def step(state, inputs):
    return _step(state, inputs, data)

  def client_params(state):
    params = state.params
    if projection is not None:
      params = jacobians.fold_projection(params, projection, layer=first_layer)
    return jax.tree.map(lambda w: w[None], params)

  return Algorithm(init=init, round_inputs=round_inputs, step=step, client_params=client_params)


def transmitted_step(
  apply_fn, params, x, targets, mask, *, lr, keep_fraction: float, bits: int, **options
):
  """One NTK step on the block's explicit flat Jacobians ``[N, C, d]`` compressed as the uploads arrive
  (row top-k ``keep_fraction``, ``bits``-bit quantisation, deterministic rounding): what the cost estimate
  times for NTK-FL's explicit path. ``options`` go to :func:`ntk_fl.evolve.ntk_step`; returns ``(Δw, info)``."""
  jac = _compress_client(
    jacobians.flat_jacobian(apply_fn, params, x),
    mask,
    None,
    keep=keep_fraction,
    bits=bits,
    stochastic=False,
  )
  flat = ntk_step.ParamMap(apply_fn, params, lambda d: jacobians.unflatten_jacobian(d, params))
  return ntk_step.ntk_step(
    apply_fn, params, x, targets, mask, lr=lr, jacobian=jac, param_map=flat, **options
  )


METHOD = Method(
  make=make_server_ntk,
  hyperparameters=NTKFLHParams,
  check=check,
  ntk=ntk_step.NTK_FUNCTIONS._replace(
    transmitted_step=transmitted_step, projected_model=models.mlp_on_inputs
  ),
)
