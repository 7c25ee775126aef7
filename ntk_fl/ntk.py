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

Implementations (``implementation=``):

* ``'jacobian'`` -- per-sample Jacobians (``vmap(jacrev)``) contracted leaf by
  leaf. Cost ``2·N1·N2·C·d`` FLOPs traced, ``2·N1·N2·C²·d`` full (``d`` = number
  of parameters). Works for any ``apply_fn``.
* ``'ntvp'`` -- NTK-vector products: ``vjp`` at ``x2`` on the identity
  cotangents gives ``J2ᵀ e``; ``jvp`` of the network linearised at ``x1`` maps
  them to ``J1 J2ᵀ e``. About ``2·N1·N2·C·d`` (one linearised forward per
  tangent) for the traced *and* the full kernel, so it is the cheap generic
  choice for the full kernel. Memory additionally grows with
  ``chunk² · C · (activation size per sample)``: pass a small ``chunk_size`` for
  conv nets.
* ``'structured'`` -- for a stack of dense layers (:class:`ntk_fl.models.DenseStack`)
  the kernel factorises over layers (see :func:`_structured_kernel`); for the
  784-100-10 MLP that is ``≈ 2·N1·N2·(784 + 100 + 100)`` FLOPs, about a thousand
  times fewer than the Jacobian contraction. It reads the weights from
  ``params`` and never calls ``apply_fn``: the caller promises that ``apply_fn``
  *is* that dense stack.
* ``'auto'`` -- ``'structured'`` when ``dense_stack`` is given; otherwise
  ``'jacobian'`` for the traced kernel and ``'ntvp'`` for the full kernel, the
  faster one in each case (benchmarks/ntk_kernels.py, 784-100-10 MLP on 2 CPU
  cores: traced N=600 13 s vs 29 s; full N=200 2.2 s vs 3.8 s, where ntvp needs
  ``C`` times fewer FLOPs); their peak memory is similar (two blocks).

:func:`projected_dense_ntk` is the structured kernel of a dense stack in
SPARK's layer-wise sketch coordinates (``J̃ J̃ᵀ`` with ``J̃ = J P``), at the
structured kernel's cost.

The generic implementations work on blocks of at most ``chunk_size`` samples of
``x1`` and of ``x2`` (``lax.map``), so peak memory is that of two blocks'
Jacobians (``2·chunk·C·d`` floats), never the whole ``N·C·d`` Jacobian. The
default block keeps one block's Jacobian under ``2**26`` floats (256 MiB).

Every function is pure and ``jit``/``vmap``-able (NTK-DFL vmaps the kernel over
all clients); there are no Python loops over samples. Contractions run at
``Precision.HIGHEST`` so accelerators do not silently drop to TF32/bf16 passes
(on CPU float32 matmuls are exact float32 anyway).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ntk_fl.models import DenseStack

__all__ = ["IMPLEMENTATIONS", "empirical_ntk", "make_ntk_fn", "full_to_matrix", "DenseProjection",
           "projected_dense_ntk", "DenseJacobianFactors", "dense_jacobian_factors",
           "NtkImplementation", "empirical_ntk_fn"]

IMPLEMENTATIONS = ("auto", "jacobian", "ntvp", "structured")

# One block's Jacobian (chunk · C · d floats) stays below this by default.
_BLOCK_FLOATS = 2**26
_HIGHEST = jax.lax.Precision.HIGHEST

Params = Any
ApplyFn = Callable[[Params, jax.Array], jax.Array]


# ----------------------------------------------------------------------------
# Validation.


def _resolve_implementation(implementation: str, dense_stack: DenseStack | None,
                            trace_outputs: bool) -> str:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown NTK implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
  if implementation == "structured" and dense_stack is None:
    raise ValueError("implementation='structured' needs dense_stack (the model's DenseStack); "
                     "use 'jacobian' or 'ntvp' for other models")
  if dense_stack is not None and not isinstance(dense_stack, DenseStack):
    raise ValueError(f"dense_stack must be an ntk_fl.models.DenseStack or None, got {type(dense_stack).__name__}")
  if implementation != "auto":
    return implementation
  if dense_stack is not None:
    return "structured"
  return "jacobian" if trace_outputs else "ntvp"


def _check_chunk_size(chunk_size: int | None) -> None:
  if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                 or chunk_size < 1):
    raise ValueError(f"chunk_size must be None (automatic) or a positive int, got {chunk_size!r}")


def _check_inputs(x1: jax.Array, x2: jax.Array | None) -> None:
  if jnp.ndim(x1) < 1:
    raise ValueError(f"x1 must have a leading batch axis, got shape {jnp.shape(x1)}")
  if x2 is not None and jnp.shape(x2)[1:] != jnp.shape(x1)[1:]:
    raise ValueError(f"x1 and x2 must have the same feature shape, got x1 {jnp.shape(x1)} "
                     f"and x2 {jnp.shape(x2)}")


# ----------------------------------------------------------------------------
# Blocking over samples.


def _map_blocks(fn: Callable[[Any], Any], xs: Any, chunk: int | None) -> Any:
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


def _blocked_kernel(features1: Callable[[Any], Any], features2: Callable[[Any], Any],
                    contract: Callable[[Any, Any], jax.Array], x1: Any, x2: Any | None,
                    chunk: int | None) -> jax.Array:
  """Kernel ``[N1, N2, ...]`` assembled from blocks ``contract(features1(x1b), features2(x2b))``.

  ``features1`` runs once per ``x1`` block (outer ``lax.map``) and ``features2``
  once per block pair (inner ``lax.map``): recomputing the ``x2`` side costs a
  fraction ``~1/chunk`` of the contraction and keeps only two blocks alive.
  ``x2=None`` means ``x2 = x1``; with a single block the features are shared.
  """
  n1 = jax.tree.leaves(x1)[0].shape[0]
  if x2 is None:
    if (chunk is None or chunk >= n1) and features1 is features2:
      f = features1(x1)
      return contract(f, f)
    x2 = x1

  def row(x1b):
    f1 = features1(x1b)
    cols = _map_blocks(lambda x2b: jnp.swapaxes(contract(f1, features2(x2b)), 0, 1), x2, chunk)
    return jnp.swapaxes(cols, 0, 1)  # [b1, N2, ...]

  return _map_blocks(row, x1, chunk)


def _default_chunk(params: Params, num_outputs: int) -> int:
  num_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  return max(1, _BLOCK_FLOATS // max(1, num_outputs * num_params))


# ----------------------------------------------------------------------------
# 'jacobian': per-sample Jacobians contracted leaf by leaf.


def _per_sample_jacobian(apply_fn: ApplyFn, params: Params, x: jax.Array) -> list[jax.Array]:
  """Leaves ``[b, C, p_leaf]`` of ``∂f_c(x_i)/∂w`` (flattened per parameter leaf)."""

  def single(p, xi):
    return apply_fn(p, xi[None])[0]

  jac = jax.vmap(jax.jacrev(single), in_axes=(None, 0))(params, x)
  return [leaf.reshape(leaf.shape[0], leaf.shape[1], -1) for leaf in jax.tree.leaves(jac)]


def _contract_jacobians(trace_outputs: bool, num_outputs: int):
  def contract(j1, j2):
    if trace_outputs:
      terms = [jnp.einsum("icp,jcp->ij", a, b, precision=_HIGHEST) for a, b in zip(j1, j2)]
      return sum(terms) / num_outputs
    return sum(jnp.einsum("iap,jbp->ijab", a, b, precision=_HIGHEST) for a, b in zip(j1, j2))
  return contract


def _jacobian_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, chunk):
  features = lambda x: _per_sample_jacobian(apply_fn, params, x)
  return _blocked_kernel(features, features, _contract_jacobians(trace_outputs, num_outputs),
                         x1, x2, chunk)


# ----------------------------------------------------------------------------
# 'ntvp': NTK-vector products (vjp at x2 on identity cotangents, then jvp at x1).


def _ntvp_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, out_dtype, chunk):
  c = num_outputs

  def linearized_at(x1b):
    # The primal forward pass at x1b is shared by every tangent.
    return jax.linearize(lambda p: apply_fn(p, x1b), params)[1]

  def transposed_basis(x2b):
    b2 = x2b.shape[0]
    _, vjp_fn = jax.vjp(lambda p: apply_fn(p, x2b), params)
    basis = jnp.eye(b2 * c, dtype=out_dtype).reshape(b2 * c, b2, c)
    return jax.vmap(vjp_fn)(basis)[0]  # leaves [b2·C, *leaf]: the rows of J(x2b)

  def contract(jvp_fn, tangents):
    out = jax.vmap(jvp_fn)(tangents)  # [b2·C, b1, C]: out[(j, b), i, a] = <J_a(x1_i), J_b(x2_j)>
    b1 = out.shape[1]
    out = out.reshape(-1, c, b1, c)  # [j, b, i, a]
    if trace_outputs:
      return jnp.einsum("jcic->ij", out) / c
    return jnp.transpose(out, (2, 0, 3, 1))  # [i, j, a, b]

  return _blocked_kernel(linearized_at, transposed_basis, contract, x1, x2, chunk)


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


def _dense_weights(stack: DenseStack, params: Params) -> tuple[list, list]:
  tree = params["params"] if isinstance(params, Mapping) and "params" in params else params
  kernels, biases = [], []
  for name in stack.layers:
    if name not in tree or "kernel" not in tree[name] or "bias" not in tree[name]:
      raise ValueError(f"dense_stack layer {name!r} not found with 'kernel' and 'bias' in params "
                       f"(available: {sorted(tree)})")
    kernels.append(tree[name]["kernel"])
    biases.append(tree[name]["bias"])
  for k, (w, b) in enumerate(zip(kernels, biases)):
    if w.ndim != 2 or b.shape != w.shape[1:]:
      raise ValueError(f"layer {stack.layers[k]!r}: expected kernel [in, out] and bias [out], "
                       f"got {w.shape} and {b.shape}")
    if k and w.shape[0] != kernels[k - 1].shape[1]:
      raise ValueError(f"layer {stack.layers[k]!r} takes {w.shape[0]} inputs but "
                       f"{stack.layers[k - 1]!r} gives {kernels[k - 1].shape[1]}")
  return kernels, biases


def _dense_features(stack: DenseStack, kernels, biases, x: jax.Array,
                    trace_outputs: bool) -> _DenseFeatures:
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


def _jacobian_factors(stack, kernels, biases, x) -> DenseJacobianFactors:
  base = _dense_features(stack, kernels, biases, x, trace_outputs=False)
  c = kernels[-1].shape[1]
  last = jnp.broadcast_to(jnp.eye(c, dtype=base.inputs[0].dtype), (x.shape[0], c, c))
  return DenseJacobianFactors(base.inputs, tuple(base.backs) + (last,))


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
  _check_inputs(x, None)
  kernels, biases = _dense_weights(stack, params)
  feat = math.prod(x.shape[1:])
  if feat != kernels[0].shape[0]:
    raise ValueError(f"dense Jacobian factors: inputs have {feat} features per sample (shape {x.shape[1:]}) "
                     f"but the first layer {stack.layers[0]!r} takes {kernels[0].shape[0]}")
  return _jacobian_factors(stack, kernels, biases, x)


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


def _structured_kernel(stack, params, x1, x2, trace_outputs, chunk):
  """Dense-stack kernel ``Σ_l (A_l A_l'ᵀ + 1) ⊙ S_l`` (see :func:`_structured_contract`).

  The factors are ``O(N · Σ_l out_l · C)`` floats, so they are computed once for
  all samples; ``chunk`` (when given) only blocks the contraction over rows of
  ``x1``, bounding the intermediate kernels to ``chunk × N2``.
  """
  kernels, biases = _dense_weights(stack, params)
  in_dim = kernels[0].shape[0]
  feat = math.prod(x1.shape[1:])
  if feat != in_dim:
    raise ValueError(f"structured NTK: inputs have {feat} features per sample (shape {x1.shape[1:]}) "
                     f"but the first layer {stack.layers[0]!r} takes {in_dim}")
  num_outputs = kernels[-1].shape[1]
  features = lambda x: _dense_features(stack, kernels, biases, x, trace_outputs)
  contract = _structured_contract(trace_outputs, num_outputs)
  f1 = features(x1)
  f2 = f1 if x2 is None else features(x2)
  return _map_blocks(lambda f1b: contract(f1b, f2), f1, chunk)


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


def _check_projections(stack: DenseStack, kernels, projections) -> tuple[DenseProjection, ...]:
  if len(projections) != len(stack.layers):
    raise ValueError(f"projections must have one DenseProjection per dense_stack layer {stack.layers}, "
                     f"got {len(projections)}")
  out = []
  for name, w, proj in zip(stack.layers, kernels, projections):
    proj = DenseProjection() if proj is None else proj
    if not isinstance(proj, DenseProjection):
      raise ValueError(f"projections[{name!r}] must be a DenseProjection or None, got {type(proj).__name__}")
    for part, dim in (("kernel", w.shape[0]), ("bias", w.shape[1])):
      m = getattr(proj, part)
      if m is not None and (jnp.ndim(m) != 2 or jnp.shape(m)[0] != dim):
        raise ValueError(f"projections[{name!r}].{part} must be [{dim}, k] (it acts on the layer's "
                         f"{'input' if part == 'kernel' else 'bias'} axis of size {dim}), got {jnp.shape(m)}")
    out.append(proj)
  return tuple(out)


def _projected_features(stack, kernels, biases, projections, x, trace_outputs) -> _ProjectedFeatures:
  """Factors of the sketched kernel (derivation in :func:`projected_dense_ntk`)."""
  base = _dense_features(stack, kernels, biases, x, trace_outputs)
  inputs = tuple(a if p.kernel is None else jnp.matmul(a, p.kernel, precision=_HIGHEST)
                 for a, p in zip(base.inputs, projections))
  if all(p.bias is None for p in projections):
    return _ProjectedFeatures(inputs, base.backs, (None,) * len(projections))
  # A sketched bias needs the per-output Jacobians M_l [N, out_l, C] themselves (the traced
  # factors fold the outputs away); M_{L-1} = I because the logits are the last layer's outputs.
  ms = _jacobian_factors(stack, kernels, biases, x).outputs
  bias_backs = []
  for m, p in zip(ms, projections):
    if p.bias is None:
      bias_backs.append(None)
      continue
    g = jnp.einsum("nqc,qk->nkc", m, p.bias, precision=_HIGHEST)
    bias_backs.append(g.reshape(g.shape[0], -1) if trace_outputs else g)
  return _ProjectedFeatures(inputs, base.backs, tuple(bias_backs))


def _projected_contract(trace_outputs: bool, num_outputs: int):
  """``contract(F1, F2)`` of two :class:`_ProjectedFeatures`; the unsketched terms in the order of
  :func:`_structured_contract`, so that no sketch at all reproduces the structured kernel."""

  def layer_term(a1, a2, s, g1, g2, outer):
    if g1 is None:                                     # (Ã Ã'ᵀ + 1) ⊙ S: bias part unsketched
      return outer(_gram_plus_one(a1, a2)) * s
    bias = (jnp.matmul(g1, g2.T, precision=_HIGHEST) / num_outputs if trace_outputs
            else jnp.einsum("ika,jkb->ijab", g1, g2, precision=_HIGHEST))
    return outer(jnp.matmul(a1, a2.T, precision=_HIGHEST)) * s + bias

  def contract(f1: _ProjectedFeatures, f2: _ProjectedFeatures) -> jax.Array:
    if trace_outputs:
      outer = lambda g: g
      k = layer_term(f1.inputs[-1], f2.inputs[-1], 1.0, f1.bias_backs[-1], f2.bias_backs[-1], outer)
      for a1, a2, b1, b2, g1, g2 in zip(f1.inputs, f2.inputs, f1.backs, f2.backs, f1.bias_backs, f2.bias_backs):
        s = jnp.matmul(b1, b2.T, precision=_HIGHEST) / num_outputs
        k = k + layer_term(a1, a2, s, g1, g2, outer)
      return k
    outer = lambda g: g[:, :, None, None]
    eye = jnp.eye(num_outputs, dtype=f1.inputs[-1].dtype)
    k = layer_term(f1.inputs[-1], f2.inputs[-1], eye, f1.bias_backs[-1], f2.bias_backs[-1], outer)
    for a1, a2, m1, m2, g1, g2 in zip(f1.inputs, f2.inputs, f1.backs, f2.backs, f1.bias_backs, f2.bias_backs):
      s = jnp.einsum("iqa,jqb->ijab", m1, m2, precision=_HIGHEST)
      k = k + layer_term(a1, a2, s, g1, g2, outer)
    return k

  return contract


def projected_dense_ntk(stack: DenseStack, params: Params, x1: jax.Array, x2: jax.Array | None = None, *,
                        projections, trace_outputs: bool = True, chunk_size: int | None = None) -> jax.Array:
  """NTK of a dense stack in layer-wise sketch coordinates: ``J̃ J̃ᵀ`` with ``J̃ = J P`` (SPARK).

  ``P = blkdiag(P_l ⊗ I, P_b)`` sketches each layer's kernel along its input
  axis and its bias (:class:`DenseProjection`; ``ntk_fl.projection``'s
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
    projections: one :class:`DenseProjection` (or ``None``) per layer of ``stack``.
    trace_outputs: ``[N1, N2]`` traced (mean over outputs) or ``[N1, N2, C, C]`` full kernel.
    chunk_size: blocks the contraction over rows of ``x1`` (as ``'structured'``).

  Raises:
    ValueError: a projection that does not match its layer, params that do not
      match ``stack``, inputs of the wrong width, a bad ``chunk_size``.
  """
  if not isinstance(stack, DenseStack):
    raise ValueError(f"stack must be an ntk_fl.models.DenseStack, got {type(stack).__name__}")
  _check_chunk_size(chunk_size)
  _check_inputs(x1, x2)
  kernels, biases = _dense_weights(stack, params)
  projections = _check_projections(stack, kernels, tuple(projections))
  feat = math.prod(x1.shape[1:])
  if feat != kernels[0].shape[0]:
    raise ValueError(f"projected structured NTK: inputs have {feat} features per sample (shape "
                     f"{x1.shape[1:]}) but the first layer {stack.layers[0]!r} takes {kernels[0].shape[0]}")
  features = lambda x: _projected_features(stack, kernels, biases, projections, x, trace_outputs)
  contract = _projected_contract(trace_outputs, kernels[-1].shape[1])
  f1 = features(x1)
  f2 = f1 if x2 is None else features(x2)
  return _map_blocks(lambda f1b: contract(f1b, f2), f1, chunk_size)


# ----------------------------------------------------------------------------
# Public API.


def empirical_ntk(apply_fn: ApplyFn, params: Params, x1: jax.Array, x2: jax.Array | None = None, *,
                  trace_outputs: bool = True, implementation: str = "auto",
                  dense_stack: DenseStack | None = None, chunk_size: int | None = None) -> jax.Array:
  """Empirical NTK of ``apply_fn`` at ``params`` between ``x1`` and ``x2``.

  Args:
    apply_fn: ``apply_fn(params, x [B, *in]) -> [B, C]`` (a flax ``apply``).
    params: the linearisation point (a flax variables dict).
    x1: ``[N1, *in]`` inputs.
    x2: ``[N2, *in]`` inputs, or ``None`` for ``x2 = x1`` (shares work).
    trace_outputs: ``True`` -> ``[N1, N2]`` kernel ``(1/C) Σ_c J_c(x1) J_c(x2)ᵀ``
      (the *mean* over outputs, as neural-tangents' ``trace_axes=(-1,)``);
      ``False`` -> full ``[N1, N2, C, C]`` kernel
      ``K[i, j, a, b] = <J_a(x1_i), J_b(x2_j)>``.
    implementation: one of :data:`IMPLEMENTATIONS` (module docstring).
    dense_stack: the model's :class:`~ntk_fl.models.DenseStack` (enables and,
      under ``'auto'``, selects ``'structured'``; ignored by the others).
    chunk_size: samples per block of ``x1`` and of ``x2``; ``None`` picks one
      that keeps a block's Jacobian below 256 MiB (``'structured'``: no
      blocking, its factors are already ``O(N)``).

  Returns:
    The kernel in the dtype of the network outputs.

  Raises:
    ValueError: unknown ``implementation``; ``'structured'`` without
      ``dense_stack``; ``x1``/``x2`` feature shapes differ; non-positive
      ``chunk_size``; outputs that are not ``[B, C]``; params that do not match
      ``dense_stack``.
  """
  impl = _resolve_implementation(implementation, dense_stack, trace_outputs)
  _check_chunk_size(chunk_size)
  _check_inputs(x1, x2)
  if impl == "structured":
    return _structured_kernel(dense_stack, params, x1, x2, trace_outputs, chunk_size)

  probe = jax.ShapeDtypeStruct((1, *jnp.shape(x1)[1:]), jnp.result_type(x1))
  out = jax.eval_shape(apply_fn, params, probe)
  if len(out.shape) != 2:
    raise ValueError(f"apply_fn must return [B, C] outputs, got shape {out.shape} for a batch of 1")
  num_outputs = out.shape[1]
  chunk = chunk_size if chunk_size is not None else _default_chunk(params, num_outputs)
  if impl == "jacobian":
    return _jacobian_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, chunk)
  return _ntvp_kernel(apply_fn, params, x1, x2, trace_outputs, num_outputs, out.dtype, chunk)


def make_ntk_fn(apply_fn: ApplyFn, *, trace_outputs: bool = True, implementation: str = "auto",
                dense_stack: DenseStack | None = None, chunk_size: int | None = None):
  """A ``jit``-compiled ``ntk_fn(params, x1, x2=None)`` with the options fixed (neural-tangents style).

  The options are validated here, before any tracing. ``ntk_fn`` compiles once
  per input shape (and once more for ``x2=None``); see :func:`empirical_ntk` for
  the arguments and the returned kernel.
  """
  impl = _resolve_implementation(implementation, dense_stack, trace_outputs)
  _check_chunk_size(chunk_size)

  def ntk_fn(params: Params, x1: jax.Array, x2: jax.Array | None = None) -> jax.Array:
    return empirical_ntk(apply_fn, params, x1, x2, trace_outputs=trace_outputs, implementation=impl,
                         dense_stack=dense_stack, chunk_size=chunk_size)

  return jax.jit(ntk_fn)


def full_to_matrix(k: jax.Array) -> jax.Array:
  """``[N1, N2, C, C]`` full kernel -> ``[N1·C, N2·C]`` matrix, sample-major (row ``i·C + a``)."""
  if jnp.ndim(k) != 4 or k.shape[2] != k.shape[3]:
    raise ValueError(f"full_to_matrix expects a [N1, N2, C, C] kernel, got shape {jnp.shape(k)}")
  n1, n2, c, _ = k.shape
  return jnp.transpose(k, (0, 2, 1, 3)).reshape(n1 * c, n2 * c)


# neural-tangents' interface over the kernels above (its module imports this one lazily).
from ntk_fl._neural_tangents_api import NtkImplementation, empirical_ntk_fn  # noqa: E402
