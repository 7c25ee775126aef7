"""The layer-wise structured empirical NTK of any flax model (private: used through :mod:`ntk_fl.ntk`).

The layers are found by intercepting the model's calls (``flax.linen.intercept_methods``) on a probe
sample, not from a declaration. For a network ``f(w, x) -> [C]`` whose parameters split into layers
``l`` and a remainder ``r``, the kernel is a sum over parameter groups,
``K = Σ_l K_l + K_r``, each computed the cheaper of two ways:

* **Factorised** (``nn.Dense``, and ``nn.Conv`` on its input patches). A layer computes
  ``z_t = A_t W + b`` at ``T`` positions ``t`` per sample (``T = 1`` for a dense layer on ``[B, d]``
  inputs; the product of the leading axes for a dense layer on ``[B, T, d]``; the output pixels for a
  convolution, with ``A_t`` the input patch of ``k²·c_in`` values). With the output cotangents
  ``G_c[t] = ∂f_c/∂z_t`` ``[T, d_out]`` -- one VJP per output ``c`` with respect to a zero perturbation
  added to the layer's output -- the per-sample Jacobian is ``∂f_c/∂W = Σ_t A_tᵀ G_c[t]``, so

  ``K_l[i, j] = (1/C) Σ_c Σ_{t,s} (A(x_i)_t · A(x'_j)_s) (G_c(x_i)[t] · G_c(x'_j)[s])
  + (1/C) Σ_c (Σ_t G_c(x_i)[t]) · (Σ_s G_c(x'_j)[s])`` (the last term is the bias; for
  ``T = 1`` both together are ``(A Aᵀ + 1) ⊙ (1/C) Σ_c G_c G_cᵀ``, the dense-stack kernel's layer
  term). Cost ``2·N1·N2·T²·(d_in + C·d_out)`` FLOPs traced and ``2·N1·N2·T²·(d_in + C²·d_out)``
  full (``K[i, j, a, b]`` keeps the output pair ``(a, b)``), with ``d_in = k²·c_in`` for a
  convolution.
* **Contraction** of the per-sample gradients of the layer's leaves, as for every other parameter:
  ``2·N1·N2·C·d_l`` FLOPs traced, ``2·N1·N2·C²·d_l`` full (``d_l`` = the layer's parameter count,
  ``d_in·d_out + d_out``). The per-sample gradients of the remainder (and of layers routed here) are
  one ``vmap`` of ``jacrev`` over the samples, restricted to those leaves.

The route of each layer is chosen from these counts (shapes only; the ``N1·N2`` factor is common).
The library's CNN on 28x28x1 images routes both dense layers (313,600 + 1,000 weights) to
factorisation and both convolutions (patches of 784 and 196 positions) to contraction.

A layer is factorised only when the analysis applies exactly, otherwise its leaves join the
contraction: a ``flax.linen.Dense`` or ``flax.linen.Conv`` (exact types: a subclass may change the
computation) whose ``__call__`` runs once per sample (a module called twice shares its weights
between two places of the network), in the model's own trace (not inside a lifted transform such as
``nn.vmap``/``nn.scan``), with the default ``dot_general``/``conv_general_dilated``, and whose
parameters in the variables are exactly ``kernel`` (and ``bias``) of the shapes it uses; a
convolution additionally needs ``feature_group_count=1``, no input dilation, no mask and ``'SAME'``,
``'VALID'`` or explicit padding.

Samples must be independent (``f`` maps each sample on its own): the factors are computed per sample
(``vmap`` over single samples), so a model whose outputs depend on the rest of the batch has no
per-sample factors and is rejected by the callers (neural-tangents' ``vmap_axes=None``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST

Params = Any
Path = tuple[str, ...]


class Layer(NamedTuple):
  """One intercepted ``nn.Dense``/``nn.Conv`` call (static; shapes per sample).

  Attributes:
    path: the module's path in the variables (``params['params'][path...]``).
    kind: ``'dense'`` or ``'conv'``.
    use_bias: whether the layer has a ``bias``.
    positions: ``T``, positions per sample (see the module docstring).
    d_in: ``A``'s features per position (a convolution: the patch size ``k²·c_in``).
    d_out: output features per position.
    out_shape: the layer output's shape for one sample (the perturbation's shape).
    conv: a convolution's patch arguments (``None`` for a dense layer).
  """

  path: Path
  kind: str
  use_bias: bool
  positions: int
  d_in: int
  d_out: int
  out_shape: tuple[int, ...]
  conv: Any = None


class Plan(NamedTuple):
  """The routes of one model: factorised layers and the parameter counts of both routes.

  Attributes:
    factorised: the layers computed by factorisation.
    contracted: the intercepted layers that are cheaper (or only possible) by contraction, with
      the reason, for reports.
    num_outputs: ``C``.
    num_rest: parameters contracted (everything but the factorised layers).
    from_factors: the contracted layers whose per-sample Jacobians are formed from their factors
      (``∂f_c/∂W = Σ_t A_tᵀ G_c[t]``, one batched matrix product) rather than by differentiating
      the parameters: the layers that could be factorised but are cheaper contracted.
  """

  factorised: tuple[Layer, ...]
  contracted: tuple[tuple[Path, str], ...]
  num_outputs: int
  num_rest: int
  from_factors: tuple[Layer, ...] = ()


# ----------------------------------------------------------------------------
# FLOP counts (2 per multiply-add; forward and backward passes, common to both routes, omitted).


def factorised_flops(
  layer: Layer, num_outputs: int, trace_outputs: bool, n1: int = 1, n2: int = 1
) -> int:
  """``2·N1·N2·T²·(d_in + C^k·d_out)`` (+ ``2·N1·N2·C^k·d_out`` for the bias when ``T > 1``), ``k = 1``
  traced, ``2`` full."""
  ck = num_outputs if trace_outputs else num_outputs**2
  t = layer.positions
  bias = ck * layer.d_out if layer.use_bias and t > 1 else 0
  return 2 * n1 * n2 * (t * t * (layer.d_in + ck * layer.d_out) + bias)


def contraction_flops(
  num_params: int, num_outputs: int, trace_outputs: bool, n1: int = 1, n2: int = 1
) -> int:
  """``2·N1·N2·C·d`` traced, ``2·N1·N2·C²·d`` full: per-sample gradients of ``d`` parameters contracted."""
  ck = num_outputs if trace_outputs else num_outputs**2
  return 2 * n1 * n2 * ck * num_params


def layer_params(layer: Layer) -> int:
  return layer.d_in * layer.d_out + (layer.d_out if layer.use_bias else 0)


def plan_flops(plan: Plan, trace_outputs: bool, n1: int, n2: int) -> int:
  """FLOPs of the layer-wise kernel for ``N1 × N2`` samples (the Gram / contraction terms)."""
  c = plan.num_outputs
  return sum(
    factorised_flops(layer, c, trace_outputs, n1, n2) for layer in plan.factorised
  ) + contraction_flops(plan.num_rest, c, trace_outputs, n1, n2)


# ----------------------------------------------------------------------------
# Discovery.


def _tree_at(tree: Any, path: Path) -> Any:
  for name in path:
    if not isinstance(tree, dict) and not hasattr(tree, "keys"):
      return None
    if name not in tree:
      return None
    tree = tree[name]
  return tree


def _conv_patch_args(module: nn.Conv, x_ndim: int) -> tuple[dict, str] | tuple[None, str]:
  """``conv_general_dilated_patches`` arguments reproducing ``module`` exactly, or ``(None, why)``."""
  if module.feature_group_count != 1:
    return None, "feature_group_count != 1"
  if module.mask is not None:
    return None, "masked kernel"
  if module.conv_general_dilated is not None or module.conv_general_dilated_cls is not None:
    return None, "custom conv_general_dilated"
  kernel_size = (
    (module.kernel_size,) if isinstance(module.kernel_size, int) else tuple(module.kernel_size)
  )
  nd = len(kernel_size)
  if x_ndim < nd + 1:
    return None, "input without a channel axis"

  def as_tuple(v):
    if v is None:
      return (1,) * nd
    return (v,) * nd if isinstance(v, int) else tuple(v)

  if as_tuple(module.input_dilation) != (1,) * nd:
    return None, "input dilation"
  padding = module.padding
  if isinstance(padding, str):
    if padding not in ("SAME", "VALID"):
      return None, f"padding {padding!r}"
  elif isinstance(padding, int):
    padding = ((padding, padding),) * nd
  else:
    padding = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
    if len(padding) != nd:
      return None, f"padding {module.padding!r}"
  return dict(
    filter_shape=kernel_size,
    window_strides=as_tuple(module.strides),
    padding=padding,
    rhs_dilation=as_tuple(module.kernel_dilation),
    nd=nd,
  ), ""


def _record_call(calls: dict, module: nn.Module, x: Any, y: Any, trace: Any) -> None:
  path = tuple(module.path)
  entry = calls.setdefault(path, {"count": 0})
  entry["count"] += 1
  entry.update(
    module=module,
    x_shape=tuple(jnp.shape(x)),
    y_shape=tuple(jnp.shape(y)),
    same_trace=getattr(x, "_trace", None) is trace and trace is not None,
  )


def _route(
  path: Path, entry: dict, tree: Any, num_outputs: int, trace_outputs: bool, force: bool = False
):
  """``(Layer, '')`` when ``path`` is factorised, ``(Layer, why)`` when it could be but contraction
  is cheaper (``force``: factorised whatever the cost), else ``(None, why)``."""
  module = entry["module"]
  if entry["count"] != 1:
    return None, f"called {entry['count']} times"
  if not entry["same_trace"]:
    return None, "inside a lifted transform"
  leaves = _tree_at(tree, path)
  names = {"kernel", "bias"} if module.use_bias else {"kernel"}
  if leaves is None or set(leaves.keys()) != names:
    return None, "parameters other than kernel/bias"
  kernel = leaves["kernel"]
  x_shape, y_shape = entry["x_shape"], entry["y_shape"]
  if type(module) is nn.Dense:  # noqa: E721 (exact type: a subclass may compute differently)
    if module.dot_general is not None or module.dot_general_cls is not None:
      return None, "custom dot_general"
    if kernel.shape != (x_shape[-1], module.features):
      return None, "kernel shape differs from its use"
    layer = Layer(
      path, "dense", module.use_bias, math.prod(x_shape[:-1]), x_shape[-1], module.features, y_shape
    )
  else:
    conv, why = _conv_patch_args(module, len(x_shape))
    if conv is None:
      return None, why
    if kernel.shape != (*conv["filter_shape"], x_shape[-1], module.features):
      return None, "kernel shape differs from its use"
    layer = Layer(
      path,
      "conv",
      module.use_bias,
      math.prod(y_shape[:-1]),
      math.prod(conv["filter_shape"]) * x_shape[-1],
      module.features,
      y_shape,
      conv,
    )
  if module.use_bias and leaves["bias"].shape != (module.features,):
    return None, "bias shape differs from its use"
  flops_f = factorised_flops(layer, num_outputs, trace_outputs)
  flops_c = contraction_flops(layer_params(layer), num_outputs, trace_outputs)
  if flops_f >= flops_c and not force:
    return layer, f"contraction is cheaper ({flops_c} vs {flops_f} FLOPs per sample pair)"
  return layer, ""


def make_plan(
  apply_fn: Callable,
  params: Params,
  x_probe: jax.Array,
  trace_outputs: bool,
  route: str | None = None,
) -> Plan:
  """The layers of ``apply_fn`` on one sample ``x_probe [1, *in]`` and the route of each.

  ``route`` (tests): ``'factorise'`` factorises every eligible layer regardless of cost,
  ``'contract'`` none (every parameter's Jacobian by differentiation); ``None`` picks the cheaper,
  and forms the Jacobians of the eligible layers it contracts from their factors.
  """
  calls: dict = {}

  def interceptor(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and type(context.module) in (nn.Dense, nn.Conv) and args:
      _record_call(calls, context.module, args[0], y, trace_box[0])
    return y

  trace_box = [None]

  def probe(p, x):
    trace_box[0] = getattr(x, "_trace", None)
    with nn.intercept_methods(interceptor):
      return apply_fn(p, x)

  out = jax.eval_shape(probe, params, x_probe)
  if not isinstance(out, jax.ShapeDtypeStruct) or len(out.shape) != 2:
    raise ValueError(f"the structured kernel needs outputs [B, C], got {out}")
  num_outputs = out.shape[1]
  tree = params.get("params", params) if hasattr(params, "get") else params
  factorised, contracted, from_factors = [], [], []
  for path, entry in calls.items():
    layer, why = _route(path, entry, tree, num_outputs, trace_outputs, force=route == "factorise")
    if layer is not None and route == "contract":
      layer, why = None, "route='contract'"
    if layer is None or why:
      contracted.append((path, why))
      if layer is not None:
        from_factors.append(layer)
    else:
      factorised.append(layer)
  total = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  rest = total - sum(layer_params(layer) for layer in factorised)
  return Plan(tuple(factorised), tuple(contracted), num_outputs, rest, tuple(from_factors))


# ----------------------------------------------------------------------------
# Factors.


class Features(NamedTuple):
  """Per-sample factors of a block of ``b`` samples.

  Attributes:
    inputs: per factorised layer, ``A`` ``[b, T, d_in]``.
    cotangents: per factorised layer, ``G`` ``[b, C, T, d_out]``.
    rest: per-sample Jacobians of the contracted leaves (pytree of ``[b, C, *leaf]``).
  """

  inputs: tuple[jax.Array, ...]
  cotangents: tuple[jax.Array, ...]
  rest: Any


def _split(params: Params, paths: set[Path]) -> tuple[Any, Any]:
  """``(rest, fixed)``: ``params`` with the factorised layers' leaves set to ``None`` / the others."""

  def walk(tree, prefix):
    if isinstance(tree, dict) or (hasattr(tree, "items") and not hasattr(tree, "shape")):
      if prefix in paths:
        return None, tree
      rest, fixed = {}, {}
      for k, v in tree.items():
        rest[k], fixed[k] = walk(v, prefix + (k,))
      return rest, fixed
    return tree, None

  if hasattr(params, "get") and "params" in params:
    out_rest, out_fixed = {}, {}
    for col, tree in params.items():
      if col == "params":
        out_rest[col], out_fixed[col] = walk(tree, ())
      else:
        out_rest[col], out_fixed[col] = tree, None
    return out_rest, out_fixed
  return walk(params, ())


def _merge(rest: Any, fixed: Any) -> Any:
  if fixed is None:
    return rest
  if rest is None:
    return fixed
  return {k: _merge(rest[k], fixed[k]) for k in rest}


def _patches(layer: Layer, x: jax.Array) -> jax.Array:
  """A convolution's input patches ``[T, k²·c_in]`` for one sample (any order within a patch)."""
  conv = layer.conv
  nd = conv["nd"]
  x = x.reshape(-1, *x.shape[-(nd + 1) :])
  spatial = "".join("HWDABEFGIJ"[:nd])
  spec = ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")
  p = jax.lax.conv_general_dilated_patches(
    x,
    conv["filter_shape"],
    conv["window_strides"],
    conv["padding"],
    rhs_dilation=conv["rhs_dilation"],
    dimension_numbers=spec,
    precision=_HIGHEST,
  )
  return p.reshape(-1, p.shape[-1])


def _jacobian_from_factors(layer: Layer, a: jax.Array, g: jax.Array) -> dict:
  """A layer's per-sample Jacobian ``{'kernel': [b, C, d_in·d_out], 'bias': [b, C, d_out]}`` from
  its factors ``a [b, T, d_in]``, ``g [b, C, T, d_out]``: ``Σ_t A_tᵀ G_c[t]`` and ``Σ_t G_c[t]``.

  The kernel's entries are in the patches' order, not the parameter's: the contraction sums
  over all of them, so only both sides' sharing one order matters.
  """
  w = jnp.einsum("btp,bctq->bcpq", a, g, precision=_HIGHEST)
  out = {"kernel": w.reshape(*w.shape[:2], -1)}
  if layer.use_bias:
    out["bias"] = g.sum(2)
  return out


def _insert(tree: Any, path: Path, value: Any) -> Any:
  """``tree`` (nested dicts) with ``value`` at ``path`` (a copy along the path)."""
  if not path:
    return value
  out = dict(tree or {})
  out[path[0]] = _insert(out.get(path[0]), path[1:], value)
  return out


def features_fn(apply_fn: Callable, params: Params, plan: Plan) -> Callable[[jax.Array], Features]:
  """``features(x [b, *in]) -> Features``: one ``vmap`` of ``jacrev`` over single samples, with
  respect to the remaining parameters and to a zero perturbation of every intercepted layer's
  output (the cotangents ``G``); the layers of ``plan.from_factors`` join ``rest`` as Jacobians
  formed from their factors."""
  intercepted = plan.factorised + plan.from_factors
  by_path = {layer.path: layer for layer in intercepted}
  rest, fixed = _split(params, set(by_path))

  def single(rest_p, eps, xi):
    inputs = {}

    def interceptor(next_fun, args, kwargs, context):
      y = next_fun(*args, **kwargs)
      if context.method_name != "__call__":
        return y
      layer = (
        by_path.get(tuple(context.module.path))
        if type(context.module) in (nn.Dense, nn.Conv)
        else None
      )
      if layer is None:
        return y
      x = args[0]
      a = x.reshape(-1, layer.d_in) if layer.kind == "dense" else _patches(layer, x)
      inputs[layer.path] = a
      return y + eps[layer.path].astype(y.dtype)

    with nn.intercept_methods(interceptor):
      out = apply_fn(_merge(rest_p, fixed), xi[None])
    missing = set(by_path) - set(inputs)
    if missing:
      raise ValueError(
        f"layers {sorted(missing)} were found on the probe sample but not called "
        "again: the model's apply must not be jit-compiled or depend on the batch"
      )
    return out[0], tuple(inputs[layer.path] for layer in intercepted)

  def features(x: jax.Array) -> Features:
    dtype = jax.eval_shape(lambda p, xx: apply_fn(p, xx), params, x[:1]).dtype
    eps = {layer.path: jnp.zeros(layer.out_shape, dtype) for layer in intercepted}
    jac = jax.jacrev(single, argnums=(0, 1), has_aux=True)
    (j_rest, j_eps), a = jax.vmap(jac, in_axes=(None, None, 0))(rest, eps, x)
    g = tuple(
      j_eps[layer.path].reshape(x.shape[0], plan.num_outputs, layer.positions, layer.d_out)
      for layer in intercepted
    )
    k = len(plan.factorised)
    if plan.from_factors:
      tree = j_rest["params"] if "params" in j_rest else j_rest
      for layer, a_l, g_l in zip(plan.from_factors, a[k:], g[k:]):
        tree = _insert(tree, layer.path, _jacobian_from_factors(layer, a_l, g_l))
      j_rest = {**j_rest, "params": tree} if "params" in j_rest else tree
    return Features(a[:k], g[:k], j_rest)

  return features


# ----------------------------------------------------------------------------
# Contraction of two blocks' factors.


def _rest_kernel(j1: Any, j2: Any, trace_outputs: bool) -> jax.Array | None:
  terms = []
  for a, b in zip(jax.tree.leaves(j1), jax.tree.leaves(j2)):
    a = a.reshape(a.shape[0], a.shape[1], -1)
    b = b.reshape(b.shape[0], b.shape[1], -1)
    if trace_outputs:
      terms.append(jnp.einsum("icd,jcd->ij", a, b, precision=_HIGHEST) / a.shape[1])
    else:
      terms.append(jnp.einsum("iad,jbd->ijab", a, b, precision=_HIGHEST))
  return sum(terms[1:], terms[0]) if terms else None


def _layer_kernel(layer: Layer, a1, a2, g1, g2, trace_outputs: bool) -> jax.Array:
  """One factorised layer's term (module docstring); ``a`` ``[b, T, d_in]``, ``g`` ``[b, C, T, d_out]``."""
  c = g1.shape[1]
  if layer.positions == 1:
    pa = jnp.matmul(a1[:, 0], a2[:, 0].T, precision=_HIGHEST)
    if layer.use_bias:
      pa = pa + 1
    if trace_outputs:
      g1f, g2f = g1.reshape(g1.shape[0], -1), g2.reshape(g2.shape[0], -1)
      return pa * jnp.matmul(g1f, g2f.T, precision=_HIGHEST) / c
    s = jnp.einsum("iaq,jbq->ijab", g1[:, :, 0], g2[:, :, 0], precision=_HIGHEST)
    return pa[:, :, None, None] * s
  pa = jnp.einsum("itp,jsp->itjs", a1, a2, precision=_HIGHEST)
  if trace_outputs:
    pg = jnp.einsum("ictq,jcsq->itjs", g1, g2, precision=_HIGHEST) / c
    k = jnp.einsum("itjs,itjs->ij", pa, pg, precision=_HIGHEST)
    if layer.use_bias:
      k = k + jnp.einsum("icq,jcq->ij", g1.sum(2), g2.sum(2), precision=_HIGHEST) / c
    return k
  pg = jnp.einsum("iatq,jbsq->itjsab", g1, g2, precision=_HIGHEST)
  k = jnp.einsum("itjs,itjsab->ijab", pa, pg, precision=_HIGHEST)
  if layer.use_bias:
    k = k + jnp.einsum("iaq,jbq->ijab", g1.sum(2), g2.sum(2), precision=_HIGHEST)
  return k


def contract_fn(plan: Plan, trace_outputs: bool) -> Callable[[Features, Features], jax.Array]:
  def contract(f1: Features, f2: Features) -> jax.Array:
    k = _rest_kernel(f1.rest, f2.rest, trace_outputs)
    for layer, a1, a2, g1, g2 in zip(
      plan.factorised, f1.inputs, f2.inputs, f1.cotangents, f2.cotangents
    ):
      term = _layer_kernel(layer, a1, a2, g1, g2, trace_outputs)
      k = term if k is None else k + term
    if k is None:  # a model without parameters
      n1 = jax.tree.leaves(f1)[0].shape[0] if jax.tree.leaves(f1) else 0
      raise ValueError(f"the model has no parameters (n1={n1})")
    return k

  return contract


def feature_floats(plan: Plan) -> int:
  """Floats of one sample's :class:`Features` (the blocks' memory)."""
  c = plan.num_outputs
  return (
    sum(layer.positions * (layer.d_in + c * layer.d_out) for layer in plan.factorised)
    + c * plan.num_rest
  )


# ----------------------------------------------------------------------------
# The kernel.


def layerwise_kernel(
  apply_fn: Callable,
  params: Params,
  x1: jax.Array,
  x2: jax.Array | None,
  trace_outputs: bool,
  chunk: int | None,
  *,
  route: str | None = None,
  plan: Plan | None = None,
  blocked: Callable | None = None,
) -> jax.Array:
  """``K = Σ_l K_l + K_r`` ``[N1, N2]`` traced or ``[N1, N2, C, C]`` full (module docstring).

  ``apply_fn(params, x [B, *in]) -> [B, C]`` must reach its flax layers without a ``jax.jit``
  boundary (a compiled function's cached trace would not be intercepted) and map samples
  independently. ``chunk``: samples per block (``None``: a block's factors below ``2**26``
  floats); ``blocked``: the block scheduler (:func:`ntk_fl._src.kernels._blocked_kernel`'s signature,
  which keeps all of ``x2``'s factors when they fit in the storage budget).
  """
  if plan is None:
    plan = make_plan(apply_fn, params, x1[:1], trace_outputs, route)
  features = features_fn(apply_fn, params, plan)
  contract = contract_fn(plan, trace_outputs)
  if chunk is None:
    chunk = max(1, 2**26 // max(1, feature_floats(plan)))
  itemsize = jax.eval_shape(apply_fn, params, x1[:1]).dtype.itemsize
  return blocked(features, features, contract, x1, x2, chunk, feature_floats(plan), itemsize)


# ----------------------------------------------------------------------------
# The weight update's pullback with the convolutions' weight gradients from their patches.


def plan_convs(plan: Plan) -> tuple[Layer, ...]:
  """The eligible convolutions of a :func:`make_plan` plan (``route`` ``None`` or ``'factorise'``),
  whatever their kernel route: either way every eligible layer is factorised or contracted from
  its factors."""
  return tuple(layer for layer in plan.factorised + plan.from_factors if layer.kind == "conv")


def conv_layers(apply_fn: Callable, params: Params, x_probe: jax.Array) -> tuple[Layer, ...]:
  """The model's eligible convolutions (``Layer``s of kind ``'conv'``, whatever their kernel route)."""
  return plan_convs(make_plan(apply_fn, params, x_probe, True, route="factorise"))


def patch_vjp(apply_fn: Callable, params: Params, x: jax.Array, convs: tuple[Layer, ...]):
  """``(f(params, x) [B, C], pullback)`` as ``jax.vjp(lambda p: apply_fn(p, x), params)`` gives them,
  with each convolution's weight gradient formed from its input patches instead of differentiated.

  A convolution ``z_t = A_t W + b`` over the batch's ``B·T`` positions has ``∂L/∂W = Σ_t A_tᵀ G_t``
  and ``∂L/∂b = Σ_t G_t`` for the cotangents ``G_t`` of its output: one matrix product
  ``[k²·c_in, B·T] @ [B·T, c_out]``. XLA's CPU backend lowers the differentiated weight gradient
  (a convolution whose window is the whole image) to its generic loop inside a compiled loop body
  (a step over clients with ``lax.map``), several times slower than that product; the input
  gradients, ordinary convolutions, stay. Same values up to float rounding.

  ``apply_fn`` must reach its flax layers without a ``jax.jit`` boundary; ``convs``:
  :func:`conv_layers` of the model.
  """
  by_path = {layer.path: layer for layer in convs}
  rest, fixed = _split(params, set(by_path))
  eps = {
    layer.path: jnp.zeros((x.shape[0], *layer.out_shape[1:]), jnp.result_type(x)) for layer in convs
  }

  def forward(rest_p, eps):
    patches = {}

    def interceptor(next_fun, args, kwargs, context):
      y = next_fun(*args, **kwargs)
      layer = by_path.get(tuple(context.module.path)) if type(context.module) is nn.Conv else None
      if context.method_name != "__call__" or layer is None:
        return y
      patches[layer.path] = _patches(layer, args[0])
      return y + eps[layer.path].astype(y.dtype)

    with nn.intercept_methods(interceptor):
      y = apply_fn(_merge(rest_p, fixed), x)
    return y, patches

  out, pull, patches = jax.vjp(forward, rest, eps, has_aux=True)

  def pullback(cotangent):
    g_rest, g_eps = pull(cotangent)
    tree = g_rest["params"] if "params" in g_rest else g_rest
    for layer in convs:
      g = g_eps[layer.path].reshape(-1, layer.d_out)
      a = patches[layer.path]  # [B·T, c_in·k²], the channel slowest (conv_general_dilated_patches)
      w = jnp.matmul(a.T, g, precision=_HIGHEST)
      c_in = layer.d_in // math.prod(layer.conv["filter_shape"])
      w = w.reshape(c_in, *layer.conv["filter_shape"], layer.d_out)
      grads = {"kernel": jnp.moveaxis(w, 0, -2)}  # [k.., c_in, c_out], the kernel's layout
      if layer.use_bias:
        grads["bias"] = g.sum(0)
      tree = _insert(tree, layer.path, grads)
    return ({**g_rest, "params": tree} if "params" in g_rest else tree,)

  return out, pullback
