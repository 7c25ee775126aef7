"""The NTK client step behind :func:`ntk_fl.evolve.ntk_step` (users: import it from :mod:`ntk_fl.evolve`).

kernel -> function-space evolution -> candidate weight updates -> scoring -> choice of ``τ``, with every
variable part an argument: the kernel (computed, precomputed, or from explicit Jacobians), the targets (fixed
or a function of the starting outputs), the coordinates of the linearisation (:class:`ParamMap`), how a
candidate is scored, and the start point.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import optax

from ntk_fl._src import evolution as _evolution
from ntk_fl._src.kernels import auto_implementation, empirical_ntk, flat_jacobian, jacobian_kernel
from ntk_fl._src.neural_tangents_api import empirical_ntk_fn
from ntk_fl._src.param_map import ParamMap, identity_map  # re-exported: the sketch builds one
from ntk_fl._src.options import (
  Implementation,
  Kernel,
  Loss,
  MseForm,
  Select,
  Solver,
  check_loss_solver,
  check_taus,
  parse,
)
from ntk_fl._src.dense_stack import DenseStack

_HIGHEST = jax.lax.Precision.HIGHEST

Array = jax.Array
ApplyFn = Callable[[Any, Array], Array]


class TauChoice(NamedTuple):
  """The selected candidate: ``index`` into the grid, ``tau`` and its ``loss``."""

  index: Array
  tau: Array
  loss: Array


# ----------------------------------------------------------------------------
# Weight updates.


def _scale(lr, norm, dtype) -> Array:
  return -jnp.asarray(lr, dtype) / jnp.asarray(norm, dtype)


def _vjp(coords: ParamMap, x: Array, flax_apply: ApplyFn | None, plan=None):
  """``jax.vjp`` of the network on ``x`` at ``coords.point``; for a flax model with convolutions
  (``flax_apply`` and its layer-wise ``plan`` on ``x``), their weight gradients from the input patches
  (``layerwise.patch_vjp``: XLA's CPU backend runs the differentiated ones several times slower inside
  the round's loop over clients)."""
  if flax_apply is not None and plan is not None:
    from ntk_fl._src import layerwise  # pylint: disable=import-outside-toplevel

    convs = layerwise.plan_convs(plan)
    if convs:
      return layerwise.patch_vjp(flax_apply, coords.point, x, convs)
  return jax.vjp(lambda u: coords.apply_fn(u, x), coords.point)


def _deltas_from_pullback(pullback, residual_sums: Array, scale: Array):
  (grads,) = jax.vmap(pullback)(residual_sums)
  return jax.tree_util.tree_map(lambda g: (scale * g).astype(g.dtype), grads)


def weight_update_vjp(apply_fn: ApplyFn, params, x: Array, residual_sums: Array, lr, norm):
  """``Δw_t = -(lr/norm) Jᵀ S_t`` for every grid point, by one VJP at ``params``.

  ``Jᵀ V = Σ_{i,c} V_ic ∂f_c(x_i)/∂w``: the pullback of ``p -> apply_fn(p, x)``
  is built once and vmapped over the ``T`` cotangents; ``J`` is never formed.

  Args:
    apply_fn: ``apply_fn(params, x) -> [N, C]``.
    params: the linearisation point (a pytree).
    x: ``[N, *in]`` inputs (padded rows should carry zero ``residual_sums``).
    residual_sums: ``[T, N, C]``.
    lr: step size (float or traced scalar).
    norm: ``N`` for cross-entropy, ``N·C`` for MSE (float or traced scalar).

  Returns:
    ``params``-shaped pytree whose leaves have a leading ``[T]`` axis.
  """
  out, pullback = jax.vjp(lambda p: apply_fn(p, x), params)
  if residual_sums.shape[1:] != out.shape:
    raise ValueError(f"residual_sums must be [T, *{out.shape}], got {residual_sums.shape}")
  return _deltas_from_pullback(
    pullback, residual_sums.astype(out.dtype), _scale(lr, norm, out.dtype)
  )


def weight_update_from_jacobian(jac, residual_sums: Array, lr, norm):
  """``Δw_t = -(lr/norm) Jᵀ S_t`` from an explicit Jacobian pytree.

  For paths that hold a (possibly compressed or projected) Jacobian anyway
  (CP-NTK-FL, SPARK's compressed sketches): ``jac`` leaves are ``[N, C, *leaf_shape]``.

  Returns:
    pytree like ``jac`` with leaves ``[T, *leaf_shape]``.
  """
  scale = _scale(lr, norm, residual_sums.dtype)

  def contract(j):
    if j.shape[:2] != residual_sums.shape[1:]:
      raise ValueError(
        f"jacobian leaves must be [N, C, ...] = {residual_sums.shape[1:]} + ..., got {j.shape}"
      )
    return scale * jnp.tensordot(residual_sums, j, axes=([1, 2], [0, 1]), precision=_HIGHEST)

  return jax.tree_util.tree_map(contract, jac)


# ----------------------------------------------------------------------------
# Losses and τ selection.


def mean_loss(logits: Array, targets: Array, mask: Array, loss: Loss | str = Loss.CE) -> Array:
  """Mean training loss over the real samples.

  ``'ce'``: ``mean_i -Σ_c Y_ic log softmax(f_i)_c`` (soft targets allowed);
  ``'mse'``: ``(1/(2NC)) Σ_{i,c} (f_ic - Y_ic)²``. Rows with ``mask`` False are
  excluded (``where``, so garbage there cannot leak in as NaN).
  """
  loss = parse(Loss, loss, "loss")
  if loss == Loss.CE:
    per_sample = optax.softmax_cross_entropy(logits, targets)
  else:
    per_sample = optax.l2_loss(logits, targets).mean(axis=-1)
  mask = mask.astype(bool)
  n = jnp.maximum(mask.sum(), 1).astype(per_sample.dtype)
  return jnp.where(mask, per_sample, 0).sum() / n


def select_tau(losses: Array, taus: Sequence[int]) -> TauChoice:
  """The grid point with the smallest loss (first on ties; NaN losses never win).

  Args:
    losses: ``[T]`` scores, one per ``τ``.
    taus: the static grid.
  """
  taus = check_taus(taus)
  if losses.shape != (len(taus),):
    raise ValueError(f"losses must be [T]={(len(taus),)}, got {losses.shape}")
  index = jnp.argmin(jnp.where(jnp.isnan(losses), jnp.inf, losses))
  return TauChoice(index.astype(jnp.int32), jnp.asarray(taus, jnp.int32)[index], losses[index])


# ----------------------------------------------------------------------------
# The client step.


def _check_lr(lr) -> None:
  # A traced learning rate (per-round decay inside a jitted step) is checked where its schedule is built.
  if isinstance(lr, numbers.Real) and not (math.isfinite(lr) and lr > 0):
    raise ValueError(f"lr must be a finite positive number, got {lr!r}")


def _mask_inputs(x: Array, mask: Array) -> Array:
  return jnp.where(mask.astype(bool).reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)


# A model that is not per-sample has no per-sample factors: its kernel is the whole batch's.
_WHOLE_BATCH = {Implementation.AUTO: 0, Implementation.JACOBIAN: 1, Implementation.NTVP: 2}


def _whole_batch(kernel_impl) -> int:
  impl = parse(Implementation, kernel_impl, "kernel_impl")
  if impl not in _WHOLE_BATCH:
    raise ValueError(
      f"kernel_impl={impl.value!r} needs a per-sample model; a model with "
      f"per_sample=False takes one of {tuple(m.value for m in _WHOLE_BATCH)}"
    )
  return _WHOLE_BATCH[impl]


def ntk_step(
  apply_fn: ApplyFn,
  params,
  x: Array,
  targets,
  mask: Array,
  *,
  lr,
  taus: Sequence[int],
  loss: Loss | str = Loss.CE,
  solver: Solver | str = Solver.EULER,
  mse_form: MseForm | str = MseForm.DISCRETE,
  ode_rtol: float = 1e-7,
  ode_atol: float = 1e-9,
  kernel: Kernel | str = Kernel.TRACED,
  kernel_impl: Implementation | str = Implementation.AUTO,
  dense_stack: DenseStack | None = None,
  flax_apply: ApplyFn | None = None,
  per_sample: bool = True,
  kernel_matrix: Array | None = None,
  jacobian=None,
  param_map: ParamMap | None = None,
  labels: Array | None = None,
  select: Select | str = Select.NETWORK,
  candidate: Callable[[Any], Any] | None = None,
  start=None,
  f0: Array | None = None,
  score_fn: Callable[[Any], Array] | None = None,
  score_outputs: Callable[[Array, Array, Array], Array] | None = None,
):
  """One NTK client step: kernel, evolution, candidate updates ``Δw_τ``, scores, the chosen ``τ``.

  The step every NTK method takes (NTK-DFL per neighbourhood, NTK-FL / CP-NTK-FL on the server's pooled
  uploads, SPARK with its targets and sketch, Fed-ensemble's NTK modes). With ``N`` samples and ``C``
  outputs:

  1. **Start.** ``f0 = apply_fn(start, x)`` (default ``start = params``): the function values the evolution
     starts from. The kernel and the Jacobians stay at ``params`` (NTK-DFL's Jacobian batching starts each
     block from the already updated network but keeps the round's linearisation point).
  2. **Targets** ``Y [N, C]``: an array (one-hot or soft rows), or a function ``targets(f0) -> Y`` (SPARK's
     annealed distillation targets, built from the starting outputs).
  3. **Kernel**, the first that applies: ``kernel_matrix`` (precomputed: e.g.
     :func:`ntk_fl.ntk.projected_dense_ntk`; ``[N, N]`` traced or ``[N, N, C, C]`` full); else the kernel of
     explicit ``jacobian`` (:func:`ntk_fl.jacobians.jacobian_kernel`); else
     :func:`ntk_fl.ntk.empirical_ntk` of the network in ``param_map``'s coordinates
     (``kernel`` = traced / full, ``kernel_impl``, ``dense_stack``; ``flax_apply``, the layer-wise
     structured kernel, in the network's own coordinates only); a model that is not ``per_sample``
     is differentiated on the whole batch at once (neural-tangents' ``vmap_axes=None``).
  4. **Evolution** (:func:`ntk_fl.evolve.evolve`: ``loss``, ``solver``, ``mse_form``, ODE tolerances).
  5. **Candidates** ``Δw_τ = -(lr/norm) Jᵀ S_τ`` (``norm = N`` for CE, ``N·C`` for MSE): from ``jacobian``
     when given (it may be compressed), else one VJP at the linearisation point (``J`` never formed); then
     mapped to the network's parameters by ``param_map.to_params``.
  6. **Scores**: the mean ``loss`` against ``labels`` (default: the targets), or ``score_outputs``, of
     ``apply_fn(candidate(Δw_τ), x)`` (``select='network'``; ``candidate`` defaults to ``start + Δw_τ`` and may
     be, e.g., the momentum step the client will hold), or of the evolved ``f_τ`` (``'linearized'``).
  7. **Choice**: the argmin (first on ties; NaN never wins).

  Args:
    apply_fn: ``apply_fn(params, x) -> logits [N, C]``, the network.
    params: its parameters, the linearisation point (NTK-DFL: the client's averaged weights ``w̄``).
    x: ``[N, *in]`` inputs; rows with ``mask`` False are zeroed and take no part.
    targets: ``[N, C]`` float rows, or ``targets(f0) -> [N, C]``.
    mask: ``[N]`` bool, True for real samples.
    lr: ``η`` (float or traced scalar).
    taus: static strictly ascending positive ints (checked once: pass a :class:`~ntk_fl.evolve.TauGrid`
      from :func:`~ntk_fl.evolve.check_taus` to skip the check).
    loss, solver, mse_form, ode_rtol, ode_atol: the evolution (:class:`~ntk_fl.evolve.Loss`, ...).
    kernel, kernel_impl, dense_stack, flax_apply, per_sample, kernel_matrix, jacobian: the kernel
      (item 3; :class:`ntk_fl.models.Model` carries ``dense_stack``, ``flax_apply`` and
      ``per_sample``); ``jacobian`` is a pytree of ``[N, C, *leaf]`` leaves in ``param_map``'s
      coordinates.
    param_map: the coordinates of the linearisation (default: the network's own parameters).
    labels: ``[N, C]`` rows the candidates are scored against (default: the targets).
    select, candidate: the scoring (item 6).
    start: the network the evolution starts from and the candidates are added to (default ``params``).
    f0: ``[N, C]`` starting function values given outright, instead of ``apply_fn(start, x)`` (rows
      computed at different weights: SPARK's Option B, each sender's rows at its own ``w̄_j``).
    score_fn: ``score_fn(candidate_params) -> loss``, scoring each candidate network on other data than
      ``x`` (NTK-FL §3: τ chosen on a validation set held out from the clients); ``select='network'``.
    score_outputs: ``score_outputs(logits [N, C], labels [N, C], mask [N] bool) -> scalar``, a candidate's
      score from its outputs on ``x`` (lower wins; item 6), instead of the mean ``loss``; ``logits`` are the
      candidate network's (``select='network'``) or the evolved ``f_τ`` (``'linearized'``), padding rows
      included (``mask`` False). Not with ``score_fn``, which scores on other data.

  Returns:
    ``(delta, info)``: ``delta`` shaped like ``params``; ``info`` has ``'tau'`` (int32), ``'loss'`` (the
    chosen score), ``'losses'`` ``[T]`` (the scores), ``'linearized_losses'`` ``[T]`` (loss of ``f_τ``
    against the labels) and ``'f0'`` ``[N, C]`` (the starting outputs).
  """
  loss, solver = parse(Loss, loss, "loss"), parse(Solver, solver, "solver")
  mse_form, select, kernel = (
    parse(MseForm, mse_form, "mse_form"),
    parse(Select, select, "select"),
    parse(Kernel, kernel, "kernel"),
  )
  check_loss_solver(loss, solver)
  if score_fn is not None and select != Select.NETWORK:
    raise ValueError(
      f"score_fn scores candidate networks, so it needs select='network', got {select.value!r}"
    )
  if score_fn is not None and score_outputs is not None:
    raise ValueError(
      "score_fn (candidates scored on other data) and score_outputs (on x) exclude each other"
    )
  taus = check_taus(taus)
  _check_lr(lr)
  n_samples = x.shape[0]
  chex.assert_shape(mask, (n_samples,))
  if not callable(targets):
    chex.assert_rank(targets, 2)
    chex.assert_shape(targets, (n_samples, None))
  if kernel_matrix is not None and kernel_matrix.shape[:2] != (n_samples, n_samples):
    raise ValueError(
      f"kernel_matrix must be [N, N] or [N, N, C, C] with N = {n_samples}, got {kernel_matrix.shape}"
    )

  given_f0 = f0
  mask = jnp.asarray(mask).astype(bool)
  x = _mask_inputs(x, mask)
  coords = identity_map(apply_fn, params) if param_map is None else param_map
  traced = kernel == Kernel.TRACED
  flax_model = flax_apply if param_map is None and per_sample else None
  plan = None  # the model's layers, found once: the pullback's convolutions and the kernel's routes
  if flax_model is not None and jacobian is None:
    from ntk_fl._src import layerwise  # pylint: disable=import-outside-toplevel

    plan = layerwise.make_plan(flax_model, coords.point, x[:1], traced)
  if jacobian is None:
    f0, pullback = _vjp(coords, x, flax_model, plan)
  else:
    f0 = coords.apply_fn(coords.point, x)
  if start is not None:
    f0 = apply_fn(start, x)
  if given_f0 is not None:
    chex.assert_equal_shape([given_f0, f0])
    f0 = given_f0.astype(f0.dtype)
  chex.assert_rank(f0, 2)
  targets = (targets(f0) if callable(targets) else targets).astype(f0.dtype)
  chex.assert_equal_shape([targets, f0])
  labels = targets if labels is None else labels.astype(f0.dtype)
  chex.assert_equal_shape([labels, f0])

  if kernel_matrix is not None:
    k = kernel_matrix
  elif jacobian is not None:
    k = jacobian_kernel(jacobian, trace_outputs=traced)
  elif not per_sample:
    k = empirical_ntk_fn(
      coords.apply_fn,
      trace_axes=(-1,) if traced else (),
      vmap_axes=None,
      implementation=_whole_batch(kernel_impl),
    )(x, None, coords.point)
  else:
    k = empirical_ntk(
      coords.apply_fn,
      coords.point,
      x,
      trace_outputs=traced,
      implementation=kernel_impl,
      dense_stack=dense_stack,
      flax_apply=flax_apply if param_map is None else None,
      plan=plan,
    )
  evo = _evolution.evolve(
    k,
    f0,
    targets,
    mask,
    lr=lr,
    taus=taus,
    loss=loss,
    solver=solver,
    mse_form=mse_form,
    ode_rtol=ode_rtol,
    ode_atol=ode_atol,
  )

  n = jnp.maximum(mask.sum(), 1)
  norm = n if loss == Loss.CE else n * f0.shape[-1]
  if jacobian is None:
    deltas = _deltas_from_pullback(pullback, evo.residual_sums, _scale(lr, norm, f0.dtype))
  else:
    deltas = weight_update_from_jacobian(jacobian, evo.residual_sums, lr, norm)
  deltas = coords.to_params(deltas)

  score = lambda logits: mean_loss(logits, labels, mask, loss)
  linearized_losses = jax.vmap(score)(evo.f_at_taus)
  if score_outputs is not None:
    score = lambda logits: score_outputs(logits, labels, mask)
  if select == Select.NETWORK:
    base = params if start is None else start
    if candidate is None:
      candidate = lambda d: jax.tree_util.tree_map(jnp.add, base, d)
    if score_fn is None:
      losses = jax.vmap(lambda d: score(apply_fn(candidate(d), x)))(deltas)
    else:
      losses = jax.vmap(lambda d: score_fn(candidate(d)))(deltas)
  else:
    losses = linearized_losses if score_outputs is None else jax.vmap(score)(evo.f_at_taus)
  choice = select_tau(losses, taus)
  delta = jax.tree_util.tree_map(lambda d: d[choice.index], deltas)
  info = {
    "tau": choice.tau,
    "loss": choice.loss,
    "losses": losses,
    "linearized_losses": linearized_losses,
    "f0": f0,
  }
  return delta, info


class NtkFunctions(NamedTuple):
  """The NTK client step and the kernels it computes, as a method hands them to the run's cost estimate.

  An NTK method names them in its :class:`~ntk_fl.algorithms.Method` (``ntk=NTK_FUNCTIONS``); the runner
  passes them to ``_src.cost``, which compiles one step and the kernel of a random block before round 1,
  so the cost estimate imports none of the kernel stack itself.

  Attributes:
    step: :func:`ntk_step`.
    empirical_ntk: :func:`ntk_fl._src.kernels.empirical_ntk` (per-sample models).
    empirical_ntk_fn: :func:`ntk_fl._src.neural_tangents_api.empirical_ntk_fn` (whole-batch models).
    mean_loss: :func:`mean_loss` (the validation clients' score of a candidate network).
    flat_jacobian: :func:`ntk_fl._src.kernels.flat_jacobian` (explicit Jacobians ``[N, C, d]``).
    jacobian_kernel: :func:`ntk_fl._src.kernels.jacobian_kernel` (their contraction).
    transmitted_step: ``(apply_fn, params, x, y, mask, *, lr, keep_fraction, bits, **options) ->
      (Δw, info)``: the step on explicit, compressed Jacobians as the method receives them (NTK-FL's
      server with compression; NTK-DFL's compressing client, which also takes ``slots`` and
      ``dense_stack``), or ``None`` for a method without that path.
    projected_model: ``(model, input_dim) -> model``: the network the step trains on projected
      ``input_dim``-wide inputs (CP-NTK-FL's and NTK-DFL's ``projection_dim``), or ``None``.
    auto_implementation: :func:`ntk_fl._src.kernels.auto_implementation`, the implementation
      ``empirical_ntk``'s ``'auto'`` takes for a kernel of a given size (the calibration times a smaller
      block with the run's block's choice), or ``None`` (the smaller block then chooses its own).
  """

  step: Callable
  empirical_ntk: Callable
  empirical_ntk_fn: Callable
  mean_loss: Callable
  flat_jacobian: Callable
  jacobian_kernel: Callable
  transmitted_step: Callable | None = None
  projected_model: Callable | None = None
  auto_implementation: Callable | None = None


NTK_FUNCTIONS = NtkFunctions(
  ntk_step,
  empirical_ntk,
  empirical_ntk_fn,
  mean_loss,
  flat_jacobian,
  jacobian_kernel,
  auto_implementation=auto_implementation,
)
