"""The implementations behind :mod:`ntk_fl.ntk` and the Jacobians of :mod:`ntk_fl.jacobians` (users: import
them from those modules).

Blocking over samples, the per-sample-Jacobian and NTK-vector-product kernels of any model, and the
structured factorisation of a dense stack (plain and in SPARK's layer-wise sketch coordinates). The
trade-offs between them are documented in :mod:`ntk_fl.ntk` and on :class:`ntk_fl.ntk.NtkImplementation`.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp

from ntk_fl import validation
from ntk_fl._src.cost import xla_flops
from ntk_fl._src.options import IMPLEMENTATIONS, Implementation
from ntk_fl._src.dense_stack import DenseStack

# One block's Jacobian (chunk · C · d floats) stays below this by default.
_BLOCK_FLOATS = 2**26
# The least storage budget (1 GiB float32), whatever the machine reports: small kernels keep their
# one-batch schedule (and their bits) on every machine.
_STORE_FLOATS = 2**28
# Overrides the storage budget (bytes; a K/M/G/T suffix counts in powers of 1024).
MEMORY_ENV = "NTK_FL_KERNEL_MEMORY"
_HIGHEST = jax.lax.Precision.HIGHEST

Params = Any
ApplyFn = Callable[[Params, jax.Array], jax.Array]


# ----------------------------------------------------------------------------
# Validation.


def resolve_implementation(
  implementation: Implementation | str,
  dense_stack: DenseStack | None,
  flax_apply: Callable | None = None,
) -> Implementation:
  """The implementation (``AUTO`` resolved, except between the layer-wise structured kernel and the
  generic ones, which :func:`ntk_fl.ntk.empirical_ntk` decides from the model's layers, and between
  ``'jacobian'`` and ``'ntvp'``, decided there from the model's forward FLOPs,
  :func:`generic_choice`); errors name the bad value and the allowed ones."""
  try:
    if isinstance(implementation, bool):  # an int to the IntEnum, but never meant as a choice
      raise ValueError(implementation)
    implementation = Implementation(implementation)
  except ValueError:
    raise ValueError(
      f"unknown NTK implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
    ) from None
  if implementation == Implementation.STRUCTURED and dense_stack is None and flax_apply is None:
    raise ValueError(
      "implementation='structured' needs dense_stack (the model's DenseStack) or "
      "flax_apply (its flax computation, e.g. module.apply, for the layer-wise kernel); "
      "use 'jacobian' or 'ntvp' otherwise"
    )
  check_dense_stack(dense_stack)
  if flax_apply is not None and not callable(flax_apply):
    raise ValueError(
      f"flax_apply must be callable as flax_apply(params, x), got {type(flax_apply).__name__}"
    )
  if flax_apply is not None and hasattr(flax_apply, "lower"):
    raise ValueError(
      "flax_apply must not be jax.jit-compiled: the layer-wise kernel intercepts its "
      "flax layers while tracing it (pass e.g. module.apply itself)"
    )
  if implementation != Implementation.AUTO:
    return implementation
  if dense_stack is not None:
    return Implementation.STRUCTURED
  return Implementation.AUTO


def check_dense_stack(dense_stack: DenseStack | None) -> None:
  if dense_stack is not None and not isinstance(dense_stack, DenseStack):
    raise ValueError(
      f"dense_stack must be an ntk_fl.models.DenseStack or None, got {type(dense_stack).__name__}"
    )


def check_chunk_size(chunk_size: int | None) -> None:
  if chunk_size is not None and (
    isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
  ):
    raise ValueError(f"chunk_size must be None (automatic) or a positive int, got {chunk_size!r}")


def check_inputs(x1: jax.Array, x2: jax.Array | None) -> None:
  if jnp.ndim(x1) < 1:
    raise ValueError(f"x1 must have a leading batch axis, got shape {jnp.shape(x1)}")
  if x2 is not None and jnp.shape(x2)[1:] != jnp.shape(x1)[1:]:
    raise ValueError(
      f"x1 and x2 must have the same feature shape, got x1 {jnp.shape(x1)} and x2 {jnp.shape(x2)}"
    )


# ----------------------------------------------------------------------------
# The storage budget.


def parse_bytes(text: str) -> int:
  """``'8G'`` -> ``8 · 2**30``: a positive integer of bytes, optionally with a ``K``, ``M``, ``G`` or
  ``T`` suffix (powers of 1024; ``'8GiB'``, ``'8gb'`` too)."""
  match = re.fullmatch(r"\s*(\d+)\s*(?:([KMGT])i?)?B?\s*", text, flags=re.IGNORECASE)
  if match is None or int(match.group(1)) <= 0:
    raise ValueError(
      f"${MEMORY_ENV}={text!r}: expected a positive number of bytes, optionally with a "
      "K, M, G or T suffix (powers of 1024), e.g. 8G"
    )
  unit = match.group(2)
  return int(match.group(1)) * (1 if unit is None else 1024 ** (1 + "KMGT".index(unit.upper())))


def available_bytes() -> int | None:
  """Memory the default device can still give: an accelerator's ``bytes_limit - bytes_in_use``
  (``Device.memory_stats()``), else the host's ``MemAvailable`` (``/proc/meminfo``) or its free
  physical pages; ``None`` where nothing is reported."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    return max(0, int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, AttributeError):
    return None


def store_floats(itemsize: int) -> int:
  """The storage budget: how many per-sample feature values (Jacobians, layer factors) of
  ``itemsize`` bytes one kernel call may keep at once.

  ``$NTK_FL_KERNEL_MEMORY`` bytes when set (``K``/``M``/``G``/``T`` suffixes, :func:`parse_bytes`);
  otherwise half of what the default device has available when the kernel is traced
  (:func:`available_bytes`), and never fewer than ``2**28`` values (1 GiB of float32), so that small
  kernels keep one schedule, and one result to the bit, on every machine. Read when the kernel is
  traced (a ``jit`` keeps the schedule of its first trace). It bounds one kernel call: a ``vmap``
  over ``k`` kernels (clients) holds up to ``k`` times as much.
  """
  text = os.environ.get(MEMORY_ENV, "")
  if text.strip():
    return max(1, parse_bytes(text) // max(1, itemsize))
  return max(_STORE_FLOATS, (available_bytes() or 0) // 2 // max(1, itemsize))


# ----------------------------------------------------------------------------
# Blocking over samples.


def map_blocks(fn: Callable[[Any], Any], xs: Any, chunk: int | None) -> Any:
  """``fn`` applied to row blocks of ``xs`` (pytree, leading axis ``n``), outputs concatenated.

  The rows are split into ``ceil(n / chunk)`` equal blocks (zero-padded at the
  end; padded rows are computed and dropped), so at most ``chunk`` rows are live
  at once and the padding is as small as possible. ``fn`` maps a block
  ``[b, ...]`` to a pytree of ``[b, ...]`` arrays.
  """
  n = jax.tree.leaves(xs)[0].shape[0]
  if chunk is None or chunk >= n:
    return fn(xs)
  num_blocks = -(-n // chunk)
  block = -(-n // num_blocks)
  pad = num_blocks * block - n

  def to_blocks(x):
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(num_blocks, block, *x.shape[1:])

  out = jax.lax.map(fn, jax.tree.map(to_blocks, xs))
  return jax.tree.map(lambda y: y.reshape(num_blocks * block, *y.shape[2:])[:n], out)


def _blocked_kernel(
  features1: Callable[[Any], Any],
  features2: Callable[[Any], Any],
  contract: Callable[[Any, Any], jax.Array],
  x1: Any,
  x2: Any | None,
  chunk: int | None,
  sample_floats: int | None = None,
  itemsize: int = 4,
) -> jax.Array:
  """Kernel ``[N1, N2, ...]`` assembled from blocks ``contract(features1(x1b), features2(x2b))``.

  The storage budget ``B`` is :func:`store_floats` values of ``itemsize`` bytes (half the available
  memory, at least ``2**28``; ``$NTK_FL_KERNEL_MEMORY``), and ``sample_floats`` the values of one
  sample's features (``None``: unknown, never stored). When all of ``x2``'s features fit in ``B``
  they are computed once, in one batch, and contracted against ``x1``'s features, computed once
  too: in one batch when both fit, else in ``x1`` blocks as large as the rest of ``B`` allows; with
  ``x2=None`` every sample's features are computed exactly once. Otherwise ``features1`` runs once
  per ``x1`` block (outer ``lax.map``; blocks of ``B`` less one ``chunk`` when ``sample_floats`` is
  known, else of ``chunk`` samples) and ``features2`` once per block pair (inner ``lax.map``, blocks
  of ``chunk``), which keeps two blocks alive at the price of recomputing the ``x2`` side once per
  ``x1`` block. ``x2=None`` means ``x2 = x1``; with a single block the features are shared.
  """
  n1 = jax.tree.leaves(x1)[0].shape[0]
  if x2 is None:
    if (chunk is None or chunk >= n1) and features1 is features2:
      f = features1(x1)
      return contract(f, f)
  n2 = n1 if x2 is None else jax.tree.leaves(x2)[0].shape[0]
  budget = None if sample_floats is None else store_floats(itemsize)
  sample_floats = max(1, sample_floats or 1)
  if budget is not None and n2 * sample_floats <= budget:
    # One vmap over all of x2 (no lax.map: XLA schedules one large batch best).
    f2 = features2(x1 if x2 is None else x2)
    if x2 is None and features1 is features2:
      return contract(f2, f2)
    left = budget - n2 * sample_floats
    rows = None if n1 * sample_floats <= left else max(chunk or 1, left // sample_floats)
    return map_blocks(lambda x1b: contract(features1(x1b), f2), x1, rows)
  if x2 is None:
    x2 = x1
  # The x1 blocks as large as the budget allows beside one x2 block: the x2 side is recomputed
  # once per x1 block.
  outer = (
    chunk
    if budget is None
    else max(chunk or 1, (budget - (chunk or 1) * sample_floats) // sample_floats)
  )

  def row(x1b):
    f1 = features1(x1b)
    cols = map_blocks(lambda x2b: jnp.swapaxes(contract(f1, features2(x2b)), 0, 1), x2, chunk)
    return jnp.swapaxes(cols, 0, 1)  # [b1, N2, ...]

  return map_blocks(row, x1, outer)


def default_chunk(params: Params, num_outputs: int) -> int:
  num_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  return max(1, _BLOCK_FLOATS // max(1, num_outputs * num_params))


# ----------------------------------------------------------------------------
# 'jacobian': per-sample Jacobians (ntk_fl.jacobians) contracted leaf by leaf.


# The parameter-axis blocks of the sample-last contraction: at least this many terms each ...
_MIN_PARAM_BLOCK = 2048
# ... at most this many ...
_MAX_PARAM_BLOCK = 32768
# ... and otherwise this many per output row or column (the larger side of one block's product), so
# that the per-block products [num_blocks, M1, M2] stay 1/32 of the Jacobians that produce them.
_PARAM_BLOCK_PER_ROW = 32


def sample_last_jacobian(apply_fn: ApplyFn, params: Params, x: jax.Array) -> list[jax.Array]:
  """Per-sample Jacobians with the sample axis last: one ``[C, P_l, N]`` array per parameter leaf
  ``l`` (``P_l`` its size, leaves in ``jax.tree.leaves`` order), all ``N`` samples in one ``vmap``.

  The sample axis is last so that the kernel's contraction over parameters is a product ``Fᵀ G``
  of two ``[K, N]`` matrices. XLA's CPU backend runs that as a GEMM on the stored arrays; the
  sample-major ``F Gᵀ`` of ``[N, K]`` matrices instead goes to a GEMM that wants its right operand
  transposed, and XLA recomputes the whole Jacobian in that transposed order (twice the Jacobian
  writes, one of them strided) before a GEMM about half as fast (docs/neural_tangents.md).
  """
  single = lambda p, xi: apply_fn(p, xi[None])[0]
  jac = jax.vmap(lambda xi: jax.jacrev(single)(params, xi), out_axes=-1)(x)  # [C, *leaf, N]
  return [leaf.reshape(leaf.shape[0], -1, leaf.shape[-1]) for leaf in jax.tree.leaves(jac)]


def param_block(length: int, rows: int) -> tuple[int, int]:
  """``(block, num_blocks)`` for a contraction of ``length`` terms with a ``rows``-wide product.

  ``block`` is the largest divisor of ``length`` not above the target
  ``clip(32 · rows, 2048, 32768)`` (the blocks are then a free reshape), or the target itself when
  ``length`` has no divisor within 4× of it (the parameter axis is zero-padded);
  ``num_blocks = ceil(length / block)``, ``1`` when ``length`` fits one block.
  """
  target = min(_MAX_PARAM_BLOCK, max(_MIN_PARAM_BLOCK, _PARAM_BLOCK_PER_ROW * rows))
  if length <= target:
    return length, 1
  block = next(b for b in range(target, 0, -1) if length % b == 0)
  if 4 * block < target:
    block = target
  return block, -(-length // block)


def pairwise_sum(terms: jax.Array) -> jax.Array:
  """``Σ_b terms[b]`` over the leading axis as a balanced binary tree (``⌈log2 B⌉`` levels of
  halves added elementwise): float rounding grows with ``log B``, not with ``B`` as XLA's
  sequential reduction would."""
  while terms.shape[0] > 1:
    half = terms.shape[0] // 2
    head = terms[:half] + terms[half : 2 * half]
    terms = jnp.concatenate([head, terms[2 * half :]]) if terms.shape[0] % 2 else head
  return terms[0]


def blocked_gram(f1: jax.Array, f2: jax.Array) -> jax.Array:
  """``f1ᵀ f2`` ``[M1, M2]`` of ``f1 [K, M1]`` and ``f2 [K, M2]``, summed over ``K`` in blocks.

  XLA's CPU backend sums a dot product with a small output in one sequential float32 loop (the
  traced diagonal of a 784-100-10 MLP at ``N = 3``: 795,100 terms, 3e-4 relative off the float64
  value). Here ``K`` is cut into :func:`param_block` blocks, each block's ``[M1, M2]`` product is one
  GEMM, and the blocks are added by :func:`pairwise_sum`: a sequential error over at most one
  block, a ``log``-depth one over the blocks (1e-7 relative, the sample-major kernel's accuracy)."""
  length = f1.shape[0]
  block, num_blocks = param_block(length, max(f1.shape[1], f2.shape[1]))
  if num_blocks == 1:
    return jax.lax.dot_general(f1, f2, (((0,), (0,)), ((), ())), precision=_HIGHEST)
  pad = num_blocks * block - length

  def to_blocks(f):
    if pad:
      f = jnp.pad(f, ((0, pad), (0, 0)))
    return f.reshape(num_blocks, block, f.shape[-1])

  # One plain GEMM per block in a loop (lax.map), not one batched dot_general: XLA's CPU backend
  # runs the batched form 1.5-2.5x slower than the single GEMM at N = 200; the loop matches it.
  gram = lambda blocks: jax.lax.dot_general(*blocks, (((0,), (0,)), ((), ())), precision=_HIGHEST)
  return pairwise_sum(jax.lax.map(gram, (to_blocks(f1), to_blocks(f2))))  # [B, M1, M2] summed


def contract_sample_last(
  jac1: list[jax.Array], jac2: list[jax.Array], trace_outputs: bool
) -> jax.Array:
  """The kernel of two :func:`sample_last_jacobian` results: traced ``[N1, N2]``
  ``(1/C) Σ_c <J_c(x1_i), J_c(x2_j)>`` or full ``[N1, N2, C, C]`` ``<J_a(x1_i), J_b(x2_j)>``,
  each leaf's term a :func:`blocked_gram`, the leaves' terms summed in leaf order (as
  :func:`ntk_fl.jacobians.jacobian_kernel`)."""
  terms = []
  for a, b in zip(jac1, jac2):
    c, n1, n2 = a.shape[0], a.shape[-1], b.shape[-1]
    if trace_outputs:  # [C·P, N1]ᵀ [C·P, N2]
      terms.append(blocked_gram(a.reshape(-1, n1), b.reshape(-1, n2)) / c)
    else:  # [P, C·N1]ᵀ [P, C·N2] -> [C, N1, C, N2] -> [N1, N2, C, C]
      f1 = jnp.swapaxes(a, 0, 1).reshape(a.shape[1], c * n1)
      f2 = jnp.swapaxes(b, 0, 1).reshape(b.shape[1], c * n2)
      k = blocked_gram(f1, f2)
      terms.append(jnp.transpose(k.reshape(c, n1, c, n2), (1, 3, 0, 2)))
  out = terms[0]
  for term in terms[1:]:
    out = out + term
  return out


def jacobian_implementation_kernel(apply_fn, params, x1, x2, trace_outputs, chunk):
  # A whole block's Jacobians at once (one vmap): the blocks already bound the memory.
  features = lambda x: sample_last_jacobian(apply_fn, params, x)
  contract = lambda j1, j2: contract_sample_last(j1, j2, trace_outputs)
  out = jax.eval_shape(lambda p, x: apply_fn(p, x), params, x1[:1])
  num_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  return _blocked_kernel(
    features, features, contract, x1, x2, chunk, out.shape[-1] * num_params, out.dtype.itemsize
  )


# ----------------------------------------------------------------------------
# 'ntvp': NTK-vector products (the rows of J(x2) pushed forward through the network linearised at x1).


def jacobian_rows(apply_fn: ApplyFn, params: Params, x: jax.Array) -> Params:
  """The rows of the per-sample Jacobians as tangents: a pytree like ``params`` with leaves
  ``[N·C, *leaf]`` (row ``j·C + b`` is ``∂f_b(x_j)/∂w``).

  One reverse pass per sample and output (``vmap`` over samples of ``jacrev`` of one sample):
  ``N·C`` backward passes of one sample each, ``≈ 2·N·C·d`` FLOPs. (A ``vjp`` of the whole batch
  on the ``N·C`` identity cotangents gives the same rows at ``N`` times the cost: each cotangent
  is zero on all samples but one, yet flows back through all of them.)
  """
  single = lambda p, xi: apply_fn(p, xi[None])[0]
  jac = jax.vmap(lambda xi: jax.jacrev(single)(params, xi))(x)  # leaves [N, C, *leaf]
  return jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[2:]), jac)


def activation_floats(apply_fn: ApplyFn, params: Params, x: jax.Array) -> int:
  """The values every operation of ``apply_fn(params, x)`` produces (``x``: one sample, ``[1, *in]``),
  summed (at least 1): a bound on what one tangent's ``jvp`` keeps per sample."""
  jaxpr = jax.make_jaxpr(apply_fn)(params, x)

  def count(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
      total += sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        total += count(sub)
    return total

  return max(1, count(jaxpr.jaxpr))


# The Jacobian rows of one x2 block stay below this (4 MiB of float32): one sample's rows for the
# 784-100-10 MLP (3.2 MB). Measured on a CPU (benchmarks/RESULTS.md): one sample per block is 2-5x
# faster than blocks of 2 and 2.6-8x faster than one block of all of x2 (the former schedule, 160 MiB
# at N = 50); in every case XLA writes the rows straight into the [d_l, C·P_l] operand of the jvp's
# GEMM, so the difference is (most likely) that one small block stays in cache between that write
# and the GEMM's read, where a large one goes through main memory twice.
_ROW_BLOCK_FLOATS = 2**20


def ntvp_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, chunk_size):
  """``K[i, j, a, b] = (J(x1_i) J(x2_j)ᵀ)[a, b]`` as ``jvp``s: the ``C`` rows of ``J(x2_j)``
  (:func:`jacobian_rows`) are the tangents of one ``vmap``-ed ``jvp`` of the network linearised at
  an ``x1`` block, one ``x2`` sample (or block of samples whose rows fit :data:`_ROW_BLOCK_FLOATS`)
  at a time in a ``lax.map``. Cost ``≈ 2·N1·N2·C·d`` FLOPs (one linearised forward pass of ``x1``
  per tangent) plus ``2·N2·C·d`` per ``x1`` block for the rows: ``C`` times fewer than the full
  Jacobian contraction. Memory: one ``x2`` block's rows and one ``jvp`` block, never all of ``J(x2)``.

  ``x1`` blocks hold at most ``2**26 / (b2·C·act)`` samples (``act``: the values one sample's forward
  pass produces, :func:`activation_floats`; 640 for the 784-100-10 MLP), ``x1`` and ``x2`` blocks at
  most ``chunk_size`` samples when given.
  """
  c = num_outputs
  n1 = x1.shape[0]
  x2 = x1 if x2 is None else x2
  act = activation_floats(apply_fn, params, x1[:1])
  limit = chunk_size or max(n1, x2.shape[0])
  b2 = max(1, min(limit, _ROW_BLOCK_FLOATS // max(1, c * num_params_of(params))))
  b1 = max(1, min(n1, limit, _BLOCK_FLOATS // (b2 * c * act)))

  def x1_block(x1c):
    # The primal forward pass at x1c is shared by every x2 block.
    jvp_fn = jax.linearize(lambda p: apply_fn(p, x1c), params)[1]

    def x2_block(x2b):
      out = jax.vmap(jvp_fn)(jacobian_rows(apply_fn, params, x2b))  # [b2·C, b1, C]
      return out.reshape(x2b.shape[0], c, *out.shape[1:])  # [j, b, i, a]

    return jnp.transpose(map_blocks(x2_block, x2, b2), (2, 0, 1, 3))  # [i, j, b, a]

  out = map_blocks(x1_block, x1, b1)  # [i, j, b, a] = <J_a(x1_i), J_b(x2_j)>
  if trace_outputs:
    return jnp.einsum("ijcc->ij", out) / c
  return jnp.swapaxes(out, 2, 3)  # [i, j, a, b]


# ----------------------------------------------------------------------------
# 'structured': dense-stack factorisation.


class _DenseFeatures(NamedTuple):
  """Per-sample factors of the dense-stack kernel (L = number of layers).

  Attributes:
    inputs: ``A_l`` ``[N, in_l]`` for every layer ``l = 0..L-1`` (layer inputs).
    backs: ``L-1`` output-Jacobian factors at the hidden pre-activations, in the
      form the requested kernel contracts (see :func:`_dense_features`).
  """

  inputs: tuple[jax.Array, ...]
  backs: tuple[jax.Array, ...]


def dense_weights(stack: DenseStack, params: Params) -> tuple[list, list]:
  tree = params["params"] if isinstance(params, Mapping) and "params" in params else params
  kernels, biases = [], []
  for name in stack.layers:
    if name not in tree or "kernel" not in tree[name] or "bias" not in tree[name]:
      raise ValueError(
        f"dense_stack layer {name!r} not found with 'kernel' and 'bias' in params "
        f"(available: {sorted(tree)})"
      )
    kernels.append(tree[name]["kernel"])
    biases.append(tree[name]["bias"])
  for k, (w, b) in enumerate(zip(kernels, biases)):
    if w.ndim != 2 or b.shape != w.shape[1:]:
      raise ValueError(
        f"layer {stack.layers[k]!r}: expected kernel [in, out] and bias [out], "
        f"got {w.shape} and {b.shape}"
      )
    if k and w.shape[0] != kernels[k - 1].shape[1]:
      raise ValueError(
        f"layer {stack.layers[k]!r} takes {w.shape[0]} inputs but "
        f"{stack.layers[k - 1]!r} gives {kernels[k - 1].shape[1]}"
      )
  return kernels, biases


def _dense_features(
  stack: DenseStack, kernels, biases, x: jax.Array, trace_outputs: bool
) -> _DenseFeatures:
  """Forward pass keeping the layer inputs, then the output Jacobians by backward recursion.

  With ``z_l = A_l W_l + b_l``, ``A_{l+1} = σ(z_l)`` and ``D_l = σ'(z_l)``, the
  output Jacobian at ``z_l`` is ``M_l = ∂f/∂z_l`` ``[N, out_l, C]``:
  ``M_{L-1} = I``, ``M_{L-2} = D_{L-2} ⊙ W_{L-1}``,
  ``M_l = D_l ⊙ (W_{l+1} M_{l+1})`` -- all ``C`` outputs at once.

  ``backs[l]`` (``l < L-1``) is ``M_l`` for the full kernel. For the traced one
  only ``Σ_c <M_l(x)[:, c], M_l(x')[:, c]>`` is needed, so ``backs[l]`` is
  ``M_l`` flattened to ``[N, out_l·C]``, except for the last hidden layer where
  ``Σ_c W_{L-1}[q, c]²`` factors out: ``backs = D_{L-2} · ‖W_{L-1}[q]‖``
  ``[N, out_{L-2}]``, a ``C``-fold smaller contraction.
  """
  a = x.reshape(x.shape[0], -1)
  inputs, derivs = [], []
  for k, (w, b) in enumerate(zip(kernels, biases)):
    inputs.append(a)
    if k == len(kernels) - 1:
      break
    z = jnp.matmul(a, w, precision=_HIGHEST) + b
    # σ'(z) of an elementwise σ is one jvp with a ones tangent (same derivative
    # convention as autodiff of the model, e.g. relu'(0) = 0).
    a, d = jax.jvp(stack.activation, (z,), (jnp.ones_like(z),))
    derivs.append(d)
  if not derivs:
    return _DenseFeatures(tuple(inputs), ())

  w_out = kernels[-1]
  m = derivs[-1][:, :, None] * w_out[None]  # M_{L-2}
  ms = [m]
  for d, w in zip(reversed(derivs[:-1]), reversed(kernels[1:-1])):
    m = d[:, :, None] * jnp.einsum("qr,nrc->nqc", w, m, precision=_HIGHEST)
    ms.append(m)
  ms.reverse()
  if not trace_outputs:
    return _DenseFeatures(tuple(inputs), tuple(ms))
  backs = [m.reshape(m.shape[0], -1) for m in ms[:-1]]
  backs.append(derivs[-1] * jnp.sqrt(jnp.sum(w_out * w_out, axis=1)))
  return _DenseFeatures(tuple(inputs), tuple(backs))


class DenseJacobianFactors(NamedTuple):
  """The per-sample Jacobian of a dense stack in factored form (``L`` layers).

  ``∂f_c/∂W_l[p, q] = inputs[l][n, p] · outputs[l][n, q, c]`` and
  ``∂f_c/∂b_l[q] = outputs[l][n, q, c]``.

  Attributes:
    inputs: ``A_l`` ``[N, in_l]``, the layer inputs.
    outputs: ``M_l = ∂f/∂z_l`` ``[N, out_l, C]``, the output Jacobians at the
      pre-activations (``M_{L-1} = I``: the logits are the last layer's outputs).
  """

  inputs: tuple[jax.Array, ...]
  outputs: tuple[jax.Array, ...]


def jacobian_factors(stack, kernels, biases, x) -> DenseJacobianFactors:
  base = _dense_features(stack, kernels, biases, x, trace_outputs=False)
  c = kernels[-1].shape[1]
  last = jnp.broadcast_to(jnp.eye(c, dtype=base.inputs[0].dtype), (x.shape[0], c, c))
  return DenseJacobianFactors(base.inputs, tuple(base.backs) + (last,))


def _gram_plus_one(a1: jax.Array, a2: jax.Array) -> jax.Array:
  """``A1 A2ᵀ + 1``: the weight (``A``) and bias (``1``) parts of one layer's input kernel."""
  return jnp.matmul(a1, a2.T, precision=_HIGHEST) + 1


def _structured_contract(trace_outputs: bool, num_outputs: int):
  """``contract(F1, F2)``: the kernel between two sets of :class:`_DenseFeatures`.

  ``K = Σ_l (A_l A_l'ᵀ + 1) ⊙ S_l`` with the output-side kernel ``S_l``:

  * last layer: ``∂f_c/∂z_{L-1} = e_c``, so traced ``S = (1/C) Σ_c 1 = 1`` and
    full ``S[a, b] = δ_ab``;
  * hidden layers: traced ``S = (1/C) B Bᵀ`` (``B`` = ``backs``), full
    ``S[i, j, a, b] = Σ_q M_l(x_i)[q, a] M_l(x'_j)[q, b]``.
  """

  def contract(f1: _DenseFeatures, f2: _DenseFeatures) -> jax.Array:
    last = _gram_plus_one(f1.inputs[-1], f2.inputs[-1])
    if trace_outputs:
      k = last
      for a1, a2, b1, b2 in zip(f1.inputs, f2.inputs, f1.backs, f2.backs):
        s = jnp.matmul(b1, b2.T, precision=_HIGHEST) / num_outputs
        k = k + _gram_plus_one(a1, a2) * s
      return k
    eye = jnp.eye(num_outputs, dtype=last.dtype)
    k = last[:, :, None, None] * eye
    for a1, a2, m1, m2 in zip(f1.inputs, f2.inputs, f1.backs, f2.backs):
      s = jnp.einsum("iqa,jqb->ijab", m1, m2, precision=_HIGHEST)
      k = k + _gram_plus_one(a1, a2)[:, :, None, None] * s
    return k

  return contract


def structured_kernel(stack, params, x1, x2, trace_outputs, chunk):
  """Dense-stack kernel ``Σ_l (A_l A_l'ᵀ + 1) ⊙ S_l`` (see :func:`_structured_contract`).

  The factors are ``O(N · Σ_l out_l · C)`` floats, so they are computed once for
  all samples; ``chunk`` (when given) only blocks the contraction over rows of
  ``x1``, bounding the intermediate kernels to ``chunk × N2``.
  """
  kernels, biases = dense_weights(stack, params)
  in_dim = kernels[0].shape[0]
  feat = math.prod(x1.shape[1:])
  if feat != in_dim:
    raise ValueError(
      f"structured NTK: inputs have {feat} features per sample (shape {x1.shape[1:]}) "
      f"but the first layer {stack.layers[0]!r} takes {in_dim}"
    )
  num_outputs = kernels[-1].shape[1]
  features = lambda x: _dense_features(stack, kernels, biases, x, trace_outputs)
  contract = _structured_contract(trace_outputs, num_outputs)
  f1 = features(x1)
  f2 = f1 if x2 is None else features(x2)
  return map_blocks(lambda f1b: contract(f1b, f2), f1, chunk)


# ----------------------------------------------------------------------------
# 'structured' with layer-wise Jacobian sketches (SPARK).


class DenseProjection(NamedTuple):
  """A sketch of one dense layer's parameter Jacobian (``None`` = that tensor is not sketched).

  Attributes:
    kernel: ``P [in_l, k_l]`` acting on the *input* axis of the layer's kernel
      ``W_l [in_l, out_l]`` (sketched coordinates ``W_l = W̄_l + P U``, ``U [k_l, out_l]``).
    bias: ``P_b [out_l, k_b]`` acting on the bias ``b_l [out_l]`` (``b_l = b̄_l + P_b u``).
  """

  kernel: jax.Array | None = None
  bias: jax.Array | None = None


class _ProjectedFeatures(NamedTuple):
  """:class:`_DenseFeatures` in sketch coordinates.

  Attributes:
    inputs: ``Ã_l = A_l P_l`` ``[N, k_l]`` (``A_l`` when the kernel is not sketched).
    backs: the weight-side output factors, exactly as :class:`_DenseFeatures`.
    bias_backs: per layer, ``P_bᵀ M_l`` (``[N, k_b·C]`` traced, ``[N, k_b, C]``
      full) when the bias is sketched, else ``None``.
  """

  inputs: tuple[jax.Array, ...]
  backs: tuple[jax.Array, ...]
  bias_backs: tuple[jax.Array | None, ...]


def check_projections(stack: DenseStack, kernels, projections) -> tuple[DenseProjection, ...]:
  if len(projections) != len(stack.layers):
    raise ValueError(
      f"projections must have one DenseProjection per dense_stack layer {stack.layers}, "
      f"got {len(projections)}"
    )
  out = []
  for name, w, proj in zip(stack.layers, kernels, projections):
    proj = DenseProjection() if proj is None else proj
    if not isinstance(proj, DenseProjection):
      raise ValueError(
        f"projections[{name!r}] must be a DenseProjection or None, got {type(proj).__name__}"
      )
    for part, dim in (("kernel", w.shape[0]), ("bias", w.shape[1])):
      m = getattr(proj, part)
      if m is not None and (jnp.ndim(m) != 2 or jnp.shape(m)[0] != dim):
        raise ValueError(
          f"projections[{name!r}].{part} must be [{dim}, k] (it acts on the layer's "
          f"{'input' if part == 'kernel' else 'bias'} axis of size {dim}), got {jnp.shape(m)}"
        )
    out.append(proj)
  return tuple(out)


def projected_features(stack, kernels, biases, projections, x, trace_outputs) -> _ProjectedFeatures:
  """Factors of the sketched kernel (derivation in :func:`ntk_fl.ntk.projected_dense_ntk`)."""
  base = _dense_features(stack, kernels, biases, x, trace_outputs)
  inputs = tuple(
    a if p.kernel is None else jnp.matmul(a, p.kernel, precision=_HIGHEST)
    for a, p in zip(base.inputs, projections)
  )
  if all(p.bias is None for p in projections):
    return _ProjectedFeatures(inputs, base.backs, (None,) * len(projections))
  # A sketched bias needs the per-output Jacobians M_l [N, out_l, C] themselves (the traced
  # factors fold the outputs away); M_{L-1} = I because the logits are the last layer's outputs.
  ms = jacobian_factors(stack, kernels, biases, x).outputs
  bias_backs = []
  for m, p in zip(ms, projections):
    if p.bias is None:
      bias_backs.append(None)
      continue
    g = jnp.einsum("nqc,qk->nkc", m, p.bias, precision=_HIGHEST)
    bias_backs.append(g.reshape(g.shape[0], -1) if trace_outputs else g)
  return _ProjectedFeatures(inputs, base.backs, tuple(bias_backs))


def projected_contract(trace_outputs: bool, num_outputs: int):
  """``contract(F1, F2)`` of two :class:`_ProjectedFeatures`; the unsketched terms in the order of
  :func:`_structured_contract`, so that no sketch at all reproduces the structured kernel."""

  def layer_term(a1, a2, s, g1, g2, outer):
    if g1 is None:  # (Ã Ã'ᵀ + 1) ⊙ S: bias part unsketched
      return outer(_gram_plus_one(a1, a2)) * s
    bias = (
      jnp.matmul(g1, g2.T, precision=_HIGHEST) / num_outputs
      if trace_outputs
      else jnp.einsum("ika,jkb->ijab", g1, g2, precision=_HIGHEST)
    )
    return outer(jnp.matmul(a1, a2.T, precision=_HIGHEST)) * s + bias

  def contract(f1: _ProjectedFeatures, f2: _ProjectedFeatures) -> jax.Array:
    if trace_outputs:
      outer = lambda g: g
      k = layer_term(f1.inputs[-1], f2.inputs[-1], 1.0, f1.bias_backs[-1], f2.bias_backs[-1], outer)
      for a1, a2, b1, b2, g1, g2 in zip(
        f1.inputs, f2.inputs, f1.backs, f2.backs, f1.bias_backs, f2.bias_backs
      ):
        s = jnp.matmul(b1, b2.T, precision=_HIGHEST) / num_outputs
        k = k + layer_term(a1, a2, s, g1, g2, outer)
      return k
    outer = lambda g: g[:, :, None, None]
    eye = jnp.eye(num_outputs, dtype=f1.inputs[-1].dtype)
    k = layer_term(f1.inputs[-1], f2.inputs[-1], eye, f1.bias_backs[-1], f2.bias_backs[-1], outer)
    for a1, a2, m1, m2, g1, g2 in zip(
      f1.inputs, f2.inputs, f1.backs, f2.backs, f1.bias_backs, f2.bias_backs
    ):
      s = jnp.einsum("iqa,jqb->ijab", m1, m2, precision=_HIGHEST)
      k = k + layer_term(a1, a2, s, g1, g2, outer)
    return k

  return contract


def full_to_matrix(k: jax.Array) -> jax.Array:
  """``[N1, N2, C, C]`` full kernel -> ``[N1·C, N2·C]`` matrix, sample-major (row ``i·C + a``)."""
  if jnp.ndim(k) != 4 or k.shape[2] != k.shape[3]:
    raise ValueError(f"full_to_matrix expects a [N1, N2, C, C] kernel, got shape {jnp.shape(k)}")
  n1, n2, c, _ = k.shape
  return jnp.transpose(k, (0, 2, 1, 3)).reshape(n1 * c, n2 * c)


# ----------------------------------------------------------------------------
# The entry point (public as ntk_fl.ntk.empirical_ntk).


def empirical_ntk(
  apply_fn: ApplyFn,
  params: Params,
  x1: jax.Array,
  x2: jax.Array | None = None,
  *,
  trace_outputs: bool = True,
  implementation: Implementation | str = Implementation.AUTO,
  dense_stack: DenseStack | None = None,
  flax_apply: ApplyFn | None = None,
  chunk_size: int | None = None,
  plan: Any = None,
) -> jax.Array:
  """Empirical NTK of ``apply_fn`` at ``params`` between ``x1`` and ``x2``.

  Args:
    apply_fn: ``apply_fn(params, x [B, *in]) -> [B, C]`` (a flax ``apply``), mapping samples
      independently (per-sample; :func:`ntk_fl.ntk.empirical_ntk_fn` with ``vmap_axes=None`` for other models).
    params: the linearisation point (a flax variables dict).
    x1: ``[N1, *in]`` inputs.
    x2: ``[N2, *in]`` inputs, or ``None`` for ``x2 = x1`` (shares work).
    trace_outputs: ``True`` -> ``[N1, N2]`` kernel ``(1/C) Σ_c J_c(x1) J_c(x2)ᵀ``
      (the *mean* over outputs, as neural-tangents' ``trace_axes=(-1,)``);
      ``False`` -> full ``[N1, N2, C, C]`` kernel
      ``K[i, j, a, b] = <J_a(x1_i), J_b(x2_j)>``.
    implementation: one of :data:`IMPLEMENTATIONS` (module docstring).
    dense_stack: the model's :class:`~ntk_fl.models.DenseStack` (enables and,
      under ``'auto'``, selects the dense-stack ``'structured'`` kernel).
    flax_apply: ``apply_fn``'s computation as a function that reaches its flax layers without a
      ``jax.jit`` boundary (``module.apply``; :attr:`ntk_fl.models.Model.flax_apply`): enables the
      layer-wise ``'structured'`` kernel of any flax model (``dense_stack`` wins when both are
      given), which ``'auto'`` selects when it needs fewer FLOPs than the generic choice.
    chunk_size: samples per block of ``x1`` and of ``x2``; ``None`` picks one
      that keeps a block's Jacobian (or factors) below 256 MiB (dense-stack ``'structured'``: no
      blocking, its factors are already ``O(N)``).
    plan: the layer-wise kernel's :class:`~ntk_fl._src.layerwise.Plan`, when the caller already
      built it (``layerwise.make_plan(flax_apply, params, x1[:1], trace_outputs)``); ``None``: built
      here when needed.

  Returns:
    The kernel in the dtype of the network outputs.

  Raises:
    ValueError: unknown ``implementation``; ``'structured'`` without
      ``dense_stack`` or ``flax_apply``; ``x1``/``x2`` feature shapes differ; non-positive
      ``chunk_size``; outputs that are not ``[B, C]``; params that do not match
      ``dense_stack``.
  """
  impl = resolve_implementation(implementation, dense_stack, flax_apply)
  check_chunk_size(chunk_size)
  check_inputs(x1, x2)
  if impl == Implementation.STRUCTURED and dense_stack is not None:
    return structured_kernel(dense_stack, params, x1, x2, trace_outputs, chunk_size)

  num_outputs = _num_outputs(apply_fn, params, x1)
  if impl == Implementation.AUTO:
    impl, plan = _auto_choice(
      apply_fn, params, x1, x2, trace_outputs, flax_apply, num_outputs, plan
    )
  if impl == Implementation.STRUCTURED:  # the layer-wise kernel of flax_apply
    # Imported here: the layer-wise kernel needs flax, which a dense-stack or generic kernel does not load.
    from ntk_fl._src import layerwise

    if plan is None:
      plan = layerwise.make_plan(flax_apply, params, x1[:1], trace_outputs)
    return layerwise.layerwise_kernel(
      flax_apply, params, x1, x2, trace_outputs, chunk_size, plan=plan, blocked=_blocked_kernel
    )
  chunk = chunk_size if chunk_size is not None else default_chunk(params, num_outputs)
  if impl == Implementation.JACOBIAN:
    return jacobian_implementation_kernel(apply_fn, params, x1, x2, trace_outputs, chunk)
  return ntvp_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, chunk_size)


def _num_outputs(apply_fn: ApplyFn, params: Params, x1) -> int:
  """``C``, the outputs per sample of ``apply_fn`` (``x1``: ``[N, *in]``, an array or a shape)."""
  probe = jax.ShapeDtypeStruct((1, *jnp.shape(x1)[1:]), jnp.result_type(x1))
  out = jax.eval_shape(apply_fn, params, probe)
  if len(out.shape) != 2:
    raise ValueError(f"apply_fn must return [B, C] outputs, got shape {out.shape} for a batch of 1")
  return out.shape[1]


def _first_sample(x):
  """``x[:1]`` (``[1, *in]``); its shape where ``x`` is a ``jax.ShapeDtypeStruct``."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
  return x[:1]


def _auto_choice(apply_fn, params, x1, x2, trace_outputs, flax_apply, num_outputs, plan):
  """``'auto'`` without a dense stack: ``(STRUCTURED, plan)`` where ``flax_apply``'s layer-wise kernel needs
  fewer FLOPs per sample pair than the generic contraction, else ``(generic_choice, plan)`` for the kernel's
  ``N1·N2`` sample pairs; ``plan``: the layer-wise plan, built here when ``flax_apply`` is given and
  ``plan`` is ``None``."""
  probe = _first_sample(x1)
  if flax_apply is not None:
    from ntk_fl._src import layerwise  # pylint: disable=import-outside-toplevel

    if plan is None:
      plan = layerwise.make_plan(flax_apply, params, probe, trace_outputs)
    generic = layerwise.contraction_flops(num_params_of(params), num_outputs, True)
    if layerwise.plan_flops(plan, trace_outputs, 1, 1) < generic:
      return Implementation.STRUCTURED, plan
  pairs = x1.shape[0] * (x1 if x2 is None else x2).shape[0]
  return generic_choice(apply_fn, params, probe, num_outputs, trace_outputs, pairs), plan


def auto_implementation(
  apply_fn: ApplyFn,
  params: Params,
  x1,
  x2=None,
  *,
  trace_outputs: bool = True,
  dense_stack: DenseStack | None = None,
  flax_apply: ApplyFn | None = None,
) -> Implementation:
  """The implementation :func:`empirical_ntk` with ``implementation='auto'`` takes for this kernel:
  ``STRUCTURED`` (the dense-stack or the layer-wise kernel), ``JACOBIAN`` or ``NTVP``.

  ``x1``, ``x2``: ``[N1, *in]``, ``[N2, *in]`` arrays or ``jax.ShapeDtypeStruct``s (only their shapes
  matter); ``params`` may be shapes too. The choice depends on ``N1·N2`` (:func:`generic_choice`:
  ``'ntvp'`` for a traced kernel of at most :data:`TRACED_NTVP_MAX_PAIRS` pairs), so a kernel timed on a
  smaller block than the one it stands for (the cost estimate's calibration) names the large block's
  choice, computed here, as its ``implementation``: with it the kernel of any size is computed as the
  large block's is.
  """
  impl = resolve_implementation(Implementation.AUTO, dense_stack, flax_apply)
  if impl != Implementation.AUTO:
    return impl
  num_outputs = _num_outputs(apply_fn, params, x1)
  return _auto_choice(apply_fn, params, x1, x2, trace_outputs, flax_apply, num_outputs, None)[0]


def forward_flops(apply_fn: ApplyFn, params: Params, x: jax.Array) -> float | None:
  """FLOPs of ``apply_fn(params, x)`` (``x``: one sample ``[1, *in]``) as XLA's cost analysis of the
  lowered program counts them (2 per multiply-add); ``None`` where the backend reports none."""
  spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
  flops = xla_flops(jax.jit(apply_fn).lower(jax.tree.map(spec, params), spec(x)))
  return flops if flops > 0 else None  # nan (not reported) compares False


# 'auto''s traced kernel takes 'ntvp' for a network that does not reuse its weights (one sample's forward
# FLOPs F within 1.25x of 2·d: ntvp's N1·N2·C·F FLOPs then exceed the traced contraction's 2·N1·N2·C·d
# by at most 25 %; elementwise operations add a few per cent to the 2·d of one multiply-add per weight,
# while a convolution over positions, a recurrent cell or a whole batch differentiated as one sample
# makes F several d: the library's CNN 23·d) and kernels of at most 256² sample pairs. Measured on the
# 784-100-10 MLP (F = 2.0·d) on one loaded core (benchmarks/RESULTS.md): 'ntvp' 3.0x faster than the
# contraction at N = 50, 1.7x at N = 200, and not reliably faster at N = 600 (57-152 s against
# 95-134 s: the contraction's GEMM gains more from the larger N, and 'ntvp's cache-resident rows
# suffer more from the load).
TRACED_NTVP_FLOPS_PER_PARAM = 2.5
TRACED_NTVP_MAX_PAIRS = 256**2


def generic_choice(
  apply_fn: ApplyFn,
  params: Params,
  x: jax.Array,
  num_outputs: int,
  trace_outputs: bool,
  pairs: int,
) -> Implementation:
  """``'auto'``'s generic kernel (no dense stack, no cheaper layer-wise kernel): ``'ntvp'`` or
  ``'jacobian'`` from ``F``, one sample's forward FLOPs (:func:`forward_flops`; ``x``: ``[1, *in]``),
  against ``d`` parameters and ``C`` outputs; ``pairs = N1·N2``, the kernel's sample pairs.

  * Full kernel: ``'ntvp'`` (``≈ N1·N2·C·F`` FLOPs) when ``F <= C·d``, i.e. at most half the
    ``'jacobian'`` contraction's ``2·N1·N2·C²·d``, else ``'jacobian'`` (its ``jvp``s run below GEMM
    speed: the library's CNN, ``F = 7.7e6 > C·d = 3.3e6``, ``'jacobian'`` 3.9× faster at ``N = 50``);
    ``'ntvp'`` where XLA reports no FLOPs.
  * Traced kernel: ``'ntvp'`` when ``F <= 2.5·d`` (:data:`TRACED_NTVP_FLOPS_PER_PARAM`: at most
    1.25× the traced contraction's ``2·N1·N2·C·d``, a network that uses each weight once per sample;
    the 784-100-10 MLP without its ``DenseStack``: ``F = 2.0·d``) and ``N1·N2 <= 256²``
    (:data:`TRACED_NTVP_MAX_PAIRS`; there it is 1.7-3× faster, at ``N = 600`` not reliably), else
    ``'jacobian'`` (the CNN: ``F = 23·d``); ``'jacobian'`` where XLA reports no FLOPs.
  """
  flops = forward_flops(apply_fn, params, x)
  d = num_params_of(params)
  if trace_outputs:
    ntvp = (
      flops is not None
      and flops <= TRACED_NTVP_FLOPS_PER_PARAM * d
      and pairs <= TRACED_NTVP_MAX_PAIRS
    )
  else:
    ntvp = flops is None or flops <= num_outputs * d
  return Implementation.NTVP if ntvp else Implementation.JACOBIAN


def num_params_of(params: Params) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# Explicit per-sample Jacobians (public as ntk_fl.jacobians.*): the 'jacobian' implementation's features
# and contraction, also CP-NTK-FL's and SPARK's uploads. Here, with the kernels, so that the kernel stack
# imports only leaves.

_BLOCK_FLOATS = 2**26  # one chunk's Jacobian stays below this (256 MiB float32) by default


def per_sample_jacobian(apply_fn: ApplyFn, params, x: jax.Array, *, chunk_size: int | None = None):
  """Per-sample Jacobians ``J[i, c] = ∂f_c(x_i)/∂w`` at ``params``.

  Args:
    apply_fn: ``apply_fn(params, x [B, *in]) -> [B, C]``.
    params: the linearisation point (pytree).
    x: ``[N, *in]`` inputs.
    chunk_size: samples whose Jacobians are computed together (one ``vmap``
      batch of a ``lax.map``); ``None`` keeps a chunk below ``2**26`` floats.

  Returns:
    A pytree shaped like ``params`` whose leaves are ``[N, C, *leaf_shape]``.
  """
  if chunk_size is not None:
    validation.check_int("chunk_size", chunk_size, low=1)
  x = jnp.asarray(x)
  if x.ndim < 1 or x.shape[0] == 0:
    raise ValueError(f"x must be [N, *in] with N >= 1, got shape {x.shape}")
  single = lambda p, xi: apply_fn(p, xi[None])[0]
  out = jax.eval_shape(single, params, x[0])
  if len(out.shape) != 1:
    raise ValueError(f"apply_fn must return [B, C] outputs, got {out.shape} per sample")
  if chunk_size is None:
    chunk_size = max(1, _BLOCK_FLOATS // max(1, out.shape[0] * num_params_of(params)))
  jac_one = lambda xi: jax.jacrev(single)(params, xi)
  if chunk_size >= x.shape[0]:
    return jax.vmap(jac_one)(x)
  return jax.lax.map(jac_one, x, batch_size=chunk_size)


def dense_stack_jacobian(stack: DenseStack, params, x: jax.Array):
  """:func:`per_sample_jacobian` of a dense stack of one or two layers, from its factors, or ``None``.

  With ``z_0 = A_0 W_0 + b_0``, ``A_1 = σ(z_0)`` and ``g_l[i, c] = ∂f_c(x_i)/∂z_l``, the kernel Jacobian of
  layer ``l`` is ``A_l[i, p] · g_l[i, c, q]`` and its bias Jacobian ``g_l[i, c]``: one product per entry,
  written once in the layout the caller reads, where ``jax.jacrev`` under ``vmap`` writes the kernel
  Jacobians transposed and then copies them. ``g`` of the last layer is one-hot and that of the first the
  activation's pullback of ``W_1[:, c]`` -- what autodiff's backward pass forms from a one-hot cotangent
  (``relu``: ``select(z > 0, W_1[:, c], 0)``), so every entry is autodiff's float, bit for bit. Deeper
  stacks sum in their backward pass: ``None`` (use :func:`per_sample_jacobian`), as for parameters that
  are not exactly the stack's layers.

  Args:
    stack: the model's :class:`DenseStack`.
    params: its parameters (``{'params': {layer: {'kernel', 'bias'}}}`` or without the ``'params'`` level).
    x: ``[N, *in]`` inputs.

  Returns:
    A pytree shaped like ``params`` with leaves ``[N, C, *leaf_shape]``, or ``None``.
  """
  tree = params["params"] if isinstance(params, Mapping) and "params" in params else params
  if len(stack.layers) > 2 or not isinstance(tree, Mapping) or set(tree) != set(stack.layers):
    return None
  kernels, biases = dense_weights(stack, params)
  a = x.reshape(x.shape[0], -1)
  c = kernels[-1].shape[1]
  eye = jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), (a.shape[0], c, c))  # g of the logits
  if len(kernels) == 1:
    inputs, outputs = [a], [eye]
  else:
    z = jnp.matmul(a, kernels[0], precision=_HIGHEST) + biases[0]
    hidden, pullback = jax.vjp(stack.activation, z)
    cotangent = lambda w_c: pullback(jnp.broadcast_to(w_c, z.shape))[0]
    g = jnp.swapaxes(jax.vmap(cotangent, in_axes=1)(kernels[1]), 0, 1)  # [N, C, hidden]
    inputs, outputs = [a, hidden], [g, eye]
  layers = {
    name: {"kernel": a_l[:, None, :, None] * g_l[:, :, None, :], "bias": g_l}
    for name, a_l, g_l in zip(stack.layers, inputs, outputs)
  }
  jac = {"params": layers} if tree is not params else layers
  if jax.tree.structure(jac) != jax.tree.structure(params):
    return None
  return jac


def flatten_jacobian(jac) -> jax.Array:
  """Pytree of ``[N, C, *leaf]`` leaves -> ``[N, C, d]`` (leaves in ``jax.tree.leaves`` order)."""
  leaves = jax.tree.leaves(jac)
  if not leaves or any(leaf.ndim < 2 for leaf in leaves):
    raise ValueError(
      f"flatten_jacobian needs leaves [N, C, *leaf], got {[leaf.shape for leaf in leaves]}"
    )
  return jnp.concatenate(
    [leaf.reshape(leaf.shape[0], leaf.shape[1], -1) for leaf in leaves], axis=-1
  )


def unflatten_jacobian(flat: jax.Array, params):
  """``[..., d]`` -> pytree like ``params`` with leaves ``[..., *leaf_shape]`` (inverse of flattening)."""
  leaves, treedef = jax.tree.flatten(params)
  sizes = [math.prod(leaf.shape) for leaf in leaves]
  if flat.shape[-1] != sum(sizes):
    raise ValueError(f"flat trailing axis {flat.shape[-1]} != number of parameters {sum(sizes)}")
  offsets = [0]
  for size in sizes:
    offsets.append(offsets[-1] + size)
  parts = [
    flat[..., a:b].reshape(*flat.shape[:-1], *leaf.shape)
    for a, b, leaf in zip(offsets[:-1], offsets[1:], leaves)
  ]
  return jax.tree.unflatten(treedef, parts)


def flat_jacobian(
  apply_fn: ApplyFn, params, x: jax.Array, *, chunk_size: int | None = None
) -> jax.Array:
  """:func:`per_sample_jacobian` in the flat layout ``[N, C, d]``."""
  return flatten_jacobian(per_sample_jacobian(apply_fn, params, x, chunk_size=chunk_size))


def jacobian_kernel(jac1, jac2=None, *, trace_outputs: bool = True) -> jax.Array:
  """The empirical NTK of explicit sample-major Jacobians (CP-NTK-FL's server and SPARK's compressed
  sketches contract here).

  Args:
    jac1: ``[N1, C, d]``, or a pytree of ``[N1, C, *leaf]`` leaves (:func:`per_sample_jacobian`'s layout;
      the kernel sums over the leaves).
    jac2: the same for ``N2`` samples (same structure), or ``None`` (``= jac1``).
    trace_outputs: ``True`` -> ``[N1, N2]`` ``(1/C) Σ_c <J1[i, c], J2[j, c]>`` (the mean over outputs, as
      :func:`ntk_fl.ntk.empirical_ntk`); ``False`` -> full ``[N1, N2, C, C]`` ``<J1[i, a], J2[j, b]>``.
  """
  leaves1 = jax.tree.leaves(jac1)
  leaves2 = leaves1 if jac2 is None else jax.tree.leaves(jac2)
  if (
    not leaves1
    or len(leaves1) != len(leaves2)
    or any(a.ndim < 3 or b.ndim < 3 or a.shape[1:] != b.shape[1:] for a, b in zip(leaves1, leaves2))
  ):
    raise ValueError(
      "jacobians must be [N, C, d] (or pytrees of [N, C, *leaf] leaves) with equal C and "
      f"parameter shapes, got {[a.shape for a in leaves1]} and {[b.shape for b in leaves2]}"
    )
  flat = lambda a: a.reshape(a.shape[0], a.shape[1], -1)
  if trace_outputs:  # each leaf's term is averaged over the outputs before the leaves are summed
    terms = [
      jnp.einsum("icp,jcp->ij", flat(a), flat(b), precision=_HIGHEST) / a.shape[1]
      for a, b in zip(leaves1, leaves2)
    ]
  else:
    terms = [
      jnp.einsum("iap,jbp->ijab", flat(a), flat(b), precision=_HIGHEST)
      for a, b in zip(leaves1, leaves2)
    ]
  return functools.reduce(jnp.add, terms)
