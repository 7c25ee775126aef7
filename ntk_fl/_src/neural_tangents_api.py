"""``empirical_ntk_fn``: neural-tangents' empirical-NTK interface over this library's kernels.

neural-tangents (``nt.empirical_ntk_fn``, release 0.6.5) describes an empirical
NTK by the network ``f(params, x)`` and three options, and this module accepts
the same ones with the same meaning:

* ``trace_axes``: output axes of ``f(x)`` (batch axis included) whose pair of
  kernel axes is replaced by its *normalised* trace, i.e. the mean
  ``(1/|T|) Σ_{t ∈ T} <J_t(x1), J_t(x2)>`` over the traced output entries.
  neural-tangents divides by the product of the traced axes' sizes (measured:
  for the 784-100-10 MLP its ``trace_axes=(-1,)`` kernel is exactly one tenth of
  the summed trace of its own full kernel), so ``trace_axes=(-1,)`` on ``[N, C]``
  outputs is this library's traced kernel ``(1/C) Σ_c J_c(x1) J_c(x2)ᵀ``.
* ``diagonal_axes``: output axes whose pair of kernel axes is replaced by its
  diagonal (one axis of that size); ``diagonal_axes=(0,)`` gives the kernel of
  each ``x1[i]`` with ``x2[i]`` only.
* ``vmap_axes``: ``None``, an ``int``, or a triple ``(in_axis, out_axis, {})``:
  the axis of ``x`` and of ``f(x)`` along which samples are independent (``int``
  means both). ``None`` certifies nothing: ``f`` is differentiated on the whole
  input at once.

The kernel's axes follow the output axes of ``f`` in order, each kept axis
twice (``x1``'s, then ``x2``'s), each diagonal axis once, traced axes dropped:
``f(x) [N, C]`` with ``trace_axes=()`` gives ``[N1, N2, C, C]``, and
``f(x) [N, H, W, K]`` with ``trace_axes=(-1,)`` gives ``[N1, N2, H, H, W, W]``.

Computation: the batch axis is moved to the front and every sample's outputs
are flattened, so the kernel is one of :func:`ntk_fl.ntk.empirical_ntk`'s: its
traced kernel when every output axis but the batch axis is traced, otherwise
its full kernel, from which the traces and diagonals over output axes are then
taken (a trace over some but not all output axes therefore costs a full kernel).
A diagonal or trace over the batch axis computes each ``(x1[i], x2[i])`` pair's
kernel only. ``vmap_axes=None`` treats the whole input as one sample.

Differences from neural-tangents, all rejected with an error rather than
approximated: ``x`` and ``f(x)`` must be single arrays (not pytrees); keyword
arguments of ``ntk_fn`` are passed to ``f`` unchanged for both inputs (no
batched keyword arguments, no ``rng`` splitting); ``STRUCTURED_DERIVATIVES``
is this library's layer-wise factorisation (dense layers factorised, other
parameters contracted; :mod:`ntk_fl._src.layerwise`): it needs a batched ``vmap_axes``
and ``[C]`` outputs per sample, and either ``dense_stack`` or an ``f`` that is not
``jax.jit``-compiled (its flax layers are intercepted while it is traced); ``AUTO``
chooses it given ``dense_stack``, or for such an ``f`` when it needs fewer FLOPs.
The default ``vmap_axes=None`` is neural-tangents': it is right for every model, including
those whose outputs depend on the rest of the batch, and costs ``N`` times the work of
``vmap_axes=0``, which certifies independent samples along the leading axis.
"""

from __future__ import annotations

import math
import string
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ntk_fl._src import kernels as _kernels
from ntk_fl._src.dense_stack import DenseStack
from ntk_fl._src.kernels import empirical_ntk
from ntk_fl._src.options import NtkImplementation

__all__ = ["NtkImplementation", "empirical_ntk_fn"]


# Letters for the einsum that takes traces and diagonals ('i', 'j' are the batch axes).
_LETTERS = [c for c in string.ascii_letters if c not in "ij"]


# ----------------------------------------------------------------------------
# Options, checked when the kernel function is made.


def _check_axes(name: str, axes: Any) -> tuple[int, ...]:
  if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
    return (int(axes),)
  if isinstance(axes, (tuple, list)) and all(
    isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in axes
  ):
    return tuple(int(a) for a in axes)
  raise ValueError(f"{name} must be an int or a sequence of ints (output axes of f), got {axes!r}")


def _check_vmap_axes(vmap_axes: Any) -> tuple[int, int] | None:
  if vmap_axes is None:
    return None
  is_int = lambda a: isinstance(a, (int, np.integer)) and not isinstance(a, bool)
  if is_int(vmap_axes):
    return int(vmap_axes), int(vmap_axes)
  if isinstance(vmap_axes, tuple) and len(vmap_axes) == 3:
    in_axis, out_axis, kwargs_axes = vmap_axes
    if kwargs_axes not in (None, {}):
      raise ValueError(
        f"vmap_axes: batched keyword arguments are not supported; the third element "
        f"must be {{}}, got {kwargs_axes!r}"
      )
    if is_int(in_axis) and is_int(out_axis):
      return int(in_axis), int(out_axis)
  raise ValueError(
    f"vmap_axes must be None, an int, or a triple (in_axis: int, out_axis: int, {{}}), "
    f"got {vmap_axes!r}"
  )


def _check_implementation(implementation: Any) -> NtkImplementation:
  allowed = ", ".join(f"{m.name} ({m.value})" for m in NtkImplementation)
  if isinstance(implementation, bool) or not isinstance(implementation, (int, np.integer)):
    raise ValueError(
      f"implementation must be an NtkImplementation or its int value ({allowed}), "
      f"got {implementation!r}"
    )
  try:
    return NtkImplementation(int(implementation))
  except ValueError:
    raise ValueError(
      f"unknown implementation {implementation!r}; choose one of {allowed}"
    ) from None


def _canonical_axes(name: str, axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"{name} {axes}: axis {a} is out of range for outputs of f with {ndim} axes")
  canonical = tuple(a % ndim for a in axes)
  if len(set(canonical)) != len(canonical):
    raise ValueError(f"{name} {axes} names an output axis twice (outputs of f have {ndim} axes)")
  return tuple(sorted(canonical))


def _as_array(name: str, x: Any) -> jax.Array:
  if not isinstance(x, (jax.Array, np.ndarray)):
    raise ValueError(
      f"{name} must be an array (pytree inputs are not supported), got {type(x).__name__}"
    )
  return x


# ----------------------------------------------------------------------------
# Kernel assembly.


def _reduce_output_axes(
  kernel: jax.Array,
  out_shape1: tuple[int, ...],
  out_shape2: tuple[int, ...],
  batch: str,
  batch_position: int | None,
  trace: tuple[int, ...],
  diagonal: tuple[int, ...],
  num_batch_traced: int,
) -> jax.Array:
  """Traces and diagonals over per-sample output axes of a full kernel, axes in ``f``'s order.

  ``kernel`` is ``[N1, N2, O1, O2]`` (``batch='pair'``), ``[N, O, O]``
  (``'diagonal'`` or ``'trace'``) or ``[O1, O2]`` (``'none'``, no batch axis);
  ``O`` is a sample's flattened output of shape ``out_shape``. ``trace`` and
  ``diagonal`` index the per-sample output axes; ``batch_position`` is where the
  batch axis sits among ``f``'s output axes.
  """
  lead = {"pair": 2, "diagonal": 1, "trace": 1, "none": 0}[batch]
  kernel = kernel.reshape(*kernel.shape[:lead], *out_shape1, *out_shape2)
  side1 = _LETTERS[: len(out_shape1)]
  side2 = [
    a if m in trace or m in diagonal else b
    for m, (a, b) in enumerate(zip(side1, _LETTERS[len(out_shape1) :]))
  ]
  lead_in = {"pair": "ij", "diagonal": "i", "trace": "i", "none": ""}[batch]
  lead_out = {"pair": "ij", "diagonal": "i", "trace": "", "none": ""}[batch]
  per_axis = [
    ("" if m in trace else a if m in diagonal else a + b)
    for m, (a, b) in enumerate(zip(side1, side2))
  ]
  if batch_position is not None:
    per_axis.insert(batch_position, lead_out)
  spec = f"{lead_in}{''.join(side1)}{''.join(side2)}->{''.join(per_axis)}"
  size = math.prod(out_shape1[m] for m in trace) * num_batch_traced
  return jnp.einsum(spec, kernel) / size


def _traced_and_diagonal_axes(
  fx1, fx2, trace_axes, diagonal_axes
) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Canonical (non-negative) traced and diagonal output axes, checked against the outputs' shapes."""
  ndim = len(fx1.shape)
  trace = _canonical_axes("trace_axes", trace_axes, ndim)
  diagonal = _canonical_axes("diagonal_axes", diagonal_axes, ndim)
  if set(trace) & set(diagonal):
    raise ValueError(
      f"trace_axes {trace_axes} and diagonal_axes {diagonal_axes} share an output axis"
    )
  for a in trace + diagonal:
    if fx1.shape[a] != fx2.shape[a]:
      raise ValueError(
        f"output axis {a} is traced or diagonal, so f(x1) and f(x2) must agree on it; "
        f"got shapes {fx1.shape} and {fx2.shape}"
      )
  return trace, diagonal


def _batched_kernel(
  f,
  kwargs,
  params,
  x1,
  x2,
  in_axis,
  out_axis,
  trace_axes,
  diagonal_axes,
  implementation,
  dense_stack,
  chunk_size,
):
  fx1 = jax.eval_shape(lambda p, x: f(p, x, **kwargs), params, x1)
  fx2 = fx1 if x2 is None else jax.eval_shape(lambda p, x: f(p, x, **kwargs), params, x2)
  if not isinstance(fx1, jax.ShapeDtypeStruct) or not fx1.shape:
    raise ValueError(
      f"f must return one array with a batch axis (pytree outputs are not supported), got {fx1}"
    )
  ndim = len(fx1.shape)
  if not -ndim <= out_axis < ndim:
    raise ValueError(
      f"vmap_axes: out_axis {out_axis} is out of range for outputs of f of shape {fx1.shape}"
    )
  out_axis %= ndim
  trace, diagonal = _traced_and_diagonal_axes(fx1, fx2, trace_axes, diagonal_axes)

  to_sample_axis = lambda a: a if a < out_axis else a - 1
  out_shape1 = fx1.shape[:out_axis] + fx1.shape[out_axis + 1 :]
  out_shape2 = fx2.shape[:out_axis] + fx2.shape[out_axis + 1 :]
  sample_trace = tuple(to_sample_axis(a) for a in trace if a != out_axis)
  sample_diagonal = tuple(to_sample_axis(a) for a in diagonal if a != out_axis)
  batch = "trace" if out_axis in trace else "diagonal" if out_axis in diagonal else "pair"
  trace_outputs = len(sample_trace) == len(out_shape1) and not sample_diagonal

  impl = implementation
  interceptable = not hasattr(f, "lower")  # a jax.jit-compiled f hides its layers
  structured_applies = (dense_stack is not None or interceptable) and len(out_shape1) == 1
  if impl == NtkImplementation.STRUCTURED_DERIVATIVES and not structured_applies:
    raise ValueError(
      "STRUCTURED_DERIVATIVES needs outputs [C] per sample and a dense_stack or an f "
      f"that is not jax.jit-compiled; got dense_stack={dense_stack!r}, "
      f"jit-compiled f: {not interceptable}, outputs of f of shape {fx1.shape}"
    )
  if impl == NtkImplementation.AUTO and not structured_applies:
    dense_stack = None

  def g(p, xb):  # batch-first inputs -> [B, O] flattened per-sample outputs
    y = f(p, jnp.moveaxis(xb, 0, in_axis), **kwargs)
    y = jnp.moveaxis(y, out_axis, 0)
    return y.reshape(y.shape[0], -1)

  flax_apply = g if structured_applies and dense_stack is None else None

  def kernel_of(a, b):
    return empirical_ntk(
      g,
      params,
      a,
      b,
      trace_outputs=trace_outputs,
      implementation=impl,
      dense_stack=dense_stack,
      flax_apply=flax_apply,
      chunk_size=chunk_size,
    )

  xb1 = jnp.moveaxis(x1, in_axis, 0)
  xb2 = None if x2 is None else jnp.moveaxis(x2, in_axis, 0)
  if batch == "pair":
    kernel = kernel_of(xb1, xb2)
  elif xb2 is None:  # each sample with itself
    kernel = jax.vmap(lambda a: kernel_of(a[None], None)[0, 0])(xb1)
  else:
    kernel = jax.vmap(lambda a, b: kernel_of(a[None], b[None])[0, 0])(xb1, xb2)

  num_batch_traced = xb1.shape[0] if batch == "trace" else 1
  if trace_outputs:
    return jnp.sum(kernel, axis=0) / num_batch_traced if batch == "trace" else kernel
  return _reduce_output_axes(
    kernel, out_shape1, out_shape2, batch, out_axis, sample_trace, sample_diagonal, num_batch_traced
  )


def _unbatched_kernel(
  f, kwargs, params, x1, x2, trace_axes, diagonal_axes, implementation, chunk_size
):
  """``vmap_axes=None``: the whole input is one sample; no independence is assumed."""
  if implementation == NtkImplementation.STRUCTURED_DERIVATIVES:
    raise ValueError(
      "STRUCTURED_DERIVATIVES needs a batched vmap_axes (its factors are per sample: "
      "certify independent samples, e.g. vmap_axes=0), got vmap_axes=None"
    )
  apply = lambda p, x: f(p, x, **kwargs)
  fx1 = jax.eval_shape(apply, params, x1)
  fx2 = fx1 if x2 is None else jax.eval_shape(apply, params, x2)
  if not isinstance(fx1, jax.ShapeDtypeStruct):
    raise ValueError(f"f must return one array (pytree outputs are not supported), got {fx1}")
  ndim = len(fx1.shape)
  trace, diagonal = _traced_and_diagonal_axes(fx1, fx2, trace_axes, diagonal_axes)
  trace_outputs = len(trace) == ndim and not diagonal
  impl = implementation

  if x2 is None:
    g = lambda p, xb: apply(p, xb[0]).reshape(1, -1)
    kernel = empirical_ntk(
      g,
      params,
      x1[None],
      None,
      trace_outputs=trace_outputs,
      implementation=impl,
      chunk_size=chunk_size,
    )[0, 0]
  else:
    # x1 and x2 may differ in shape: one "sample" input is a selector s (0 -> x1, 1 -> x2) and both
    # sides' outputs are zero-padded to a common length; the unselected side has zero Jacobian.
    o1, o2 = math.prod(fx1.shape), math.prod(fx2.shape)
    width = max(o1, o2)

    def g(p, s):
      y1 = jnp.pad(apply(p, x1).reshape(-1), (0, width - o1))
      y2 = jnp.pad(apply(p, x2).reshape(-1), (0, width - o2))
      return jnp.where(s == 0, y1[None], y2[None])

    kernel = empirical_ntk(
      g,
      params,
      jnp.zeros((1, 1), jnp.int32),
      jnp.ones((1, 1), jnp.int32),
      trace_outputs=trace_outputs,
      implementation=impl,
      chunk_size=chunk_size,
    )[0, 0]
    if not trace_outputs:
      kernel = kernel[:o1, :o2]
  if trace_outputs:
    return kernel
  return _reduce_output_axes(kernel, fx1.shape, fx2.shape, "none", None, trace, diagonal, 1)


# ----------------------------------------------------------------------------
# Public API (re-exported by ntk_fl.ntk).


def empirical_ntk_fn(
  f: Callable[..., jax.Array],
  trace_axes: Any = (-1,),
  diagonal_axes: Any = (),
  vmap_axes: Any = None,
  implementation: NtkImplementation | int = NtkImplementation.AUTO,
  *,
  dense_stack: DenseStack | None = None,
  chunk_size: int | None = None,
):
  """Returns ``ntk_fn(x1, x2, params, **apply_fn_kwargs)``, the empirical NTK of ``f`` (neural-tangents' API).

  Args:
    f: ``f(params, x, **kwargs) -> array`` (e.g. a flax ``apply``).
    trace_axes: output axes of ``f(x)`` to replace by their normalised trace
      (mean over those entries; module docstring). Default ``(-1,)``.
    diagonal_axes: output axes to replace by their diagonal. Default ``()``.
    vmap_axes: ``None``, ``int`` or ``(in_axis, out_axis, {})``: the axis of
      ``x`` and of ``f(x)`` along which samples are independent. Default ``None``
      (neural-tangents' default: nothing certified, the whole input differentiated at once;
      ``0`` is ``N`` times cheaper for a model that maps samples independently).
    implementation: an :class:`NtkImplementation` (or its int value).
    dense_stack: the model's :class:`~ntk_fl.models.DenseStack` when ``f`` is
      that dense stack (the dense-stack ``STRUCTURED_DERIVATIVES``, chosen by ``AUTO``).
      Without it, ``STRUCTURED_DERIVATIVES`` is the layer-wise kernel of ``f``'s flax layers.
    chunk_size: samples per block (:func:`ntk_fl.ntk.empirical_ntk`).

  Returns:
    ``ntk_fn(x1, x2, params, **apply_fn_kwargs)``: ``x2=None`` means ``x2 = x1``
    (and shares the work); the kernel has ``f``'s output axes in order, kept
    axes twice, diagonal axes once, traced axes dropped, in the dtype of
    ``f``'s outputs. Pure and ``jit``-able (``jax.jit(ntk_fn)``; keyword
    arguments that are not arrays go in ``static_argnames``).

  Raises:
    ValueError: here, for malformed options; from ``ntk_fn``, for axes out of
      range or shared by ``trace_axes`` and ``diagonal_axes``, traced or
      diagonal axes whose sizes differ between ``f(x1)`` and ``f(x2)``, pytree
      inputs or outputs, ``STRUCTURED_DERIVATIVES`` where it does not apply.
  """
  if not callable(f):
    raise ValueError(f"f must be callable as f(params, x), got {type(f).__name__}")
  trace_axes = _check_axes("trace_axes", trace_axes)
  diagonal_axes = _check_axes("diagonal_axes", diagonal_axes)
  batch_axes = _check_vmap_axes(vmap_axes)
  implementation = _check_implementation(implementation)
  _kernels.check_dense_stack(dense_stack)
  if (
    implementation == NtkImplementation.STRUCTURED_DERIVATIVES
    and dense_stack is None
    and hasattr(f, "lower")
  ):
    raise ValueError(
      "implementation=STRUCTURED_DERIVATIVES needs dense_stack (the model's DenseStack) "
      "or an f that is not jax.jit-compiled (e.g. module.apply, or Model.flax_apply), "
      "whose flax layers the layer-wise kernel intercepts"
    )
  _kernels.check_chunk_size(chunk_size)

  def ntk_fn(x1: jax.Array, x2: jax.Array | None, params: Any, **apply_fn_kwargs) -> jax.Array:
    x1 = _as_array("x1", x1)
    x2 = None if x2 is None else _as_array("x2", x2)
    if batch_axes is None:
      return _unbatched_kernel(
        f, apply_fn_kwargs, params, x1, x2, trace_axes, diagonal_axes, implementation, chunk_size
      )
    in_axis, out_axis = batch_axes
    if not -x1.ndim <= in_axis < x1.ndim:
      raise ValueError(f"vmap_axes: in_axis {in_axis} is out of range for x1 of shape {x1.shape}")
    in_axis %= x1.ndim
    if x2 is not None and (
      x2.ndim != x1.ndim
      or np.delete(x2.shape, in_axis).tolist() != np.delete(x1.shape, in_axis).tolist()
    ):
      raise ValueError(
        f"x1 and x2 must agree on every axis but the batch axis {in_axis}, "
        f"got shapes {x1.shape} and {x2.shape}"
      )
    return _batched_kernel(
      f,
      apply_fn_kwargs,
      params,
      x1,
      x2,
      in_axis,
      out_axis,
      trace_axes,
      diagonal_axes,
      implementation,
      dense_stack,
      chunk_size,
    )

  return ntk_fn
