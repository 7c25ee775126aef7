"""Local training shared by the gradient baselines: minibatch SGD on one client's data.

:func:`make_local_update` returns a pure function of ONE client's slice
(``params``, ``x [n, ...]``, ``y [n]``, ``mask [n]``, a PRNG key and the round's
learning rate). The methods lift it with :func:`ntk_fl.parallel.for_each_client`,
so all clients train in one compiled program (chunked ``vmap``), never in a
Python loop over clients.

What one call does (the authors' baselines, PyTorch ``DataLoader(shuffle=True)``
+ ``torch.optim.SGD``):

* ``epochs`` passes over the client's *real* samples ("local epochs" are passes
  over the ≈200 samples, not single steps). Each epoch visits the samples in a
  fresh uniformly random order (:func:`epoch_order`, keyed by
  ``split(key, epochs)[e]``) and cuts it into minibatches of ``batch_size``; the
  last one may be short (``drop_last=False``). The minibatch loss is the mean
  cross-entropy over the samples actually in it.
* Ragged clients: shapes are static, so every client runs
  ``ceil(n_slots / batch_size)`` step slots per epoch; a client with ``n`` real
  samples uses the first ``ceil(n / batch_size)`` of them and the rest are
  *masked steps* -- parameters and optimiser state pass through unchanged (a
  zero-gradient step would still move momentum, so masking the update is not
  enough). Padding rows are never read: they come after every real sample in
  the epoch order, and the empty slots of a short or masked minibatch read the
  epoch's first real sample with weight 0 instead.
* Optimiser: ``optax.sgd`` with momentum (heavy ball, no dampening, optional
  Nesterov) after ``optax.add_decayed_weights`` -- exactly PyTorch's SGD with
  ``weight_decay``. The optimiser state starts fresh every call (the authors
  create the optimiser inside each round's local training), so only parameters
  cross rounds.
* Options: FedProx's proximal term ``(mu/2)||w - anchor||^2``; SAM / ASAM
  (sharpness-aware steps with radius ``rho``: the gradient is taken at
  ``w + eps`` with ``eps = rho * T^2 g / ||T g||``, ``T = |w|`` for ASAM and 1
  for SAM, then the base optimiser steps from ``w``); a fixed 0/1 parameter mask
  (DisPFL's sparse models: gradients and weights outside the mask stay zero).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ntk_fl import compression, parallel, rng, validation

__all__ = [
    "LocalResult",
    "make_local_update",
    "epoch_order",
    "num_batches",
    "sgd",
    "sam_perturbation",
    "masked_cross_entropy",
    "LOCAL_KEYS",
    "validate_local_config",
    "local_update_from_config",
    "round_lr",
    "check_positive",
    "check_nonnegative",
    "check_fraction",
    "check_bool",
    "check_int",
    "transmit",
    "local_config",
    "quantize_variants",
]


class LocalResult(NamedTuple):
  """What one client's local training returns.

  Attributes:
    params: the trained parameters (same pytree as the input).
    loss: float32 mean minibatch loss over the last epoch's steps (at the
      weights before each step).
    steps: int32 optimiser steps taken, ``epochs * ceil(n / batch_size)``.
  """
  params: Any
  loss: jax.Array
  steps: jax.Array


def num_batches(num_slots: int, batch_size: int) -> int:
  """Static minibatch slots per epoch for ``num_slots`` sample slots."""
  return -(-num_slots // batch_size)


def epoch_order(key, mask):
  """A uniformly random order of the real samples, padding slots last.

  Args:
    key: PRNG key of the epoch.
    mask: bool ``[n]``, True for real samples (anywhere in the array).

  Returns:
    int32 ``[n]``: positions ``0 .. n_real-1`` are a uniformly random
    permutation of the real samples' indices; the rest point at padding.
  """
  return rng.masked_permutation(key, mask)


def masked_cross_entropy(logits, labels, weights):
  """Mean cross-entropy over the samples with weight 1: ``logits [B, C]``, ``labels [B]``, ``weights [B]``."""
  per_sample = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  # `where`, not a product: a padded row's loss may be inf/NaN, and 0 * NaN is NaN.
  return jnp.sum(jnp.where(weights > 0, weights * per_sample, 0.0)) / jnp.maximum(jnp.sum(weights), 1.0)


def sgd(lr, *, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
  """PyTorch-style SGD as an optax chain: ``g + wd * w`` -> heavy-ball momentum -> ``-lr``.

  ``lr`` may be a traced scalar (a per-round decayed rate); ``momentum = 0``
  keeps no velocity at all, exactly like ``torch.optim.SGD(momentum=0)``.
  """
  return optax.chain(optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
                     optax.sgd(lr, momentum=momentum or None, nesterov=nesterov))


def sam_perturbation(params, grads, rho, *, adaptive: bool = False):
  """SAM's ascent step ``eps = rho * T^2 g / ||T g||`` (``T = |w|`` if ``adaptive`` (ASAM), else 1).

  ``rho = 0`` gives ``eps = 0`` exactly (plain SGD). A zero gradient gives
  ``eps = 0`` (the norm is guarded, as in the reference SAM code).
  """
  scale_of = (lambda w: jnp.abs(w)) if adaptive else (lambda w: jnp.ones_like(w))
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(scale_of(w) * g))
                      for w, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads))))
  factor = rho / (norm + 1e-12)
  return jax.tree.map(lambda w, g: jnp.square(scale_of(w)) * g * factor, params, grads)


def make_local_update(apply_fn: Callable, *, epochs: int, batch_size: int, momentum: float = 0.0,
                      nesterov: bool = False, weight_decay: float = 0.0, prox_mu: float = 0.0,
                      sam_rho: float = 0.0, sam_adaptive: bool = False) -> Callable[..., LocalResult]:
  """Builds one client's local training (see the module docstring).

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> logits [B, C]``.
    epochs: passes over the client's real samples (>= 1).
    batch_size: minibatch size (>= 1); ``>= n`` gives full-batch gradient descent.
    momentum, nesterov, weight_decay: :func:`sgd`.
    prox_mu: FedProx coefficient (0 = none); needs ``anchor`` at call time.
    sam_rho, sam_adaptive: SAM / ASAM radius (0 = plain gradient steps).

  Returns:
    ``local_update(params, x, y, mask, key, lr, anchor=None, param_mask=None) ->
    LocalResult`` for one client: ``x [n, *features]``, ``y [n]`` int labels,
    ``mask [n]`` bool, ``lr`` a scalar (may be traced), ``anchor`` the FedProx
    reference weights, ``param_mask`` a 0/1 pytree like ``params``.
  """
  for name, value in (("epochs", epochs), ("batch_size", batch_size)):
    validation.check_int(name, value, low=1)
  for name, value in (("momentum", momentum), ("weight_decay", weight_decay), ("prox_mu", prox_mu),
                      ("sam_rho", sam_rho)):
    validation.check_real(name, value, low=0)
  if momentum >= 1:
    raise ValueError(f"momentum must be < 1, got {momentum!r}")

  def objective(params, xb, yb, weights):
    return masked_cross_entropy(apply_fn(params, xb), yb, weights)

  grad_fn = jax.value_and_grad(objective)

  def local_update(params, x, y, mask, key, lr, anchor=None, param_mask=None) -> LocalResult:
    if prox_mu and anchor is None:
      raise ValueError("prox_mu > 0 needs the anchor (round-start) weights")
    x, y, mask = jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)
    slots = num_batches(mask.shape[0], batch_size)
    n_real = jnp.sum(mask.astype(jnp.int32))
    optimizer = sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    apply_mask = (lambda tree: tree) if param_mask is None else (
        lambda tree: jax.tree.map(lambda t, m: t * m.astype(t.dtype), tree, param_mask))

    def minibatch_step(order, carry, b):
      params, opt_state = carry
      start = b * batch_size
      valid = (start + jnp.arange(batch_size)) < n_real
      # Empty slots of a short (or masked) minibatch read a real sample with weight 0, so padding rows are
      # never gathered at all (0 * NaN padding would still poison the loss).
      idx = jnp.where(valid, jax.lax.dynamic_slice(order, (start,), (batch_size,)), order[0])
      weights = valid.astype(jnp.float32)
      xb, yb = x[idx], y[idx]
      loss, grads = grad_fn(params, xb, yb, weights)
      if sam_rho:
        eps = sam_perturbation(params, grads, sam_rho, adaptive=sam_adaptive)
        _, grads = grad_fn(jax.tree.map(jnp.add, params, eps), xb, yb, weights)
      if prox_mu:
        grads = jax.tree.map(lambda g, w, a: g + prox_mu * (w - a), grads, params, anchor)
      grads = apply_mask(grads)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = apply_mask(optax.apply_updates(params, updates))
      active = start < n_real  # masked step slot: beyond this client's last real minibatch
      keep = lambda new, old: jax.tree.map(lambda a, c: jnp.where(active, a, c), new, old)
      return (keep(new_params, params), keep(new_opt_state, opt_state)), jnp.where(active, loss, 0.0)

    def epoch(carry, epoch_key):
      order = epoch_order(epoch_key, mask)
      order = jnp.pad(order, (0, slots * batch_size - order.shape[0]))  # pad slots are never real
      carry, losses = jax.lax.scan(functools.partial(minibatch_step, order), carry, jnp.arange(slots))
      return carry, jnp.sum(losses)

    carry = (params, optimizer.init(params))
    (params, _), epoch_losses = jax.lax.scan(epoch, carry, jax.random.split(key, epochs))
    batches = (n_real + batch_size - 1) // batch_size
    return LocalResult(params=params, loss=epoch_losses[-1] / jnp.maximum(batches, 1),
                       steps=(epochs * batches).astype(jnp.int32))

  return local_update


# ----------------------------------------------------------------------------- config helpers
#
# Every gradient baseline's ``config.algorithm`` block holds the LOCAL_KEYS below
# plus its own extras; unknown keys are rejected, so a typo (``prox_mu`` in a
# FedAvg config, say) never runs silently as something else.

LOCAL_KEYS = ("lr", "lr_gamma", "epochs", "batch_size", "momentum", "nesterov", "weight_decay",
              "quantize_bits", "stochastic_rounding")
"""``config.algorithm`` fields shared by all gradient baselines (see :func:`validate_local_config`)."""


_is_number = validation.is_real


def check_positive(name, value):
  if not (_is_number(value) and value > 0):
    raise ValueError(f"config.algorithm.{name} must be a finite number > 0, got {value!r}")


def check_nonnegative(name, value):
  if not (_is_number(value) and value >= 0):
    raise ValueError(f"config.algorithm.{name} must be a finite number >= 0, got {value!r}")


def check_fraction(name, value):
  if not (_is_number(value) and 0 < value <= 1):
    raise ValueError(f"config.algorithm.{name} must be in (0, 1], got {value!r}")


def check_bool(name, value):
  validation.check_bool(f"config.algorithm.{name}", value)


def check_int(low):
  def check(name, value):
    validation.check_int(f"config.algorithm.{name}", value, low=low)
  return check


def _check_momentum(name, value):
  if not (_is_number(value) and 0 <= value < 1):
    raise ValueError(f"config.algorithm.{name} must be in [0, 1), got {value!r}")


def _check_bits(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or not (1 <= value <= 16 or value == 32):
    raise ValueError(f"config.algorithm.{name} must be 32 (no quantisation) or an int in [1, 16], got {value!r}")


_LOCAL_CHECKS = {
    "lr": check_positive,
    "lr_gamma": check_fraction,            # multiplicative per round: lr_r = lr * lr_gamma**r
    "epochs": check_int(1),
    "batch_size": check_int(1),
    "momentum": _check_momentum,
    "nesterov": check_bool,
    "weight_decay": check_nonnegative,
    "quantize_bits": _check_bits,
    "stochastic_rounding": check_bool,
}


def validate_local_config(config, method: str, extra_checks=None) -> None:
  """Checks ``config.algorithm`` = :data:`LOCAL_KEYS` + ``extra_checks`` (name -> ``check(name, value)``)."""
  algo = config.algorithm
  checks = {**_LOCAL_CHECKS, **(extra_checks or {})}
  missing = sorted(set(checks) - set(algo.keys()))
  if missing:
    raise ValueError(f"config.algorithm is missing {missing} for method {method!r}")
  unknown = sorted(set(algo.keys()) - set(checks))
  if unknown:
    raise ValueError(f"config.algorithm has unknown key(s) {unknown} for method {method!r}; "
                     f"allowed: {sorted(checks)}")
  for name, check in checks.items():
    check(name, algo[name])


def round_lr(algo, round_index):
  """``lr * lr_gamma ** round`` (0-based round; may be traced)."""
  return algo.lr * jnp.power(jnp.float32(algo.lr_gamma), jnp.asarray(round_index, jnp.float32))


def local_update_from_config(apply_fn: Callable, algo) -> Callable[..., LocalResult]:
  """:func:`make_local_update` with the hyperparameters of ``config.algorithm``."""
  return make_local_update(
      apply_fn, epochs=int(algo.epochs), batch_size=int(algo.batch_size), momentum=float(algo.momentum),
      nesterov=bool(algo.nesterov), weight_decay=float(algo.weight_decay),
      prox_mu=float(algo.get("prox_mu", 0.0)), sam_rho=float(algo.get("sam_rho", 0.0)),
      sam_adaptive=bool(algo.get("sam_adaptive", False)))


def transmit(stacked_params, bits: int, *, key, stochastic: bool, chunk_size=None):
  """What the receivers see of every client's weights: ``bits``-bit quantised, or exact at 32 bits.

  Args:
    stacked_params: pytree with leaves ``[M, ...]``.
    bits: 32 (float32, unchanged) or ``[1, 16]``.
    key: PRNG key of the round's quantisation (split per client, then per leaf).
    stochastic: unbiased stochastic rounding.
    chunk_size: see :func:`ntk_fl.parallel.for_each_client`.
  """
  if bits == compression.FLOAT_BITS:
    return stacked_params
  num_clients = jax.tree.leaves(stacked_params)[0].shape[0]
  quantize = lambda p, k: compression.quantize_tree(p, bits, key=k, stochastic=stochastic)
  return parallel.for_each_client(quantize, chunk_size=chunk_size)(stacked_params,
                                                                     jax.random.split(key, num_clients))


def local_config(*, lr: float, epochs: int, batch_size: int, lr_gamma: float = 1.0, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, quantize_bits: int = 32,
                 stochastic_rounding: bool = False, **extra):
  """A ``config.algorithm`` block holding every :data:`LOCAL_KEYS` field (plus a method's ``extra``)."""
  import ml_collections  # pylint: disable=g-import-not-at-top -- configs only
  return ml_collections.ConfigDict(dict(
      lr=lr, lr_gamma=lr_gamma, epochs=epochs, batch_size=batch_size, momentum=momentum, nesterov=nesterov,
      weight_decay=weight_decay, quantize_bits=quantize_bits, stochastic_rounding=stochastic_rounding, **extra))


def quantize_variants(bits=(8, 4)) -> dict:
  """Config variants ``q<b>``: send ``b``-bit quantised weights (nearest level)."""
  return {f"q{b}": (lambda config, b=b: setattr(config.algorithm, "quantize_bits", b)) for b in bits}


# ----------------------------------------------------------------------------- config families


def server_config(method: str, *, rounds: int = 300, clients_per_round: int = 20, **algorithm):
  """Base config of a server-based baseline (FedAvg family): NTK-FL's comparison setting.

  Fashion-MNIST, 300 clients, the authors' fixed-size Dirichlet partition (≈200
  samples each, α = 0.1), MLP 784-100-10; each round ``clients_per_round`` = 20
  of the 300 clients (uniformly, without replacement; NTK-FL's setting) train
  from the global model and the server averages their weights by data size.
  The configs use 20 epochs of full-batch gradient descent (batch 200 = the
  client's data; NTK-FL's "client batch size 200"), lr 0.1, plain SGD -- the
  NTK-DFL authors' FedAvg notebook; NTK-FL tuned the local iteration count over
  {1, 3, …, 50} and the lr over {1e-3, …, 1e-1} without reporting the winner --
  and 300 rounds (NTK-FL Table 1: FedAvg needs 284 to reach 85 % at α = 0.1).
  Uplink bits are counted per round and cumulatively.

  One global model (so ``client_params`` has one row and the aggregated
  evaluation is the evaluation; per-client evaluation is off), ``clients_per_round``
  of the clients train each round, ``algorithm`` goes to :func:`local_config`.
  """
  from ntk_fl import config as config_lib  # pylint: disable=g-import-not-at-top -- configs only
  config = config_lib.base_config()
  config.method = method
  config.rounds = rounds
  config.eval.clients_every = 0
  config.chunk_size = 0
  config.algorithm = local_config(clients_per_round=clients_per_round, **algorithm)
  return config


def gossip_config(method: str, *, rounds: int = 200, **algorithm):
  """Base config of a decentralized baseline: train locally, then one uniform gossip step.

  The authors' baselines average uniformly with their neighbours (1/(κ+1)); the
  per-client evaluation runs every 5 rounds (it is the expensive part of a
  300-client evaluation); 30 clients per vmap chunk (measured fastest for local
  training on 2 cores).
  """
  from ntk_fl import config as config_lib  # pylint: disable=g-import-not-at-top -- configs only
  config = config_lib.base_config()
  config.method = method
  config.rounds = rounds
  config.topology.mixing = "uniform"
  config.eval.clients_every = 5
  config.chunk_size = 30
  config.algorithm = local_config(**algorithm)
  return config


def _server_smoke(config):
  from ntk_fl import config as config_lib  # pylint: disable=g-import-not-at-top -- configs only
  config_lib.smoke_slice(config)
  config.algorithm.clients_per_round = 5
  config.algorithm.epochs = min(config.algorithm.epochs, 2)


def _gossip_smoke(config):
  from ntk_fl import config as config_lib  # pylint: disable=g-import-not-at-top -- configs only
  config_lib.smoke_slice(config)
  config.eval.clients_every = 1
  config.algorithm.epochs = min(config.algorithm.epochs, 2)


PARTICIPATION_VARIANTS = {
    "full": lambda c: setattr(c.algorithm, "clients_per_round", 0),          # every client, every round
    "busiest_node": lambda c: setattr(c.algorithm, "clients_per_round", 5),  # NTK-DFL App. C.1 (κ = 5)
}
SERVER_VARIANTS = {**quantize_variants(), **PARTICIPATION_VARIANTS, "smoke": _server_smoke}
"""Variants of the server-based configs: ``q8``/``q4``, ``full``, ``busiest_node``, ``smoke``."""
GOSSIP_VARIANTS = {**quantize_variants(), "smoke": _gossip_smoke}
"""Variants of the decentralized configs: ``q8``/``q4``, ``smoke``."""
