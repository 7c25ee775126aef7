"""Shared Gaussian random projections of Jacobians (SPARK, arXiv 2512.12737, App. A.2).

A client sends ``J̃ = J P`` instead of its Jacobian ``J [N, C, d]``; the
receiver evolves with the sketched kernel ``J̃ J̃ᵀ`` and maps the sketched update
back, ``Δw = P Δw̃``. ``P`` is block-diagonal over the parameter tensors
("layers") of the model and never transmitted: every client regenerates the
same blocks from the run seed and the layer's name.

Schemes (``SCHEMES``):

* ``'layerwise'`` (paper Eqs. 2-5): each tensor is projected along its
  *input-feature axis* with ``P_l [d_in, k_l]``, ``k_l = min(d_in, k_proj)``;
  the other axes (``o_l`` entries) are kept, so ``d_proj = Σ_l o_l k_l``. The
  paper's "last parameter axis" is the input axis of PyTorch's ``(out, in)``
  layout; flax ``Dense`` kernels are ``(in, out)``, so here the projected axis
  is axis ``ndim - 2`` (``0`` for a dense kernel, the input channels of an HWIO
  convolution) and axis ``0`` for 1-D tensors (a bias: ``o = 1``,
  ``d_in = size``) -- spark.md §5 item 24(a).
* ``'flattened'`` (App. A.2): the whole tensor is vectorised and sketched,
  ``P_l [size_l, k_l]``, ``k_l = min(size_l, k_proj)``.
* ``'none'``: ``P = I`` (the paper's main experiments).

``P_l`` has i.i.d. ``N(0, 1/k_l)`` entries, so ``E[P_l P_lᵀ] = I`` and sketched
inner products are unbiased (Johnson-Lindenstrauss). A tensor whose cap does
not compress it (``k_l = d_in``) is left unprojected by default
(``skip_uncompressed=True``): a square Gaussian would add distortion and save
nothing (spark.md §5 item 24(c)); ``skip_uncompressed=False`` is the literal
formula. With every tensor skipped the sketch is exactly the identity.

Seeds: the key of tensor ``name`` (its ``/``-joined pytree path, e.g.
``params/dense_0/kernel``) is ``rng.jax_key(seed, Stream.PROJECTION, h)`` with
``h`` the first 31 bits of ``SHA-256(f"{seed}|{name}")`` -- the paper's
``Hash(s_global || name_l)`` routed through the run's table of random streams.

:func:`dense_stack_projections` hands a layer-wise sketch of a dense stack to
:func:`ntk_fl.ntk.projected_dense_ntk`, the structured kernel in sketch
coordinates (no per-sample Jacobians). :func:`sketched_dense_jacobian` forms
``J̃`` of a dense stack explicitly from the Jacobian's factors, for any scheme
(the flattened one and the compression stack need it).

Everything works on the *leaves* of a parameter pytree in
``jax.tree.leaves`` order. A :class:`LeafSketch` plan is static (shapes, axes,
sizes: close over it); the matrices are arrays (pass them to jitted code as
arguments). Memory: a flattened sketch of the 784×100 MLP kernel at
``k_proj = 10,000`` is a 78,400 × 10,000 matrix (3.1 GB float32), generated
once per run and shared by all clients.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from ntk_fl import rng, validation
from ntk_fl._src.dense_stack import DenseStack
from ntk_fl._src.kernels import DenseProjection
from ntk_fl._src.param_map import ParamMap
from ntk_fl._src.projected_kernel import dense_jacobian_factors

__all__ = [
  "SCHEMES",
  "LeafSketch",
  "leaf_names",
  "make_plan",
  "layer_key",
  "sample_matrices",
  "project_leaf",
  "back_project_leaf",
  "project_jacobian",
  "back_project",
  "sketch_dims",
  "compression_ratio",
  "lift",
  "sketch_map",
  "dense_matrix",
  "dense_stack_projections",
  "sketched_dense_jacobian",
]

SCHEMES = ("none", "layerwise", "flattened")
_HIGHEST = jax.lax.Precision.HIGHEST


class LeafSketch(NamedTuple):
  """Static description of one tensor's sketch.

  Attributes:
    name: ``/``-joined pytree path of the tensor.
    shape: the tensor's shape.
    kind: ``'identity'`` (not projected), ``'axis'`` (layer-wise) or ``'flat'`` (flattened).
    axis: the projected axis (``'axis'`` only; ``-1`` otherwise).
    d_in: size of the projected dimension (axis length, or the tensor size for ``'flat'``).
    k: sketch size ``k_l`` (``d_in`` for ``'identity'``).
  """

  name: str
  shape: tuple[int, ...]
  kind: str
  axis: int
  d_in: int
  k: int

  @property
  def projected_shape(self) -> tuple[int, ...]:
    if self.kind == "flat":
      return (self.k,)
    if self.kind == "axis":
      return self.shape[: self.axis] + (self.k,) + self.shape[self.axis + 1 :]
    return self.shape


def _path_name(path) -> str:
  parts = []
  for entry in path:
    parts.append(str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))))
  return "/".join(parts)


def leaf_names(params) -> tuple[str, ...]:
  """The ``/``-joined path of every leaf of ``params`` (``jax.tree.leaves`` order)."""
  return tuple(_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _input_axis(ndim: int) -> int:
  return 0 if ndim <= 1 else ndim - 2


def make_plan(
  params, scheme: str, k_proj: int, *, skip_uncompressed: bool = True
) -> tuple[LeafSketch, ...]:
  """The static sketch plan of every leaf of ``params`` (arrays or ``ShapeDtypeStruct``s).

  Args:
    params: a parameter pytree (only shapes are read).
    scheme: one of :data:`SCHEMES`.
    k_proj: the cap ``k_proj >= 1`` (ignored for ``'none'``).
    skip_uncompressed: leave a tensor unprojected when its cap does not compress it.
  """
  validation.check_choice("scheme", scheme, SCHEMES)
  if scheme != "none":
    validation.check_int("k_proj", k_proj, low=1)
  validation.check_bool("skip_uncompressed", skip_uncompressed)
  plan = []
  for name, leaf in zip(leaf_names(params), jax.tree.leaves(params)):
    shape = tuple(int(s) for s in leaf.shape)
    if scheme == "none" or not shape:
      plan.append(LeafSketch(name, shape, "identity", -1, math.prod(shape), math.prod(shape)))
      continue
    if scheme == "layerwise":
      axis, kind = _input_axis(len(shape)), "axis"
      d_in = shape[axis]
    else:
      axis, kind = -1, "flat"
      d_in = math.prod(shape)
    k = min(d_in, int(k_proj))
    if k == d_in and skip_uncompressed:
      plan.append(LeafSketch(name, shape, "identity", -1, math.prod(shape), math.prod(shape)))
    else:
      plan.append(LeafSketch(name, shape, kind, axis, d_in, k))
  return tuple(plan)


def layer_key(seed: int, name: str) -> jax.Array:
  """The key of tensor ``name``: ``Hash(seed || name)`` folded into the PROJECTION stream."""
  digest = hashlib.sha256(f"{int(seed)}|{name}".encode()).digest()
  index = int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
  return rng.jax_key(seed, rng.Stream.PROJECTION, index)


def sample_matrices(plan: Sequence[LeafSketch], seed: int, dtype=jnp.float32) -> tuple[Any, ...]:
  """``P_l [d_in, k_l]`` with i.i.d. ``N(0, 1/k_l)`` entries per projected leaf; ``None`` for identity leaves."""
  out = []
  for sketch in plan:
    if sketch.kind == "identity":
      out.append(None)
    else:
      normal = jax.random.normal(layer_key(seed, sketch.name), (sketch.d_in, sketch.k), dtype)
      out.append(normal / jnp.sqrt(jnp.asarray(sketch.k, dtype)))
  return tuple(out)


def project_leaf(sketch: LeafSketch, matrix, x, lead: int = 0):
  """``x P``: a full tensor ``x [*lead, *shape]`` -> ``[*lead, *projected_shape]``.

  For a Jacobian leaf ``[N, C, *shape]`` pass ``lead=2``.
  """
  if sketch.kind == "identity":
    return x
  if sketch.kind == "flat":
    flat = x.reshape(x.shape[:lead] + (-1,))
    return jnp.matmul(flat, matrix, precision=_HIGHEST)
  moved = jnp.moveaxis(x, lead + sketch.axis, -1)
  return jnp.moveaxis(jnp.matmul(moved, matrix, precision=_HIGHEST), -1, lead + sketch.axis)


def back_project_leaf(sketch: LeafSketch, matrix, x, lead: int = 0):
  """``P x̃``: a sketched tensor ``[*lead, *projected_shape]`` -> ``[*lead, *shape]`` (paper Eq. 17)."""
  if sketch.kind == "identity":
    return x
  if sketch.kind == "flat":
    full = jnp.matmul(x, matrix.T, precision=_HIGHEST)
    return full.reshape(x.shape[:lead] + sketch.shape)
  moved = jnp.moveaxis(x, lead + sketch.axis, -1)
  return jnp.moveaxis(jnp.matmul(moved, matrix.T, precision=_HIGHEST), -1, lead + sketch.axis)


def project_jacobian(
  plan: Sequence[LeafSketch], matrices, jac_leaves, lead: int = 2
) -> tuple[Any, ...]:
  """``J̃ = J P`` leaf by leaf (``jac_leaves [N, C, *shape]`` in ``jax.tree.leaves`` order)."""
  return tuple(project_leaf(s, m, j, lead) for s, m, j in zip(plan, matrices, jac_leaves))


def back_project(
  plan: Sequence[LeafSketch], matrices, tilde_leaves, lead: int = 0
) -> tuple[Any, ...]:
  """``Δw = P Δw̃`` leaf by leaf."""
  return tuple(back_project_leaf(s, m, t, lead) for s, m, t in zip(plan, matrices, tilde_leaves))


def sketch_dims(plan: Sequence[LeafSketch]) -> tuple[int, int]:
  """``(d_full, d_proj)``: parameters before and entries after the sketch (paper Eq. 4's sums)."""
  d_full = sum(math.prod(s.shape) for s in plan)
  d_proj = sum(math.prod(s.projected_shape) for s in plan)
  return d_full, d_proj


def compression_ratio(plan: Sequence[LeafSketch]) -> float:
  """``ρ = d_proj / d_full`` (paper Eq. 4)."""
  d_full, d_proj = sketch_dims(plan)
  return d_proj / d_full


def lift(apply_fn: Callable, params, plan: Sequence[LeafSketch], matrices):
  """The network in sketch coordinates: ``g(u, x) = f(w̄ + P u, x)`` and ``u0 = 0``.

  ``∂g/∂u`` at ``u0`` is exactly ``J P = J̃``, so the NTK of ``g`` is the sketched
  kernel ``J̃ J̃ᵀ = J P Pᵀ Jᵀ`` and a VJP of ``g`` is ``J̃ᵀ v`` -- neither ``J``
  nor ``J̃`` is ever materialised.

  Returns:
    ``(g, u0)``: ``g(u, x) -> logits``; ``u0`` a tuple of zero leaves of the
    projected shapes.
  """
  leaves, treedef = jax.tree.flatten(params)

  def g(u, x):
    full = back_project(plan, matrices, u)
    return apply_fn(jax.tree.unflatten(treedef, [w + d for w, d in zip(leaves, full)]), x)

  u0 = tuple(jnp.zeros(s.projected_shape, leaf.dtype) for s, leaf in zip(plan, leaves))
  return g, u0


def sketch_map(apply_fn: Callable, params, plan: Sequence[LeafSketch], matrices) -> ParamMap:
  """The sketch as the coordinates of an NTK step (:func:`ntk_fl.evolve.ntk_step`'s ``param_map``).

  The network :func:`lift`-ed to ``g(u) = f(w̄ + P u)`` at ``u0 = 0`` (its kernel is the sketched one and
  its VJPs give ``J̃ᵀ v``), and the back-projection ``Δw = P Δu`` of the candidate updates (leading ``[T]``
  axis) into ``params``' structure.
  """
  g, u0 = lift(apply_fn, params, plan, matrices)
  treedef = jax.tree.structure(params)
  to_params = lambda tilde: jax.tree.unflatten(
    treedef, back_project(plan, matrices, tuple(tilde), lead=1)
  )
  return ParamMap(g, u0, to_params)


def dense_matrix(plan: Sequence[LeafSketch], matrices) -> jax.Array:
  """The effective ``[d_full, d_proj]`` matrix ``P`` (Def. 4.1) -- for tests and small models only."""
  blocks = []
  for sketch, matrix in zip(plan, matrices):
    n_in = math.prod(sketch.projected_shape)
    basis = jnp.eye(n_in, dtype=jnp.float32).reshape((n_in,) + sketch.projected_shape)
    block = back_project_leaf(sketch, matrix, basis, lead=1).reshape(n_in, -1).T  # [size, n_in]
    blocks.append(block)
  return jax.scipy.linalg.block_diag(*blocks)


def dense_stack_projections(
  plan: Sequence[LeafSketch], matrices, stack: DenseStack
) -> tuple[DenseProjection, ...]:
  """The sketch as per-layer :class:`ntk_fl.ntk.DenseProjection` s for :func:`ntk_fl.ntk.projected_dense_ntk`.

  Layer ``l`` of ``stack`` owns the leaves named ``.../<layer>/kernel`` and
  ``.../<layer>/bias``; a ``'layerwise'`` sketch of a ``[in, out]`` kernel acts on
  axis 0 (its input axis) and of a bias on its only axis, which is exactly
  what ``DenseProjection`` describes. Identity leaves map to ``None``.

  Raises:
    ValueError: a ``'flat'`` sketch (the flattened scheme mixes a tensor's axes:
      no per-layer factorisation), or a sketched tensor that is not a kernel or
      bias of ``stack``.
  """
  by_name = {}
  for sketch, matrix in zip(plan, matrices):
    if sketch.kind == "flat":
      raise ValueError(
        f"tensor {sketch.name!r} has a flattened sketch: the structured projected kernel needs "
        "the 'layerwise' scheme (use the generic kernel of the lifted network)"
      )
    by_name[tuple(sketch.name.split("/")[-2:])] = (sketch, matrix)
  used, out = set(), []
  for layer in stack.layers:
    parts = {}
    for part in ("kernel", "bias"):
      entry = by_name.get((layer, part))
      if entry is None:
        raise ValueError(
          f"dense_stack layer {layer!r} has no '{part}' among the sketched tensors "
          f"{[s.name for s in plan]}"
        )
      sketch, matrix = entry
      used.add((layer, part))
      if sketch.kind == "identity":
        parts[part] = None
      elif sketch.axis != 0 or len(sketch.shape) != (2 if part == "kernel" else 1):
        raise ValueError(
          f"tensor {sketch.name!r} (shape {sketch.shape}) is sketched along axis {sketch.axis}; "
          "a dense kernel [in, out] must be sketched along axis 0 and a bias along its only axis"
        )
      else:
        parts[part] = matrix
    out.append(DenseProjection(**parts))
  stray = [s.name for key, (s, _) in by_name.items() if key not in used and s.kind != "identity"]
  if stray:
    raise ValueError(
      f"sketched tensors {stray} are not kernels or biases of the dense stack {stack.layers}"
    )
  return tuple(out)


def _layer_of(sketch: LeafSketch, stack: DenseStack) -> tuple[int, str]:
  """``(layer index, 'kernel' | 'bias')`` of a leaf named ``.../<layer>/<part>``."""
  parts = sketch.name.split("/")
  layer, part = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
  if layer not in stack.layers or part not in ("kernel", "bias"):
    raise ValueError(
      f"tensor {sketch.name!r} is not a kernel or bias of the dense stack {stack.layers}"
    )
  return stack.layers.index(layer), part


def _sketched_leaf(sketch: LeafSketch, matrix, part: str, a, m, sample_block: int):
  """One leaf of ``J̃`` ``[N, C, *projected_shape]`` from ``A [N, in]`` and ``M [N, out, C]``."""
  if part == "bias":  # ∂f_c/∂b[q] = M[q, c]; any sketch of a 1-D tensor is P_b
    if sketch.kind == "identity":
      return jnp.swapaxes(m, 1, 2)
    return jnp.einsum("nqc,qk->nck", m, matrix, precision=_HIGHEST)
  if sketch.kind == "identity":  # ∂f_c/∂W[p, q] = A[p] M[q, c]
    return jnp.einsum("np,nqc->ncpq", a, m, precision=_HIGHEST)
  if sketch.kind == "axis":  # the input axis: (A P)[k] M[q, c]
    return jnp.einsum(
      "nk,nqc->nckq", jnp.matmul(a, matrix, precision=_HIGHEST), m, precision=_HIGHEST
    )
  # Flattened (row-major [in, out] -> p·out + q): J̃[c, k] = Σ_q M[q, c] Σ_p A[p] P[p, q, k]. Contracting A
  # first costs in·out·k per sample, C times less than projecting the C rows of J; blocks of samples bound
  # the [block, out, k] intermediate.
  n_in, n_out = sketch.shape
  stacked = matrix.reshape(n_in, n_out * sketch.k)

  def one_sample(a_n, m_n):
    t = jnp.matmul(a_n, stacked, precision=_HIGHEST).reshape(n_out, sketch.k)
    return jnp.einsum("qk,qc->ck", t, m_n, precision=_HIGHEST)

  return jax.lax.map(
    lambda args: one_sample(*args), (a, m), batch_size=min(sample_block, a.shape[0])
  )


def sketched_dense_jacobian(
  plan: Sequence[LeafSketch], matrices, stack: DenseStack, params, x, *, sample_block: int = 32
) -> tuple[Any, ...]:
  """``J̃ = J P`` of a dense stack, per sample, assembled from the Jacobian's factors.

  Equals :func:`project_jacobian` of the per-sample Jacobian (and the Jacobian
  of :func:`lift`'s ``g``) without differentiating through ``P``: with
  ``∂f_c/∂W_l[p, q] = A_l[p] M_l[q, c]`` (:func:`ntk_fl.ntk.dense_jacobian_factors`),
  a flattened sketch of ``W_l`` costs ``in_l·out_l·k_l`` per sample (``A_l``
  is contracted with ``P_l`` first) instead of ``C·in_l·out_l·k_l``; layer-wise
  and identity leaves are outer products of the factors.

  Args:
    plan: the sketch plan of ``params`` (every leaf a kernel or bias of ``stack``).
    matrices: :func:`sample_matrices` of ``plan``.
    stack: the model's :class:`~ntk_fl.models.DenseStack`.
    params: the linearisation point ``w̄`` (flax variables dict).
    x: ``[N, *in]`` inputs.
    sample_block: samples per block of a flattened leaf (bounds its
      ``[block, out_l, k_l]`` intermediate).

  Returns:
    ``J̃`` leaves ``[N, C, *projected_shape]`` in ``plan`` (``jax.tree.leaves``) order.

  Raises:
    ValueError: a leaf that is not a kernel or bias of ``stack``, a ``plan`` that
      does not match ``params``, a bad ``sample_block``.
  """
  validation.check_int("sample_block", sample_block, low=1)
  shapes = tuple(tuple(int(s) for s in leaf.shape) for leaf in jax.tree.leaves(params))
  if shapes != tuple(s.shape for s in plan):
    raise ValueError(
      f"plan is for tensors of shapes {[s.shape for s in plan]}, params have {list(shapes)}"
    )
  factors = dense_jacobian_factors(stack, params, x)
  out = []
  for sketch, matrix in zip(plan, matrices):
    layer, part = _layer_of(sketch, stack)
    out.append(
      _sketched_leaf(
        sketch, matrix, part, factors.inputs[layer], factors.outputs[layer], sample_block
      )
    )
  return tuple(out)
