"""``ParamMap``: the coordinates an NTK step linearises in (:func:`ntk_fl.evolve.ntk_step`).

A leaf module (the standard library only): the NTK step takes a ``ParamMap`` and SPARK's sketch
(:func:`ntk_fl.projection.sketch_map`) builds one, so the sketch names the type without loading the NTK
step and its kernel stack. :mod:`ntk_fl._src.ntk_step` and :mod:`ntk_fl.evolve` re-export it.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

__all__ = ["ParamMap", "identity_map"]


class ParamMap(NamedTuple):
  """The coordinates an NTK step linearises in, and the way back to the network's parameters.

  Attributes:
    apply_fn: ``apply_fn(point, x) -> [N, C]``, the network in these coordinates.
    point: the linearisation point in these coordinates.
    to_params: maps candidate updates in these coordinates (leaves with a leading ``[T]`` axis) to updates
      of the network's parameters (same leading axis).

  :func:`identity_map` is the network itself. SPARK's sketch (:func:`ntk_fl.projection.sketch_map`) is
  ``u ↦ w̄ + P u`` at ``u = 0``, with ``Δw = P Δu``; CP-NTK-FL's flat Jacobians have the flat parameter
  vector as coordinates, mapped back by :func:`ntk_fl.jacobians.unflatten_jacobian`.
  """

  apply_fn: Callable[[Any, Any], Any]
  point: Any
  to_params: Callable[[Any], Any]


def identity_map(apply_fn: Callable[[Any, Any], Any], params) -> ParamMap:
  """The network's own parameters as the coordinates of the linearisation."""
  return ParamMap(apply_fn, params, lambda deltas: deltas)
