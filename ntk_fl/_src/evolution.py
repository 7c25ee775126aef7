"""Function-space evolution under a fixed kernel: the solvers behind :func:`ntk_fl.evolve.evolve`.

Users: import these from :mod:`ntk_fl.evolve`. Conventions (masking, normalisation, the ``τ`` grid
readout) are stated in that module's docstring.
"""

from __future__ import annotations

import math
from typing import NamedTuple
from collections.abc import Sequence

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl._src.kernels import full_to_matrix
from ntk_fl._src.options import Loss, MseForm, Solver, check_loss_solver, check_taus, parse

# Largest block of unit intervals one diffeqsolve call covers in the ODE path:
# bounds the saved readouts to [block, N, C] while letting the adaptive solver
# take steps longer than one unit inside a block.
_ODE_MAX_BLOCK = 32
_HIGHEST = jax.lax.Precision.HIGHEST

Array = jax.Array


class Evolution(NamedTuple):
  """Function-space trajectory, read out on the ``τ`` grid.

  Attributes:
    residual_sums: ``[T, N, C]`` ``S_τ = Σ_{s<τ} r_s`` for each ``τ`` of the grid
      (``r = softmax(f) - Y`` for CE, ``f - Y`` for MSE; zero on padded rows).
    f_at_taus: ``[T, N, C]`` evolved function values ``f_τ`` (zero on padded rows).
  """

  residual_sums: Array
  f_at_taus: Array


def _check_shapes(f0: Array, targets: Array, mask: Array, kernel: Array | None = None) -> None:
  if targets.ndim != 2:
    raise ValueError(f"targets must be [N, C] float rows, got shape {targets.shape}")
  if f0.shape != targets.shape:
    raise ValueError(
      f"function values {f0.shape} and targets {targets.shape} must have equal shapes"
    )
  if mask.shape != targets.shape[:1]:
    raise ValueError(f"mask must be [N]={targets.shape[:1]}, got {mask.shape}")
  if kernel is not None:
    n, c = targets.shape
    if kernel.shape not in ((n, n), (n, n, c, c)):
      raise ValueError(
        f"kernel must be [N, N]={(n, n)} (traced) or [N, N, C, C]={(n, n, c, c)} "
        f"(full), got {kernel.shape}"
      )


# ----------------------------------------------------------------------------
# Masking and kernel application.


class _Problem(NamedTuple):
  kernel: Array  # [N, N] or [N, N, C, C], zero rows/cols on padding
  f0: Array  # [N, C], zero on padding
  targets: Array  # [N, C], zero on padding
  weights: Array  # [N] float 0/1
  n: Array  # scalar float, number of real samples (>= 1)


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


def evolve_ce_euler(
  kernel: Array, f0: Array, targets: Array, mask: Array, *, lr, taus: Sequence[int]
) -> Evolution:
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


def evolve_ce_ode(
  kernel: Array,
  f0: Array,
  targets: Array,
  mask: Array,
  *,
  lr,
  taus: Sequence[int],
  rtol: float = 1e-7,
  atol: float = 1e-9,
  max_steps: int = 4096,
) -> Evolution:
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

  term = diffrax.ODETerm(
    lambda u, f, args: -rate * _apply_kernel(p.kernel, _ce_residual(f, p.targets, p.weights))
  )
  solver = diffrax.Dopri5()
  # RMS error norm over the real rows only: padded rows never move, and
  # counting them would dilute the norm and change the step sizes.
  num_entries = p.n * p.f0.shape[-1]
  masked_rms = lambda e: jnp.sqrt(jnp.sum(jnp.square(e) * p.weights[:, None]) / num_entries)
  controller = diffrax.PIDController(rtol=rtol, atol=atol, norm=masked_rms)
  offsets = jnp.arange(block, dtype=dtype)

  def solve_block(f, u0, solver_state, controller_state):
    saveat = diffrax.SaveAt(
      subs=[
        diffrax.SubSaveAt(
          ts=u0 + offsets, fn=lambda u, y, args: _ce_residual(y, p.targets, p.weights)
        ),
        diffrax.SubSaveAt(t1=True),
      ],
      solver_state=True,
      controller_state=True,
    )
    sol = diffrax.diffeqsolve(
      term,
      solver,
      u0,
      u0 + block,
      None,
      f,
      saveat=saveat,
      stepsize_controller=controller,
      max_steps=max_steps,
      solver_state=solver_state,
      controller_state=controller_state,
    )
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
      f, (index * block).astype(dtype), solver_state, controller_state
    )
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
  if form == MseForm.CONTINUOUS:
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


def evolve_mse_closed_form(
  kernel: Array,
  f0: Array,
  targets: Array,
  mask: Array,
  *,
  lr,
  taus: Sequence[int],
  form: str = "discrete",
) -> Evolution:
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
  form = parse(MseForm, form, "mse_form")
  p = _prepare(kernel, f0, targets, mask)
  n, c = p.f0.shape
  eps = jnp.asarray(lr, p.f0.dtype) / (p.n * c)
  r0 = p.f0 - p.targets
  matrix = p.kernel if p.kernel.ndim == 2 else full_to_matrix(p.kernel)
  lam, vecs = jnp.linalg.eigh(matrix)
  decay, total = _spectral_factors(eps * jnp.maximum(lam, 0), taus, form)
  if p.kernel.ndim == 2:
    coords = jnp.matmul(vecs.T, r0, precision=_HIGHEST)  # [N, C]
    back = lambda g: jnp.einsum("nk,tk,kc->tnc", vecs, g, coords, precision=_HIGHEST)
  else:
    coords = jnp.matmul(vecs.T, r0.reshape(-1), precision=_HIGHEST)  # [N*C]
    back = lambda g: jnp.einsum("mk,tk,k->tm", vecs, g, coords, precision=_HIGHEST).reshape(
      len(taus), n, c
    )
  w = p.weights[None, :, None]
  residual_sums = back(total) * w
  f_at_taus = (p.targets[None] + back(decay)) * w
  return Evolution(residual_sums, f_at_taus)


def evolve(
  kernel: Array,
  f0: Array,
  targets: Array,
  mask: Array,
  *,
  lr,
  taus: Sequence[int],
  loss: Loss | str = Loss.CE,
  solver: Solver | str = Solver.EULER,
  mse_form: MseForm | str = MseForm.DISCRETE,
  ode_rtol: float = 1e-7,
  ode_atol: float = 1e-9,
) -> Evolution:
  """Dispatches to the CE Euler / CE ODE / MSE closed-form evolution (see :mod:`ntk_fl.evolve`)."""
  loss, solver = parse(Loss, loss, "loss"), parse(Solver, solver, "solver")
  mse_form = parse(MseForm, mse_form, "mse_form")
  check_loss_solver(loss, solver)
  if loss == Loss.MSE:
    return evolve_mse_closed_form(kernel, f0, targets, mask, lr=lr, taus=taus, form=mse_form)
  if solver == Solver.ODE:
    return evolve_ce_ode(kernel, f0, targets, mask, lr=lr, taus=taus, rtol=ode_rtol, atol=ode_atol)
  return evolve_ce_euler(kernel, f0, targets, mask, lr=lr, taus=taus)
