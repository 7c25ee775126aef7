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

# The registry lives in the method interface, ``algorithms.base``, which imports only leaves: the
# schema, the run directory and the runner resolve a method from there in two levels.
from ntk_fl.algorithms.base import (
  _REGISTRY,  # noqa: F401  (tests register test doubles in it)
  Algorithm,
  MakeFn,
  Method,
  available,
  get_method,
  register,
)

__all__ = ["Algorithm", "MakeFn", "Method", "get_method", "register", "available"]
