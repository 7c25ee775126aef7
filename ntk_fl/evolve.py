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

Layers (each pure, ``jit``/``vmap``-able; NTK-DFL vmaps the whole client step):

* :func:`evolve_ce_euler`, :func:`evolve_ce_ode`, :func:`evolve_mse_closed_form`
  and the dispatcher :func:`evolve` -- kernel + initial function values ->
  :class:`Evolution` (``residual_sums [T, N, C]``, ``f_at_taus [T, N, C]``).
* :func:`weight_update_vjp` (``Jᵀ S`` by VJP) and
  :func:`weight_update_from_jacobian` (explicit, possibly compressed ``J``).
* :func:`mean_loss` and :func:`select_tau` -- choosing ``τ``.
* :func:`ntk_step` -- the whole client step (kernel, evolution, candidates,
  scores, choice) with the variable parts as arguments: the kernel, the
  targets, the coordinates (:class:`ParamMap`), the scoring and the start
  point; :func:`ntk_update` applies it.

Options are enums (:class:`Loss`, :class:`Solver`, :class:`Select`,
:class:`Kernel`, :class:`MseForm`; their string values work too), parsed once
where they enter; the ``τ`` grid is checked once (:func:`check_taus` ->
:class:`TauGrid`). The implementations live in the private modules
``ntk_fl._src.evolution`` (solvers) and ``ntk_fl._src.ntk_step`` (the step); this
module is their public face.

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


import jax
import jax.numpy as jnp

from ntk_fl._src.evolution import (
  Evolution,
  evolve,
  evolve_ce_euler,
  evolve_ce_ode,
  evolve_mse_closed_form,
)
from ntk_fl._src.ntk_step import (
  ParamMap,
  TauChoice,
  identity_map,
  mean_loss,
  ntk_step,
  select_tau,
  weight_update_from_jacobian,
  weight_update_vjp,
)
from ntk_fl._src.options import (
  Choice,
  Kernel,
  Loss,
  MseForm,
  Select,
  Solver,
  TauGrid,
  check_loss_solver,
  check_taus,
)

__all__ = [
  "Evolution",
  "TauChoice",
  "TauGrid",
  "ParamMap",
  "Choice",
  "Loss",
  "Solver",
  "Select",
  "Kernel",
  "MseForm",
  "check_taus",
  "check_loss_solver",
  "evolve",
  "evolve_ce_euler",
  "evolve_ce_ode",
  "evolve_mse_closed_form",
  "weight_update_vjp",
  "weight_update_from_jacobian",
  "mean_loss",
  "select_tau",
  "identity_map",
  "ntk_step",
  "ntk_update",
]


def ntk_update(apply_fn, params, x: jax.Array, targets, mask: jax.Array, **step_options):
  """:func:`ntk_step` applied: returns ``(params + delta, info)`` (same arguments)."""
  delta, info = ntk_step(apply_fn, params, x, targets, mask, **step_options)
  return jax.tree_util.tree_map(
    jnp.add, params if step_options.get("start") is None else step_options["start"], delta
  ), info
