"""ntk_fl: neural-tangent-kernel federated learning in JAX.

The flat public API (like optax's): everything a researcher needs to run a paper
config, rescore a run, or build a method of their own is importable from here::

  import ntk_fl
  config = ntk_fl.load_config("ntk_dfl", "smoke")   # a packaged config by name, or a file path
  summary = ntk_fl.run(config, "runs/smoke")

Names are imported on first use (``import ntk_fl`` itself loads neither JAX nor
the datasets). The modules behind them, each documented in its own docstring:

* config layer: :mod:`ntk_fl.config` (``base_config``, variants, ``load_config``),
  :mod:`ntk_fl.config_docs` (the meaning of every config field, the configs' variants),
  ``ntk_fl/configs/`` (the paper configs and their presets), :mod:`ntk_fl.schema`
  (the one place a config is checked; it returns typed :mod:`ntk_fl.settings`).
* runs: :mod:`ntk_fl.runner` (the loop, ``build_experiment``), :mod:`ntk_fl.rundir`
  (the files of a run directory; resume and branch), :mod:`ntk_fl.summaries`
  (TensorBoard event files), :mod:`ntk_fl.cli` (``ntk-fl``).
* methods: :mod:`ntk_fl.algorithms` (``Algorithm``, ``Method``, the registry and one
  module per method family, each with its typed hyperparameters).
* building blocks: :mod:`ntk_fl.data`, :mod:`ntk_fl.models`, :mod:`ntk_fl.topology`,
  :mod:`ntk_fl.ntk`, :mod:`ntk_fl.evolve`, :mod:`ntk_fl.jacobians`, :mod:`ntk_fl.projection`,
  :mod:`ntk_fl.compression`, :mod:`ntk_fl.parallel` (the single "for each client"),
  :mod:`ntk_fl.metrics`, :mod:`ntk_fl.rng`, :mod:`ntk_fl.stats`.

docs/ARCHITECTURE.md says how they fit together and where a new method, kernel,
topology or dataset plugs in.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute); resolved lazily by __getattr__.
_EXPORTS: dict[str, tuple[str, str]] = {}


def _export(module: str, *names: str, rename: dict[str, str] | None = None) -> None:
  for name in names:
    _EXPORTS[name] = (module, name)
  for public, attr in (rename or {}).items():
    _EXPORTS[public] = (module, attr)


# Configs, checked once into typed settings.
_export("ntk_fl.config", "base_config", "load_config", "apply_variants")
_export("ntk_fl.schema", "validate_config")
_export(
  "ntk_fl.settings",
  "RunSettings",
  "DataSettings",
  "ModelSettings",
  "TopologySettings",
  "EvalSettings",
)
# Runs and run directories.
_export("ntk_fl.runner", "run", "build_experiment", "make_algorithm", "Experiment")
_export(
  "ntk_fl.rundir", "read_run", "read_metrics", "read_config", "read_summary", "rebuild_config"
)
# Methods: the interface, the registry, the factories and their hyperparameters.
_export(
  "ntk_fl.algorithms",
  "Algorithm",
  "Method",
  "register",
  "get_method",
  rename={"available_methods": "available"},
)
_export("ntk_fl.algorithms.graph_inputs", "GraphRound", "graph_round_inputs")
_export("ntk_fl.algorithms.ntk_dfl", "make_ntk_dfl", "make_neighbourhood_round", "NTKDFLHParams")
_export("ntk_fl.algorithms.spark", "make_spark", "SparkHParams")
_export("ntk_fl.algorithms.server_ntk", "make_server_ntk", "NTKFLHParams")
_export("ntk_fl.algorithms.fed_ensemble", "make_fed_ensemble", "FedEnsembleHParams")
_export("ntk_fl.algorithms.local", "make_local_update", "LocalHParams")
# Building blocks.
_export(
  "ntk_fl.data", "Federation", "make_federation", "partition", rename={"load_dataset": "load"}
)
_export("ntk_fl.models", "Model", "mlp", "cnn", "init_clients")
_export("ntk_fl.topology", "Topology", "Graph", "make_topology", "mixing_weights")
_export("ntk_fl.gossip", "mix", "consensus")
_export("ntk_fl.ntk", "empirical_ntk", "empirical_ntk_fn", "NtkImplementation")
_export("ntk_fl.evolve", "ntk_step", "ntk_update")
_export("ntk_fl.parallel", "for_each_client", "for_each_client_by_group", "use_devices", "Shared")
_export("ntk_fl.metrics", "evaluate", "evaluate_clients", "average_params", "make_evaluator")

_SUBMODULES = (
  "algorithms",
  "checkpoint",
  "cli",
  "compression",
  "config",
  "config_docs",
  "configs",
  "data",
  "evolve",
  "jacobians",
  "metrics",
  "models",
  "ntk",
  "parallel",
  "plotting",
  "privacy",
  "projection",
  "rng",
  "rundir",
  "runner",
  "schema",
  "settings",
  "stats",
  "topology",
  "validation",
  "gossip",
  "communication",
  "distributed",
  "summaries",
)

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value
  if name in _SUBMODULES:
    return importlib.import_module(f"ntk_fl.{name}")
  raise AttributeError(f"module 'ntk_fl' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
