"""``DenseStack``: the structure of a model that is a plain stack of dense layers.

A leaf module (the standard library only), so that the kernels can name the structure without
loading the model zoo (flax) or the device code; :mod:`ntk_fl.models` re-exports it.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

__all__ = ["DenseStack"]


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
