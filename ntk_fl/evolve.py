"""Function-space evolution under the NTK and the weight updates it implies.

The numerical heart of NTK-FL, NTK-DFL and SPARK. Given a kernel ``K`` built at
weights ``w0`` on ``N`` samples, the network is linearised,
``f(w) ≈ f(w0) + J (w - w0)``, and gradient descent on that linear model is run
*in function space*, where it only needs ``K`` and the ``[N, C]`` function
values. A step ``s`` of weight-space gradient descent with step ``η`` on the
mean loss moves the function values by ``-(η/N) K ∇_f`` and the weights by
``-(η/N) Jᵀ ∇_f``, so after ``τ`` steps

  ``Δw_τ = -(η / norm) Jᵀ S_τ``,   ``S_τ = Σ_{s<τ} r_s``   (``r_s`` = residual at step ``s``)

with ``norm = N`` for cross-entropy (``r = softmax(f) - Y``) and ``norm = N·C``
for the half mean squared error (``r = f - Y``). Only the ``[T, N, C]``
cumulative residuals ``S`` at the candidate ``τ`` grid are kept (never the
whole ``τ_max`` trajectory), and ``Jᵀ S`` is one VJP at ``w0`` vmapped over the
``T`` cotangents, so ``J`` is never materialised.

Layers (each pure, ``jit``/``vmap``-able; NTK-DFL vmaps the whole client update):

* :func:`evolve_ce_euler`, :func:`evolve_ce_ode`, :func:`evolve_mse_closed_form`
  and the dispatcher :func:`evolve` -- kernel + initial function values ->
  :class:`Evolution` (``residual_sums [T, N, C]``, ``f_at_taus [T, N, C]``).
* :func:`weight_update_vjp` (``Jᵀ S`` by VJP) and
  :func:`weight_update_from_jacobian` (explicit, possibly compressed ``J``).
* :func:`mean_loss` and :func:`select_tau` -- choosing ``τ``.
* :func:`ntk_delta_from_kernel`, :func:`ntk_delta`, :func:`ntk_update` -- the
  whole client update.

Conventions (docs/CONVENTIONS.md, conventions 1-4):

* Kernel: ``[N, N]`` output-traced ``H = (1/C) Σ_c J_c J_cᵀ`` applied to every
  output column (default), or the full ``[N, N, C, C]`` kernel with
  ``(K r)_{ia} = Σ_{jb} K[i, j, a, b] r_{jb}``.
* ``N`` is the number of real samples (``mask.sum()``). Padded rows (``mask``
  False) get zero kernel rows/columns, zero residuals, zeroed inputs and are
  excluded from every loss, so they cannot change any result.
* Cross-entropy, ``solver='euler'``: exact function-space GD,
  ``f_{s+1} = f_s - (η/N) K (softmax(f_s) - Y)``. ``solver='ode'``: the
  gradient flow ``df/dt = -(1/N) K (softmax(f) - Y)`` integrated by diffrax
  (Dopri5, PID step control; defaults ``rtol=1e-7, atol=1e-9`` like the authors'
  torchdiffeq), read out at ``t = sη`` and summed as a left Riemann sum, as the
  NTK-FL / NTK-DFL reference code does. The two agree to ``O(η)``.
* Mean squared error: closed form from one ``eigh`` of ``K`` (eigenvalues
  clipped at 0), step ``ε = η/(N·C)``. ``mse_form='discrete'`` is exact GD
  (``r_s = (I - εK)^s r_0``, geometric sums for ``S``); ``'continuous'`` is the
  gradient flow in step units (``r(u) = exp(-εKu) r_0``, ``S_τ = ∫_0^τ r``).
  ``solver='ode'`` is rejected for MSE (there is nothing to integrate).
* ``τ`` selection: ``select='network'`` (default, the reference code) scores
  the nonlinear network at ``w0 + Δw_τ``; ``'linearized'`` (the papers'
  reading) scores the evolved function values ``f_τ``. The score is the
  training loss of ``loss`` (mean cross-entropy against the targets for
  ``'ce'``; half mean squared error for ``'mse'``) on the real samples. The
  argmin wins, ties go to the smallest ``τ``, NaN scores never win.

Matrix products with the kernel use ``Precision.HIGHEST``: they multiply an
``[N, N]`` matrix by only ``C`` columns, so they are memory-bound and full float32
costs next to nothing, whereas the TF32 default of recent GPUs would inject
~1e-3 relative error into each of the ``τ_max`` steps. On CPU it changes nothing.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple, Sequence

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "Evolution",
    "TauChoice",
    "LOSSES",
    "SOLVERS",
    "SELECTS",
    "KERNELS",
    "MSE_FORMS",
    "check_taus",
    "evolve",
    "evolve_ce_euler",
    "evolve_ce_ode",
    "evolve_mse_closed_form",
    "weight_update_vjp",
    "weight_update_from_jacobian",
    "mean_loss",
    "select_tau",
    "ntk_delta_from_kernel",
    "ntk_delta",
    "ntk_update",
]

LOSSES = ("ce", "mse")
SOLVERS = ("euler", "ode")
SELECTS = ("network", "linearized")
KERNELS = ("traced", "full")
MSE_FORMS = ("discrete", "continuous")

# Largest block of unit intervals one diffeqsolve call covers in the ODE path:
# bounds the saved readouts to [block, N, C] while letting the adaptive solver
# take steps longer than one unit inside a block.
_ODE_MAX_BLOCK = 32
_HIGHEST = jax.lax.Precision.HIGHEST

Array = jax.Array
ApplyFn = Callable[[Any, Array], Array]


class Evolution(NamedTuple):
  """Function-space trajectory, read out on the ``τ`` grid.

  Attributes:
    residual_sums: ``[T, N, C]`` ``S_τ = Σ_{s<τ} r_s`` for each ``τ`` of the grid
      (``r = softmax(f) - Y`` for CE, ``f - Y`` for MSE; zero on padded rows).
    f_at_taus: ``[T, N, C]`` evolved function values ``f_τ`` (zero on padded rows).
  """
  residual_sums: Array
  f_at_taus: Array


class TauChoice(NamedTuple):
  """The selected candidate: ``index`` into the grid, ``tau`` and its ``loss``."""
  index: Array
  tau: Array
  loss: Array


# ----------------------------------------------------------------------------
# Validation.


def check_taus(taus: Sequence[int]) -> tuple[int, ...]:
  """Validates a static ``τ`` grid: a non-empty, strictly ascending tuple of positive ints."""
  if isinstance(taus, (jax.Array, str)) or not isinstance(taus, Sequence | np.ndarray):
    raise ValueError(f"taus must be a static sequence of positive ints, got {taus!r}")
  out = []
  for tau in list(taus):
    if isinstance(tau, (bool, np.bool_)) or not isinstance(tau, numbers.Integral):
      raise ValueError(f"taus must contain Python/numpy ints, got {tau!r} in {taus!r}")
    out.append(int(tau))
  if not out:
    raise ValueError("taus must be non-empty")
  if out[0] <= 0:
    raise ValueError(f"taus must be positive, got {tuple(out)}")
  if any(b <= a for a, b in zip(out, out[1:])):
    raise ValueError(f"taus must be strictly ascending, got {tuple(out)}")
  return tuple(out)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _check_options(*, loss, solver, select, kernel, mse_form) -> None:
  _check_choice("loss", loss, LOSSES)
  _check_choice("solver", solver, SOLVERS)
  _check_choice("select", select, SELECTS)
  _check_choice("kernel", kernel, KERNELS)
  _check_choice("mse_form", mse_form, MSE_FORMS)
  if loss == "mse" and solver == "ode":
    raise ValueError("solver='ode' is only defined for loss='ce'; the MSE evolution is always the "
                     "closed form (choose mse_form='discrete' or 'continuous')")


def _check_lr(lr) -> None:
  # Traced learning rates (per-round decay inside a jitted step) cannot be
  # checked; concrete ones can.
  if isinstance(lr, numbers.Real) and not (math.isfinite(lr) and lr > 0):
    raise ValueError(f"lr must be a finite positive number, got {lr!r}")


def _check_shapes(f0: Array, targets: Array, mask: Array, kernel: Array | None = None) -> None:
  if targets.ndim != 2:
    raise ValueError(f"targets must be [N, C] float rows, got shape {targets.shape}")
  if f0.shape != targets.shape:
    raise ValueError(f"function values {f0.shape} and targets {targets.shape} must have equal shapes")
  if mask.shape != targets.shape[:1]:
    raise ValueError(f"mask must be [N]={targets.shape[:1]}, got {mask.shape}")
  if kernel is not None:
    n, c = targets.shape
    if kernel.shape not in ((n, n), (n, n, c, c)):
      raise ValueError(f"kernel must be [N, N]={(n, n)} (traced) or [N, N, C, C]={(n, n, c, c)} "
                       f"(full), got {kernel.shape}")


# ----------------------------------------------------------------------------
# Masking and kernel application.


class _Problem(NamedTuple):
  kernel: Array    # [N, N] or [N, N, C, C], zero rows/cols on padding
  f0: Array        # [N, C], zero on padding
  targets: Array   # [N, C], zero on padding
  weights: Array   # [N] float 0/1
  n: Array         # scalar float, number of real samples (>= 1)


def _prepare(kernel: Array, f0: Array, targets: Array, mask: Array) -> _Problem:
  _check_shapes(f0, targets, mask, kernel)
  mask = mask.astype(bool)
  weights = mask.astype(f0.dtype)
  rows = weights.reshape((-1,) + (1,) * (kernel.ndim - 1))
  cols = weights.reshape((1, -1) + (1,) * (kernel.ndim - 2))
  # `where`, not multiplication: garbage in padded rows may be inf/NaN.
  kernel = jnp.where((rows * cols) > 0, kernel, 0).astype(f0.dtype)
  f0 = jnp.where(mask[:, None], f0, 0)
  targets = jnp.where(mask[:, None], targets, 0).astype(f0.dtype)
  n = jnp.maximum(weights.sum(), 1)
  return _Problem(kernel, f0, targets, weights, n)


def _apply_kernel(kernel: Array, r: Array) -> Array:
  """``K r`` for ``r [N, C]``: traced ``[N, N]`` acts per column; full contracts ``(j, b)``."""
  if kernel.ndim == 2:
    return jnp.matmul(kernel, r, precision=_HIGHEST)
  return jnp.einsum("ijab,jb->ia", kernel, r, precision=_HIGHEST)


def _ce_residual(f: Array, targets: Array, weights: Array) -> Array:
  return (jax.nn.softmax(f, axis=-1) - targets) * weights[:, None]


def _tau_slots(taus: tuple[int, ...], steps: np.ndarray) -> np.ndarray:
  """Grid slot each step writes to: the first ``τ >= step``.

  Writing the running value unconditionally into that slot after every step
  leaves slot ``k`` holding the value at exactly ``taus[k]`` (its last write),
  with no branch in the loop body (a ``cond`` under ``vmap`` would become a
  select over the whole ``[T, N, C]`` buffer every step).
  """
  return np.searchsorted(np.asarray(taus), steps, side="left").astype(np.int32)


# ----------------------------------------------------------------------------
# Cross-entropy evolution.


def evolve_ce_euler(kernel: Array, f0: Array, targets: Array, mask: Array, *, lr,
                    taus: Sequence[int]) -> Evolution:
  """Exact function-space gradient descent on the mean cross-entropy.

  ``f_{s+1} = f_s - (lr/N) K (softmax(f_s) - Y)`` for ``s < τ_max``, one
  ``lax.scan`` of ``τ_max`` kernel products, keeping only the grid readouts.

  Args:
    kernel: ``[N, N]`` traced or ``[N, N, C, C]`` full kernel at the linearisation point.
    f0: ``[N, C]`` function values (logits) at the linearisation point.
    targets: ``[N, C]`` float target rows (one-hot or soft).
    mask: ``[N]`` bool, True for real samples.
    lr: step size ``η`` (float or traced scalar).
    taus: static strictly ascending positive ints (the candidate grid, ``T`` of them).

  Returns:
    :class:`Evolution` with ``[T, N, C]`` fields. Memory ``O(T·N·C + N²)``.
  """
  taus = check_taus(taus)
  p = _prepare(kernel, f0, targets, mask)
  step = jnp.asarray(lr, p.f0.dtype) / p.n
  slots = _tau_slots(taus, np.arange(1, taus[-1] + 1))
  if p.kernel.ndim == 2:
    return _euler_traced(p, step, slots, len(taus))
  buffer = jnp.zeros((len(taus),) + p.f0.shape, p.f0.dtype)

  def body(carry, slot):
    f, s_run, s_buf, f_buf = carry
    r = _ce_residual(f, p.targets, p.weights)
    s_run = s_run + r
    f = f - step * _apply_kernel(p.kernel, r)
    s_buf = jax.lax.dynamic_update_index_in_dim(s_buf, s_run, slot, axis=0)
    f_buf = jax.lax.dynamic_update_index_in_dim(f_buf, f, slot, axis=0)
    return (f, s_run, s_buf, f_buf), None

  init = (p.f0, jnp.zeros_like(p.f0), buffer, buffer)
  (_, _, s_buf, f_buf), _ = jax.lax.scan(body, init, slots)
  return Evolution(s_buf, f_buf)


def _euler_traced(p: _Problem, step: Array, slots: np.ndarray, num_taus: int) -> Evolution:
  """The Euler loop for a traced kernel, in output-major ``[C, N]`` layout.

  The loop is ``τ_max`` products of the ``[N, N]`` kernel with a thin residual
  and is bound by streaming the kernel from memory. ``r [C, N] @ K`` (which
  contracts the kernel's leading axis) runs faster on XLA:CPU than ``K @ r
  [N, C]``; it equals ``(K r)ᵀ`` because ``K`` is symmetric -- made exactly
  symmetric here, a change at rounding level only.
  """
  kernel = 0.5 * (p.kernel + p.kernel.T)
  targets, weights = p.targets.T, p.weights[None, :]
  buffer = jnp.zeros((num_taus,) + targets.shape, p.f0.dtype)

  def body(carry, slot):
    f, s_run, s_buf, f_buf = carry
    r = (jax.nn.softmax(f, axis=0) - targets) * weights
    s_run = s_run + r
    f = f - step * jnp.matmul(r, kernel, precision=_HIGHEST)
    s_buf = jax.lax.dynamic_update_index_in_dim(s_buf, s_run, slot, axis=0)
    f_buf = jax.lax.dynamic_update_index_in_dim(f_buf, f, slot, axis=0)
    return (f, s_run, s_buf, f_buf), None

  init = (p.f0.T, jnp.zeros_like(targets), buffer, buffer)
  (_, _, s_buf, f_buf), _ = jax.lax.scan(body, init, slots)
  return Evolution(jnp.swapaxes(s_buf, 1, 2), jnp.swapaxes(f_buf, 1, 2))


def _ode_block(taus: tuple[int, ...]) -> int:
  """Largest divisor of every ``τ`` that is at most ``_ODE_MAX_BLOCK``."""
  g = math.gcd(*taus)
  return max(b for b in range(1, min(g, _ODE_MAX_BLOCK) + 1) if g % b == 0)


def evolve_ce_ode(kernel: Array, f0: Array, targets: Array, mask: Array, *, lr,
                  taus: Sequence[int], rtol: float = 1e-7, atol: float = 1e-9,
                  max_steps: int = 4096) -> Evolution:
  """Cross-entropy gradient flow integrated with diffrax (Dopri5 + PID control).

  Solves ``df/dt = -(1/N) K (softmax(f) - Y)`` and reads it out at ``t = sη``.
  Time is measured in step units ``u = t/η`` (``df/du = -(η/N) K (...)``), which
  leaves the tolerances (on ``f``) unchanged and keeps the readout times static.
  ``S_τ = Σ_{s<τ} (softmax(f(sη)) - Y)`` (left Riemann sum, as the reference code).

  The ``[0, τ_max]`` horizon is cut into blocks of ``B`` unit intervals (``B``
  divides every ``τ``, at most 32); a ``lax.scan`` solves one block per
  iteration, carrying ``f``, the running sum and the solver/controller state (so
  the solver continues rather than restarts), and saving only ``B`` readouts. Memory
  ``O((T + B)·N·C + N²)``.

  Args: as :func:`evolve_ce_euler`, plus ``rtol``/``atol`` of the PID controller and
    ``max_steps`` per block.

  Returns:
    :class:`Evolution` with ``[T, N, C]`` fields.
  """
  taus = check_taus(taus)
  p = _prepare(kernel, f0, targets, mask)
  dtype = p.f0.dtype
  rate = jnp.asarray(lr, dtype) / p.n
  block = _ode_block(taus)
  num_blocks = taus[-1] // block
  slots = _tau_slots(taus, block * np.arange(1, num_blocks + 1))

  term = diffrax.ODETerm(lambda u, f, args: -rate * _apply_kernel(p.kernel, _ce_residual(
      f, p.targets, p.weights)))
  solver = diffrax.Dopri5()
  # RMS error norm over the real rows only: padded rows never move, and
  # counting them would dilute the norm and change the step sizes.
  num_entries = p.n * p.f0.shape[-1]
  masked_rms = lambda e: jnp.sqrt(jnp.sum(jnp.square(e) * p.weights[:, None]) / num_entries)
  controller = diffrax.PIDController(rtol=rtol, atol=atol, norm=masked_rms)
  offsets = jnp.arange(block, dtype=dtype)

  def solve_block(f, u0, solver_state, controller_state):
    saveat = diffrax.SaveAt(
        subs=[diffrax.SubSaveAt(ts=u0 + offsets,
                                fn=lambda u, y, args: _ce_residual(y, p.targets, p.weights)),
              diffrax.SubSaveAt(t1=True)],
        solver_state=True, controller_state=True)
    sol = diffrax.diffeqsolve(term, solver, u0, u0 + block, None, f, saveat=saveat,
                              stepsize_controller=controller, max_steps=max_steps,
                              solver_state=solver_state, controller_state=controller_state)
    readouts, f_end = sol.ys
    return f_end[-1], readouts.sum(axis=0), sol.solver_state, sol.controller_state

  # The first block runs outside the scan: it creates the solver/controller
  # states whose structure the scan carry needs.
  f, s_run, solver_state, controller_state = solve_block(p.f0, jnp.zeros((), dtype), None, None)
  buffer = jnp.zeros((len(taus),) + p.f0.shape, dtype)
  s_buf = jax.lax.dynamic_update_index_in_dim(buffer, s_run, slots[0], axis=0)
  f_buf = jax.lax.dynamic_update_index_in_dim(buffer, f, slots[0], axis=0)

  def body(carry, xs):
    f, s_run, s_buf, f_buf, solver_state, controller_state = carry
    index, slot = xs
    f, s_block, solver_state, controller_state = solve_block(
        f, (index * block).astype(dtype), solver_state, controller_state)
    s_run = s_run + s_block
    s_buf = jax.lax.dynamic_update_index_in_dim(s_buf, s_run, slot, axis=0)
    f_buf = jax.lax.dynamic_update_index_in_dim(f_buf, f, slot, axis=0)
    return (f, s_run, s_buf, f_buf, solver_state, controller_state), None

  if num_blocks > 1:
    xs = (jnp.arange(1, num_blocks, dtype=jnp.int32), slots[1:])
    init = (f, s_run, s_buf, f_buf, solver_state, controller_state)
    (f, s_run, s_buf, f_buf, _, _), _ = jax.lax.scan(body, init, xs)
  # Padded rows never move (zero kernel rows), but keep them exactly zero.
  w = p.weights[None, :, None]
  return Evolution(s_buf * w, f_buf * w)


# ----------------------------------------------------------------------------
# Mean-squared-error evolution (closed form).


def _full_to_matrix(kernel: Array) -> Array:
  n, _, c, _ = kernel.shape
  return kernel.transpose(0, 2, 1, 3).reshape(n * c, n * c)


def _spectral_factors(x: Array, taus: tuple[int, ...], form: str) -> tuple[Array, Array]:
  """Per-eigenvalue decay ``[T, K]`` and summed residual ``[T, K]`` for scaled eigenvalues ``x = ελ``.

  discrete: decay ``(1-x)^τ``, sum ``Σ_{s<τ} (1-x)^s = (1 - (1-x)^τ)/x``;
  continuous: decay ``e^{-xτ}``, sum ``∫_0^τ e^{-xu} du = (1 - e^{-xτ})/x``.
  Both sums tend to ``τ`` as ``x -> 0``; ``log1p``/``expm1`` keep small ``x`` accurate
  (the naive forms cancel catastrophically in float32).
  """
  tau = jnp.asarray(taus, x.dtype)[:, None]
  zero = x <= 0
  x_safe = jnp.where(zero, 1, x)
  if form == "continuous":
    decay = jnp.exp(-x * tau)
    total = jnp.where(zero, tau, -jnp.expm1(-x_safe * tau) / x_safe)
    return decay, total
  # Discrete: (1 - x)^τ. For x < 1 via log1p; for x >= 1 (oscillating or
  # divergent GD; 1 - x <= 0) via |1 - x|^τ with the sign of the integer power.
  small = x < 1
  log_q = jnp.log1p(-jnp.where(small, x, 0))
  decay_small = jnp.exp(tau * log_q)
  q = 1 - x
  odd = (np.asarray(taus)[:, None] % 2) == 1
  sign = jnp.where((q < 0) & odd, -1.0, 1.0).astype(x.dtype)
  decay_large = sign * jnp.exp(tau * jnp.log(jnp.abs(jnp.where(small, 1, q))))
  decay = jnp.where(small, decay_small, decay_large)
  total_small = -jnp.expm1(tau * log_q) / x_safe
  total = jnp.where(zero, tau, jnp.where(small, total_small, (1 - decay) / x_safe))
  return decay, total


def evolve_mse_closed_form(kernel: Array, f0: Array, targets: Array, mask: Array, *, lr,
                           taus: Sequence[int], form: str = "discrete") -> Evolution:
  """Linearised gradient descent / flow on ``(1/(2NC)) Σ (f - Y)²`` in closed form.

  With ``ε = lr/(N·C)`` and ``K = U diag(λ) Uᵀ`` (one ``eigh``; ``λ`` clipped at 0):
  ``r_τ = U g(λ) Uᵀ r_0`` and ``S_τ = U h(λ) Uᵀ r_0`` with ``g, h`` from
  :func:`_spectral_factors` (``form='discrete'``: GD with step ``lr``;
  ``'continuous'``: gradient flow in step units). A full kernel is
  diagonalised as its ``[N·C, N·C]`` sample-major matrix.

  Returns:
    :class:`Evolution`: ``residual_sums [T, N, C]`` and ``f_at_taus = Y + r_τ``.
  """
  taus = check_taus(taus)
  _check_choice("mse_form", form, MSE_FORMS)
  p = _prepare(kernel, f0, targets, mask)
  n, c = p.f0.shape
  eps = jnp.asarray(lr, p.f0.dtype) / (p.n * c)
  r0 = p.f0 - p.targets
  matrix = p.kernel if p.kernel.ndim == 2 else _full_to_matrix(p.kernel)
  lam, vecs = jnp.linalg.eigh(matrix)
  decay, total = _spectral_factors(eps * jnp.maximum(lam, 0), taus, form)
  if p.kernel.ndim == 2:
    coords = jnp.matmul(vecs.T, r0, precision=_HIGHEST)                       # [N, C]
    back = lambda g: jnp.einsum("nk,tk,kc->tnc", vecs, g, coords, precision=_HIGHEST)
  else:
    coords = jnp.matmul(vecs.T, r0.reshape(-1), precision=_HIGHEST)           # [N*C]
    back = lambda g: jnp.einsum("mk,tk,k->tm", vecs, g, coords,
                                precision=_HIGHEST).reshape(len(taus), n, c)
  w = p.weights[None, :, None]
  residual_sums = back(total) * w
  f_at_taus = (p.targets[None] + back(decay)) * w
  return Evolution(residual_sums, f_at_taus)


def evolve(kernel: Array, f0: Array, targets: Array, mask: Array, *, lr, taus: Sequence[int],
           loss: str = "ce", solver: str = "euler", mse_form: str = "discrete",
           ode_rtol: float = 1e-7, ode_atol: float = 1e-9) -> Evolution:
  """Dispatches to the CE Euler / CE ODE / MSE closed-form evolution (see module docstring)."""
  _check_choice("loss", loss, LOSSES)
  _check_choice("solver", solver, SOLVERS)
  _check_choice("mse_form", mse_form, MSE_FORMS)
  if loss == "mse":
    if solver == "ode":
      raise ValueError("solver='ode' is only defined for loss='ce'; the MSE evolution is always "
                       "the closed form (choose mse_form='discrete' or 'continuous')")
    return evolve_mse_closed_form(kernel, f0, targets, mask, lr=lr, taus=taus, form=mse_form)
  if solver == "ode":
    return evolve_ce_ode(kernel, f0, targets, mask, lr=lr, taus=taus, rtol=ode_rtol,
                         atol=ode_atol)
  return evolve_ce_euler(kernel, f0, targets, mask, lr=lr, taus=taus)


# ----------------------------------------------------------------------------
# Weight updates.


def _scale(lr, norm, dtype) -> Array:
  return -jnp.asarray(lr, dtype) / jnp.asarray(norm, dtype)


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
  return _deltas_from_pullback(pullback, residual_sums.astype(out.dtype),
                               _scale(lr, norm, out.dtype))


def weight_update_from_jacobian(jac, residual_sums: Array, lr, norm):
  """``Δw_t = -(lr/norm) Jᵀ S_t`` from an explicit Jacobian pytree.

  For paths that hold a (possibly compressed or projected) Jacobian anyway
  (CP-NTK-FL, SPARK's projection): ``jac`` leaves are ``[N, C, *leaf_shape]``.

  Returns:
    pytree like ``jac`` with leaves ``[T, *leaf_shape]``.
  """
  scale = _scale(lr, norm, residual_sums.dtype)

  def contract(j):
    if j.shape[:2] != residual_sums.shape[1:]:
      raise ValueError(f"jacobian leaves must be [N, C, ...] = {residual_sums.shape[1:]} + ..., "
                       f"got {j.shape}")
    return scale * jnp.tensordot(residual_sums, j, axes=([1, 2], [0, 1]), precision=_HIGHEST)

  return jax.tree_util.tree_map(contract, jac)


# ----------------------------------------------------------------------------
# Losses and τ selection.


def mean_loss(logits: Array, targets: Array, mask: Array, loss: str = "ce") -> Array:
  """Mean training loss over the real samples.

  ``'ce'``: ``mean_i -Σ_c Y_ic log softmax(f_i)_c`` (soft targets allowed);
  ``'mse'``: ``(1/(2NC)) Σ_{i,c} (f_ic - Y_ic)²``. Rows with ``mask`` False are
  excluded (``where``, so garbage there cannot leak in as NaN).
  """
  _check_choice("loss", loss, LOSSES)
  if loss == "ce":
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
    raise ValueError(f"losses must be [T]={len(taus),}, got {losses.shape}")
  index = jnp.argmin(jnp.where(jnp.isnan(losses), jnp.inf, losses))
  return TauChoice(index.astype(jnp.int32), jnp.asarray(taus, jnp.int32)[index], losses[index])


# ----------------------------------------------------------------------------
# The client update.


def _mask_inputs(x: Array, mask: Array) -> Array:
  return jnp.where(mask.astype(bool).reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)


def ntk_delta_from_kernel(apply_fn: ApplyFn, params, x: Array, targets: Array, mask: Array,
                          kernel: Array, *, lr, taus: Sequence[int], loss: str = "ce",
                          solver: str = "euler", select: str = "network",
                          mse_form: str = "discrete", ode_rtol: float = 1e-7,
                          ode_atol: float = 1e-9, start=None):
  """The NTK weight update for a precomputed kernel (traced ``[N, N]`` or full ``[N, N, C, C]``).

  Evolves, forms every candidate ``Δw_τ`` by one vmapped VJP, scores the
  candidates and returns the chosen one.

  ``start`` (default: ``params``) is the network the evolution starts from and
  the candidates are added to, while the kernel and the Jacobians stay at the
  linearisation point ``params``. NTK-DFL's Jacobian batching uses it: each
  block starts from the already updated weights but keeps the round's
  linearisation point.

  Returns:
    ``(delta_params, info)``: ``delta_params`` like ``params``; ``info`` has
    ``'tau'`` (int32), ``'loss'`` (the chosen score), ``'losses'`` ``[T]`` (the
    selection scores) and ``'linearized_losses'`` ``[T]`` (loss of ``f_τ``).
  """
  taus = check_taus(taus)
  kernel_kind = "traced" if kernel.ndim == 2 else "full"
  _check_options(loss=loss, solver=solver, select=select, kernel=kernel_kind, mse_form=mse_form)
  _check_lr(lr)
  if x.shape[:1] != mask.shape or targets.shape[:1] != mask.shape:
    raise ValueError(f"x {x.shape}, targets {targets.shape} and mask {mask.shape} must share N")
  mask = mask.astype(bool)
  x = _mask_inputs(x, mask)
  f0, pullback = jax.vjp(lambda p: apply_fn(p, x), params)
  base = params if start is None else start
  if start is not None:
    f0 = apply_fn(start, x)
  targets = targets.astype(f0.dtype)
  evo = evolve(kernel, f0, targets, mask, lr=lr, taus=taus, loss=loss, solver=solver,
               mse_form=mse_form, ode_rtol=ode_rtol, ode_atol=ode_atol)
  n = jnp.maximum(mask.sum(), 1)
  norm = n if loss == "ce" else n * f0.shape[-1]
  deltas = _deltas_from_pullback(pullback, evo.residual_sums, _scale(lr, norm, f0.dtype))

  score = lambda logits: mean_loss(logits, targets, mask, loss)
  linearized_losses = jax.vmap(score)(evo.f_at_taus)
  if select == "network":
    add = lambda d: jax.tree_util.tree_map(jnp.add, base, d)
    losses = jax.vmap(lambda d: score(apply_fn(add(d), x)))(deltas)
  else:
    losses = linearized_losses
  choice = select_tau(losses, taus)
  delta = jax.tree_util.tree_map(lambda d: d[choice.index], deltas)
  info = {"tau": choice.tau, "loss": choice.loss, "losses": losses,
          "linearized_losses": linearized_losses}
  return delta, info


def ntk_delta(apply_fn: ApplyFn, params, x: Array, targets: Array, mask: Array, *, lr,
              taus: Sequence[int], loss: str = "ce", solver: str = "euler", dense_stack=None,
              kernel_impl: str = "auto", kernel: str = "traced", select: str = "network",
              mse_form: str = "discrete", ode_rtol: float = 1e-7, ode_atol: float = 1e-9,
              start=None):
  """One NTK client update: kernel at ``params`` on ``x``, evolution, ``τ`` selection.

  Args:
    apply_fn: ``apply_fn(params, x) -> logits [N, C]``.
    params: linearisation point (for NTK-DFL: the receiving client's averaged weights).
    x: ``[N, *in]`` inputs (own plus neighbours' data for NTK-DFL).
    targets: ``[N, C]`` float rows (one-hot or soft).
    mask: ``[N]`` bool, True for real samples.
    lr: ``η`` (float or traced scalar, e.g. ``η·exp(-decay·r)``).
    taus: static strictly ascending positive ints.
    loss: ``'ce'`` or ``'mse'``; solver: ``'euler'`` or ``'ode'`` (CE only).
    dense_stack, kernel_impl: forwarded to :func:`ntk_fl.ntk.empirical_ntk`.
    kernel: ``'traced'`` (``[N, N]``) or ``'full'`` (``[N, N, C, C]``).
    select: ``'network'`` or ``'linearized'``; mse_form: ``'discrete'`` or ``'continuous'``.
    ode_rtol, ode_atol: tolerances of the ODE solver.
    start: optional network the evolution starts from and the candidates are
      added to (default ``params``); see :func:`ntk_delta_from_kernel`.

  Returns:
    ``(delta_params, info)`` as :func:`ntk_delta_from_kernel`.
  """
  _check_options(loss=loss, solver=solver, select=select, kernel=kernel, mse_form=mse_form)
  check_taus(taus)
  _check_lr(lr)
  from ntk_fl import ntk  # pylint: disable=import-outside-toplevel

  mask = jnp.asarray(mask).astype(bool)
  x_real = _mask_inputs(x, mask)
  k = ntk.empirical_ntk(apply_fn, params, x_real, trace_outputs=(kernel == "traced"),
                        implementation=kernel_impl, dense_stack=dense_stack)
  return ntk_delta_from_kernel(apply_fn, params, x_real, targets, mask, k, lr=lr, taus=taus,
                               loss=loss, solver=solver, select=select, mse_form=mse_form,
                               ode_rtol=ode_rtol, ode_atol=ode_atol, start=start)


def ntk_update(apply_fn: ApplyFn, params, x: Array, targets: Array, mask: Array, *, lr,
               taus: Sequence[int], loss: str = "ce", solver: str = "euler", dense_stack=None,
               kernel_impl: str = "auto", kernel: str = "traced", select: str = "network",
               mse_form: str = "discrete", ode_rtol: float = 1e-7, ode_atol: float = 1e-9):
  """:func:`ntk_delta` applied: returns ``(params + delta_params, info)``."""
  delta, info = ntk_delta(apply_fn, params, x, targets, mask, lr=lr, taus=taus, loss=loss,
                          solver=solver, dense_stack=dense_stack, kernel_impl=kernel_impl,
                          kernel=kernel, select=select, mse_form=mse_form, ode_rtol=ode_rtol,
                          ode_atol=ode_atol)
  return jax.tree_util.tree_map(jnp.add, params, delta), info
