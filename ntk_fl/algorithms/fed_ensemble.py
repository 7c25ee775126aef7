"""Fed-ensemble (Shi, Lai, Al Kontar, Chowdhury; arXiv 2107.10663): K modes trained by random permutations.

The server keeps ``K`` models ("modes"), initialised independently. Before
training the ``N`` clients are split once, uniformly at random, into ``Q``
strata (``num_strata``; ``0`` = every client its own stratum, as the authors'
later code does). Training runs in *ages* of ``K`` rounds; each age draws a
``Q x K`` matrix ``P`` whose rows are independent uniform permutations of the
modes. In round ``r`` (0-based; age ``r // K``, slot ``r % K``):

1. ``round_inputs(r)`` samples the participants (``clients_per_round``, ``0`` =
   all): ``sampling='uniform'`` draws them exactly as FedAvg does (uniformly
   without replacement, stream ``PARTICIPATION``), so ``C_q`` = the participants
   in stratum ``q``; ``'stratified'`` draws ``clients_per_round / Q`` from every
   stratum (Algorithm 1's "select C_q from S_q" with equal counts). A
   participant of stratum ``q`` trains mode ``P[q, r % K]``, so within an age
   every stratum trains every mode exactly once.
2. Every participant trains its mode on its own data (all participants in one
   compiled program): ``local_training='fedavg'`` (minibatch SGD of
   :mod:`ntk_fl.algorithms.local`), ``'fedprox'`` (plus ``(mu/2)||w - w_mode||^2``),
   or ``'ntk'`` (see below).
3. The server replaces each mode by the average of the returned models that
   started from it (Remark 3.1) -- ``aggregation_weights='uniform'`` (the
   paper's unweighted mean) or ``'data_size'`` (``n_i``-weighted, like this
   library's FedAvg and the paper's theory); a mode no participant trained stays
   as it is.

Steps 2-3, the round's training of the modes, are public: :func:`make_mode_update` builds them from the
hyperparameters, and a variant passes its own (:class:`ModeUpdateFn`) as ``mode_update`` of
:func:`make_fed_ensemble`; the schedule, learning rate, bit count and metrics around it stay the method's.

With ``K = 1`` every participant trains the one mode and the method *is*
FedAvg (FedProx): same initial model (mode 0 is ``model.init(key)``, the model
FedAvg starts from), same participants, same per-client keys, same local
update, same weighted mean -- bit for bit with ``aggregation_weights='data_size'``.

**NTK local training (``'ntk'``, beyond the paper: an NTK-FL ensemble).** The
natural reading of NTK-FL inside Fed-ensemble: in a round, the participants
that received mode ``k`` send what NTK-FL clients send (Jacobians at ``w_k``,
function values, labels) and the server evolves mode ``k`` on their *pooled*
data with :func:`ntk_fl.evolve.ntk_step` (kernel at ``w_k``, function-space
gradient descent with step ``lr * lr_gamma**r``, ``tau`` chosen from ``taus``
by the nonlinear network's training loss). The pooled mean loss weighs every
sample equally, i.e. data-size weights, so ``'ntk'`` requires
``aggregation_weights='data_size'``; the minibatch keys (``epochs``,
``batch_size``, ``momentum``, ...) do not apply to it. Padded rows are masked,
so each mode's kernel spans all participants' slots (``[P n, P n]``): cost is
``K`` times what one mode's own rows would need -- fine for this option's small
experiments; ``chunk_size`` bounds how many modes evolve at once.

Prediction (evaluation): ``Algorithm.aggregate`` = ``'ensemble_probs'``
(``prediction='probs'``: mean of the modes' softmax probabilities, the paper's
posterior-predictive reading) or ``'ensemble_logits'`` (``'logits'``);
``client_params`` returns the ``[K, ...]`` modes, so the runner's per-client
metrics are per-mode metrics (Table 4's max/min mode accuracy) and it logs the
mean predictive entropy of the modes (Table 4's "avg entropy") and of the
ensemble.

Communication is counted like FedAvg's (one model uplink per participant;
``quantize_bits`` applies to what is sent); for ``'ntk'`` the same count is
logged although NTK-FL's uplink is Jacobians (see ``ntk_fl``'s method for that
accounting).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl import compression, models, parallel, validation
from ntk_fl.algorithms.base import Method
from ntk_fl.algorithms import local
from ntk_fl._src import ntk_step
from ntk_fl._src.options import Choice, Loss, Select, Solver, check_taus
from ntk_fl.algorithms.base import Algorithm, parse_enums, run_options
from ntk_fl.rng import Stream, jax_key, numpy_rng

__all__ = [
  "EnsembleState",
  "EnsembleRound",
  "LocalTraining",
  "Sampling",
  "AggregationWeights",
  "Prediction",
  "make_strata",
  "age_permutations",
  "round_modes",
  "sample_participants",
  "init_modes",
  "aggregate_modes",
  "ModeUpdateFn",
  "make_mode_update",
  "make_fed_ensemble",
  "FedEnsembleHParams",
  "check",
  "METHOD",
]


class LocalTraining(Choice):
  """How a mode is trained on its participants: FedAvg's or FedProx's local SGD, or the NTK evolution."""

  FEDAVG = "fedavg"
  FEDPROX = "fedprox"
  NTK = "ntk"


class Sampling(Choice):
  """How a round's participants are drawn: uniformly, or one per stratum (``num_strata``)."""

  UNIFORM = "uniform"
  STRATIFIED = "stratified"


class AggregationWeights(Choice):
  """The weights of a mode's participants when it is averaged: uniform or by data size."""

  UNIFORM = "uniform"
  DATA_SIZE = "data_size"


class Prediction(Choice):
  """What the ensemble averages per test sample: the modes' softmax probabilities or their logits."""

  PROBS = "probs"
  LOGITS = "logits"


_AGGREGATE_OF_PREDICTION = {"probs": "ensemble_probs", "logits": "ensemble_logits"}


class EnsembleState(NamedTuple):
  """``modes``: the ``K`` models (leaves ``[K, ...]``); ``bits_cumulative``: float32 uplink bits so far."""

  modes: Any
  bits_cumulative: Any


class EnsembleRound(NamedTuple):
  """Inputs of one round.

  Attributes:
    round: int32 scalar, 0-based.
    clients: int32 ``[P]`` participants (sorted).
    modes: int32 ``[P]`` the mode each participant trains.
    key: PRNG key of the round (local minibatches, quantisation).
  """

  round: Any
  clients: Any
  modes: Any
  key: Any


# ----------------------------------------------------------------------------- schedule (host side)


def make_strata(num_clients: int, num_strata: int, seed: int) -> np.ndarray:
  """The fixed random split of the clients into ``Q`` strata.

  Args:
    num_clients: ``N``.
    num_strata: ``Q`` in ``[1, N]``, or ``0`` for ``Q = N`` (each client its own stratum).
    seed: config seed (stream ``ENSEMBLE_SCHEDULE``, index 0).

  Returns:
    int32 ``[N]``: the stratum of every client; a uniformly random permutation
    of the clients cut into ``Q`` near-equal consecutive groups (sizes differ by
    at most one).
  """
  validation.check_int("num_clients", num_clients, low=1)
  q = validation.check_int("num_strata", num_strata, low=0, high=num_clients) or num_clients
  perm = numpy_rng(seed, Stream.ENSEMBLE_SCHEDULE, 0).permutation(num_clients)
  strata = np.empty(num_clients, np.int32)
  for index, group in enumerate(np.array_split(perm, q)):
    strata[group] = index
  return strata


def age_permutations(num_strata: int, num_modes: int, seed: int, age: int) -> np.ndarray:
  """The ``Q x K`` matrix ``P`` of age ``age``: every row an independent uniform permutation of ``0..K-1``.

  Stream ``ENSEMBLE_SCHEDULE`` with indices ``(1, age)`` (never the strata's ``(0,)``).
  """
  rng = numpy_rng(seed, Stream.ENSEMBLE_SCHEDULE, 1, age)
  return np.stack([rng.permutation(num_modes) for _ in range(num_strata)]).astype(np.int32)


def round_modes(strata: np.ndarray, num_modes: int, seed: int, round_index: int) -> np.ndarray:
  """int32 ``[N]``: the mode client ``i`` trains if it participates in round ``round_index``.

  ``P[strata[i], round_index % K]`` with ``P`` the permutation matrix of age ``round_index // K``.
  """
  perms = age_permutations(int(strata.max()) + 1, num_modes, seed, round_index // num_modes)
  return perms[strata, round_index % num_modes]


def sample_participants(
  strata: np.ndarray, clients_per_round: int, sampling: str, seed: int, round_index: int
) -> np.ndarray:
  """The sorted int32 participants of a round (stream ``PARTICIPATION``, index ``round_index``).

  ``'uniform'``: ``clients_per_round`` clients uniformly without replacement --
  the very draw of the FedAvg family. ``'stratified'``: ``clients_per_round / Q``
  from every stratum (strata in index order, each uniformly without
  replacement). ``clients_per_round = 0`` means every client.
  """
  num_clients = strata.shape[0]
  k = clients_per_round or num_clients
  rng = numpy_rng(seed, Stream.PARTICIPATION, round_index)
  if sampling == "uniform":
    clients = rng.choice(num_clients, size=k, replace=False)
  else:
    per_stratum = k // (int(strata.max()) + 1)
    clients = np.concatenate(
      [
        rng.choice(np.flatnonzero(strata == q), size=per_stratum, replace=False)
        for q in range(int(strata.max()) + 1)
      ]
    )
  return np.sort(clients).astype(np.int32)


def first_to_finish(
  selected: np.ndarray, sizes: np.ndarray, keep: int, sigma: float, seed: int, round_index: int
) -> np.ndarray:
  """Straggler over-selection (Fed-ensemble's OpenImage setting, after Bonawitz et al., 2019).

  The ``selected`` clients train; client ``i`` finishes after ``n_i · exp(σ z_i)``
  time units (work proportional to its samples, times a log-normal device speed,
  ``z_i ~ N(0, 1)`` drawn per round from ``Stream.STRAGGLERS``, index
  ``round_index``, in the order of ``selected``), and the ``keep`` first to
  finish are aggregated (ties to the lower position).

  Returns:
    The sorted int32 kept clients (``keep`` of them).
  """
  z = numpy_rng(seed, Stream.STRAGGLERS, round_index).standard_normal(len(selected))
  finish = np.asarray(sizes, np.float64)[selected] * np.exp(sigma * z)
  return np.sort(selected[np.argsort(finish, kind="stable")[:keep]]).astype(np.int32)


# ----------------------------------------------------------------------------- pure pieces


def init_modes(model: models.Model, key, num_modes: int):
  """``K`` independently initialised modes, leaves ``[K, ...]``.

  Mode 0 is ``model.init(key)`` -- the model FedAvg starts from with the same
  key, which makes ``K = 1`` exactly FedAvg -- and mode ``k >= 1`` is
  ``model.init(fold_in(key, k))``, an independent draw.
  """
  keys = [key] + [jax.random.fold_in(key, k) for k in range(1, num_modes)]
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *[model.init(k) for k in keys])


def aggregate_modes(modes, returned, assignment, weights):
  """Remark 3.1: each mode becomes the weighted mean of the returned models that started from it.

  Args:
    modes: leaves ``[K, ...]``, the modes before the round.
    returned: leaves ``[P, ...]``, the participants' returned models.
    assignment: int32 ``[P]``, the mode each participant trained.
    weights: float ``[P]`` non-negative participant weights (ones = unweighted,
      data sizes = ``n_i``-weighted).

  Returns:
    ``(new_modes, counts)``: leaves ``[K, ...]`` (a mode with no participant,
    or only zero-weight ones, keeps its value) and int32 ``[K]`` participants per mode.
  """
  num_modes = jax.tree.leaves(modes)[0].shape[0]
  member = assignment[:, None] == jnp.arange(num_modes)[None, :]  # [P, K]
  w = jnp.where(member, weights[:, None], 0.0)
  total = jnp.sum(w, axis=0)  # [K]
  coeff = w / jnp.where(total > 0, total, 1.0)  # columns sum to 1
  trained = total > 0

  def one(old, new):
    mean = jnp.tensordot(coeff.T, new, axes=1).astype(old.dtype)  # [K, ...]
    return jnp.where(trained.reshape(-1, *([1] * (old.ndim - 1))), mean, old)

  return jax.tree.map(one, modes, returned), jnp.sum(member, axis=0).astype(jnp.int32)


# ----------------------------------------------------------------------------- config


def _check_taus(name, value):
  try:
    check_taus(tuple(value))
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"config.algorithm.{name} must be strictly ascending positive ints, got {value!r}"
    ) from e


@dataclasses.dataclass(frozen=True)
class FedEnsembleHParams(local.LocalHParams):
  """Fed-ensemble: local training (:class:`ntk_fl.algorithms.local.LocalHParams`) plus the modes' schedule.

  Attributes:
    num_modes: ``K`` (>= 1).
    num_strata: ``Q`` (0 = every client its own stratum).
    clients_per_round: participants per round (0 = all).
    sampling, aggregation_weights, local_training, prediction: :class:`Sampling`,
      :class:`AggregationWeights`, :class:`LocalTraining`, :class:`Prediction`.
    prox_mu: FedProx coefficient (> 0 exactly with ``local_training='fedprox'``).
    taus, solver, select: the NTK evolution of ``local_training='ntk'``.
    over_selected: straggler over-selection -- this many clients are selected
      and the ``clients_per_round`` first to finish are aggregated
      (:func:`first_to_finish`; 0 = off, the configs stored before it existed).
    latency_sigma: ``σ`` of the log-normal device speed of the latency model.
  """

  num_modes: int
  num_strata: int
  clients_per_round: int
  sampling: Sampling
  aggregation_weights: AggregationWeights
  local_training: LocalTraining
  prox_mu: float
  prediction: Prediction
  taus: tuple[int, ...]
  solver: Solver
  select: Select
  over_selected: int = dataclasses.field(default=0, kw_only=True)
  latency_sigma: float = dataclasses.field(default=0.5, kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    parse_enums(self)  # the enum fields: strings become members (a bad one is an error naming it)
    local.check_fields(
      self, {"over_selected": local.int_at_least(0), "latency_sigma": local.nonnegative}
    )
    if self.over_selected and not 0 < self.clients_per_round < self.over_selected:
      raise ValueError(
        f"config.algorithm.over_selected = {self.over_selected} selects that many clients and "
        "aggregates the clients_per_round first to finish: it needs 0 < clients_per_round < "
        f"over_selected (got clients_per_round = {self.clients_per_round})"
      )
    if self.over_selected and self.sampling != Sampling.UNIFORM:
      raise ValueError(
        "config.algorithm.over_selected draws its clients uniformly: it needs sampling='uniform', "
        f"got {self.sampling!r}"
      )
    local.check_fields(
      self,
      {
        "num_modes": local.int_at_least(1),
        "num_strata": local.int_at_least(0),
        "clients_per_round": local.int_at_least(0),
        "prox_mu": local.nonnegative,
        "taus": _check_taus,
      },
    )
    if (self.prox_mu > 0) != (self.local_training == "fedprox"):
      raise ValueError(
        f"config.algorithm.prox_mu = {self.prox_mu!r} with local_training = {self.local_training!r}: "
        "'fedprox' needs prox_mu > 0 and the other local trainings need prox_mu = 0"
      )
    if self.local_training == "ntk":
      if self.aggregation_weights != "data_size":
        raise ValueError(
          "local_training = 'ntk' evolves each mode on its participants' pooled data (every sample "
          "weighs the same): config.algorithm.aggregation_weights must be 'data_size', got "
          f"{self.aggregation_weights!r}"
        )
      if self.quantize_bits != compression.FLOAT_BITS:
        raise ValueError(
          "local_training = 'ntk' sends Jacobians, not weights: config.algorithm.quantize_bits "
          f"must be 32, got {self.quantize_bits!r}"
        )


def check(hparams: FedEnsembleHParams, run) -> None:
  """Rules across blocks: participants and strata within the clients; no weight-averaging selection curves."""
  n = run.data.num_clients
  if hparams.clients_per_round > n:
    raise ValueError(
      f"config.algorithm.clients_per_round = {hparams.clients_per_round} exceeds "
      f"config.data.num_clients = {n} (0 = all clients)"
    )
  if hparams.over_selected > n:
    raise ValueError(
      f"config.algorithm.over_selected = {hparams.over_selected} exceeds config.data.num_clients = "
      f"{n}"
    )
  if hparams.num_strata > n:
    raise ValueError(
      f"config.algorithm.num_strata = {hparams.num_strata} exceeds config.data.num_clients = {n} "
      "(0 = every client its own stratum)"
    )
  if hparams.sampling == "stratified":
    q = hparams.num_strata or n
    k = hparams.clients_per_round or n
    if k % q or k // q > n // q:
      raise ValueError(
        f"sampling = 'stratified' draws clients_per_round / Q clients from each of Q = {q} strata "
        f"of >= {n // q} clients: config.algorithm.clients_per_round = {hparams.clients_per_round} "
        f"must be a multiple of Q with quotient <= {n // q}"
      )
  if run.eval.selection:
    raise ValueError(
      "fed_ensemble's modes are independent models; weight-averaging selection curves do not "
      "apply: config.eval.selection must be False"
    )


# ----------------------------------------------------------------------------- the method


class ModeUpdateFn(Protocol):
  """The hook of Fed-ensemble's round that trains the modes (:func:`make_mode_update`; ``mode_update`` of
  :func:`make_fed_ensemble`). Called inside the round's ``jit``."""

  def __call__(
    self,
    modes: Any,
    assignment: jax.Array,
    key: jax.Array,
    x: jax.Array,
    y: jax.Array,
    mask: jax.Array,
    lr: jax.Array,
  ) -> tuple[Any, dict]:
    """Args:
      modes: the ``K`` modes before the round, leaves ``[K, ...]``.
      assignment: int32 ``[P]``, the mode each of the round's ``P`` participants trains.
      key: the round's PRNG key (local minibatches, quantisation).
      x: ``[P, n_max, *in]`` the participants' samples (padded rows masked).
      y: int ``[P, n_max]`` their labels.
      mask: bool ``[P, n_max]``, True for real samples.
      lr: float32 scalar, the round's learning rate.

    Returns:
      ``(new_modes, metrics)``: leaves ``[K, ...]`` (a mode no participant trained keeps its value) and a
      dict of metric arrays (scalars or ``[K]`` per-mode values) for the round's line.
    """


def make_mode_update(model: models.Model, hparams: FedEnsembleHParams) -> ModeUpdateFn:
  """Fed-ensemble's training of the modes in a round, every setting of ``hparams`` forwarded.

  ``local_training='fedavg'`` / ``'fedprox'``: every participant runs the minibatch local update of
  :func:`ntk_fl.algorithms.local.local_update_from_hparams` (``prox_mu`` anchored at its mode) from its
  mode, sends it (``quantize_bits``, ``stochastic_rounding``), and each mode becomes the mean of the models
  that started from it (:func:`aggregate_modes`, ``aggregation_weights``); metric ``loss``, the
  participants' mean. ``'ntk'``: each mode evolves on its participants' pooled data by one
  :func:`ntk_fl.evolve.ntk_step` (``taus``, ``solver``, ``select``, the network's kernel structure);
  metrics ``tau`` ``[K]`` (0 for an idle mode) and ``loss``, the trained modes' mean.

  Args:
    model: the model of every mode.
    hparams: :class:`FedEnsembleHParams`.

  Returns:
    A :class:`ModeUpdateFn`.
  """
  if hparams.local_training == "ntk":
    evolve_options = dict(
      taus=check_taus(tuple(hparams.taus)),
      loss=Loss.CE,
      solver=hparams.solver,
      select=hparams.select,
      dense_stack=model.dense_stack,
      flax_apply=model.flax_apply,
      per_sample=model.per_sample,
    )

    def ntk_update(modes, assignment, key, x, y, mask, lr):
      """Each mode evolves on the pooled data of its participants (NTK-FL's server update)."""
      del key  # the evolution draws nothing
      num_modes = jax.tree.leaves(modes)[0].shape[0]
      num_participants, n_max = mask.shape
      num_classes = jax.eval_shape(
        model.apply,
        jax.eval_shape(model.init, jax.random.key(0)),
        jax.ShapeDtypeStruct((1, *x.shape[2:]), jnp.float32),
      ).shape[-1]
      pooled_x = x.reshape(num_participants * n_max, *x.shape[2:])
      targets = jax.nn.one_hot(y.reshape(-1), num_classes, dtype=jnp.float32)
      owner = jnp.repeat(assignment, n_max)  # [P n]

      def one_mode(params, index):
        pooled_mask = mask.reshape(-1) & (owner == index)
        delta, info = ntk_step.ntk_step(
          model.apply, params, pooled_x, targets, pooled_mask, lr=lr, **evolve_options
        )
        return jax.tree.map(jnp.add, params, delta), info["tau"], info["loss"]

      evolved, tau, loss = parallel.for_each_client(one_mode)(modes, jnp.arange(num_modes))
      counts = jnp.sum(assignment[:, None] == jnp.arange(num_modes)[None, :], axis=0)
      trained = counts > 0  # idle modes stay
      new_modes = jax.tree.map(
        lambda new, old: jnp.where(trained.reshape(-1, *([1] * (old.ndim - 1))), new, old),
        evolved,
        modes,
      )
      mean_loss = jnp.sum(jnp.where(trained, loss, 0.0)) / jnp.maximum(jnp.sum(trained), 1)
      return new_modes, {"tau": jnp.where(trained, tau, 0), "loss": mean_loss}

    return ntk_update

  local_update = local.model_local_update(model, hparams)
  bits, stochastic = int(hparams.quantize_bits), bool(hparams.stochastic_rounding)
  uniform_weights = hparams.aggregation_weights == "uniform"

  def local_sgd_update(modes, assignment, key, x, y, mask, lr):
    """FedAvg's vmapped local training, each participant starting from (and anchored at) its mode."""
    train_key, quant_key = jax.random.split(key)
    start = jax.tree.map(lambda m: m[assignment], modes)  # [P, ...]
    per_client = lambda p, xc, yc, mc, kc: local_update(p, xc, yc, mc, kc, lr, anchor=p)
    result = parallel.for_each_client(per_client)(
      start, x, y, mask, jax.random.split(train_key, mask.shape[0])
    )
    sent = local.transmit(result.params, bits, key=quant_key, stochastic=stochastic)
    sizes = jnp.sum(mask, axis=1).astype(jnp.float32)
    weights = jnp.ones_like(sizes) if uniform_weights else sizes
    new_modes, _ = aggregate_modes(modes, sent, assignment, weights)
    return new_modes, {"loss": jnp.mean(result.loss)}

  return local_sgd_update


def make_fed_ensemble(
  model: models.Model,
  federation,
  topology,
  hparams: FedEnsembleHParams,
  run=None,
  *,
  seed: int | None = None,
  mode_update: ModeUpdateFn | None = None,
) -> Algorithm:
  """Builds Fed-ensemble for ``federation`` and ``model`` (see the module docstring).

  Args:
    model: the model of every mode.
    federation: a :class:`ntk_fl.data.Federation`.
    hparams: :class:`FedEnsembleHParams`.
    seed: the run seed (strata, participants, mode assignments, round keys).
    mode_update: the round's training of the modes (:class:`ModeUpdateFn`), a variant's own; default
      :func:`make_mode_update` ``(model, hparams)``. The schedule (strata, participants, the modes they
      train), the learning rate, the communication count and the metrics around it stay the method's.

  Returns:
    An :class:`Algorithm` with ``client_params`` = the ``[K, ...]`` modes and
    ``aggregate`` = ``'ensemble_probs'`` or ``'ensemble_logits'``.
  """
  seed = run_options(run, "Fed-ensemble", needs_topology=False, seed=seed).seed
  num_clients = federation.mask.shape[0]
  num_modes = int(hparams.num_modes)
  k = int(hparams.clients_per_round) or num_clients
  bits = int(hparams.quantize_bits)
  strata = make_strata(num_clients, int(hparams.num_strata), seed)
  data = parallel.to_device(federation)
  payload = compression.tree_payload_bits(jax.eval_shape(model.init, jax.random.key(0)), bits)
  over, sizes = int(hparams.over_selected), np.asarray(federation.n)

  def init(key):
    return EnsembleState(modes=init_modes(model, key, num_modes), bits_cumulative=jnp.float32(0))

  def round_inputs(round_index: int) -> EnsembleRound:
    if over:
      selected = sample_participants(strata, over, hparams.sampling, seed, round_index)
      clients = first_to_finish(selected, sizes, k, float(hparams.latency_sigma), seed, round_index)
    else:
      clients = sample_participants(
        strata, int(hparams.clients_per_round), hparams.sampling, seed, round_index
      )
    modes = round_modes(strata, num_modes, seed, round_index)[clients]
    return EnsembleRound(
      round=np.int32(round_index),
      clients=clients,
      modes=modes,
      key=jax_key(seed, Stream.ROUND_KEYS, round_index),
    )

  def counts_of(assignment):
    return jnp.sum(assignment[:, None] == jnp.arange(num_modes)[None, :], axis=0).astype(jnp.int32)

  train = make_mode_update(model, hparams) if mode_update is None else mode_update

  @jax.jit
  def _step(state, inputs, data):
    lr = local.round_lr(hparams, inputs.round)
    (x, y), mask = data.samples(data.index[inputs.clients]), data.mask[inputs.clients]
    new_modes, extra = train(state.modes, inputs.modes, inputs.key, x, y, mask, lr)
    counts = counts_of(inputs.modes)
    total = jnp.float32(payload) * k
    new_state = EnsembleState(modes=new_modes, bits_cumulative=state.bits_cumulative + total)
    metrics = {
      **extra,
      "lr": lr,
      "mode_participants": counts,
      "bits_per_client": jnp.float32(payload),
      "bits_sent_total": total,
      "bits_cumulative": new_state.bits_cumulative,
    }
    return new_state, metrics

  def step(state, inputs):
    return _step(state, inputs, data)

  return Algorithm(
    init=init,
    round_inputs=round_inputs,
    step=step,
    client_params=lambda state: state.modes,
    aggregate=_AGGREGATE_OF_PREDICTION[hparams.prediction],
  )


METHOD = Method(
  make=make_fed_ensemble,
  hyperparameters=FedEnsembleHParams,
  check=check,
  ntk=ntk_step.NTK_FUNCTIONS,
)
