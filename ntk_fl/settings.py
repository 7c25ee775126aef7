"""Typed, immutable run settings: what a run config becomes once :mod:`ntk_fl.schema` has checked it.

Below the schema nothing reads a config: the runner, the data pipeline and the
method factories receive these frozen dataclasses (and a method its own
hyperparameter dataclass, ``RunSettings.algorithm``). Field names and meanings
are those of :func:`ntk_fl.config.base_config`; a settings object turns back
into the config's JSON form with :func:`to_dict` (what ``config.json`` holds).

:func:`from_mapping` is the one converter from a nested mapping (a config's
``to_dict()``, a stored ``config.json``) to any of these dataclasses or a
method's own: it rejects missing and unknown keys by name, turns lists into
tuples, turns strings into the members of fields typed with an enum (``loss: Loss``; an error names
the value and the allowed ones), recurses into fields whose type is itself a dataclass, and leaves the
value checks to the dataclass (``__post_init__``) and the schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from typing import Any
from collections.abc import Mapping

__all__ = [
  "DataSettings",
  "ModelSettings",
  "TopologySettings",
  "EvalSettings",
  "RunSettings",
  "from_mapping",
  "to_dict",
]


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """``config.data``: dataset, partition and client count (see :mod:`ntk_fl.config`)."""

  name: str
  data_dir: str
  partition: str
  partition_file: str
  num_clients: int
  alpha: float
  samples_per_client: int
  classes_per_client: int
  max_train: int
  max_test: int
  keep_per_client: int = 0


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """``config.model``: architecture and whether clients share one initialisation."""

  name: str
  hidden: tuple[int, ...]
  activation: str
  init: str
  module: str = ""  # 'package.module:factory' of the user's own flax module ('' = ``name``)
  per_sample: bool = (
    False  # ``module`` only: its outputs per sample do not depend on the rest of the batch
  )

  @property
  def shared_init(self) -> bool:
    return self.init == "shared"


@dataclasses.dataclass(frozen=True)
class TopologySettings:
  """``config.topology``: the graph family (:func:`ntk_fl.topology.make_topology`) and mixing scheme."""

  name: str
  degree: int
  p: float
  mean_degree: float
  cluster_size: int
  dynamic: bool
  k_max: int
  mixing: str


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """``config.eval``: what the runner scores, how often, and when it stops."""

  every: int
  clients_every: int
  targets: tuple[float, ...]
  selection: bool
  stop_at: float
  batch_size: int
  consensus: bool


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """A whole checked run config; ``algorithm`` is the method's own hyperparameter dataclass.

  ``built_topology`` is the run's :class:`ntk_fl.topology.Topology` (the graph of
  every round), built once by the schema from ``topology`` (the config block's
  settings) for methods that mix over a graph (``None`` otherwise); it is not a
  config field and not part of :func:`to_dict`.
  """

  method: str
  method_module: str
  seed: int
  rounds: int
  data: DataSettings
  model: ModelSettings
  topology: TopologySettings
  eval: EvalSettings
  checkpoint_every: int
  checkpoint_keep: tuple[int, ...]
  on_divergence: str
  chunk_size: int
  devices: int
  algorithm: Any
  debug_clients: bool = False
  replicas: int = 1
  replica_chunk: int = 1
  cost_estimate: bool = True
  built_topology: Any = dataclasses.field(default=None, compare=False, repr=False)


def _tuples(value):
  if isinstance(value, (list, tuple)):
    return tuple(_tuples(v) for v in value)
  return value


def from_mapping(cls, mapping: Mapping[str, Any], path: str):
  """``cls(**mapping)`` for a frozen dataclass ``cls``, nested dataclass fields included.

  Args:
    cls: the dataclass.
    mapping: field name -> value (nested mappings for dataclass-typed fields).
    path: the config path of ``mapping`` for error messages, e.g. ``'config.algorithm'``.

  Raises:
    ValueError: ``mapping`` is not a mapping, misses a field without a default, or
      holds a key ``cls`` does not have (each named with the allowed keys).
  """
  if not isinstance(mapping, Mapping):
    raise ValueError(
      f"{path} must be a block of keys {[f.name for f in _config_fields(cls)]}, got {mapping!r}"
    )
  fields = _config_fields(cls)
  names = [f.name for f in fields]
  unknown = sorted(set(mapping) - set(names))
  missing = [
    f.name
    for f in fields
    if f.name not in mapping
    and f.default is dataclasses.MISSING
    and f.default_factory is dataclasses.MISSING
  ]
  if len(unknown) == 1 and not missing:
    # One mistyped key (the usual case): the command line's own words, with the nearest field.
    close = difflib.get_close_matches(unknown[0], names, n=1)
    if close:
      raise ValueError(
        f"unknown config key {path.split(' ')[0]}.{unknown[0]}; "
        f"did you mean {path.split(' ')[0]}.{close[0]}?"
      )
  if unknown or missing:
    problems = ([f"unknown key(s) {unknown}"] if unknown else []) + (
      [f"missing key(s) {missing}"] if missing else []
    )
    raise ValueError(f"{path}: {', '.join(problems)}; the keys are {names}")
  hints = typing.get_type_hints(cls)
  values = {}
  for name in names:
    if name not in mapping:
      continue
    value = mapping[name]
    hint = hints.get(name)
    if dataclasses.is_dataclass(hint):
      value = from_mapping(hint, value, f"{path}.{name}")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum) and not isinstance(value, hint):
      try:
        value = hint(value)
      except ValueError:
        base, sep, note = path.partition(" (")  # 'config.algorithm (method ...)' -> field first
        raise ValueError(
          f"{base}.{name}{' (' + note if sep else ''} must be one of "
          f"{tuple(m.value for m in hint)}, got {value!r}"
        ) from None
    values[name] = _tuples(value)
  return cls(**values)


def _config_fields(cls):
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise TypeError(f"expected a dataclass type, got {cls!r}")
  return [
    f for f in dataclasses.fields(cls) if f.compare
  ]  # RunSettings.built_topology is built, not configured


def to_dict(settings) -> dict:
  """The config's JSON form of a settings dataclass (tuples stay tuples; ``graph`` left out)."""
  out = {}
  for f in _config_fields(type(settings)):
    value = getattr(settings, f.name)
    out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
  return out
