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
  ``weight_decay`` -- or ``optax.adam`` (``optimizer='adam'``; Fed-ensemble's
  clients train with Adam) after the same L2 term (PyTorch's ``Adam(weight_decay)``).
  The optimiser state starts fresh every call (the authors
  create the optimiser inside each round's local training), so only parameters
  cross rounds.
* Options: FedProx's proximal term ``(mu/2)||w - anchor||^2``; SAM / ASAM
  (sharpness-aware steps with radius ``rho``: the gradient is taken at
  ``w + eps`` with ``eps = rho * T^2 g / ||T g||``, ``T = |w|`` for ASAM and 1
  for SAM, then the base optimiser steps from ``w``); a fixed 0/1 parameter mask
  (DisPFL's sparse models: gradients and weights outside the mask stay zero).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from ntk_fl import compression, parallel, rng, validation

__all__ = [
  "LocalResult",
  "make_local_update",
  "minibatch_value_and_grad",
  "patch_apply",
  "epoch_order",
  "num_batches",
  "sgd",
  "adam",
  "OPTIMIZERS",
  "sam_perturbation",
  "masked_cross_entropy",
  "LocalHParams",
  "local_update_from_hparams",
  "model_local_update",
  "round_lr",
  "check_fields",
  "positive",
  "nonnegative",
  "fraction",
  "flag",
  "int_at_least",
  "transmit",
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
  return jnp.sum(jnp.where(weights > 0, weights * per_sample, 0.0)) / jnp.maximum(
    jnp.sum(weights), 1.0
  )


def sgd(lr, *, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
  """PyTorch-style SGD as an optax chain: ``g + wd * w`` -> heavy-ball momentum -> ``-lr``.

  ``lr`` may be a traced scalar (a per-round decayed rate); ``momentum = 0``
  keeps no velocity at all, exactly like ``torch.optim.SGD(momentum=0)``.
  """
  return optax.chain(
    optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
    optax.sgd(lr, momentum=momentum or None, nesterov=nesterov),
  )


OPTIMIZERS = ("sgd", "adam")
"""Client optimisers of the local-training methods (``config.algorithm.optimizer``)."""


def adam(lr, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0):
  """PyTorch-style Adam as an optax chain: ``g + wd * w`` (L2, not AdamW) -> ``optax.adam``.

  Step ``t`` (1-based): ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g²``,
  ``w -= lr · (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``. ``lr`` may be traced.
  """
  return optax.chain(
    optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
    optax.adam(lr, b1=b1, b2=b2, eps=eps),
  )


def sam_perturbation(params, grads, rho, *, adaptive: bool = False):
  """SAM's ascent step ``eps = rho * T^2 g / ||T g||`` (``T = |w|`` if ``adaptive`` (ASAM), else 1).

  ``rho = 0`` gives ``eps = 0`` exactly (plain SGD). A zero gradient gives
  ``eps = 0`` (the norm is guarded, as in the reference SAM code).
  """
  scale_of = (lambda w: jnp.abs(w)) if adaptive else (lambda w: jnp.ones_like(w))
  norm = jnp.sqrt(
    sum(
      jnp.sum(jnp.square(scale_of(w) * g))
      for w, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads))
    )
  )
  factor = rho / (norm + 1e-12)
  return jax.tree.map(lambda w, g: jnp.square(scale_of(w)) * g * factor, params, grads)


def minibatch_value_and_grad(apply_fn: Callable, flax_apply: Callable | None = None) -> Callable:
  """``value_and_grad(params, xb [B, ...], yb [B], weights [B]) -> (loss, grads)`` of
  :func:`masked_cross_entropy` of ``apply_fn(params, xb)``: the local training's one gradient.

  Given ``flax_apply`` (the same function, reaching its flax layers without a ``jax.jit`` boundary)
  and a model with eligible ``nn.Conv`` layers, the gradient is one ``layerwise.patch_vjp``: each
  convolution's weight gradient is formed from its input patches, ``Σ_t A_tᵀ G_t`` (one matrix
  product), not differentiated. Inside the compiled loops of local training (minibatches, epochs,
  clients) XLA's CPU backend runs the differentiated weight gradient of a convolution in its generic
  loop, several times slower. Same values up to float rounding. Without convolutions (the MLP) or
  without ``flax_apply``, exactly ``jax.value_and_grad`` of the loss.
  """

  def objective(params, xb, yb, weights):
    return masked_cross_entropy(apply_fn(params, xb), yb, weights)

  plain = jax.value_and_grad(objective)
  if flax_apply is None:
    return plain

  def value_and_grad(params, xb, yb, weights):
    from ntk_fl._src import layerwise  # pylint: disable=import-outside-toplevel

    # A shape, not a slice of xb: the probe adds nothing to the traced program.
    probe = jax.ShapeDtypeStruct((1, *xb.shape[1:]), xb.dtype)
    convs = layerwise.conv_layers(flax_apply, params, probe)
    if not convs:
      return plain(params, xb, yb, weights)
    logits, pullback = layerwise.patch_vjp(flax_apply, params, xb, convs)
    loss, cotangent = jax.value_and_grad(masked_cross_entropy)(logits, yb, weights)
    (grads,) = pullback(cotangent)
    return loss, grads

  return value_and_grad


def patch_apply(model) -> Callable | None:
  """A model's ``flax_apply`` for :func:`minibatch_value_and_grad`: only where each sample is mapped on
  its own (``model.per_sample``), so that every convolution runs on the minibatch's own samples."""
  return model.flax_apply if getattr(model, "per_sample", False) else None


def make_local_update(
  apply_fn: Callable,
  *,
  epochs: int,
  batch_size: int,
  momentum: float = 0.0,
  nesterov: bool = False,
  weight_decay: float = 0.0,
  prox_mu: float = 0.0,
  sam_rho: float = 0.0,
  sam_adaptive: bool = False,
  optimizer: str = "sgd",
  adam_b1: float = 0.9,
  adam_b2: float = 0.999,
  adam_eps: float = 1e-8,
  flax_apply: Callable | None = None,
) -> Callable[..., LocalResult]:
  """Builds one client's local training (see the module docstring).

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> logits [B, C]``.
    epochs: passes over the client's real samples (>= 1).
    batch_size: minibatch size (>= 1); ``>= n`` gives full-batch gradient descent.
    momentum, nesterov, weight_decay: :func:`sgd`.
    prox_mu: FedProx coefficient (0 = none); needs ``anchor`` at call time.
    sam_rho, sam_adaptive: SAM / ASAM radius (0 = plain gradient steps).
    optimizer: one of :data:`OPTIMIZERS`; ``'adam'`` takes ``adam_b1``, ``adam_b2``, ``adam_eps``
      (:func:`adam`) and no ``momentum``/``nesterov``.
    flax_apply: ``apply_fn``'s computation reaching its flax layers without a ``jax.jit`` boundary
      (:attr:`ntk_fl.models.Model.flax_apply`), or ``None``: a model with convolutions then takes
      their weight gradients from the input patches (:func:`minibatch_value_and_grad`).

  Returns:
    ``local_update(params, x, y, mask, key, lr, anchor=None, param_mask=None) ->
    LocalResult`` for one client: ``x [n, *features]``, ``y [n]`` int labels,
    ``mask [n]`` bool, ``lr`` a scalar (may be traced), ``anchor`` the FedProx
    reference weights, ``param_mask`` a 0/1 pytree like ``params``.
  """
  for name, value in (("epochs", epochs), ("batch_size", batch_size)):
    validation.check_int(name, value, low=1)
  for name, value in (
    ("momentum", momentum),
    ("weight_decay", weight_decay),
    ("prox_mu", prox_mu),
    ("sam_rho", sam_rho),
  ):
    validation.check_real(name, value, low=0)
  if momentum >= 1:
    raise ValueError(f"momentum must be < 1, got {momentum!r}")
  validation.check_choice("optimizer", optimizer, OPTIMIZERS)
  if optimizer == "adam":
    if momentum or nesterov:
      raise ValueError(
        f"optimizer='adam' keeps its own moments: set momentum=0 and nesterov=False (got "
        f"momentum={momentum!r}, nesterov={nesterov!r})"
      )
    for name, value in (("adam_b1", adam_b1), ("adam_b2", adam_b2)):
      validation.check_real(name, value, low=0, high=1, high_open=True)
    validation.check_real("adam_eps", adam_eps, low=0, low_open=True)

  grad_fn = minibatch_value_and_grad(apply_fn, flax_apply)
  optimizer_name = optimizer

  def local_update(params, x, y, mask, key, lr, anchor=None, param_mask=None) -> LocalResult:
    if prox_mu and anchor is None:
      raise ValueError("prox_mu > 0 needs the anchor (round-start) weights")
    x, y, mask = jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)
    slots = num_batches(mask.shape[0], batch_size)
    n_real = jnp.sum(mask.astype(jnp.int32))
    if optimizer_name == "adam":
      optimizer = adam(lr, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay)
    else:
      optimizer = sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    apply_mask = (
      (lambda tree: tree)
      if param_mask is None
      else (lambda tree: jax.tree.map(lambda t, m: t * m.astype(t.dtype), tree, param_mask))
    )

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
      return (keep(new_params, params), keep(new_opt_state, opt_state)), jnp.where(
        active, loss, 0.0
      )

    def epoch(carry, epoch_key):
      order = epoch_order(epoch_key, mask)
      order = jnp.pad(order, (0, slots * batch_size - order.shape[0]))  # pad slots are never real
      carry, losses = jax.lax.scan(
        functools.partial(minibatch_step, order), carry, jnp.arange(slots)
      )
      return carry, jnp.sum(losses)

    carry = (params, optimizer.init(params))
    (params, _), epoch_losses = jax.lax.scan(epoch, carry, jax.random.split(key, epochs))
    batches = (n_real + batch_size - 1) // batch_size
    return LocalResult(
      params=params,
      loss=epoch_losses[-1] / jnp.maximum(batches, 1),
      steps=(epochs * batches).astype(jnp.int32),
    )

  return local_update


# ----------------------------------------------------------------------------- hyperparameters
#
# Every gradient baseline's ``config.algorithm`` block holds the fields of
# LocalHParams plus its own extras (a subclass); the schema rejects unknown keys,
# so a typo (``prox_mu`` in a FedAvg config, say) never runs silently as something else.


def _check_momentum(name, value):
  validation.check_real(f"config.algorithm.{name}", value, low=0, high=1, high_open=True)


def _check_bits(name, value):
  if isinstance(value, bool) or not isinstance(value, int) or not (1 <= value <= 16 or value == 32):
    raise ValueError(
      f"config.algorithm.{name} must be 32 (no quantisation) or an int in [1, 16], got {value!r}"
    )


def positive(name, value):
  validation.check_real(f"config.algorithm.{name}", value, low=0, low_open=True)


def nonnegative(name, value):
  validation.check_real(f"config.algorithm.{name}", value, low=0)


def fraction(name, value):
  validation.check_real(f"config.algorithm.{name}", value, low=0, high=1, low_open=True)


def flag(name, value):
  validation.check_bool(f"config.algorithm.{name}", value)


def int_at_least(low: int):
  """A field check: an int ``>= low``."""
  return lambda name, value: validation.check_int(f"config.algorithm.{name}", value, low=low)


def check_fields(hparams, checks: dict) -> None:
  """Runs ``checks`` (field name -> ``check(name, value)``) on a hyperparameter dataclass's fields."""
  for name, check in checks.items():
    check(name, getattr(hparams, name))


@dataclasses.dataclass(frozen=True)
class LocalHParams:
  """Local SGD of the gradient baselines (``config.algorithm``; each value checked on construction).

  Attributes:
    lr: learning rate of round 0 (> 0); round ``r`` uses ``lr * lr_gamma**r``.
    lr_gamma: per-round multiplicative decay in (0, 1].
    epochs, batch_size: local passes over the client's data and minibatch size (>= 1).
    momentum, nesterov, weight_decay: :func:`sgd` (momentum in [0, 1)).
    quantize_bits: bits per transmitted weight: 32 (none) or [1, 16].
    stochastic_rounding: unbiased stochastic rounding when quantising.
    optimizer: :data:`OPTIMIZERS`; ``'adam'`` with ``adam_b1``, ``adam_b2``, ``adam_eps`` (and momentum 0).
      Keyword-only with defaults (SGD): configs stored before they existed ran SGD.
  """

  lr: float
  lr_gamma: float
  epochs: int
  batch_size: int
  momentum: float
  nesterov: bool
  weight_decay: float
  quantize_bits: int
  stochastic_rounding: bool
  optimizer: str = dataclasses.field(default="sgd", kw_only=True)
  adam_b1: float = dataclasses.field(default=0.9, kw_only=True)
  adam_b2: float = dataclasses.field(default=0.999, kw_only=True)
  adam_eps: float = dataclasses.field(default=1e-8, kw_only=True)

  def __post_init__(self):
    check_fields(
      self,
      {
        "lr": positive,
        "lr_gamma": fraction,
        "epochs": int_at_least(1),
        "batch_size": int_at_least(1),
        "momentum": _check_momentum,
        "nesterov": flag,
        "weight_decay": nonnegative,
        "quantize_bits": _check_bits,
        "stochastic_rounding": flag,
      },
    )
    validation.check_choice("config.algorithm.optimizer", self.optimizer, OPTIMIZERS)
    for name in ("adam_b1", "adam_b2"):
      validation.check_real(
        f"config.algorithm.{name}", getattr(self, name), low=0, high=1, high_open=True
      )
    positive("adam_eps", self.adam_eps)
    if self.optimizer == "adam" and (self.momentum or self.nesterov):
      raise ValueError(
        "config.algorithm.optimizer='adam' keeps its own moments: set momentum=0 and nesterov=False "
        f"(got momentum={self.momentum!r}, nesterov={self.nesterov!r})"
      )


def round_lr(hparams: LocalHParams, round_index):
  """``lr * lr_gamma ** round`` (0-based round; may be traced)."""
  return hparams.lr * jnp.power(
    jnp.float32(hparams.lr_gamma), jnp.asarray(round_index, jnp.float32)
  )


def local_update_from_hparams(
  apply_fn: Callable, hparams: LocalHParams, *, flax_apply: Callable | None = None
) -> Callable[..., LocalResult]:
  """:func:`make_local_update` with the local-training fields of ``hparams`` (FedProx/SAM extras when
  present); ``flax_apply``: :func:`make_local_update`'s (a model's :attr:`~ntk_fl.models.Model.flax_apply`)."""
  return make_local_update(
    apply_fn,
    epochs=hparams.epochs,
    batch_size=hparams.batch_size,
    momentum=float(hparams.momentum),
    nesterov=hparams.nesterov,
    weight_decay=float(hparams.weight_decay),
    prox_mu=float(getattr(hparams, "prox_mu", 0.0)),
    sam_rho=float(getattr(hparams, "sam_rho", 0.0)),
    sam_adaptive=bool(getattr(hparams, "sam_adaptive", False)),
    optimizer=hparams.optimizer,
    adam_b1=float(hparams.adam_b1),
    adam_b2=float(hparams.adam_b2),
    adam_eps=float(hparams.adam_eps),
    flax_apply=flax_apply,
  )


def model_local_update(model, hparams: LocalHParams) -> Callable[..., LocalResult]:
  """:func:`local_update_from_hparams` for a :class:`~ntk_fl.models.Model`: its ``apply``, and its
  ``flax_apply`` where :func:`patch_apply` allows (the convolutions' weight gradients from their
  patches). What every local-training method builds its clients' update with."""
  return local_update_from_hparams(model.apply, hparams, flax_apply=patch_apply(model))


def transmit(stacked_params, bits: int, *, key, stochastic: bool):
  """What the receivers see of every client's weights: ``bits``-bit quantised, or exact at 32 bits.

  Args:
    stacked_params: pytree with leaves ``[M, ...]``.
    bits: 32 (float32, unchanged) or ``[1, 16]``.
    key: PRNG key of the round's quantisation (split per client, then per leaf).
    stochastic: unbiased stochastic rounding.
  """
  if bits == compression.FLOAT_BITS:
    return stacked_params
  num_clients = jax.tree.leaves(stacked_params)[0].shape[0]
  quantize = lambda p, k: compression.quantize_tree(p, bits, key=k, stochastic=stochastic)
  return parallel.for_each_client(quantize)(stacked_params, jax.random.split(key, num_clients))
