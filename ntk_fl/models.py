"""Models as pure ``(init, apply)`` pairs (flax modules underneath).

(Contract stub written by the lead; the models helper fills in the factories.)
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["DenseStack", "Model"]


class DenseStack(NamedTuple):
  """Structure of a model that is a plain stack of dense layers.

  ``f(x) = W_L σ(... σ(W_1 x + b_1) ...) + b_L``: ``layers`` are the names of the
  flax ``Dense`` submodules in forward order (``params['params'][name]`` holds
  ``kernel [in, out]`` and ``bias [out]``), and ``activation`` is the one
  elementwise nonlinearity applied between consecutive layers (not after the
  last). The structured NTK (:mod:`ntk_fl.ntk`) uses it to factorise the kernel.
  """
  layers: tuple[str, ...]
  activation: Callable[[Any], Any]


class Model(NamedTuple):
  """A model as pure functions.

  Attributes:
    init: ``init(key) -> params`` (a flax variables dict ``{'params': ...}``).
    apply: ``apply(params, x) -> logits``; ``x [B, *input_shape]`` -> ``[B, num_classes]``.
    input_shape: shape of one input, e.g. ``(784,)`` or ``(32, 32, 3)``.
    num_classes: number of outputs ``C``.
    dense_stack: the :class:`DenseStack` structure when the model is a pure
      dense stack (enables the structured NTK), else ``None``.
  """
  init: Callable[[Any], Any]
  apply: Callable[[Any, Any], Any]
  input_shape: tuple[int, ...]
  num_classes: int
  dense_stack: DenseStack | None = None
