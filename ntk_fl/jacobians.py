"""Explicit per-sample Jacobians and the CP-NTK-FL client-side transforms.

Most of ``ntk_fl`` never forms a Jacobian: kernels come from the structured /
NTK-vector-product implementations of :mod:`ntk_fl.ntk` and weight updates are
VJPs (:mod:`ntk_fl.evolve`). A Jacobian has to exist only where it is
*transmitted* and altered on the way -- CP-NTK-FL's sparsified and quantised
uploads (Yue et al. 2022, Sec. 4.2), SPARK's
projected Jacobians, and the reconstruction attack that inverts them. This
module holds those pieces as small pure functions (``jit``/``vmap``-able,
no Python loops over samples):

* :func:`per_sample_jacobian` -- ``∂f_c(x_i)/∂w`` as a params-shaped pytree of
  ``[N, C, *leaf]`` arrays, materialised ``chunk_size`` samples at a time;
  :func:`flatten_jacobian` / :func:`unflatten_jacobian` convert to and from the
  flat ``[N, C, d]`` layout (leaf order of ``jax.tree.leaves``, the order of
  ``jax.flatten_util.ravel_pytree``); :func:`flat_jacobian` does both at once.
* :func:`jacobian_kernel` -- the NTK from explicit (possibly compressed)
  Jacobians: traced ``(1/C) Σ_c J_c J_cᵀ`` ``[N1, N2]`` or full ``[N1, N2, C, C]``.

SPARK's sketched Jacobians of a non-dense model and the transmitted (compressed) Jacobians call them;
:mod:`ntk_fl.ntk`'s ``'jacobian'`` implementation forms the same Jacobians with the sample axis last
(its contraction is a faster GEMM on a CPU that way; ``ntk_fl._src.kernels.sample_last_jacobian``).
* Input projection (CP-NTK-FL's seeded ``Z = X P``): :func:`projection_matrix`,
  :func:`project_inputs` and :func:`fold_projection` (``P`` folded into the
  first dense layer, so a model trained on ``d1'``-dim projected inputs is
  evaluated on raw inputs by the unmodified ``d1``-input network).
* :func:`subsample` -- a fraction ``β`` of one client's real samples.
* :func:`sparsify_rows` -- magnitude top-k of every ``(sample, output)`` row.
* :func:`quantize_kept` -- ``b``-bit min-max quantisation of the kept values.
* :func:`shuffle_rows` -- the shuffling server's synchronised permutation.

Memory: a flat Jacobian is ``N·C·d`` floats (784-100-10 MLP: 3.2 MB per sample
in float32; d1' = 200 projection: 0.84 MB). :func:`per_sample_jacobian` keeps
one chunk's Jacobians (``chunk_size·C·d`` floats; default below ``2**26``
floats = 256 MiB) live beyond the output.
"""

from __future__ import annotations

import math
import numbers
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ntk_fl import compression, rng, validation
from ntk_fl._src.kernels import (
  flat_jacobian,
  flatten_jacobian,
  jacobian_kernel,
  per_sample_jacobian,
  unflatten_jacobian,
)

__all__ = [
  "PROJECTION_SCALES",
  "per_sample_jacobian",
  "flatten_jacobian",
  "unflatten_jacobian",
  "flat_jacobian",
  "jacobian_kernel",
  "projection_matrix",
  "project_inputs",
  "fold_projection",
  "subsample",
  "num_subsampled",
  "sparsify_rows",
  "quantize_kept",
  "shuffle_rows",
]

PROJECTION_SCALES = ("sqrt_input", "none")
"""Scale of the Gaussian projection ``P``: ``1/sqrt(d1)`` (keeps ``‖z‖ ≈ ‖x‖/sqrt(d1)·sqrt(d1')``, i.e.
unit-variance features for standardised inputs) or none (the paper as printed; ``z`` then has
variance ``≈ d1``, 784 for images, which saturates a Kaiming-initialised network)."""

_HIGHEST = jax.lax.Precision.HIGHEST

Array = jax.Array
ApplyFn = Callable[[Any, Array], Array]


# ----------------------------------------------------------------------------
# Jacobians: per_sample_jacobian, flatten_jacobian, unflatten_jacobian, flat_jacobian and jacobian_kernel
# are defined with the kernels that contract them (``ntk_fl._src.kernels``) and re-exported above.


# ----------------------------------------------------------------------------
# Input projection.


def projection_matrix(
  key, input_dim: int, proj_dim: int, *, scale: str = "sqrt_input", dtype=jnp.float32
) -> Array:
  """The shared random projection ``P [d1, d1']`` with i.i.d. standard normal entries.

  Every client and the evaluator derive the same ``P`` from the same key (the
  paper's seed ``ρ`` handed out by a trusted key server; here
  ``rng.jax_key(seed, Stream.PROJECTION)``).

  Args:
    key: PRNG key.
    input_dim: ``d1`` (flattened input size).
    proj_dim: ``d1'`` (the model's input size); any positive int (``< d1`` for a
      non-invertible projection, which is the privacy argument).
    scale: one of :data:`PROJECTION_SCALES`.
  """
  validation.check_int("input_dim", input_dim, low=1)
  validation.check_int("proj_dim", proj_dim, low=1)
  validation.check_choice("projection scale", scale, PROJECTION_SCALES)
  p = jax.random.normal(key, (input_dim, proj_dim), dtype)
  return p / jnp.sqrt(jnp.asarray(input_dim, dtype)) if scale == "sqrt_input" else p


def project_inputs(x: Array, projection: Array) -> Array:
  """``Z = X P``: ``x [..., d1]`` -> ``[..., d1']`` (full float32 precision on accelerators)."""
  if x.shape[-1] != projection.shape[0]:
    raise ValueError(
      f"inputs have {x.shape[-1]} features but the projection expects {projection.shape[0]} "
      "(flatten the inputs first)"
    )
  return jnp.matmul(x, projection, precision=_HIGHEST)


def fold_projection(params, projection: Array, *, layer: str = "dense_0"):
  """Params of the ``d1``-input network equal to ``params`` applied after the projection.

  A dense first layer computes ``(x P) W + b = x (P W) + b``, so replacing its
  ``kernel [d1', h]`` by ``P @ kernel [d1, h]`` gives a network on raw inputs
  that agrees with the projected one (up to float rounding). ``params`` is a
  flax variables dict (``params['params'][layer]['kernel']``); leading batch
  axes on the kernel (e.g. a client axis) are allowed.
  """
  inner = params["params"]
  if layer not in inner or "kernel" not in inner[layer]:
    raise ValueError(
      f"fold_projection: params have no dense layer {layer!r} with a 'kernel' "
      f"(layers: {sorted(inner)})"
    )
  kernel = inner[layer]["kernel"]
  if kernel.shape[-2] != projection.shape[1]:
    raise ValueError(
      f"layer {layer!r} takes {kernel.shape[-2]} inputs but the projection gives "
      f"{projection.shape[1]}"
    )
  folded = jnp.matmul(projection, kernel, precision=_HIGHEST)
  return {**params, "params": {**inner, layer: {**inner[layer], "kernel": folded}}}


# ----------------------------------------------------------------------------
# Subsampling, sparsification, quantisation, shuffling.


def num_subsampled(num_real, fraction: float):
  """``max(1, floor(fraction · n))`` samples kept of ``n`` (int or int array)."""
  if isinstance(num_real, numbers.Integral):
    return max(1, math.floor(fraction * num_real + 1e-9))
  return jnp.maximum(jnp.floor(fraction * num_real + 1e-6), 1).astype(jnp.int32)


def subsample(key, mask: Array, fraction: float) -> tuple[Array, Array]:
  """A uniform random ``β = fraction`` share of one client's real samples.

  Args:
    key: PRNG key (CP-NTK-FL redraws the subset every round from the round key).
    mask: ``[n_max]`` bool, True for real samples.
    fraction: ``β`` in ``(0, 1]``.

  Returns:
    ``(indices [n_slots], keep [n_slots])`` with ``n_slots = max(1, floor(β·n_max))``
    static: the first ``max(1, floor(β·n))`` slots index distinct real samples
    (uniformly drawn, ``n = mask.sum()``); the rest are masked padding.
  """
  validation.check_real("subsample fraction", fraction, low=0, high=1, low_open=True)
  (n_max,) = mask.shape
  n_slots = num_subsampled(n_max, fraction)
  order = rng.masked_permutation(key, mask)[:n_slots]
  keep = jnp.arange(n_slots) < num_subsampled(mask.sum(), fraction)
  return order.astype(jnp.int32), keep


def sparsify_rows(jac: Array, keep_fraction: float) -> tuple[Array, Array]:
  """Magnitude top-k of every ``(sample, output)`` row of a flat Jacobian ``[..., d]``.

  Each row keeps its ``ceil(keep_fraction · d)`` largest-magnitude entries
  (:func:`ntk_fl.compression.sparsify_topk` along the last axis), so every row
  costs the same number of values and indices. Returns ``(sparse, mask)``.
  """
  return compression.sparsify_topk(jac, keep_fraction, axis=-1)


def quantize_kept(
  values: Array, mask: Array, bits: int, *, key=None, stochastic: bool = False
) -> Array:
  """``b``-bit min-max quantisation of the entries in ``mask`` (one ``lo``/step pair for all of them).

  :func:`ntk_fl.compression.quantize` over the kept values only: the range is
  taken over ``values[mask]`` (entries outside the support are not sent, so
  they must not widen it) and they stay exactly zero.
  """
  mask = jnp.asarray(mask, bool)
  if mask.shape != values.shape:
    raise ValueError(f"mask {mask.shape} must have the shape of values {values.shape}")
  lowest = jnp.min(jnp.where(mask, values, jnp.inf))
  filled = jnp.where(mask, values, jnp.where(jnp.isfinite(lowest), lowest, 0).astype(values.dtype))
  q = compression.quantize(filled, bits, key=key, stochastic=stochastic)
  return jnp.where(mask, q, jnp.zeros_like(q))


def shuffle_rows(key, tree):
  """The shuffling server: one random permutation applied to axis 0 of every leaf of ``tree``.

  Returns ``(permuted_tree, perm)`` with ``permuted[i] = original[perm[i]]``;
  Jacobians, function values, labels and masks permuted together leave the NTK
  update unchanged (``Π`` commutes through ``H -> Π H Πᵀ`` and ``Jᵀ S``).
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError("shuffle_rows needs at least one array")
  n = leaves[0].shape[0]
  if any(leaf.shape[:1] != (n,) for leaf in leaves):
    raise ValueError(
      f"every leaf must share leading axis {n}, got {[leaf.shape for leaf in leaves]}"
    )
  perm = jax.random.permutation(key, n)
  return jax.tree.map(lambda a: a[perm], tree), perm
