"""Federated methods, registered by name.

Each method module defines ``METHOD = Method(make=..., hyperparameters=...)``:

* ``hyperparameters``: a frozen dataclass, the typed form of the method's
  ``config.algorithm`` block. :func:`ntk_fl.schema.validate_config` builds it
  from the block (a missing or unknown key is an error naming it) and its
  ``__post_init__`` checks each value, so a bad value fails before any data is
  loaded -- and a hyperparameter object built in Python is checked the same way.
* ``make(model, federation, topology, hparams, run) -> Algorithm`` builds the
  pure functions from the model, the stacked client data, the run's
  :class:`ntk_fl.topology.Topology` (``None`` unless ``graph``), the
  hyperparameters and the typed :class:`ntk_fl.settings.RunSettings` (for the
  seed, the round count and the initialisation mode). Clients are mapped with
  :func:`ntk_fl.parallel.for_each_client`, whose chunk size and devices come
  from the device policy (:func:`ntk_fl.parallel.use_devices`).
* optionally ``check(hparams, run)``: rules that span the method's block and
  the shared ones (e.g. "clients_per_round <= data.num_clients"), run once by
  the schema; raises ``ValueError`` naming the values.
* ``graph``: the method mixes over ``config.topology``; the schema builds the
  topology once (checking its numbers against the client count) and ``make``
  receives it.
* optionally ``shared_rounds(stored, current) -> int``: for two of the method's
  configs (plain JSON dicts, as in a run's ``config.json``) that differ, how
  many leading rounds they provably compute identically (0 when not known).
  The runner lets a run *branch* from another run's checkpoint within that
  prefix (``runner.run(..., branch_from=...)``), e.g. SPARK's ablation rows
  share the hard-label warm-up.

:func:`get_method` resolves a name lazily (importing a method's module only when
it is used); :func:`register` adds a user's own method or a test double.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Protocol
from collections.abc import Callable

from ntk_fl.algorithms.base import Algorithm

__all__ = ["Algorithm", "MakeFn", "Method", "get_method", "register", "available"]


class MakeFn(Protocol):
  """``make(model, federation, topology, hparams, run) -> Algorithm``: a method's factory."""

  def __call__(
    self, model: Any, federation: Any, topology: Any, hparams: Any, run: Any
  ) -> Algorithm:
    """Args:
      model: the :class:`ntk_fl.models.Model`.
      federation: the stacked client data, a :class:`ntk_fl.data.Federation` of ``M`` clients.
      topology: the run's :class:`ntk_fl.topology.Topology` when the method's ``graph`` is set, else None.
      hparams: the method's hyperparameter dataclass, checked (enum fields are members).
      run: the checked :class:`ntk_fl.settings.RunSettings` (seed, rounds, ``topology.mixing``,
        ``model.shared_init``).

    Returns:
      The method's :class:`Algorithm`, its ``step`` jit-compiled.
    """


class Method(NamedTuple):
  """A registered federated method: its factory, its typed hyperparameters and the rules of its config.

  Attributes:
    make: :class:`MakeFn`; a public factory such as ``ntk_dfl.make_ntk_dfl`` is registered as is.
    hyperparameters: the frozen dataclass of ``config.algorithm`` (a subclass may add fields: they are set
      like any other, ``--config.algorithm.<field>=...`` included).
    check: ``check(hparams, run)``, rules across blocks (raises ``ValueError``), or None.
    graph: the method mixes over ``config.topology``: ``make`` receives the run's topology (else None).
    shared_rounds: ``shared_rounds(stored, current) -> int`` for branching from a run (module docstring).
    replicas: the method's :class:`~ntk_fl.algorithms.base.Algorithm` has a ``replicable`` step, so it
      runs seed-batched (``config.replicas > 1``); the others refuse it when the config is checked.
    ntk: an NTK method's client step and kernels (``ntk_fl._src.ntk_step.NTK_FUNCTIONS``), which the
      runner's cost estimate compiles before round 1; None for the methods that train by gradient steps.
  """

  make: MakeFn
  hyperparameters: type
  check: Callable[[Any, Any], None] | None = None
  graph: bool = False
  shared_rounds: Callable[[dict, dict], int] | None = None
  replicas: bool = False
  ntk: Any = None


# name -> "module" defining METHOD or "module:ATTR" (imported on first use), or a registered Method.
_REGISTRY: dict[str, str | Method] = {
  "ntk_dfl": "ntk_fl.algorithms.ntk_dfl",
  "fedavg": "ntk_fl.algorithms.fedavg",
  "fedprox": "ntk_fl.algorithms.fedprox",
  "fedbe": "ntk_fl.algorithms.fedbe",
  "fednova": "ntk_fl.algorithms.fednova",
  "datashare": "ntk_fl.algorithms.datashare",
  "centralized": "ntk_fl.algorithms.centralized",
  "dpsgd": "ntk_fl.algorithms.dpsgd",
  "dfedavg": "ntk_fl.algorithms.dfedavg",
  "dfedavgm": "ntk_fl.algorithms.dfedavgm",
  "dfedsam": "ntk_fl.algorithms.dfedsam",
  "dispfl": "ntk_fl.algorithms.dispfl",
  "ntk_fl": "ntk_fl.algorithms.server_ntk",
  "spark": "ntk_fl.algorithms.spark",
  "fed_ensemble": "ntk_fl.algorithms.fed_ensemble",
  "fedcom": "ntk_fl.algorithms.fedcom",
  "qsgd": "ntk_fl.algorithms.qsgd",
}


def register(name: str, method: Method) -> None:
  """Registers ``method`` under ``name`` (overwrites an existing entry)."""
  if not isinstance(method, Method):
    raise TypeError(
      f"register expects a Method(make, hyperparameters, ...), got {type(method).__name__}"
    )
  if not callable(method.make):
    raise TypeError(
      f"Method.make of {name!r} must be a factory make(model, federation, topology, hparams, "
      f"run), got {method.make!r}"
    )
  _REGISTRY[name] = method


def available() -> list[str]:
  return sorted(_REGISTRY)


def get_method(name: str) -> Method:
  """Returns the :class:`Method` registered as ``name``; a clear error lists the choices."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available())}")
  entry = _REGISTRY[name]
  if isinstance(entry, str):  # "module" (its METHOD) or "module:ATTR"
    module, _, attr = entry.partition(":")
    entry = getattr(importlib.import_module(module), attr or "METHOD")
    _REGISTRY[name] = entry
  return entry
