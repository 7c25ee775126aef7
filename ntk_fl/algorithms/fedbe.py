"""FedBE (Chen & Chao, ICLR 2021): FedAvg whose server distils a Bayesian model ensemble.

The baseline "Fedbe" of Fed-ensemble's Table 2. One round ``r`` (the participants' draw, their local
training, the upload and the bit count are FedAvg's, :mod:`ntk_fl.algorithms.server_round`):

1. The ``K`` participants train from the global model and send their weights ``w_k``.
2. **Gaussian.** The server fits a diagonal Gaussian over the client models around their
   data-size-weighted mean (FedBE's eq. with ``p_k = n_k / sum_K n``, the FedAvg weights):
   ``mu = sum_k p_k w_k`` (exactly FedAvg's new model) and ``var = sum_k p_k (w_k - mu)**2``,
   per parameter (:func:`fit_gaussian`). ``posterior='swag'``: FedBE's other choice, SWAG's
   (Maddox et al. 2019) diagonal-plus-low-rank Gaussian over the same client models
   (:func:`fit_swag`): the same ``mu`` and ``var``, and the deviations ``D = [w_1 - mu, ..., w_K - mu]``,
   covariance ``(diag(var) + D D^T / (K - 1)) / 2``.
3. **Ensemble.** It samples ``M = num_samples`` models ``mu + sqrt(var) * eps``, ``eps ~ N(0, I)``
   (:func:`sample_models`; SWAG: ``mu + sqrt(var / 2) * z_1 + D z_2 / sqrt(2 (K - 1))``,
   ``z_1 ~ N(0, I_d)``, ``z_2 ~ N(0, I_K)``, :func:`sample_swag`) and forms the ensemble
   ``{mu, w_1..w_K, samples}`` of ``1 + K + M`` models (FedBE's "global mean + clients + samples").
4. **Soft labels.** The ensemble's prediction on the server's unlabelled set ``U`` is the mean of
   its members' softmax probabilities, ``q(x) = mean_e softmax(f(x; w_e))``
   (:func:`ensemble_soft_labels`), computed once per round.
5. **Distillation.** Starting from ``mu``, the server runs ``distill_epochs`` epochs of minibatch
   SGD (``distill_batch_size``, ``distill_lr``, heavy-ball ``distill_momentum``; every epoch a fresh
   permutation of ``U``, the last partial batch dropped) on the cross-entropy to the soft labels,
   ``-(1/B) sum_b sum_c q_bc log softmax(f(x_b; w))_c`` -- FedBE's KL to the ensemble up to a
   constant in ``w``, so the same gradient. **SWA** (FedBE's choice, torchcontrib's rule): with
   ``swa_every > 0`` the new global model is the running mean of the iterates after the steps
   ``t > swa_start`` with ``t % swa_every == 0`` (steps counted from 1), else the last iterate
   (:func:`distill`).

With ``distill_epochs = 0`` (the ensemble acts only through the distillation) the round is
FedAvg's, bit for bit (same participants, keys, local update and mean).

**Server set.** ``U`` is ``server_set_size`` training samples that **no client holds** (rows of the
federation's sample store that no client's index list references), drawn once, uniformly without
replacement, from the config seed (stream ``Stream.SHARED_SET``, index 1); only their inputs are
used (unlabelled). A partition that hands every sample to a client leaves none: the configs use an
``iid`` partition with ``data.samples_per_client`` below ``N / num_clients``.

**Keys.** The sampling and the distillation minibatches use ``fold_in(quant_key, 1)`` of the round's
quantisation key (:func:`ntk_fl.algorithms.server_round.make_server_method`), so the participants'
training keys are FedAvg's.

**Communication** is FedAvg's uplink count (one model per participant); the server's ensemble and
distillation send nothing.

Choices the papers leave open (Fed-ensemble gives no FedBE hyperparameters): the distillation
schedule follows the FedBE authors' code (SGD lr 1e-3, momentum 0.9, 20 epochs of batch 128, SWA
from step 500 every 25 steps, ``M = 10``), without its weight decay (1e-5) and with the paper's
plain diagonal Gaussian rather than the code's per-layer normalised update directions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ntk_fl import models, validation
from ntk_fl.algorithms import local
from ntk_fl.algorithms import server_round
from ntk_fl._src.options import Choice
from ntk_fl.algorithms.base import parse_enums
from ntk_fl.algorithms.server_round import ServerHParams
from ntk_fl.rng import Stream, numpy_rng

__all__ = [
  "FedBEHParams",
  "Posterior",
  "Gaussian",
  "fit_gaussian",
  "sample_models",
  "Swag",
  "fit_swag",
  "sample_swag",
  "ensemble_members",
  "ensemble_soft_labels",
  "soft_cross_entropy",
  "distill",
  "swa_steps",
  "server_set",
  "make_fedbe",
  "METHOD",
]


class Posterior(Choice):
  """The distribution over models the server samples from: FedBE's diagonal Gaussian or SWAG's."""

  GAUSSIAN = "gaussian"
  SWAG = "swag"


@dataclasses.dataclass(frozen=True)
class FedBEHParams(ServerHParams):
  """FedBE: FedAvg's local training plus the server's ensemble and distillation.

  Attributes:
    num_samples: ``M`` >= 0, models sampled from the Gaussian each round.
    server_set_size: unlabelled server samples (>= 1), drawn from the training samples no client holds.
    distill_epochs: passes over the server set per round (>= 0; 0 = the model is the Gaussian's mean).
    distill_batch_size: distillation minibatch (>= 1, at most ``server_set_size``).
    distill_lr: distillation SGD step (> 0).
    distill_momentum: its heavy-ball momentum in [0, 1).
    swa_start: SWA averages the iterates after steps ``t > swa_start`` (>= 0) ...
    swa_every: ... with ``t % swa_every == 0`` (>= 0; 0 = no SWA, the last iterate).
    posterior: :class:`Posterior`, the distribution the ``M`` models are sampled from.
  """

  num_samples: int
  server_set_size: int
  distill_epochs: int
  distill_batch_size: int
  distill_lr: float
  distill_momentum: float
  swa_start: int
  swa_every: int
  posterior: Posterior = dataclasses.field(default=Posterior.GAUSSIAN, kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    parse_enums(self)  # 'gaussian' / 'swag' become members (another value is an error naming it)
    local.check_fields(
      self,
      {
        "num_samples": local.int_at_least(0),
        "server_set_size": local.int_at_least(1),
        "distill_epochs": local.int_at_least(0),
        "distill_batch_size": local.int_at_least(1),
        "distill_lr": local.positive,
        "swa_start": local.int_at_least(0),
        "swa_every": local.int_at_least(0),
      },
    )
    validation.check_real(
      "config.algorithm.distill_momentum", self.distill_momentum, low=0, high=1, high_open=True
    )
    if self.distill_batch_size > self.server_set_size:
      raise ValueError(
        f"config.algorithm.distill_batch_size = {self.distill_batch_size} exceeds "
        f"config.algorithm.server_set_size = {self.server_set_size}"
      )
    if self.swa_every and self.distill_epochs and not swa_steps(self):
      raise ValueError(
        f"config.algorithm.swa_start = {self.swa_start} with swa_every = {self.swa_every} averages no "
        f"iterate of the {self.distill_steps} distillation steps; lower swa_start or set swa_every = 0"
      )

  @property
  def steps_per_epoch(self) -> int:
    """Full minibatches per pass over the server set (the last partial one is dropped)."""
    return self.server_set_size // self.distill_batch_size

  @property
  def distill_steps(self) -> int:
    return self.distill_epochs * self.steps_per_epoch


def swa_steps(hparams: FedBEHParams) -> list[int]:
  """The steps (1-based) whose iterates SWA averages: ``t > swa_start``, ``t % swa_every == 0``."""
  if not hparams.swa_every:
    return []
  return [
    t
    for t in range(1, hparams.distill_steps + 1)
    if t > hparams.swa_start and t % hparams.swa_every == 0
  ]


# ----------------------------------------------------------------------------- the server's pieces


class Gaussian(NamedTuple):
  """A diagonal Gaussian over models: ``mean`` and ``var`` pytrees shaped like the model."""

  mean: Any
  var: Any


def fit_gaussian(client_params, weights) -> Gaussian:
  """FedBE's Gaussian over the client models (leaves ``[K, ...]``) with weights ``[K]`` summing to 1.

  ``mean = sum_k p_k w_k`` (the same contraction as FedAvg's
  :func:`~ntk_fl.algorithms.server_round.weighted_average`), ``var = sum_k p_k (w_k - mean)**2``.
  """
  mean = jax.tree.map(lambda w: jnp.tensordot(weights, w, axes=1), client_params)
  var = jax.tree.map(
    lambda w, m: jnp.tensordot(weights, jnp.square(w - m[None]), axes=1), client_params, mean
  )
  return Gaussian(mean, var)


def sample_models(gaussian: Gaussian, key, num: int):
  """``num`` models ``mean + sqrt(var) * eps``, ``eps ~ N(0, I)``: leaves ``[num, ...]``."""
  leaves, treedef = jax.tree.flatten(gaussian.mean)
  keys = jax.random.split(key, len(leaves))
  draws = [
    m[None] + jnp.sqrt(v)[None] * jax.random.normal(k, (num, *m.shape), m.dtype)
    for m, v, k in zip(leaves, jax.tree.leaves(gaussian.var), keys)
  ]
  return jax.tree.unflatten(treedef, draws)


class Swag(NamedTuple):
  """SWAG's Gaussian over models: ``mean``, diagonal ``var`` and ``deviations`` (leaves ``[K, ...]``)."""

  mean: Any
  var: Any
  deviations: Any


def fit_swag(client_params, weights) -> Swag:
  """SWAG's Gaussian over the client models (leaves ``[K, ...]``), FedBE's second choice.

  ``mean`` and ``var`` as :func:`fit_gaussian`; ``deviations`` the columns ``w_k - mean`` of SWAG's
  low-rank factor ``D``. The covariance is ``(diag(var) + D D^T / (K - 1)) / 2`` (Maddox et al. 2019,
  eq. (1) of its SWAG sampling, with the clients as the collected models).
  """
  gaussian = fit_gaussian(client_params, weights)
  deviations = jax.tree.map(lambda w, m: w - m[None], client_params, gaussian.mean)
  return Swag(gaussian.mean, gaussian.var, deviations)


def sample_swag(swag: Swag, key, num: int):
  """``num`` models ``mean + sqrt(var / 2) * z_1 + D z_2 / sqrt(2 (K - 1))``: leaves ``[num, ...]``.

  ``z_1 ~ N(0, I_d)`` per parameter (:func:`sample_models`' draw at half the variance, from
  ``split(key)[0]``); ``z_2 ~ N(0, I_K)`` one vector per model, shared by all leaves (the low-rank term
  couples the parameters; from ``split(key)[1]``). ``K = 1`` has no low-rank term.
  """
  diagonal_key, low_rank_key = jax.random.split(key)
  half = jax.tree.map(lambda v: v / 2, swag.var)
  draws = sample_models(Gaussian(swag.mean, half), diagonal_key, num)
  k = jax.tree.leaves(swag.deviations)[0].shape[0]
  if k < 2:
    return draws
  z = jax.random.normal(low_rank_key, (num, k), jax.tree.leaves(swag.mean)[0].dtype)
  scale = 1.0 / np.sqrt(2.0 * (k - 1))
  return jax.tree.map(
    lambda d, dev: d + scale * jnp.tensordot(z, dev, axes=1), draws, swag.deviations
  )


def ensemble_members(mean, client_params, samples):
  """The ensemble ``{mean, clients, samples}`` as one stacked pytree, leaves ``[1 + K + M, ...]``."""
  return jax.tree.map(
    lambda m, c, s: jnp.concatenate([m[None], c, s]), mean, client_params, samples
  )


def ensemble_soft_labels(apply_fn, members, x):
  """Mean softmax probabilities of the stacked ``members`` (leaves ``[E, ...]``) on ``x [S, ...]``: ``[S, C]``."""
  probs = jax.lax.map(lambda w: jax.nn.softmax(apply_fn(w, x), axis=-1), members)  # [E, S, C]
  return jnp.mean(probs, axis=0)


def soft_cross_entropy(logits, soft_labels):
  """``-(1/B) sum_b sum_c q_bc log softmax(logits_b)_c``: ``logits, soft_labels [B, C]`` -> scalar."""
  return jnp.mean(optax.softmax_cross_entropy(logits, soft_labels))


def distill(apply_fn, params, x, soft_labels, key, hparams: FedBEHParams):
  """FedBE's distillation from ``params``: SGD on :func:`soft_cross_entropy`, SWA as ``hparams`` says.

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> [B, C]`` logits.
    params: the starting model (the Gaussian's mean).
    x: ``[S, ...]`` the server set; ``soft_labels [S, C]`` the ensemble's probabilities on it.
    key: the minibatch key; epoch ``e`` uses ``permutation(fold_in(key, e), S)``, cut into
      ``S // distill_batch_size`` batches.
    hparams: :class:`FedBEHParams`.

  Returns:
    The distilled model: the SWA mean (``swa_every > 0``) or the last iterate.
  """
  size, batch = x.shape[0], int(hparams.distill_batch_size)
  per_epoch = size // batch
  tx = optax.sgd(hparams.distill_lr, momentum=float(hparams.distill_momentum) or None)
  grad_fn = jax.grad(lambda w, xb, qb: soft_cross_entropy(apply_fn(w, xb), qb))
  swa_every, swa_start = int(hparams.swa_every), int(hparams.swa_start)

  def one_step(carry, batch_rows):
    w, opt_state, t, avg, count = carry
    updates, opt_state = tx.update(grad_fn(w, x[batch_rows], soft_labels[batch_rows]), opt_state, w)
    w = optax.apply_updates(w, updates)
    t = t + 1
    if swa_every:  # torchcontrib's running mean of the iterates after the chosen steps
      take = (t > swa_start) & (t % swa_every == 0)
      new_count = count + take.astype(jnp.float32)
      avg = jax.tree.map(
        lambda a, p: jnp.where(take, a + (p - a) / jnp.maximum(new_count, 1.0), a), avg, w
      )
      count = new_count
    return (w, opt_state, t, avg, count), None

  def one_epoch(carry, epoch):
    order = jax.random.permutation(jax.random.fold_in(key, epoch), size)[: per_epoch * batch]
    carry, _ = jax.lax.scan(one_step, carry, order.reshape(per_epoch, batch))
    return carry, None

  carry = (params, tx.init(params), jnp.int32(0), params, jnp.float32(0))
  (w, _, _, avg, _), _ = jax.lax.scan(
    one_epoch, carry, jnp.arange(int(hparams.distill_epochs), dtype=jnp.int32)
  )
  return avg if swa_every else w


def server_set(federation, size: int, seed: int):
  """FedBE's unlabelled server set ``x [size, ...]``: samples no client holds, drawn from the seed.

  Raises:
    ValueError: fewer than ``size`` training samples are left out of the clients' index lists.
  """
  index, mask = np.asarray(federation.index), np.asarray(federation.mask)
  num_rows = federation.samples_x.shape[0] - 1  # the last row is the padding zero
  held = np.zeros(num_rows, bool)
  held[index[mask]] = True
  free = np.flatnonzero(~held)
  if size > free.size:
    raise ValueError(
      f"config.algorithm.server_set_size = {size} exceeds the {free.size} training samples no client "
      f"holds (of {num_rows}); give the clients fewer (e.g. data.partition='iid' with a smaller "
      "data.samples_per_client) or ask for a smaller server set"
    )
  rng = numpy_rng(seed, Stream.SHARED_SET, 1)
  rows = free[np.sort(rng.choice(free.size, size=size, replace=False))]
  return np.asarray(federation.samples_x[rows])


# ----------------------------------------------------------------------------- the method


def fedbe_update(model: models.Model, hparams: FedBEHParams) -> server_round.ServerUpdate:
  """FedBE's round (:data:`~ntk_fl.algorithms.server_round.ServerUpdate`); ``extra`` is the server set."""
  num = int(hparams.num_samples)

  def keep_clients(params, result, sent, sizes):
    # FedAvg's mean and what the server received: the aggregation hook hands both on.
    return server_round.weighted_average(params, result, sent, sizes), sent

  fedavg_round = server_round.federated_update(model, hparams, aggregate=keep_clients)

  def update(params, x, y, mask, sizes, train_key, quant_key, lr, server_x):
    (mean, sent), loss, bits = fedavg_round(
      params, x, y, mask, sizes, train_key, quant_key, lr, None
    )
    if hparams.distill_epochs == 0:  # the ensemble acts only through the distillation
      return mean, loss, bits
    sample_key, distill_key = jax.random.split(jax.random.fold_in(quant_key, 1))
    if hparams.posterior == Posterior.SWAG:
      swag = fit_swag(sent, sizes / jnp.sum(sizes))
      gaussian, samples = swag, sample_swag(swag, sample_key, num)
    else:
      gaussian = fit_gaussian(sent, sizes / jnp.sum(sizes))
      samples = sample_models(gaussian, sample_key, num)
    members = ensemble_members(gaussian.mean, sent, samples)
    soft = ensemble_soft_labels(model.apply, members, server_x)
    return distill(model.apply, gaussian.mean, server_x, soft, distill_key, hparams), loss, bits

  return update


METHOD = server_round.server_method(
  "fedbe",
  "FedBE",
  fedbe_update,
  hyperparameters=FedBEHParams,
  extra=lambda federation, hparams, seed: server_set(
    federation, int(hparams.server_set_size), seed
  ),
)
make_fedbe = METHOD.make
