"""The config schema: the one place a run config is checked, and where it stops.

:func:`validate_config` checks a config built on :func:`ntk_fl.config.base_config`
-- names, ranges, unknown keys of the shared blocks, then the method's own
``config.algorithm`` block (turned into the method's hyperparameter dataclass,
which checks its values) and the method's rules across blocks -- and returns
frozen :class:`ntk_fl.settings.RunSettings`. It loads no data, so a bad key or
value fails in milliseconds with a message naming it, what is allowed and what
it got. Below this module nothing imports ``ml_collections`` or reads a config.

Methods outside :mod:`ntk_fl.algorithms` (a user's own, or a test double) are
found through ``config.method_module``: a dotted module name or a path to a
``.py`` file, imported (:func:`import_method_module`) before ``config.method``
is resolved; importing it should call :func:`ntk_fl.algorithms.register`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import ml_collections

from ntk_fl import settings, validation
from ntk_fl._src.names import ACTIVATIONS, DATASETS, MODELS, PARTITIONS
from ntk_fl._src.method_modules import import_method_module, method_module_imported
from ntk_fl.algorithms.base import get_method  # the registry, two levels deep
from ntk_fl.config import base_config
from ntk_fl.settings import DataSettings, EvalSettings, ModelSettings, RunSettings, TopologySettings

if TYPE_CHECKING:  # the graphs are built lazily, inside validate_config
  from ntk_fl import topology

__all__ = [
  "DIVERGENCE_POLICIES",
  "changed_fields",
  "ignored_settings",
  "import_method_module",
  "method_module_imported",
  "replica_settings",
  "validate_config",
  "warn_ignored_settings",
]

#: ``config.on_divergence``: end the run at a non-finite round, or log it and go on.
DIVERGENCE_POLICIES = ("stop", "continue")

# Config keys beyond base_config(): the optional method module, and the free-form algorithm block.
_EXTRA_TOP_LEVEL = frozenset({"method_module"})
_SCHEMA_BLOCKS = ("data", "model", "topology", "eval")


def _get(config, path: str):
  node = config
  for key in path.split("."):
    if not isinstance(node, Mapping) or key not in node:
      raise ValueError(f"config is missing {path!r} (see ntk_fl.config.base_config for the schema)")
    node = node[key]
  return node


def _int(config, path: str, low: int) -> int:
  return validation.check_int(f"config.{path}", _get(config, path), low=low)


def _choice(config, path: str, choices) -> str:
  return validation.check_choice(f"config.{path}", _get(config, path), choices)


def _check_keys(config) -> None:
  """Rejects keys the shared schema does not know (a typo would otherwise be ignored)."""
  schema = base_config()
  unknown = set(config.keys()) - set(schema.keys()) - _EXTRA_TOP_LEVEL
  if unknown:
    raise ValueError(
      f"unknown config key(s) {sorted(unknown)}; known top-level keys: "
      f"{sorted(set(schema.keys()) | _EXTRA_TOP_LEVEL)}"
    )
  for block in _SCHEMA_BLOCKS:
    if not isinstance(_get(config, block), Mapping):
      raise ValueError(
        f"config.{block} must be a block of keys {sorted(schema[block].keys())}, "
        f"got {_get(config, block)!r:.80}"
      )
    unknown = set(_get(config, block).keys()) - set(schema[block].keys())
    if unknown:
      raise ValueError(
        f"unknown key(s) {sorted(f'{block}.{k}' for k in unknown)}; "
        f"config.{block} has: {sorted(schema[block].keys())}"
      )


def _check_rounds_fit_k_max(built: topology.Topology, rounds: int) -> None:
  """A chosen ``config.topology.k_max`` must hold every round's graph: found now, not at the round.

  A drawn graph of larger degree stops the run at its round (its neighbour lists are never truncated);
  drawing the run's graphs here (milliseconds each, and the run draws the same ones) turns hours of
  rounds before it into an error before any data loads.
  """
  for r in range(rounds if built.dynamic else 1):
    try:
      built.sample(r)
    except ValueError as error:
      raise ValueError(
        f"config.topology.k_max = {built.k_max} is too small for this run's graphs: {error} "
        "(all rounds are checked before the run; use k_max = 0 to derive a bound)"
      ) from None


def validate_config(config, reference=None) -> RunSettings:
  """Checks ``config`` once and returns it as typed, immutable :class:`RunSettings`.

  The shared schema first (names, ranges, unknown keys of every block), then the
  method's own block: ``config.algorithm`` becomes the method's hyperparameter
  dataclass (whose construction checks each value), the method's ``check``
  sees the typed settings for rules that span blocks, and the topology of a
  method that mixes over a graph is built here (its numbers checked against the
  client count) and handed on as ``RunSettings.built_topology``.

  Args:
    config: an ``ml_collections.ConfigDict`` built on :func:`ntk_fl.config.base_config`,
      a plain dict of the same shape (a run's ``config.json``), or settings this
      function returned already (returned as they are).
    reference: optional, the config before the user's changes (``ntk-fl``: the
      config file's variant before the ``--config.<key>`` overrides); each field
      changed from it that the run does not read (``data.alpha`` of an IID
      partition, ...) is logged as a warning (:func:`warn_ignored_settings`).

  Raises ``ValueError`` naming the bad key, its value and what is allowed. Loads
  no data.
  """
  from ntk_fl import topology  # pylint: disable=g-import-not-at-top

  if isinstance(config, RunSettings):
    return config
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  elif not isinstance(config, Mapping):
    raise ValueError(f"config must be an ml_collections.ConfigDict, got {type(config).__name__}")
  _check_keys(config)
  method = _get(config, "method")
  if not isinstance(method, str) or not method:
    raise ValueError(f"config.method must name a registered method, got {method!r}")
  method_module = config.get("method_module", "")
  if not isinstance(method_module, str):
    raise ValueError(
      f"config.method_module must be a module name or .py path, got {method_module!r}"
    )
  # The seed becomes an int64 PRNG key.
  validation.check_int("config.seed", _get(config, "seed"), low=0, high=2**63 - 1)
  _int(config, "rounds", 1)
  _int(config, "checkpoint_every", 0)
  keep = _get(config, "checkpoint_keep")
  if not isinstance(keep, (tuple, list)):
    raise ValueError(
      f"config.checkpoint_keep must be a tuple of 1-based round numbers, got {keep!r}"
    )
  for r in keep:
    validation.check_int("config.checkpoint_keep (1-based round numbers)", r, low=1)
  _choice(config, "on_divergence", DIVERGENCE_POLICIES)
  _int(config, "chunk_size", 0)
  # A config.json written before seed-batched runs existed has neither key (a single run).
  validation.check_int("config.replicas", config.get("replicas", 1), low=1)
  validation.check_int("config.replica_chunk", config.get("replica_chunk", 1), low=0)
  devices = _int(config, "devices", 0)
  if devices > jax.device_count():
    raise ValueError(
      f"config.devices = {devices} but only {jax.device_count()} device(s) exist; "
      f"use 0 for all of them or a number in [1, {jax.device_count()}]"
    )
  if jax.process_count() > 1 and devices not in (0, jax.device_count()):
    raise ValueError(
      f"config.devices = {devices} in a run of {jax.process_count()} processes: the clients are "
      f"split over every process's devices; use 0 (all {jax.device_count()} of them)"
    )

  dataset = _choice(config, "data.name", DATASETS)
  if not isinstance(_get(config, "data.data_dir"), str):
    raise ValueError(
      f"config.data.data_dir must be a string ('' = search path), got {_get(config, 'data.data_dir')!r}"
    )
  partition = _choice(config, "data.partition", PARTITIONS)
  if partition == "by_writer" and dataset not in ("femnist", "femnist_digits"):
    raise ValueError(
      f"config.data.partition = 'by_writer' needs writer ids; only 'femnist' and 'femnist_digits' "
      "have them, "
      f"got data.name = {dataset!r}"
    )
  num_clients = _int(config, "data.num_clients", 1)
  alpha = _get(config, "data.alpha")
  if not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
    raise ValueError(f"config.data.alpha must be a finite number > 0, got {alpha!r}")
  _int(config, "data.samples_per_client", 0)
  _int(config, "data.classes_per_client", 1)
  _int(config, "data.keep_per_client", 0)
  _int(config, "data.max_train", 0)
  _int(config, "data.max_test", 0)
  _check_partition_file(config, partition, dataset, num_clients)
  _check_partition_fits(config, partition, dataset, num_clients)

  _choice(config, "model.name", MODELS)
  hidden = _get(config, "model.hidden")
  if not isinstance(hidden, (tuple, list)) or not all(
    isinstance(h, numbers.Integral) and not isinstance(h, bool) and h >= 1 for h in hidden
  ):
    raise ValueError(f"config.model.hidden must be a tuple of positive ints, got {hidden!r}")
  _choice(config, "model.activation", ACTIVATIONS)
  _choice(config, "model.init", ("shared", "per_client"))
  _check_user_module(config, dataset)

  # Names here; whether the topology's numbers fit the client count is checked below, by building it,
  # for the methods that mix over a graph.
  _choice(config, "topology.name", topology.TOPOLOGIES)
  _choice(config, "topology.mixing", topology.MIXING_SCHEMES)

  _int(config, "eval.every", 1)
  _int(config, "eval.clients_every", 0)
  _int(config, "eval.batch_size", 1)
  targets = _get(config, "eval.targets")
  if not isinstance(targets, (tuple, list)) or not all(
    isinstance(t, numbers.Real) and not isinstance(t, bool) and 0 < t <= 1 for t in targets
  ):
    raise ValueError(
      f"config.eval.targets must be a tuple of accuracies in (0, 1], got {targets!r}"
    )
  stop_at = _get(config, "eval.stop_at")
  if not validation.is_real(stop_at) or not 0 <= stop_at <= 1:
    raise ValueError(
      f"config.eval.stop_at must be an accuracy in [0, 1] (0 = run every round), got {stop_at!r}"
    )
  if stop_at and _get(config, "eval.every") != 1:
    raise ValueError(
      f"config.eval.stop_at = {stop_at} needs the aggregated accuracy every round: "
      f"config.eval.every must be 1, got {_get(config, 'eval.every')!r}"
    )
  for flag in ("eval.consensus", "eval.selection", "topology.dynamic", "debug_clients"):
    if not isinstance(_get(config, flag), bool):
      raise ValueError(f"config.{flag} must be a bool, got {_get(config, flag)!r}")
  # A config.json written before the switch existed has no key (the estimate ran).
  if not isinstance(config.get("cost_estimate", True), bool):
    raise ValueError(f"config.cost_estimate must be a bool, got {config['cost_estimate']!r}")

  import_method_module(method_module)
  spec = get_method(method)
  shared = {
    name: settings.from_mapping(cls, config[name], f"config.{name}")
    for name, cls in (
      ("data", DataSettings),
      ("model", ModelSettings),
      ("topology", TopologySettings),
      ("eval", EvalSettings),
    )
  }
  hyperparameters = settings.from_mapping(
    spec.hyperparameters, _get(config, "algorithm"), f"config.algorithm (method {method!r})"
  )
  run = RunSettings(
    method=method,
    method_module=method_module,
    seed=config["seed"],
    rounds=config["rounds"],
    checkpoint_every=config["checkpoint_every"],
    checkpoint_keep=tuple(keep),
    on_divergence=config["on_divergence"],
    chunk_size=config["chunk_size"],
    devices=devices,
    debug_clients=config["debug_clients"],
    replicas=config.get("replicas", 1),
    replica_chunk=config.get("replica_chunk", 1),
    cost_estimate=config.get("cost_estimate", True),
    algorithm=hyperparameters,
    **shared,
  )
  if spec.graph:
    built = topology.topology_from_fields(
      dataclasses.asdict(run.topology), run.data.num_clients, seed=run.seed
    )
    if run.topology.k_max:
      _check_rounds_fit_k_max(built, run.rounds)
    run = dataclasses.replace(run, built_topology=built)
  if run.replicas > 1 and not spec.replicas:
    raise ValueError(
      f"config.replicas = {run.replicas}: method {method!r} does not support seed-batched runs "
      "(supported: the decentralized gradient baselines and ntk_dfl); set config.replicas = 1 and "
      "run the seeds separately"
    )
  if spec.check is not None:
    spec.check(hyperparameters, run)
  if reference is not None:
    warn_ignored_settings(run, config, reference)
  return run


def _check_user_module(config, dataset: str) -> None:
  """``model.module`` / ``model.per_sample``: the user's flax module is imported and probed now (trusted code)."""
  from ntk_fl._src import user_model  # pylint: disable=g-import-not-at-top
  from ntk_fl.data import sources  # pylint: disable=g-import-not-at-top

  model = _get(config, "model")
  spec, per_sample = model.get("module", ""), model.get("per_sample", False)
  if not isinstance(spec, str):
    raise ValueError(
      f"config.model.module must be a string 'package.module:factory' ('' = model.name), "
      f"got {spec!r}"
    )
  if not isinstance(per_sample, bool):
    raise ValueError(f"config.model.per_sample must be a bool, got {per_sample!r}")
  if not spec:
    return
  if model["name"] != "mlp":
    raise ValueError(
      f"config.model.module = {spec!r} and config.model.name = {model['name']!r} both name a "
      "model; leave model.name at 'mlp' (the module replaces name, hidden and activation)"
    )
  user_model.check_module(spec, *sources.dataset_input(dataset))


def _check_partition_fits(config, partition: str, dataset: str, num_clients: int) -> None:
  """The partition's numbers against the training-set size, where that is known without loading the data.

  The size is ``data.max_train`` or, for datasets with one standard file set,
  their training-set size (``data.index_map.TRAIN_SIZES``); the same conditions
  are checked again on the loaded labels (``data.partition``), so this only
  moves the failure before the data load.
  """
  from ntk_fl.data import index_map  # pylint: disable=g-import-not-at-top

  standard = index_map.TRAIN_SIZES.get(dataset)
  max_train, per_client = _get(config, "data.max_train"), _get(config, "data.samples_per_client")
  if standard is not None and max_train > standard:
    raise ValueError(
      f"config.data.max_train = {max_train} exceeds the {standard} training samples of "
      f"{dataset!r}; use at most {standard}, or 0 for all of them"
    )
  n = max_train or standard
  if n is None or partition in ("by_writer", "index_map"):
    return
  where = f"the {n} training samples" + (" (data.max_train)" if max_train else f" of {dataset!r}")
  if num_clients > n:
    raise ValueError(
      f"config.data.num_clients = {num_clients} exceeds {where}: every client needs at least one"
    )
  if partition == "iid" and per_client and num_clients * per_client > n:
    raise ValueError(
      f"config.data.samples_per_client = {per_client} too large for iid: {num_clients} disjoint "
      f"clients need {num_clients * per_client} samples, more than {where}"
    )
  num_classes = (
    10  # every dataset but FEMNIST (62 classes, of which a max_train subset may lack some)
  )
  if (
    partition == "dirichlet_fixed_size"
    and dataset not in ("femnist", "femnist_digits")
    and per_client
    and per_client > n // num_classes
  ):
    raise ValueError(
      f"config.data.samples_per_client = {per_client} too large for dirichlet_fixed_size: at most "
      f"the class-pool size floor(N / C) = {n} // {num_classes} = {n // num_classes} for {where}"
    )


def _check_partition_file(config, partition: str, dataset: str, num_clients: int) -> None:
  """``data.partition_file``: required by ``index_map`` (and read and checked now), unused otherwise."""
  from ntk_fl.data import index_map  # pylint: disable=g-import-not-at-top

  partition_file = _get(config, "data.partition_file")
  if not isinstance(partition_file, str):
    raise ValueError(f"config.data.partition_file must be a string, got {partition_file!r}")
  if partition != "index_map":
    if partition_file:
      raise ValueError(
        f"config.data.partition_file = {partition_file!r} is only read by "
        f"data.partition = 'index_map', got data.partition = {partition!r}"
      )
    return
  if index_map.is_vendored(partition_file) and dataset != index_map.VENDORED_DATASET:
    raise ValueError(
      f"config.data.partition_file = {partition_file!r} is a {index_map.VENDORED_DATASET} "
      f"partition, but data.name = {dataset!r}"
    )
  max_train = _get(config, "data.max_train")
  if max_train:
    raise ValueError(
      f"config.data.max_train = {max_train}: an index map's indices refer to "
      "the whole training set, so data.partition = 'index_map' needs max_train = 0"
    )
  index_map.load_index_map(
    partition_file, num_clients=num_clients, num_samples=index_map.TRAIN_SIZES.get(dataset)
  )


# ------------------------------------------------------------------------ settings without effect

_DIRICHLET = ("dirichlet", "dirichlet_fixed_size", "index_map")  # index_map: alpha labels the map
_SIZED = ("iid", "dirichlet_fixed_size", "contiguous")


def _algo(run: RunSettings, *path: str):
  """``run.algorithm.<path>``, or None when the method's hyperparameters have no such field."""
  node = run.algorithm
  for name in path:
    if not hasattr(node, name):
      return None
    node = getattr(node, name)
  return node


def _only(block: str, readers: str):
  """Why a field that only ``readers`` read is ignored, for the warning."""
  return lambda r: f"{block}.name = {getattr(r, block).name!r} (only {readers} reads it)"


# (field, condition on the checked settings under which nothing reads it, why). The one place for
# which fields each partition, topology, model and method option reads.
_UNREAD = (
  (
    "data.alpha",
    lambda r: r.data.partition not in _DIRICHLET,
    lambda r: (
      f"data.partition = {r.data.partition!r} draws no Dirichlet proportions (only "
      "'dirichlet' and 'dirichlet_fixed_size' read it)"
    ),
  ),
  (
    "data.samples_per_client",
    lambda r: r.data.partition not in _SIZED,
    lambda r: (
      f"data.partition = {r.data.partition!r} sets the client sizes itself (only "
      f"{', '.join(_SIZED)} read it)"
    ),
  ),
  (
    "data.classes_per_client",
    lambda r: r.data.partition != "shards",
    lambda r: f"data.partition = {r.data.partition!r} (only 'shards' reads it)",
  ),
  (
    "data.keep_per_client",
    lambda r: r.data.partition != "shards",
    lambda r: f"data.partition = {r.data.partition!r} (only 'shards' reads it)",
  ),
  ("model.hidden", lambda r: r.model.name != "mlp", _only("model", "'mlp'")),
  ("model.activation", lambda r: r.model.name != "mlp", _only("model", "'mlp'")),
  ("topology.degree", lambda r: r.topology.name != "regular", _only("topology", "'regular'")),
  ("topology.p", lambda r: r.topology.name != "erdos_renyi", _only("topology", "'erdos_renyi'")),
  (
    "topology.mean_degree",
    lambda r: r.topology.name != "erdos_renyi",
    _only("topology", "'erdos_renyi'"),
  ),
  (
    "topology.cluster_size",
    lambda r: r.topology.name != "clustered",
    _only("topology", "'clustered'"),
  ),
  (
    "topology.dynamic",
    lambda r: r.topology.name == "complete",
    lambda r: "the complete graph is the same in every round",
  ),
  (
    "algorithm.nesterov",
    lambda r: _algo(r, "momentum") == 0,
    lambda r: "algorithm.momentum = 0 (Nesterov's variant needs momentum)",
  ),
  (
    "algorithm.stochastic_rounding",
    lambda r: _algo(r, "quantize_bits") == 32,
    lambda r: "algorithm.quantize_bits = 32 (nothing is quantised)",
  ),
  *(
    (
      f"algorithm.{name}",
      lambda r: _algo(r, "quantize_bits") == 32,
      lambda r: "algorithm.quantize_bits = 32 (nothing is quantised)",
    )
    for name in ("bucket_size", "qsgd_norm")
  ),
  *(
    (
      f"algorithm.{name}",
      lambda r: _algo(r, "local_training") not in (None, "ntk"),
      lambda r: (
        f"algorithm.local_training = {_algo(r, 'local_training')!r} (only 'ntk' evolves over taus)"
      ),
    )
    for name in ("taus", "solver", "select")
  ),
  *(
    (
      f"algorithm.distill.{name}",
      lambda r: _algo(r, "distill", "enabled") is False,
      lambda r: "algorithm.distill.enabled = False",
    )
    for name in (
      "warmup_rounds",
      "anneal_rounds",
      "alpha_init",
      "alpha_final",
      "temp_init",
      "temp_final",
    )
  ),
  *(
    (
      f"algorithm.projection.{name}",
      lambda r: _algo(r, "projection", "scheme") == "none",
      lambda r: "algorithm.projection.scheme = 'none'",
    )
    for name in ("k_proj", "skip_uncompressed")
  ),
  (
    "algorithm.lr_boost.factor",
    lambda r: _algo(r, "lr_boost", "rounds") == (),
    lambda r: "algorithm.lr_boost.rounds = () (no round is boosted)",
  ),
)


def _leaves(config: Mapping, prefix: str = ""):
  for key, value in config.items():
    if isinstance(value, Mapping):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


def _plain(value):
  """Lists as tuples, so a config and its JSON form compare equal."""
  return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def changed_fields(config, reference) -> set[str]:
  """Dotted paths whose value in ``config`` differs from ``reference`` (configs or mappings)."""
  as_dict = lambda c: c.to_dict() if isinstance(c, ml_collections.ConfigDict) else c
  before = dict(_leaves(as_dict(reference)))
  return {
    path
    for path, value in _leaves(as_dict(config))
    if path not in before or _plain(before[path]) != _plain(value)
  }


def ignored_settings(run: RunSettings, changed) -> list[str]:
  """Messages for the fields of ``changed`` (dotted paths the user set) that ``run`` never reads.

  Only changed fields are named: every config carries fields its own setting
  does not read (``data.alpha`` of an IID config), and those are not news.
  """
  messages = []
  graph = get_method(run.method).graph
  if not graph:
    messages += [
      f"config.{path} = {_value(run, path)!r} has no effect: method {run.method!r} "
      "does not mix over a graph"
      for path in sorted(changed)
      if path.startswith("topology.")
    ]
  for path, unread, why in _UNREAD:
    if path in changed and (graph or not path.startswith("topology.")) and unread(run):
      messages.append(f"config.{path} = {_value(run, path)!r} has no effect: {why(run)}")
  return messages


def _value(run: RunSettings, path: str):
  node = run
  for name in path.split("."):
    node = getattr(node, name)
  return node


def warn_ignored_settings(run: RunSettings, config, reference) -> list[str]:
  """Logs a warning for each field ``config`` changed from ``reference`` that ``run`` does not read.

  ``reference`` is the config before the user's changes (for ``ntk-fl``: the
  config file's ``get_config(variant)`` before the ``--config.<key>``
  overrides). Returns the messages.
  """
  from absl import logging  # pylint: disable=g-import-not-at-top

  messages = ignored_settings(run, changed_fields(config, reference))
  for message in messages:
    logging.warning("%s", message)
  return messages


def replica_settings(run: RunSettings) -> list[RunSettings]:
  """The single-seed runs of a seed-batched run: seeds ``seed .. seed + replicas - 1``, ``replicas = 1``.

  Each is checked as its own config (its topology built from its own seed), so replica ``k`` is exactly the
  run ``--config.seed=<seed + k>`` would start; ``replica_chunk`` is kept (it says how the run was stepped).
  """
  plain = settings.to_dict(run)
  return [
    validate_config({**plain, "seed": run.seed + k, "replicas": 1}) for k in range(run.replicas)
  ]
