"""Models as pure ``(init, apply)`` pairs (flax linen modules underneath).

Factories return a :class:`Model`: ``init(key) -> {'params': ...}`` and
``apply(params, x) -> logits``. Algorithms never see flax; they only call these
two pure functions (and read :attr:`Model.dense_stack` for the structured NTK).

Initialisation follows the authors' code (PyTorch ``kaiming_normal_`` with
``mode='fan_in'``): weights ``N(0, 2 / fan_in)`` -- an untruncated normal, unlike
``jax.nn.initializers.kaiming_normal`` which truncates at two standard deviations
-- and zero biases. For a convolution ``fan_in = kh * kw * in_channels``.

* :func:`mlp`: the papers' 784-100-10 ReLU network (79,510 parameters) and deeper
  or differently activated variants.
* :func:`cnn`: conv32-pool-conv64-pool-fc100-fc10 (the authors' ``NaiveCNN``).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from ntk_fl import parallel, validation
from ntk_fl._src.dense_stack import DenseStack
from ntk_fl._src.names import ACTIVATIONS, MODELS  # re-exported

__all__ = [
  "DenseStack",
  "Model",
  "ACTIVATIONS",
  "MODELS",
  "mlp",
  "mlp_on_inputs",
  "cnn",
  "make_model",
  "flat_inputs",
  "from_flax",
  "check_dense_stack",
  "init_clients",
  "num_params",
]


class Model(NamedTuple):
  """A model as pure functions.

  Attributes:
    init: ``init(key) -> params`` (a flax variables dict ``{'params': ...}``).
    apply: ``apply(params, x) -> logits``; ``x [B, *input_shape]`` -> ``[B, num_classes]``.
    input_shape: shape of one input, e.g. ``(784,)`` or ``(32, 32, 3)``.
    num_classes: number of outputs ``C``.
    dense_stack: the :class:`DenseStack` structure when the model is a pure
      dense stack (enables the structured NTK), else ``None``.
    flax_apply: ``apply`` without its ``jax.jit`` (the same function), so that the layer-wise
      structured NTK can intercept the flax layers it calls (:func:`ntk_fl.ntk.empirical_ntk`'s
      ``flax_apply``); ``None`` for a model that is not a flax module.
    per_sample: ``True`` when every sample's outputs depend on that sample only (the library's
      models; :func:`from_flax` checks it on a probe batch when the user declares it). The NTK
      methods then compute the kernel from per-sample Jacobians; ``False`` differentiates the
      whole batch at once (neural-tangents' ``vmap_axes=None``).
  """

  init: Callable[[Any], Any]
  apply: Callable[[Any, Any], Any]
  input_shape: tuple[int, ...]
  num_classes: int
  dense_stack: DenseStack | None = None
  flax_apply: Callable[[Any, Any], Any] | None = None
  per_sample: bool = True


# --------------------------------------------------------------------- pieces

_INIT_MODES = ("shared", "per_client")

# Kaiming-normal, fan-in, *untruncated* (see the module docstring).
_KAIMING = nn.initializers.variance_scaling(2.0, "fan_in", "normal")
_ZEROS = nn.initializers.zeros


def _identity(x):
  return x


_ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
  "relu": jax.nn.relu,
  "tanh": jnp.tanh,
  # Exact (erf) GELU, as PyTorch's default; jax.nn.gelu defaults to the tanh approximation.
  "gelu": functools.partial(jax.nn.gelu, approximate=False),
  "sigmoid": jax.nn.sigmoid,
  "softplus": jax.nn.softplus,
  "elu": jax.nn.elu,
  "silu": jax.nn.silu,
  "erf": jax.scipy.special.erf,
  "identity": _identity,
}
# ACTIVATIONS, the table's names in its order, lives in the leaf ``_src.names`` (the schema checks a
# config's activation without loading flax); tests/test_layers.py holds the two equal.


def _activation(name: str) -> Callable[[Any], Any]:
  if name not in _ACTIVATIONS:
    raise ValueError(f"unknown activation {name!r}; choose one of {ACTIVATIONS}")
  return _ACTIVATIONS[name]


def _check_positive_int(name: str, value: Any) -> int:
  return validation.check_int(name, value, low=1)


def _pure(
  module: nn.Module,
  input_shape: tuple[int, ...],
  num_classes: int,
  dense_stack: DenseStack | None,
  per_sample: bool = True,
) -> Model:
  """Wraps a flax module taking ``[B, *input_shape]`` into a :class:`Model`.

  ``apply`` accepts any number of leading batch axes (including none, handy
  under ``vmap`` over samples): they are folded into one for the module and
  restored on the logits. A ``dense_stack`` is checked against ``apply`` on a probe batch.
  """
  n_in = len(input_shape)

  def init(key):
    return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))

  def apply(params, x):
    if x.ndim < n_in or tuple(x.shape[x.ndim - n_in :]) != input_shape:
      raise ValueError(
        f"inputs must have shape [..., {', '.join(map(str, input_shape))}], got {tuple(x.shape)}"
      )
    batch = x.shape[: x.ndim - n_in]
    logits = module.apply(params, x.reshape(-1, *input_shape))
    chex.assert_shape(logits, (None, num_classes))  # a module whose head disagrees with num_classes
    return logits.reshape(*batch, num_classes)

  # jit: one compiled program instead of one dispatch per flax op for eager callers
  # (it inlines into an enclosing jit/vmap as usual).
  model = Model(
    init=jax.jit(init),
    apply=jax.jit(apply),
    input_shape=input_shape,
    num_classes=num_classes,
    dense_stack=dense_stack,
    flax_apply=apply,
    per_sample=per_sample,
  )
  if dense_stack is not None:
    check_dense_stack(model)
  return model


def check_dense_stack(model: Model, *, rtol: float = 1e-4) -> None:
  """Raises when ``model.dense_stack`` does not compute ``model.apply`` (on a probe batch).

  The structured NTK reads the declared stack's weights and never calls ``apply``, so a wrong
  declaration (an activation, a layer order) would give a wrong kernel silently. The declared
  stack's outputs on four Gaussian inputs at ``init(PRNGKey(0))`` must match ``apply``'s to
  ``rtol`` relative to the largest output (float32 rounding is ~1e-6; both computed at the highest
  matmul precision).
  """
  stack = model.dense_stack
  if not isinstance(stack, DenseStack):
    raise ValueError(f"dense_stack must be an ntk_fl.models.DenseStack, got {type(stack).__name__}")
  params = model.init(jax.random.PRNGKey(0))
  tree = params.get("params", {}) if hasattr(params, "get") else {}
  x = jax.random.normal(jax.random.PRNGKey(1), (4, *model.input_shape), jnp.float32)
  a = x.reshape(4, -1)
  for k, name in enumerate(stack.layers):
    layer = tree.get(name) if hasattr(tree, "get") else None
    if layer is None or "kernel" not in layer or "bias" not in layer:
      raise ValueError(
        f"dense_stack layer {name!r} is not a dense layer with 'kernel' and 'bias' "
        f"among the model's parameters (available: {sorted(tree)})"
      )
    w, b = layer["kernel"], layer["bias"]
    if w.ndim != 2 or w.shape[0] != a.shape[1] or b.shape != w.shape[1:]:
      raise ValueError(
        f"dense_stack layer {name!r}: kernel {w.shape} and bias {b.shape} do not "
        f"take the previous layer's {a.shape[1]} features"
      )
    a = jnp.matmul(a, w, precision=jax.lax.Precision.HIGHEST) + b
    if k < len(stack.layers) - 1:
      a = stack.activation(a)
  # Both sides in full float32: an accelerator's default matmul precision (TensorFloat-32 on an
  # H100/H200) alone moves the outputs by ~1e-3 of their scale, more than ``rtol``.
  with jax.default_matmul_precision("highest"):
    y = model.apply(params, x)
  if a.shape != y.shape:
    raise ValueError(
      f"dense_stack {stack.layers} gives outputs {a.shape} on a probe batch, apply gives {y.shape}"
    )
  err = float(jnp.max(jnp.abs(a - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30))
  if not err <= rtol:
    act = getattr(stack.activation, "__name__", repr(stack.activation))
    raise ValueError(
      f"dense_stack (layers {stack.layers}, activation {act}) does not compute the "
      f"model's apply: on a probe batch its outputs differ by {err:.3g} of the largest "
      f"output (allowed {rtol:g}); check the activation and the layers' names and order"
    )


def _check_per_sample(model: Model) -> None:
  """Raises when ``model.apply`` on a probe batch differs from ``apply`` on each sample alone."""
  params = model.init(jax.random.PRNGKey(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (4, *model.input_shape), jnp.float32)
  with jax.default_matmul_precision("highest"):  # as check_dense_stack: no TensorFloat-32 rounding
    batch = model.apply(params, x)
    single = jnp.concatenate([model.apply(params, x[i : i + 1]) for i in range(4)])
  err = float(jnp.max(jnp.abs(batch - single)) / jnp.maximum(jnp.max(jnp.abs(single)), 1e-30))
  if not err <= 1e-4:
    raise ValueError(
      f"per_sample=True, but the model's outputs on a probe batch of 4 differ from "
      f"its outputs on each sample alone by {err:.3g} of the largest output: the "
      "outputs depend on the rest of the batch (e.g. batch statistics); use "
      "per_sample=False"
    )


def from_flax(
  module: nn.Module,
  input_shape: Sequence[int],
  num_classes: int,
  *,
  per_sample: bool = False,
  dense_stack: DenseStack | None = None,
) -> Model:
  """A :class:`Model` of the user's flax module (any architecture).

  Args:
    module: a flax linen module, ``module.apply(variables, x [B, *input_shape]) -> [B, C]``,
      initialised by ``module.init(key, x)``, deterministic (no dropout rngs, no mutable
      collections).
    input_shape: shape of one input sample.
    num_classes: ``C``.
    per_sample: ``True`` declares that each sample's outputs depend on that sample only (no batch
      statistics): the NTK methods then use per-sample Jacobians and the layer-wise structured
      kernel. Checked on a probe batch. ``False`` (default, neural-tangents' ``vmap_axes=None``)
      differentiates the whole batch at once: correct for any model, but ``N`` times more work.
    dense_stack: optionally, the :class:`DenseStack` the module is (checked on a probe batch).

  Raises:
    ValueError: a module that is not a flax module, bad shapes, a declaration (``per_sample``,
      ``dense_stack``) that the probe batch contradicts.
  """
  if not isinstance(module, nn.Module):
    raise ValueError(f"module must be a flax.linen.Module, got {type(module).__name__}")
  input_shape = tuple(input_shape)
  if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in input_shape):
    raise ValueError(f"input_shape must be positive ints, got {input_shape}")
  num_classes = _check_positive_int("num_classes", num_classes)
  if not isinstance(per_sample, bool):
    raise ValueError(f"per_sample must be True or False, got {per_sample!r}")
  if dense_stack is not None and not per_sample:
    raise ValueError("a dense_stack is a per-sample model: pass per_sample=True with it")
  model = _pure(module, input_shape, num_classes, dense_stack, per_sample)
  if per_sample:
    _check_per_sample(model)
  return model


# ---------------------------------------------------------------------- MLP


class _MLP(nn.Module):
  """Dense layers ``features[0], ..., features[-1]`` with ``activation`` between them."""

  features: tuple[int, ...]
  activation: Callable[[Any], Any]

  @nn.compact
  def __call__(self, x):  # [B, input_dim] -> [B, features[-1]]
    for i, width in enumerate(self.features):
      x = nn.Dense(width, kernel_init=_KAIMING, bias_init=_ZEROS, name=f"dense_{i}")(x)
      if i < len(self.features) - 1:
        x = self.activation(x)
    return x


def mlp(
  input_dim: int = 784,
  hidden: Sequence[int] = (100,),
  num_classes: int = 10,
  activation: str = "relu",
) -> Model:
  """A fully connected network ``input_dim -> hidden... -> num_classes``.

  Args:
    input_dim: flattened input size (784 for 28x28 images).
    hidden: widths of the hidden layers; ``()`` gives a linear (softmax-regression) model.
    num_classes: number of logits ``C``.
    activation: one of :data:`ACTIVATIONS`, applied after every hidden layer.

  Returns:
    A :class:`Model` on inputs ``[B, input_dim]`` with ``dense_stack`` naming the
    layers ``dense_0, ..., dense_L`` in forward order. The default 784-100-10 has
    ``784*100 + 100 + 100*10 + 10 = 79,510`` parameters.
  """
  input_dim = _check_positive_int("input_dim", input_dim)
  num_classes = _check_positive_int("num_classes", num_classes)
  hidden = tuple(hidden)
  for width in hidden:
    _check_positive_int("hidden width", width)
  act = _activation(activation)
  features = hidden + (num_classes,)
  stack = DenseStack(layers=tuple(f"dense_{i}" for i in range(len(features))), activation=act)
  return _pure(_MLP(features=features, activation=act), (input_dim,), num_classes, stack)


def mlp_on_inputs(model: Model, input_dim: int) -> Model:
  """The MLP ``model`` (same layer widths, activation and initialisation) on ``input_dim`` inputs.

  CP-NTK-FL trains the network on secretly projected inputs ``x P`` of width
  ``d1'``: the same architecture with a narrower first layer.
  """
  if model.dense_stack is None:
    raise ValueError(
      "mlp_on_inputs needs an MLP (a model with a dense_stack), e.g. model.name='mlp'"
    )
  input_dim = _check_positive_int("input_dim", input_dim)
  shapes = jax.eval_shape(model.init, jax.random.key(0))["params"]
  features = tuple(int(shapes[name]["kernel"].shape[-1]) for name in model.dense_stack.layers)
  return _pure(
    _MLP(features=features, activation=model.dense_stack.activation),
    (input_dim,),
    model.num_classes,
    model.dense_stack,
  )


# ---------------------------------------------------------------------- CNN


@jax.custom_jvp
def _max_pool_2x2(x: jax.Array) -> jax.Array:
  """``nn.max_pool(x, (2, 2), strides=(2, 2))`` on ``[B, H, W, C]`` -> ``[B, H // 2, W // 2, C]``, with a
  derivative that XLA's CPU backend runs about 40x faster.

  The values are ``nn.max_pool``'s. Its derivative (JAX's ``select_and_gather_add`` forward,
  ``select_and_scatter_add`` backward) passes each window's tangent / cotangent through its first
  maximum in row-major window order; the rule below does the same with an ``argmax`` (first
  occurrence) and a ``where`` over the window's 4 elements, so derivatives are bit for bit the same
  (ties included) without the window scatter, which XLA's CPU backend runs element by element: a
  vmapped pullback of the CNN (the kernel's ``N·C`` cotangents, the ``τ`` candidates' updates) spent
  most of its time there.
  """
  return nn.max_pool(x, (2, 2), strides=(2, 2))


def _pool_windows(x: jax.Array) -> jax.Array:
  """``[B, H, W, C]`` -> ``[B, H // 2, W // 2, C, 4]``: each 2x2 window (an odd last row/column
  dropped, as ``'VALID'`` pooling drops it), its elements in row-major order."""
  b, h, w, c = x.shape
  x = x[:, : h // 2 * 2, : w // 2 * 2]
  x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
  return x.reshape(b, h // 2, w // 2, c, 4)


@_max_pool_2x2.defjvp
def _max_pool_2x2_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  # Linear in t through where + sum, so its transpose (the pullback) is a where, not a scatter.
  first = jax.nn.one_hot(jnp.argmax(_pool_windows(x), axis=-1), 4, dtype=bool)
  return _max_pool_2x2(x), jnp.where(first, _pool_windows(t), 0).sum(-1)


class _CNN(nn.Module):
  """conv32-relu-pool-conv64-relu-pool-fc100-relu-fc(num_classes) on NHWC images."""

  num_classes: int
  kernel_size: int

  @nn.compact
  def __call__(self, x):  # [B, H, W, C] -> [B, num_classes]
    k = (self.kernel_size, self.kernel_size)
    for i, channels in enumerate((32, 64)):
      x = nn.Conv(
        channels, k, padding="SAME", kernel_init=_KAIMING, bias_init=_ZEROS, name=f"conv_{i}"
      )(x)
      x = _max_pool_2x2(jax.nn.relu(x))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(nn.Dense(100, kernel_init=_KAIMING, bias_init=_ZEROS, name="dense_0")(x))
    return nn.Dense(self.num_classes, kernel_init=_KAIMING, bias_init=_ZEROS, name="dense_1")(x)


def cnn(
  input_shape: Sequence[int] = (32, 32, 3), num_classes: int = 10, *, kernel_size: int = 3
) -> Model:
  """The small CNN of the NTK papers' code: conv32-pool-conv64-pool-fc100-fc10, ReLU.

  The papers state no kernel size; the authors' ``NaiveCNN`` uses 3x3 kernels with
  ``'same'`` padding, stride 1, and 2x2 max pooling with stride 2, which is the
  default here (``kernel_size=5`` gives the FedAvg-paper variant). After two
  poolings the flattened feature size is ``64 * (H // 4) * (W // 4)``.

  Args:
    input_shape: one image ``(H, W, channels)``, channels last; ``H, W >= 4``.
    num_classes: number of logits ``C``.
    kernel_size: side of the square convolution kernels.

  Returns:
    A :class:`Model` on inputs ``[B, H, W, channels]``; ``dense_stack`` is ``None`` (its NTK is
    the layer-wise structured kernel through ``flax_apply``).
  """
  input_shape = tuple(input_shape)
  if len(input_shape) != 3 or any(
    isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in input_shape
  ):
    raise ValueError(
      f"cnn needs input_shape (H, W, channels) of positive ints, got {input_shape}; "
      "load image data with flatten=False"
    )
  if input_shape[0] < 4 or input_shape[1] < 4:
    raise ValueError(f"cnn pools twice by 2, so H and W must be >= 4, got {input_shape}")
  num_classes = _check_positive_int("num_classes", num_classes)
  kernel_size = _check_positive_int("kernel_size", kernel_size)
  return _pure(
    _CNN(num_classes=num_classes, kernel_size=kernel_size), input_shape, num_classes, None
  )


# --------------------------------------------------------------- from config


def make_model(model_config: Any, input_shape: Sequence[int], num_classes: int) -> Model:
  """The model of :class:`ntk_fl.settings.ModelSettings` (``name``, ``hidden``, ``activation``).

  Args:
    model_config: the run's model settings; ``name`` in :data:`MODELS`. ``init`` (when
      present) is checked against ``('shared', 'per_client')`` for
      :func:`init_clients`.
    input_shape: shape of one input sample as the data provides it. ``mlp`` uses
      ``input_dim = prod(input_shape)`` and expects flattened inputs ``[B, input_dim]``;
      ``cnn`` needs ``(H, W, channels)``.
    num_classes: number of logits ``C``.

  With ``model_config.module`` set (``'package.module:factory'``, trusted code: see
  ``ntk_fl/_src/user_model.py``) the model is ``factory(input_shape, num_classes)``, the user's
  flax module, on unflattened inputs (:func:`flat_inputs`), per-sample when
  ``model_config.per_sample`` says so.
  """
  name = model_config.name
  spec = getattr(model_config, "module", "")
  if spec:
    from ntk_fl._src import user_model  # pylint: disable=import-outside-toplevel

    input_shape = tuple(input_shape)
    return from_flax(
      user_model.build_module(spec, input_shape, num_classes),
      input_shape,
      num_classes,
      per_sample=bool(model_config.per_sample),
    )
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
  init_mode = getattr(model_config, "init", None)
  if init_mode is not None and init_mode not in _INIT_MODES:
    raise ValueError(f"unknown model.init {init_mode!r}; choose one of {_INIT_MODES}")
  if name == "mlp":
    return mlp(
      math.prod(input_shape), tuple(model_config.hidden), num_classes, model_config.activation
    )
  return cnn(tuple(input_shape), num_classes)


def flat_inputs(model_config: Any) -> bool:
  """Whether the model of ``model_config`` takes flattened inputs (the MLP) or images (CNN, user module)."""
  return model_config.name == "mlp" and not getattr(model_config, "module", "")


# ------------------------------------------------------------------ clients


def init_clients(model: Model, key: jax.Array, num_clients: int, *, shared: bool = True):
  """Stacked initial parameters of ``num_clients`` clients, leading axis ``M``.

  Args:
    model: the :class:`Model`.
    key: PRNG key. ``shared=True``: every client gets ``model.init(key)`` (the
      papers' default, one common initialisation). ``shared=False``: client ``i``
      gets ``model.init(jax.random.split(key, M)[i])``, independent draws.
    num_clients: ``M``.

  Returns:
    The params pytree with every leaf of shape ``[M, *leaf_shape]``.
  """
  num_clients = _check_positive_int("num_clients", num_clients)
  if shared:
    params = model.init(key)
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *a.shape)), params)
  else:
    stacked = parallel.for_each_client(model.init, chunk_size=0)(jax.random.split(key, num_clients))
  chex.assert_tree_shape_prefix(stacked, (num_clients,))
  return stacked


def num_params(params) -> int:
  """Number of scalars in a params pytree (for stacked params: ``M`` times one model's count)."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
