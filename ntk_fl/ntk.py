"""Empirical neural tangent kernels, three ways that agree with each other.

For a network ``f(w, x) -> [C]`` with per-output Jacobians ``J_c(x) = ∂f_c/∂w``,

* the **traced** kernel (default) is ``K[i, j] = (1/C) Σ_c <J_c(x1_i), J_c(x2_j)>``
  (``[N1, N2]``): one ``N×N`` kernel applied to every output column, as in both
  authors' reference codes (docs/CONVENTIONS.md, convention 1);
* the **full** kernel is ``K[i, j, a, b] = <J_a(x1_i), J_b(x2_j)>``
  (``[N1, N2, C, C]``, neural-tangents' layout with ``trace_axes=()``);
  :func:`full_to_matrix` turns it into the ``(N1·C) × (N2·C)`` matrix.

The traced kernel is neural-tangents' ``trace_axes=(-1,)`` kernel: neural-tangents
normalises a trace by the number of traced entries, so its traced kernel is the
*mean* over the outputs too (one ``C``-th of the summed trace of its full kernel;
checked against kernels computed by neural-tangents 0.6.5 itself,
``tests/test_neural_tangents_oracle.py``). The mean is also what the NTK-FL/NTK-DFL
evolution ``df/dt = −(1/N) K (softmax(f) − Y)`` was written (and tuned) with.
:func:`empirical_ntk_fn` offers neural-tangents' interface (``trace_axes``,
``diagonal_axes``, ``vmap_axes``, ``NtkImplementation``) over these kernels;
neural-tangents itself is not a dependency (it does not import on current JAX).

Implementations (``implementation=``, an :class:`NtkImplementation` or its string name):

* ``'jacobian'`` -- per-sample Jacobians (``vmap(jacrev)``, the sample axis last:
  ``[C, P_l, N]`` per leaf) contracted leaf by leaf as ``Fᵀ G``, one GEMM per block
  of the parameter axis and the blocks summed pairwise (float32 sums within a few
  ``eps`` of float64). Cost ``2·N1·N2·C·d`` FLOPs traced, ``2·N1·N2·C²·d`` full
  (``d`` = number of parameters). Works for any ``apply_fn``.
* ``'ntvp'`` -- NTK-vector products: the rows of the per-sample Jacobians of ``x2``
  (``vmap`` over samples of ``jacrev``: ``N2·C`` reverse passes of one sample, ``2·N2·C·d``
  FLOPs) are the tangents of a ``vmap``-ed ``jvp`` of the network linearised at ``x1``,
  which maps them to ``J1 J2ᵀ``: ``2·N1·N2·C·d`` FLOPs (one linearised forward pass per
  tangent) for the traced *and* the full kernel, ``C`` times fewer than the full
  ``'jacobian'`` contraction, so it is the generic choice for the full kernel, and for the traced
  kernel of a network without weight reuse up to ``256²`` sample pairs (the same FLOPs as the
  contraction, at a higher rate). The rows
  are never all stored: a ``lax.map`` takes ``x2`` one sample at a time (blocks whose rows
  stay below ``2**20`` floats, 4 MiB), and each sample's ``C`` rows go through the ``jvp``
  at a block of ``b1`` samples of ``x1`` at once, ``b1·b2·C·a`` below ``2**26`` floats,
  ``a`` the values one sample's forward pass produces (784-100-10 MLP: 640, the library's
  CNN: 201,440). Small blocks are the fast schedule on a CPU: the rows stay in cache and
  XLA writes them straight into the ``jvp``'s GEMM operand.
* ``'structured'`` -- for a stack of dense layers (:class:`ntk_fl.models.DenseStack`)
  the kernel factorises over layers (the private ``structured_kernel``); for the
  784-100-10 MLP that is ``≈ 2·N1·N2·(784 + 100 + 100)`` FLOPs, about a thousand
  times fewer than the Jacobian contraction. It reads the weights from
  ``params`` and never calls ``apply_fn``: the caller promises that ``apply_fn``
  *is* that dense stack.
* ``'auto'`` -- ``'structured'`` when ``dense_stack`` is given (or the layer-wise kernel,
  given ``flax_apply``, when it needs fewer FLOPs); otherwise ``'ntvp'`` or ``'jacobian'`` from one
  sample's forward FLOPs ``F`` (XLA's count) against the ``d`` parameters: the full kernel takes
  ``'ntvp'`` when ``F <= C·d`` (its ``≈ N1·N2·C·F`` FLOPs at most half the contraction's
  ``2·N1·N2·C²·d``), the traced kernel when ``F <= 2.5·d`` (at most 1.25× the traced contraction's
  ``2·N1·N2·C·d``: a network that uses each weight once per sample) and ``N1·N2 <= 256²``, else
  ``'jacobian'``.
  Measured (benchmarks/ntk_any_model.py, loaded 2-core CPU): the 784-100-10 MLP (``F = 2.0·d``)
  full at N=50 'ntvp' 0.51 s (neural-tangents' ``NTK_VECTOR_PRODUCTS`` 0.95 s), at N=200 2.9 s
  (5.9 s); traced 'ntvp' against 'jacobian' 0.33 s / 0.96 s at N=50, 10.9 s / 18.4 s at N=200,
  not reliably faster at N=600 (57-152 s / 95-134 s, medians of four 106 s / 122 s); the
  library's CNN (``F = 23·d``: its convolutions reuse their weights) at N=50 'jacobian' 9.8 s vs
  'ntvp' 37.8 s full, 26 s vs 214 s traced.

:func:`projected_dense_ntk` is the structured kernel of a dense stack in
SPARK's layer-wise sketch coordinates (``J̃ J̃ᵀ`` with ``J̃ = J P``), at the
structured kernel's cost.

The ``'jacobian'`` and layer-wise kernels keep all of ``x2``'s per-sample
features (Jacobians, layer factors) when they fit in the **storage budget** and compute
every sample's features once, as neural-tangents does; ``x1``'s follow in one batch or in
blocks as large as the rest of the budget allows. The budget is half of the memory the
default device has available when the kernel is traced (``/proc/meminfo``'s
``MemAvailable`` on a CPU, ``bytes_limit - bytes_in_use`` on an accelerator), at least
``2**28`` values (1 GiB of float32); the environment variable ``NTK_FL_KERNEL_MEMORY``
sets it instead (bytes, or with a ``K``/``M``/``G``/``T`` suffix: ``NTK_FL_KERNEL_MEMORY=4G``).
It bounds one kernel call (a ``vmap`` over ``k`` clients holds up to ``k`` times as much).
Beyond it the kernel is assembled from blocks of at most ``chunk_size`` samples of
``x2`` (``lax.map``) against ``x1`` blocks as large as the budget allows, recomputing the
``x2`` side once per ``x1`` block. The default
block keeps one block's Jacobian under ``2**26`` floats (256 MiB).

The implementations live in the private module ``ntk_fl._src.kernels``; this module is their public face.
Every function is pure and ``jit``/``vmap``-able (NTK-DFL vmaps the kernel over
all clients); there are no Python loops over samples. Contractions run at
``Precision.HIGHEST`` so accelerators do not silently drop to TF32/bf16 passes
(on CPU float32 matmuls are exact float32 anyway).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import jax

from ntk_fl._src import kernels as _kernels
from ntk_fl._src.dense_stack import DenseStack
from ntk_fl._src.kernels import (
  DenseJacobianFactors,
  DenseProjection,
  empirical_ntk,
  full_to_matrix,
  num_params_of,
)
from ntk_fl._src.neural_tangents_api import empirical_ntk_fn
from ntk_fl._src.projected_kernel import dense_jacobian_factors, projected_dense_ntk
from ntk_fl._src.options import IMPLEMENTATIONS, Implementation, NtkImplementation

__all__ = [
  "Implementation",
  "num_params_of",
  "IMPLEMENTATIONS",
  "empirical_ntk",
  "make_ntk_fn",
  "full_to_matrix",
  "DenseProjection",
  "projected_dense_ntk",
  "DenseJacobianFactors",
  "dense_jacobian_factors",
  "NtkImplementation",
  "empirical_ntk_fn",
]

Params = Any
ApplyFn = Callable[[Params, jax.Array], jax.Array]


# ----------------------------------------------------------------------------
# Public API.


def make_ntk_fn(
  apply_fn: ApplyFn,
  *,
  trace_outputs: bool = True,
  implementation: Implementation | str = Implementation.AUTO,
  dense_stack: DenseStack | None = None,
  flax_apply: ApplyFn | None = None,
  chunk_size: int | None = None,
):
  """A ``jit``-compiled ``ntk_fn(params, x1, x2=None)`` with the options fixed (neural-tangents style).

  The options are validated here, before any tracing. ``ntk_fn`` compiles once
  per input shape (and once more for ``x2=None``); see :func:`empirical_ntk` for
  the arguments and the returned kernel.
  """
  impl = _kernels.resolve_implementation(implementation, dense_stack, flax_apply)
  _kernels.check_chunk_size(chunk_size)

  def ntk_fn(params: Params, x1: jax.Array, x2: jax.Array | None = None) -> jax.Array:
    return empirical_ntk(
      apply_fn,
      params,
      x1,
      x2,
      trace_outputs=trace_outputs,
      implementation=impl,
      dense_stack=dense_stack,
      flax_apply=flax_apply,
      chunk_size=chunk_size,
    )

  return jax.jit(ntk_fn)
