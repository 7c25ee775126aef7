"""The options of the NTK kernel, evolution and client step, as enums checked once where they enter.

It also holds :data:`AGGREGATES`, evaluation's choices of the aggregated model, so that the method
interface (``ntk_fl.algorithms.base``) names them without importing the evaluator.

Every option is a ``StrEnum`` (in the spirit of neural-tangents' ``NtkImplementation``): a member equals its
string value, so configs and callers may pass either; the kernel implementation is neural-tangents'
``NtkImplementation`` itself, an ``IntEnum`` whose members also answer to this library's string
names, and :func:`parse` turns a string into the member once, at the public entry point; below it
the code compares members and never re-checks. The ``τ`` grid is checked
once by :func:`check_taus`, which returns a :class:`TauGrid` that later calls accept without checking again.
"""

from __future__ import annotations

import enum
import numbers
from typing import TypeVar
from collections.abc import Sequence

import jax
import numpy as np

__all__ = [
  "AGGREGATES",
  "Choice",
  "Loss",
  "Solver",
  "Select",
  "Kernel",
  "MseForm",
  "JacobianPath",
  "NtkImplementation",
  "Implementation",
  "IMPLEMENTATIONS",
  "TauGrid",
  "parse",
  "check_taus",
  "check_loss_solver",
]


AGGREGATES = ("params", "ensemble_probs", "ensemble_logits")
"""What the aggregated model is: the mean of the parameters, or an ensemble averaging probabilities / logits
(public as ``ntk_fl.metrics.AGGREGATES``)."""


class Choice(enum.StrEnum):
  """A config option: a ``StrEnum`` whose ``repr`` is its string's (``'ce'``), so error messages and
  printed settings read as the config does."""

  def __repr__(self) -> str:
    return repr(self.value)


class Loss(Choice):
  """Training loss of the evolution: mean cross-entropy, or half mean squared error ``(1/(2NC)) Σ (f − Y)²``."""

  CE = "ce"
  MSE = "mse"


class Solver(Choice):
  """Cross-entropy evolution: exact function-space gradient descent (``EULER``) or the gradient flow
  integrated by Dopri5 (``ODE``, the reference codes' numerics). The MSE evolution is always a closed form."""

  EULER = "euler"
  ODE = "ode"


class Select(Choice):
  """How the ``τ`` candidates are scored: the non-linear network ``w + Δw_τ`` (``NETWORK``, the reference codes)
  or the evolved function values ``f_τ`` of the linearised model (``LINEARIZED``, the papers' reading)."""

  NETWORK = "network"
  LINEARIZED = "linearized"


class Kernel(Choice):
  """``TRACED``: ``[N, N]`` ``(1/C) Σ_c J_c J_cᵀ`` applied to every output column; ``FULL``: ``[N, N, C, C]``."""

  TRACED = "traced"
  FULL = "full"


class MseForm(Choice):
  """The MSE closed form: exact gradient descent (``DISCRETE``) or the gradient flow in step units
  (``CONTINUOUS``)."""

  DISCRETE = "discrete"
  CONTINUOUS = "continuous"


class JacobianPath(Choice):
  """How a method that sends Jacobians forms them (SPARK's and NTK-FL's ``jacobian``): ``EXPLICIT``
  materialises ``J``, ``IMPLICIT`` uses only products with it (VJPs), ``AUTO`` materialises it only when
  compression alters it."""

  AUTO = "auto"
  IMPLICIT = "implicit"
  EXPLICIT = "explicit"


class NtkImplementation(enum.IntEnum):
  """How an empirical NTK is computed (neural-tangents' enum and values; the kernel does not depend on it).

  Trade-offs in :mod:`ntk_fl.ntk`. Each member also answers to this library's short name, as an alias
  (``JACOBIAN`` is ``JACOBIAN_CONTRACTION``) and as a string (``NtkImplementation('jacobian')``):

  * ``AUTO`` (``'auto'``): ``STRUCTURED_DERIVATIVES`` given a dense stack, or given the model's flax
    computation when the layer-wise kernel needs fewer FLOPs; else, for the traced kernel,
    ``NTK_VECTOR_PRODUCTS`` when the network uses each weight once per sample (forward FLOPs at most
    ``2.5·d``) and the kernel has at most 256² sample pairs, else ``JACOBIAN_CONTRACTION``; for the
    full kernel ``NTK_VECTOR_PRODUCTS`` when one sample's forward FLOPs are at most ``C·d`` (dense
    nets), else ``JACOBIAN_CONTRACTION`` (conv nets). The rule: ``ntk_fl._src.kernels.generic_choice``.
  * ``JACOBIAN_CONTRACTION`` (``'jacobian'``): per-sample Jacobians contracted (any model; best generic
    choice for the traced kernel).
  * ``NTK_VECTOR_PRODUCTS`` (``'ntvp'``): the per-sample Jacobian rows of ``x2`` pushed through ``jvp``s
    at ``x1`` (any model; ``C`` times fewer FLOPs for the full kernel of a dense net).
  * ``STRUCTURED_DERIVATIVES`` (``'structured'``): the dense-stack factorisation (MLPs: ~1000x fewer
    FLOPs), or the layer-wise one of any flax model (dense layers factorised, the rest contracted; the
    library's CNN: ~15x fewer FLOPs); needs ``dense_stack`` or the flax computation (``flax_apply``).
  """

  AUTO = 0
  JACOBIAN_CONTRACTION = 1
  NTK_VECTOR_PRODUCTS = 2
  STRUCTURED_DERIVATIVES = 3
  # This library's short names: aliases of the same members.
  JACOBIAN = 1
  NTVP = 2
  STRUCTURED = 3

  @property
  def short_name(self) -> str:
    """This library's string name of the member: ``'auto'``, ``'jacobian'``, ``'ntvp'`` or ``'structured'``."""
    return _SHORT_NAMES[self.value]

  @classmethod
  def _missing_(cls, value):
    if isinstance(value, str) and value in _SHORT_NAMES:
      return cls(_SHORT_NAMES.index(value))
    return None


_SHORT_NAMES = ("auto", "jacobian", "ntvp", "structured")  # indexed by NtkImplementation's value
IMPLEMENTATIONS = _SHORT_NAMES
"""The string names :func:`ntk_fl.ntk.empirical_ntk` accepts for ``implementation``."""

Implementation = NtkImplementation
"""This library's earlier name of :class:`NtkImplementation` (the same class)."""


E = TypeVar("E", bound=enum.StrEnum)


def parse(kind: type[E], value, name: str) -> E:
  """``value`` as a member of ``kind``; a ``ValueError`` naming ``name``, the value and the allowed ones."""
  if isinstance(value, kind):
    return value
  try:
    return kind(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} is not one of {tuple(m.value for m in kind)}") from None


def check_loss_solver(loss: Loss, solver: Solver) -> None:
  """The one rule tying two options: the ODE solver integrates the cross-entropy flow only."""
  if loss == Loss.MSE and solver == Solver.ODE:
    raise ValueError(
      "solver='ode' is only defined for loss='ce'; the MSE evolution is always the closed form "
      "(leave solver='euler' and choose mse_form='discrete' or 'continuous')"
    )


class TauGrid(tuple):
  """A checked ``τ`` grid (non-empty, strictly ascending positive ints); made by :func:`check_taus` only."""

  __slots__ = ()


def check_taus(taus: Sequence[int]) -> TauGrid:
  """Validates a static ``τ`` grid: a non-empty, strictly ascending tuple of positive ints.

  Returns a :class:`TauGrid`, which every function taking ``taus`` accepts without checking it again.
  """
  if isinstance(taus, TauGrid):
    return taus
  if isinstance(taus, (jax.Array, str)) or not isinstance(taus, Sequence | np.ndarray):
    raise ValueError(f"taus must be a static sequence of positive ints, got {taus!r}")
  out = []
  for tau in list(taus):
    if isinstance(tau, (bool, np.bool_)) or not isinstance(tau, numbers.Integral):
      raise ValueError(f"taus must contain Python/numpy ints, got {tau!r} in {taus!r}")
    out.append(int(tau))
  if not out:
    raise ValueError("taus must be non-empty")
  if out[0] <= 0 or out[-1] > 2**31 - 1:  # the steps are counted in int32 on the device
    raise ValueError(f"taus must be positive ints <= 2**31 - 1, got {tuple(out)}")
  if any(b <= a for a, b in zip(out, out[1:])):
    raise ValueError(f"taus must be strictly ascending, got {tuple(out)}")
  return TauGrid(out)
