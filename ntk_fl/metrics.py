"""Evaluation metrics shared by every method: accuracy, deviation, rounds to target, selection.

Evaluation runs over the test set in fixed-size batches (one compiled program
however large the set; the last batch is padded and masked), and per-client
evaluation lifts the single-model evaluation with
:func:`ntk_fl.parallel.for_each_client`, so the device policy's ``chunk_size`` bounds its memory.

* :func:`evaluate` / :func:`evaluate_clients`: accuracy and mean cross-entropy.
* :func:`make_evaluator`: the same, as jit-compiled closures over a fixed test
  set (what the runner uses: the test arrays go to the device once). Its
  ``aggregate`` option (:data:`AGGREGATES`) says what the aggregated model is:
  the uniform mean of the client parameters (``'params'``), or an ensemble of
  the stacked models whose softmax probabilities (``'ensemble_probs'``) or
  logits (``'ensemble_logits'``) are averaged per sample (Fed-ensemble); an
  ensemble also reports the mean predictive entropy of its members
  (``mode_entropy``, Fed-ensemble Table 4) and of the averaged prediction
  (``ensemble_entropy``), in nats.
* :func:`average_params`: the aggregated model (uniform mean by default).
* :func:`model_deviation`: NTK-DFL eq. 12, ``V = (1/d) sum_j sqrt(sum_i (w_ij - wbar_j)^2)``.
* :func:`rounds_to_target`: the first (1-based) round whose accuracy reaches a target.
* :func:`selection_curves`: final model averaging with client selection
  (NTK-DFL Sec. 5.1 / Fig. 6): best-to-worst, random and worst-to-best orders.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl._src.options import (
  AGGREGATES,
)  # the choices live in a leaf the method interface can import
from ntk_fl.distributed import to_host
from ntk_fl.parallel import for_each_client, policy_chunk_size
from ntk_fl.rng import Stream, numpy_rng

__all__ = [
  "AGGREGATES",
  "ENSEMBLE_METRICS",
  "Batches",
  "Evaluator",
  "average_params",
  "batch_test_set",
  "evaluate",
  "evaluate_clients",
  "make_evaluator",
  "model_deviation",
  "rounds_to_target",
  "selection_curves",
  "SELECTION_ORDERS",
]

SELECTION_ORDERS = ("best_to_worst", "random", "worst_to_best")
ENSEMBLE_METRICS = ("mode_entropy", "ensemble_entropy")
"""Extra aggregated metrics of an ensemble evaluator, in the order ``Evaluator.aggregate`` returns them."""


class Batches(NamedTuple):
  """A test set cut into equal batches (a pytree).

  Attributes:
    x: ``[num_batches, batch, *feature_shape]`` inputs; padding rows are zeros.
    y: ``[num_batches, batch]`` int32 labels (0 in padding rows).
    mask: ``[num_batches, batch]`` bool, True for real samples.
  """

  x: Any
  y: Any
  mask: Any


def batch_test_set(x, y, batch_size: int = 10_000) -> Batches:
  """Pads ``x [N, ...]``, ``y [N]`` to whole batches of ``min(batch_size, N)`` rows (host side)."""
  x = np.asarray(x)
  y = np.asarray(y)
  if x.ndim < 1 or y.ndim != 1 or x.shape[0] != y.shape[0]:
    raise ValueError(
      f"expected x [N, ...] and y [N] with equal N, got shapes {x.shape} and {y.shape}"
    )
  n = x.shape[0]
  if n == 0:
    raise ValueError("cannot evaluate on an empty set (N = 0)")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  batch = min(batch_size, n)
  num_batches = -(-n // batch)
  pad = num_batches * batch - n
  mask = np.concatenate([np.ones(n, bool), np.zeros(pad, bool)])
  x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
  y = np.concatenate([y.astype(np.int32), np.zeros(pad, np.int32)])
  return Batches(
    x=x.reshape(num_batches, batch, *x.shape[1:]),
    y=y.reshape(num_batches, batch),
    mask=mask.reshape(num_batches, batch),
  )


def _accuracy_and_loss(apply_fn: Callable, params, batches: Batches):
  """Accuracy and mean cross-entropy of one model over all real rows of ``batches``.

  Sums are accumulated batch by batch (``lax.scan``) so only one batch of
  activations is alive at a time; the masked padding rows contribute nothing.
  """

  def body(carry, batch):
    logits = apply_fn(params, batch.x).astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=-1)[:, 0]
    correct = jnp.argmax(logits, axis=-1) == batch.y
    correct_sum, nll_sum = carry
    return (
      correct_sum + jnp.sum(correct & batch.mask),
      nll_sum + jnp.sum(jnp.where(batch.mask, nll, 0.0)),
    ), None

  (correct, nll), _ = jax.lax.scan(body, (jnp.int32(0), jnp.float32(0.0)), batches)
  n = jnp.sum(batches.mask)
  return correct / n, nll / n


@functools.partial(jax.jit, static_argnums=0)
def _evaluate_jit(apply_fn, params, batches):
  return _accuracy_and_loss(apply_fn, params, batches)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _evaluate_clients_jit(apply_fn, stacked_params, batches, chunk_size):
  one = lambda p: _accuracy_and_loss(apply_fn, p, batches)
  return for_each_client(one, chunk_size=chunk_size)(stacked_params)


def evaluate(apply_fn: Callable, params, x, y, *, batch_size: int = 10_000):
  """Accuracy and mean cross-entropy of one model.

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> logits [B, C]``.
    params: one model's parameters.
    x: ``[N, *input_shape]`` inputs.
    y: ``[N]`` int labels.
    batch_size: rows per batch (one compiled program for every batch).

  Returns:
    ``(accuracy, loss)``: float32 scalars.
  """
  return _evaluate_jit(apply_fn, params, batch_test_set(x, y, batch_size))


def evaluate_clients(
  apply_fn: Callable,
  stacked_params,
  x,
  y,
  *,
  batch_size: int = 10_000,
  chunk_size: int | None = None,
):
  """Accuracy and mean cross-entropy of every client model on the same set.

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> logits [B, C]``.
    stacked_params: parameters with a leading client axis ``M``.
    x, y: ``[N, *input_shape]`` inputs and ``[N]`` labels.
    batch_size: test rows per batch.
    chunk_size: clients evaluated at once (``0`` = all ``M``; ``None`` = the
      device policy's, :func:`ntk_fl.parallel.use_devices`); peak memory is about
      ``chunk_size * batch_size`` activations.

  Returns:
    ``(accuracy [M], loss [M])`` float32.
  """
  chex.assert_equal_shape_prefix(jax.tree_util.tree_leaves(stacked_params), 1)  # one client axis M
  # Resolved here, not at trace time: the compiled program is cached per chunk size.
  chunk_size = policy_chunk_size() if chunk_size is None else chunk_size
  return _evaluate_clients_jit(
    apply_fn, stacked_params, batch_test_set(x, y, batch_size), chunk_size
  )


def average_params(stacked_params, weights=None):
  """The aggregated model: a (weighted) mean over the leading client axis.

  Args:
    stacked_params: pytree whose leaves are ``[M, ...]``.
    weights: ``None`` for the uniform mean, else ``[M]`` non-negative weights
      (normalised here, e.g. data sizes for FedAvg-style averaging).

  Returns:
    One model's parameters (leaves without the client axis).
  """
  leaves = jax.tree_util.tree_leaves(stacked_params)
  if not leaves:
    raise ValueError("average_params needs at least one parameter array")
  chex.assert_equal_shape_prefix(leaves, 1)  # every leaf has the same client axis M
  if weights is None:
    return jax.tree.map(lambda w: jnp.mean(w, axis=0), stacked_params)
  weights = jnp.asarray(weights, jnp.float32)
  num_clients = leaves[0].shape[0]
  if weights.shape != (num_clients,):
    raise ValueError(f"weights must have shape [M] = ({num_clients},), got {weights.shape}")
  weights = weights / jnp.sum(weights)
  return jax.tree.map(lambda w: jnp.tensordot(weights, w, axes=1).astype(w.dtype), stacked_params)


def model_deviation(stacked_params):
  """Inter-client model deviation, NTK-DFL eq. 12.

  ``V = (1/d) sum_j sqrt(sum_i (w_ij - wbar_j)^2)`` over all ``d`` parameters
  ``j`` and clients ``i``. Note the square root is of the *sum* over clients, so
  ``V`` grows like ``sqrt(M)`` for a fixed per-client spread (as in the paper).

  Args:
    stacked_params: pytree whose leaves are ``[M, ...]``.

  Returns:
    ``V``: a float32 scalar (a jnp array, so it can be used under ``jit``).
  """
  leaves = jax.tree_util.tree_leaves(stacked_params)
  if not leaves:
    raise ValueError("model_deviation needs at least one parameter array")
  chex.assert_equal_shape_prefix(leaves, 1)  # every leaf has the same client axis M
  # Per-leaf sums avoid concatenating all d parameters of all clients.
  total = sum(
    jnp.sum(jnp.sqrt(jnp.sum(jnp.square(w - jnp.mean(w, axis=0)), axis=0)), dtype=jnp.float32)
    for w in leaves
  )
  d = sum(math.prod(w.shape[1:]) for w in leaves)
  return total / d


def rounds_to_target(accuracies: Sequence[float | None], target: float) -> int | None:
  """The 1-based round of the first accuracy ``>= target``; ``None`` if never reached.

  Args:
    accuracies: one entry per round (round 1 first); ``None`` or NaN marks a
      round that was not evaluated.
    target: an accuracy in ``(0, 1]``.
  """
  if not 0.0 < target <= 1.0:
    raise ValueError(f"target must be an accuracy in (0, 1], got {target}")
  for r, acc in enumerate(accuracies, start=1):
    if acc is not None and not math.isnan(acc) and acc >= target:
      return r
  return None


def _ensemble_metrics(
  apply_fn: Callable, stacked_params, batches: Batches, aggregate: str, chunk_size: int | None
):
  """Accuracy, cross-entropy and entropies of the ensemble of the ``K`` stacked models.

  Per test sample the ensemble predicts ``q = (1/K) sum_k softmax(f_k)``
  (``'ensemble_probs'``) or ``q = softmax((1/K) sum_k f_k)`` (``'ensemble_logits'``);
  accuracy is ``argmax q == y``, the loss ``-log q_y`` (computed from
  ``logsumexp`` of the members' log-probabilities, so it never takes ``log 0``).

  Returns:
    ``(accuracy, loss, mode_entropy, ensemble_entropy)``: float32 scalars;
    ``mode_entropy`` = mean over samples and members of each member's entropy,
    ``ensemble_entropy`` = mean over samples of the entropy of ``q`` (nats).
  """
  num_models = jax.tree_util.tree_leaves(stacked_params)[0].shape[0]
  entropy = lambda log_p: jnp.sum(jax.scipy.special.entr(jnp.exp(log_p)), axis=-1)

  def body(carry, batch):
    member = lambda p: apply_fn(p, batch.x).astype(jnp.float32)
    logits = for_each_client(member, chunk_size=chunk_size)(stacked_params)  # [K, B, C]
    log_p = jax.nn.log_softmax(logits)
    if aggregate == "ensemble_probs":
      log_q = jax.nn.logsumexp(log_p, axis=0) - jnp.log(jnp.float32(num_models))
    else:
      log_q = jax.nn.log_softmax(jnp.mean(logits, axis=0))
    nll = -jnp.take_along_axis(log_q, batch.y[:, None], axis=-1)[:, 0]
    values = (
      jnp.argmax(log_q, axis=-1) == batch.y,
      nll,
      jnp.mean(entropy(log_p), axis=0),
      entropy(log_q),
    )
    return tuple(
      c + jnp.sum(jnp.where(batch.mask, v, 0), dtype=jnp.float32) for c, v in zip(carry, values)
    ), None

  sums, _ = jax.lax.scan(body, (jnp.float32(0.0),) * 4, batches)
  n = jnp.sum(batches.mask)
  return tuple(s / n for s in sums)


class Evaluator(NamedTuple):
  """Jit-compiled evaluation closures over one fixed test set (see :func:`make_evaluator`).

  Attributes:
    aggregate: ``stacked_params -> (accuracy, loss, deviation, *extra)`` of the
      aggregated model (the uniform mean of all client models, or their
      ensemble) and :func:`model_deviation` of the clients; ``extra`` holds one
      scalar per name in ``extra_names``.
    clients: ``stacked_params -> (accuracy [M], loss [M])`` of every client model.
    extra_names: names of the extra aggregated metrics (``()`` for
      ``'params'``, :data:`ENSEMBLE_METRICS` for an ensemble).
  """

  aggregate: Callable[[Any], tuple[Any, ...]]
  clients: Callable[[Any], tuple[Any, Any]]
  extra_names: tuple[str, ...] = ()


def make_evaluator(
  apply_fn: Callable,
  x,
  y,
  *,
  batch_size: int = 10_000,
  chunk_size: int | None = None,
  aggregate: str = "params",
) -> Evaluator:
  """Builds the jitted evaluation closures the runner calls every round.

  The batched test set is put on the device once and passed as an argument (not
  captured as a constant, which would embed it in every compiled program).

  Args:
    apply_fn: ``apply(params, x [B, ...]) -> logits [B, C]``.
    x, y: the test set, ``[N, ...]`` and ``[N]``.
    batch_size: test rows per batch.
    chunk_size: clients (ensemble members) evaluated at once (``0`` = all;
      ``None`` = the device policy's when the evaluator is first called).
    aggregate: one of :data:`AGGREGATES` (see the module docstring).
  """
  if aggregate not in AGGREGATES:
    raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
  batches = jax.device_put(batch_test_set(x, y, batch_size))

  @jax.jit
  def _aggregate(stacked_params, batches):
    if aggregate == "params":
      acc, loss = _accuracy_and_loss(apply_fn, average_params(stacked_params), batches)
      return acc, loss, model_deviation(stacked_params)
    acc, loss, mode_entropy, ensemble_entropy = _ensemble_metrics(
      apply_fn, stacked_params, batches, aggregate, chunk_size
    )
    return acc, loss, model_deviation(stacked_params), mode_entropy, ensemble_entropy

  @jax.jit
  def _clients(stacked_params, batches):
    one = lambda p: _accuracy_and_loss(apply_fn, p, batches)
    return for_each_client(one, chunk_size=chunk_size)(stacked_params)

  return Evaluator(
    aggregate=lambda p: _aggregate(p, batches),
    clients=lambda p: _clients(p, batches),
    extra_names=() if aggregate == "params" else ENSEMBLE_METRICS,
  )


@jax.jit
def _running_means(stacked_params, order):
  """``[M, ...]`` leaves -> the mean of the first ``k`` clients of ``order``, for ``k = 1..M``."""
  counts = jnp.arange(1, len(order) + 1, dtype=jnp.float32)

  def one(w):
    cumsum = jnp.cumsum(w[order].astype(jnp.float32), axis=0)
    return (cumsum / counts.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)

  return jax.tree.map(one, stacked_params)


def selection_curves(
  apply_fn: Callable,
  stacked_params,
  x_test,
  y_test,
  *,
  seed: int,
  batch_size: int = 10_000,
  chunk_size: int | None = None,
) -> dict[str, np.ndarray]:
  """Final model averaging with client selection (NTK-DFL Sec. 5.1, Fig. 6).

  The test set is split 50:50 (a permutation from the ``Stream.SELECTION`` stream of ``seed``) into a
  validation half that ranks the client models and a test half that scores the
  running average of the first ``k`` models, ``k = 1..M``, in three orders:
  best-to-worst validation accuracy (ties broken by client index), a random
  order (from ``seed``), and worst-to-best (the reverse of best-to-worst).

  Args:
    apply_fn: ``apply(params, x) -> logits``.
    stacked_params: final client parameters, leaves ``[M, ...]``.
    x_test, y_test: ``[N, ...]`` and ``[N]`` (``N >= 2``).
    seed: seeds the split and the random order.
    batch_size, chunk_size: as in :func:`evaluate_clients`.

  Returns:
    ``{'best_to_worst', 'random', 'worst_to_best'}``: ``[M]`` float test-half
    accuracy of the average of the first ``k`` clients (index ``k - 1``); the
    orders under ``'<name>_order'`` (``[M]`` int client indices); each client's
    own accuracy under ``'validation_accuracy'`` and ``'test_accuracy'`` ``[M]``.
  """
  x_test = np.asarray(x_test)
  y_test = np.asarray(y_test)
  n = y_test.shape[0]
  if n < 2:
    raise ValueError(f"selection needs at least 2 test samples to split 50:50, got {n}")
  rng = numpy_rng(seed, Stream.SELECTION)
  perm = rng.permutation(n)
  val_idx, test_idx = perm[: n // 2], perm[n // 2 :]
  eval_clients = functools.partial(
    evaluate_clients, apply_fn, batch_size=batch_size, chunk_size=chunk_size
  )

  val_acc = to_host(eval_clients(stacked_params, x_test[val_idx], y_test[val_idx])[0])
  test_acc = to_host(eval_clients(stacked_params, x_test[test_idx], y_test[test_idx])[0])
  num_clients = val_acc.shape[0]
  best_to_worst = np.argsort(-val_acc, kind="stable")
  orders = {
    "best_to_worst": best_to_worst,
    "random": rng.permutation(num_clients),
    "worst_to_best": best_to_worst[::-1].copy(),
  }
  result = {"validation_accuracy": val_acc, "test_accuracy": test_acc}
  for name, order in orders.items():
    averages = _running_means(stacked_params, jnp.asarray(order))
    result[name] = to_host(eval_clients(averages, x_test[test_idx], y_test[test_idx])[0])
    result[f"{name}_order"] = order
  return result
