"""SPARK's kernel pieces for a dense stack in layer-wise sketch coordinates (public in :mod:`ntk_fl.ntk`).

:func:`projected_dense_ntk` is the structured kernel in the sketch coordinates and
:func:`dense_jacobian_factors` the factors ``(A_l, M_l)`` the sketch (:mod:`ntk_fl.projection`) assembles
``J P`` from. They sit here, beside the kernels they contract, so that the sketch loads neither the NTK
step nor the public kernel module.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from ntk_fl._src import kernels as _kernels
from ntk_fl._src.dense_stack import DenseStack
from ntk_fl._src.kernels import DenseJacobianFactors

__all__ = ["dense_jacobian_factors", "projected_dense_ntk"]

Params = Any


def dense_jacobian_factors(stack: DenseStack, params: Params, x: jax.Array) -> DenseJacobianFactors:
  """The factors ``(A_l, M_l)`` of a dense stack's per-sample Jacobian at ``params`` on ``x [N, *in]``.

  ``O(N · Σ_l (in_l + out_l·C))`` floats instead of the ``N·C·d`` of the
  Jacobian itself: a sketch ``J P`` can be assembled from them without
  differentiating through ``P`` (:func:`ntk_fl.projection.sketched_dense_jacobian`).

  Raises:
    ValueError: params that do not match ``stack``, inputs of the wrong width.
  """
  if not isinstance(stack, DenseStack):
    raise ValueError(f"stack must be an ntk_fl.models.DenseStack, got {type(stack).__name__}")
  _kernels.check_inputs(x, None)
  kernels, biases = _kernels.dense_weights(stack, params)
  feat = math.prod(x.shape[1:])
  if feat != kernels[0].shape[0]:
    raise ValueError(
      f"dense Jacobian factors: inputs have {feat} features per sample (shape {x.shape[1:]}) "
      f"but the first layer {stack.layers[0]!r} takes {kernels[0].shape[0]}"
    )
  return _kernels.jacobian_factors(stack, kernels, biases, x)


def projected_dense_ntk(
  stack: DenseStack,
  params: Params,
  x1: jax.Array,
  x2: jax.Array | None = None,
  *,
  projections,
  trace_outputs: bool = True,
  chunk_size: int | None = None,
) -> jax.Array:
  """NTK of a dense stack in layer-wise sketch coordinates: ``J̃ J̃ᵀ`` with ``J̃ = J P`` (SPARK).

  ``P = blkdiag(P_l ⊗ I, P_b)`` sketches each layer's kernel along its input
  axis and its bias (:class:`~ntk_fl.ntk.DenseProjection`; ``ntk_fl.projection``'s
  ``'layerwise'`` scheme). With ``z_l = A_l W_l + b_l`` and the output
  Jacobians ``M_l = ∂f/∂z_l`` ``[out_l, C]``, the Jacobian entries are
  ``∂f_c/∂W_l[p, q] = A_l[p] M_l[q, c]`` and ``∂f_c/∂b_l[q] = M_l[q, c]``. In
  sketch coordinates (``W = W̄ + P_l U``, ``b = b̄ + P_b u``):

  * ``∂f_c/∂U[k, q] = (A_l P_l)[k] M_l[q, c]`` -- the kernel part keeps its
    factorisation with ``A_l`` replaced by ``Ã_l = A_l P_l``;
  * ``∂f_c/∂u[k] = (P_bᵀ M_l[:, c])[k]`` -- the bias part is no longer the
    ``+1`` of ``(A A'ᵀ + 1)``, but the Gram matrix of ``P_bᵀ M_l``.

  Hence the traced kernel is
  ``Σ_l (Ã_l Ã_l'ᵀ) ⊙ S_l + (1/C) Σ_c (P_bᵀ M_l[:, c]) (P_bᵀ M_l'[:, c])ᵀ``
  (``S_l`` as in the structured kernel; the second term is ``S_l`` itself when
  the bias is not sketched), and the full kernel is the same with the output
  axes kept. Cost ``2·N1·N2·Σ_l (k_l + out_l·C)``: for the 784-100-10 MLP with
  ``k = 500`` about the structured kernel's, instead of the per-sample
  Jacobians of a generic implementation on the lifted network. The flattened
  sketch mixes a tensor's input and output axes and has no such factorisation.

  Args:
    stack: the model's :class:`~ntk_fl.models.DenseStack`.
    params: the linearisation point ``w̄`` (flax variables dict), where ``u = 0``.
    x1: ``[N1, *in]`` inputs.
    x2: ``[N2, *in]`` inputs, or ``None`` for ``x2 = x1``.
    projections: one :class:`~ntk_fl.ntk.DenseProjection` (or ``None``) per layer of ``stack``.
    trace_outputs: ``[N1, N2]`` traced (mean over outputs) or ``[N1, N2, C, C]`` full kernel.
    chunk_size: blocks the contraction over rows of ``x1`` (as ``'structured'``).

  Raises:
    ValueError: a projection that does not match its layer, params that do not
      match ``stack``, inputs of the wrong width, a bad ``chunk_size``.
  """
  if not isinstance(stack, DenseStack):
    raise ValueError(f"stack must be an ntk_fl.models.DenseStack, got {type(stack).__name__}")
  _kernels.check_chunk_size(chunk_size)
  _kernels.check_inputs(x1, x2)
  kernels, biases = _kernels.dense_weights(stack, params)
  projections = _kernels.check_projections(stack, kernels, tuple(projections))
  feat = math.prod(x1.shape[1:])
  if feat != kernels[0].shape[0]:
    raise ValueError(
      f"projected structured NTK: inputs have {feat} features per sample (shape "
      f"{x1.shape[1:]}) but the first layer {stack.layers[0]!r} takes {kernels[0].shape[0]}"
    )
  features = lambda x: _kernels.projected_features(
    stack, kernels, biases, projections, x, trace_outputs
  )
  contract = _kernels.projected_contract(trace_outputs, kernels[-1].shape[1])
  f1 = features(x1)
  f2 = f1 if x2 is None else features(x2)
  return _kernels.map_blocks(lambda f1b: contract(f1b, f2), f1, chunk_size)
