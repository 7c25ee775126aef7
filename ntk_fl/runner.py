"""The generic experiment loop every method shares.

``run(config, workdir)`` does, in this order:

1. :func:`validate_config` -- the shared schema of :mod:`ntk_fl.config` (names,
   ranges, unknown keys) and the method's own ``validate_config``; then the
   workdir is checked (a fresh run needs an empty one, ``resume`` needs a
   matching ``config.json`` and a checkpoint). Nothing is loaded before that, so
   a bad key or value fails in milliseconds with a message naming it.
2. :func:`build_experiment` -- dataset, partition, :class:`Federation`, model and
   :class:`Algorithm` (also the entry point of the functional API: build once,
   then drive ``algorithm.init`` / ``algorithm.step`` yourself).
3. The round loop: ``algorithm.step`` (compiled once by its factory); after every round one
   JSON line in ``metrics.jsonl`` (aggregated-model and client accuracies,
   inter-client deviation, the algorithm's own metrics, timings), a tqdm
   progress bar, and an orbax checkpoint every ``checkpoint_every`` rounds and
   at the end.
4. Final client-selection curves, PNG plots, ``summary.json``.

The aggregated model is what ``algorithm.aggregate`` says: the uniform mean of
``client_params`` (default), or, for an ensemble method (Fed-ensemble), the
ensemble of those models with averaged probabilities/logits -- then the
per-client metrics are per-member metrics, the lines also carry the members'
and the ensemble's mean predictive entropy, and selection curves (which average
weights) are refused.

Workdir layout::

  config.json      the run's config (resume refuses a different one)
  metrics.jsonl    one line per round (1-based ``round``)
  summary.json     rounds to each target, final/best accuracies, timings, selection curves
  accuracy.png     aggregated vs mean-client accuracy (client min-max band)
  selection.png    best-to-worst / random / worst-to-best averaging curves
  checkpoints/     orbax checkpoints, one directory per saved round count
  branched_from.json  only for a branched run: the source workdir and the round it was taken after

Determinism and resume: ``algorithm.init`` gets ``jax.random.PRNGKey(seed)``,
``algorithm.round_inputs(r)`` depends on ``r`` only, and the state is the whole
carried pytree, so a run resumed from the checkpoint after round ``k`` repeats
rounds ``k+1..R`` bit for bit: its ``metrics.jsonl`` and ``summary.json`` equal
an uninterrupted run's except for wall-clock times.

Branching (``run(..., branch_from=SOURCE)``, ``--branch_from``): a new run
starts from the checkpoint of the run in ``SOURCE`` after ``k`` rounds and
copies its metrics lines 1..k. The two configs must be equal, or the method's
``shared_rounds`` must certify that they compute rounds 1..k identically (SPARK's
ablation rows share the hard-label warm-up); the branched run then equals the
run started from scratch.

Methods outside :mod:`ntk_fl.algorithms` (a user's own, or a test double) are
found through ``config.method_module``: a dotted module name or a path to a
``.py`` file, imported before ``config.method`` is resolved; importing it
should call :func:`ntk_fl.algorithms.register`.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import numbers
import os
import sys
import time
from typing import Any, Callable, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from ntk_fl import distributed, parallel, topology, validation
from ntk_fl import metrics as metrics_lib
from ntk_fl import plotting
from ntk_fl.algorithms import Algorithm, get_method
from ntk_fl.algorithms.base import config_without
from ntk_fl.checkpoint import Checkpoints
from ntk_fl.config import base_config
from ntk_fl.rng import Stream, numpy_rng

__all__ = [
    "Experiment",
    "build_experiment",
    "import_method_module",
    "read_metrics",
    "run",
    "check_workdir",
    "validate_config",
    "CONFIG_FILE",
    "METRICS_FILE",
    "SUMMARY_FILE",
    "CHECKPOINT_DIR",
    "ACCURACY_PLOT",
    "SELECTION_PLOT",
    "BRANCH_FILE",
    "check_branch",
    "check_start",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
ACCURACY_PLOT = "accuracy.png"
SELECTION_PLOT = "selection.png"
BRANCH_FILE = "branched_from.json"

# Keys the runner writes into every metrics line; an algorithm metric may not reuse them.
_RESERVED = frozenset({
    "round", "step_time", "eval_time", "test_acc", "test_loss", "deviation", "client_acc_mean",
    "client_acc_min", "client_acc_max", "client_loss_mean", "consensus_acc_mean", "consensus_acc_min",
    "consensus_acc_max", "consensus_loss_mean", "clients", *metrics_lib.ENSEMBLE_METRICS})
# Keys that do not change the trajectory (where clients run, which checkpoints are kept, whether the
# consensus models are also scored); resume and branch ignore them.
_RESULT_NEUTRAL_KEYS = ("devices", "checkpoint_keep", "eval.consensus")
# Keys added to the schema after runs were stored, each with the value that reproduces those runs: a stored
# config.json without one ran with that value (resume, branch and load_run_config fill it in).
_ADDED_KEYS = {"data.max_test": 0, "eval.consensus": False}
# Config keys beyond base_config(): the optional method module, and the free-form algorithm block.
_EXTRA_TOP_LEVEL = frozenset({"method_module"})
_SCHEMA_BLOCKS = ("data", "model", "topology", "eval")


# ----------------------------------------------------------------------------- validation


def _get(config, path: str):
  node = config
  for key in path.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or key not in node:
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
    raise ValueError(f"unknown config key(s) {sorted(unknown)}; known top-level keys: "
                     f"{sorted(set(schema.keys()) | _EXTRA_TOP_LEVEL)}")
  for block in _SCHEMA_BLOCKS:
    unknown = set(_get(config, block).keys()) - set(schema[block].keys())
    if unknown:
      raise ValueError(f"unknown key(s) {sorted(f'{block}.{k}' for k in unknown)}; "
                       f"config.{block} has: {sorted(schema[block].keys())}")


def import_method_module(spec: str) -> None:
  """Imports ``spec`` (a dotted module name, or a path to a ``.py`` file) for its registrations."""
  if not spec:
    return
  try:
    if spec.endswith(".py"):
      path = os.path.abspath(spec)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path}")
      name = f"_ntk_fl_method_{abs(hash(path)):x}"
      if name not in sys.modules:  # execute a file once per process, like an import
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
          module_spec.loader.exec_module(module)
        except BaseException:
          del sys.modules[name]
          raise
    else:
      importlib.import_module(spec)
  except (ImportError, FileNotFoundError) as e:
    raise ValueError(f"config.method_module = {spec!r} could not be imported: {e}") from e


def validate_config(config) -> None:
  """Checks ``config`` against the shared schema, then the method's own block.

  Raises ``ValueError`` naming the bad key, its value and what is allowed. Loads
  no data; the dataset/partition/topology/model name tuples are imported here.
  """
  from ntk_fl import data, models, topology  # pylint: disable=g-import-not-at-top

  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f"config must be an ml_collections.ConfigDict, got {type(config).__name__}")
  _check_keys(config)
  method = _get(config, "method")
  if not isinstance(method, str) or not method:
    raise ValueError(f"config.method must name a registered method, got {method!r}")
  method_module = config.get("method_module", "")
  if not isinstance(method_module, str):
    raise ValueError(f"config.method_module must be a module name or .py path, got {method_module!r}")
  _int(config, "seed", 0)
  _int(config, "rounds", 1)
  _int(config, "checkpoint_every", 0)
  keep = _get(config, "checkpoint_keep")
  if not isinstance(keep, (tuple, list)):
    raise ValueError(f"config.checkpoint_keep must be a tuple of 1-based round numbers, got {keep!r}")
  for r in keep:
    validation.check_int("config.checkpoint_keep (1-based round numbers)", r, low=1)
  _int(config, "chunk_size", 0)
  devices = _int(config, "devices", 0)
  if devices > jax.device_count():
    raise ValueError(f"config.devices = {devices} but only {jax.device_count()} device(s) exist; "
                     f"use 0 for all of them or a number in [1, {jax.device_count()}]")
  if jax.process_count() > 1 and devices not in (0, jax.device_count()):
    raise ValueError(f"config.devices = {devices} in a run of {jax.process_count()} processes: the clients are "
                     f"split over every process's devices; use 0 (all {jax.device_count()} of them)")

  dataset = _choice(config, "data.name", data.DATASETS)
  if not isinstance(_get(config, "data.data_dir"), str):
    raise ValueError(f"config.data.data_dir must be a string ('' = search path), got {config.data.data_dir!r}")
  partition = _choice(config, "data.partition", data.PARTITIONS)
  if partition == "by_writer" and dataset != "femnist":
    raise ValueError(f"config.data.partition = 'by_writer' needs writer ids; only 'femnist' has them, "
                     f"got data.name = {dataset!r}")
  _int(config, "data.num_clients", 1)
  alpha = _get(config, "data.alpha")
  if not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
    raise ValueError(f"config.data.alpha must be a finite number > 0, got {alpha!r}")
  _int(config, "data.samples_per_client", 0)
  _int(config, "data.classes_per_client", 1)
  _int(config, "data.max_train", 0)
  _int(config, "data.max_test", 0)

  _choice(config, "model.name", models.MODELS)
  hidden = _get(config, "model.hidden")
  if (not isinstance(hidden, (tuple, list))
      or not all(isinstance(h, numbers.Integral) and not isinstance(h, bool) and h >= 1 for h in hidden)):
    raise ValueError(f"config.model.hidden must be a tuple of positive ints, got {hidden!r}")
  _choice(config, "model.activation", models.ACTIVATIONS)
  _choice(config, "model.init", ("shared", "per_client"))

  # Names only: whether the topology's numbers fit the client count is the
  # business of the methods that use a topology (their validate_config).
  _choice(config, "topology.name", topology.TOPOLOGIES)
  _choice(config, "topology.mixing", topology.MIXING_SCHEMES)

  _int(config, "eval.every", 1)
  _int(config, "eval.clients_every", 0)
  _int(config, "eval.batch_size", 1)
  targets = _get(config, "eval.targets")
  if not isinstance(targets, (tuple, list)) or not all(
      isinstance(t, numbers.Real) and not isinstance(t, bool) and 0 < t <= 1 for t in targets):
    raise ValueError(f"config.eval.targets must be a tuple of accuracies in (0, 1], got {targets!r}")
  stop_at = _get(config, "eval.stop_at")
  if not validation.is_real(stop_at) or not 0 <= stop_at <= 1:
    raise ValueError(f"config.eval.stop_at must be an accuracy in [0, 1] (0 = run every round), got {stop_at!r}")
  if stop_at and config.eval.every != 1:
    raise ValueError(f"config.eval.stop_at = {stop_at} needs the aggregated accuracy every round: "
                     f"config.eval.every must be 1, got {config.eval.every!r}")
  if not isinstance(_get(config, "eval.consensus"), bool):
    raise ValueError(f"config.eval.consensus must be a bool, got {config.eval.consensus!r}")
  if not isinstance(_get(config, "eval.selection"), bool):
    raise ValueError(f"config.eval.selection must be a bool, got {config.eval.selection!r}")

  import_method_module(method_module)
  get_method(method).validate_config(config)


# ----------------------------------------------------------------------------- building


class Experiment(NamedTuple):
  """Everything a run is made of, built from a config by :func:`build_experiment`.

  Attributes:
    config: the config it was built from.
    dataset: the (optionally subsampled) :class:`ntk_fl.data.Dataset`.
    client_indices: ``M`` index arrays into ``dataset.x_train``.
    federation: the stacked client data :class:`ntk_fl.data.Federation`.
    model: the :class:`ntk_fl.models.Model`.
    algorithm: the method's :class:`Algorithm`.
  """
  config: ml_collections.ConfigDict
  dataset: Any
  client_indices: list
  federation: Any
  model: Any
  algorithm: Algorithm


def _keep(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
  """``size`` of ``range(n)`` drawn without replacement, in their original order."""
  return np.sort(rng.choice(n, size=size, replace=False))


def _subsample(dataset, max_train: int, max_test: int, seed: int):
  """Keeps ``max_train`` training and ``max_test`` test samples (``0`` = all), each drawn without replacement.

  The two draws come from their own streams (original order kept), so capping one
  split leaves the other's draw unchanged.
  """
  for split, size, n in (("max_train", max_train, dataset.x_train.shape[0]),
                         ("max_test", max_test, dataset.x_test.shape[0])):
    if size > n:
      raise ValueError(f"config.data.{split} = {size} exceeds the {n} {split[4:]} samples of "
                       f"{dataset.name!r}; use 0 for all of them")
  if max_train and max_train != dataset.x_train.shape[0]:
    keep = _keep(dataset.x_train.shape[0], max_train, numpy_rng(seed, Stream.SUBSAMPLE))
    writers = None if dataset.writers_train is None else dataset.writers_train[keep]
    dataset = dataset._replace(x_train=dataset.x_train[keep], y_train=dataset.y_train[keep],
                               writers_train=writers)
  if max_test and max_test != dataset.x_test.shape[0]:
    keep = _keep(dataset.x_test.shape[0], max_test, numpy_rng(seed, Stream.TEST_SUBSAMPLE))
    dataset = dataset._replace(x_test=dataset.x_test[keep], y_test=dataset.y_test[keep])
  return dataset


def build_experiment(config) -> Experiment:
  """Validates ``config`` and builds dataset, partition, federation, model and algorithm.

  The functional API: ``exp = build_experiment(config)``, then
  ``state = exp.algorithm.init(jax.random.PRNGKey(config.seed))`` and
  ``state, metrics = exp.algorithm.step(state, exp.algorithm.round_inputs(r))``.
  """
  from ntk_fl import data, models  # pylint: disable=g-import-not-at-top

  validate_config(config)
  dataset = data.load(config.data.name, config.data.data_dir or None,
                      flatten=config.model.name != "cnn", seed=config.seed)
  dataset = _subsample(dataset, config.data.max_train, config.data.max_test, config.seed)
  client_indices = data.partition(
      dataset.y_train, config.data.partition, config.data.num_clients, seed=config.seed,
      alpha=config.data.alpha, samples_per_client=config.data.samples_per_client or None,
      classes_per_client=config.data.classes_per_client, writers=dataset.writers_train)
  federation = data.make_federation(dataset.x_train, dataset.y_train, client_indices)
  model = models.make_model(config.model, dataset.x_train.shape[1:], dataset.num_classes)
  algorithm = get_method(config.method).make(config, model, federation)
  return Experiment(config, dataset, client_indices, federation, model, algorithm)


# ----------------------------------------------------------------------------- files


def _jsonable(obj):
  """Plain-python JSON value of ``obj`` (numpy/jax arrays and scalars, tuples, ConfigDicts).

  Non-finite floats become ``None`` (JSON has no NaN/inf).
  """
  if isinstance(obj, ml_collections.ConfigDict):
    obj = obj.to_dict()
  if isinstance(obj, dict):
    return {str(k): _jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_jsonable(v) for v in obj]
  if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
    return _jsonable(np.asarray(obj).tolist())
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if obj is None or isinstance(obj, (bool, int, str)):
    return obj
  raise TypeError(f"cannot write {type(obj).__name__} to JSON: {obj!r}")


def _write_atomic(path: str, text: str) -> None:
  """Replaces ``path`` by ``text`` in one step; in a multi-process run only process 0 writes."""
  if not distributed.is_primary():
    return
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _write_json(path: str, obj) -> None:
  _write_atomic(path, json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")


def read_metrics(workdir: str) -> list[dict]:
  """The per-round metrics lines of ``workdir/metrics.jsonl`` (a trailing partial line is dropped)."""
  path = os.path.join(workdir, METRICS_FILE)
  lines = []
  with open(path) as f:
    raw = f.read().split("\n")
  for i, text in enumerate(raw):
    if not text.strip():
      continue
    try:
      lines.append(json.loads(text))
    except json.JSONDecodeError:
      if i == len(raw) - 1:  # the process died mid-write; that round is redone anyway
        break
      raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
  return lines


def _config_diff(old, new, prefix: str = "") -> list[str]:
  if isinstance(old, dict) and isinstance(new, dict):
    return [d for k in sorted(set(old) | set(new))
            for d in _config_diff(old.get(k, "<missing>"), new.get(k, "<missing>"), f"{prefix}{k}.")]
  return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def _stored_config(workdir: str, action: str) -> dict:
  """``workdir``'s ``config.json`` as a JSON dict, keys added to the schema since it was written filled in."""
  config_path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"cannot {action}: {config_path} does not exist (no run was started in {workdir})")
  with open(config_path) as f:
    stored = json.load(f)
  for path, value in _ADDED_KEYS.items():
    *parents, leaf = path.split(".")
    node = stored
    for key in parents:
      node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
      node.setdefault(leaf, value)
  return stored


def _tuples(value):
  """JSON lists back to the tuples the config files use (``taus``, ``hidden``, ``targets``, ...)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config the run in ``workdir`` was started with (its ``config.json``), as a ``ConfigDict``.

  For scripts that read a finished or running run (``experiments/consensus_accuracy.py``):
  ``build_experiment(load_run_config(workdir))`` rebuilds its experiment.
  """
  return ml_collections.ConfigDict(_tuples(_stored_config(workdir, "read the run")))


def _experiment_configs(config, workdir: str, action: str) -> tuple[dict, dict]:
  """``workdir``'s stored config and ``config`` as JSON dicts, without the placement keys."""
  stored = _stored_config(workdir, action)
  current = json.loads(json.dumps(_jsonable(config)))
  # Where clients run is not part of the experiment: a run may resume on another device count
  # (results agree up to float rounding), and runs started before these keys existed lack them.
  return config_without(stored, *_RESULT_NEUTRAL_KEYS), config_without(current, *_RESULT_NEUTRAL_KEYS)


def check_workdir(config, workdir: str, *, resume: bool) -> int:
  """Checks ``workdir`` before any work; returns the round count to start from.

  A fresh run refuses a workdir that already holds a run (never overwrites one
  silently). ``resume`` needs the same config (``config.json``) and a finalised
  checkpoint.
  """
  workdir = os.path.abspath(workdir)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if not resume:
    existing = [n for n in (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR) if os.path.exists(os.path.join(workdir, n))]
    if existing:
      raise ValueError(f"workdir {workdir} already holds a run ({', '.join(existing)}); resume it "
                       "(resume=True / --resume) or choose an empty workdir")
    return 0
  stored, current = _experiment_configs(config, workdir, "resume")
  diff = _config_diff(stored, current)
  if diff:
    raise ValueError(f"cannot resume {workdir} with a different config; changed: {'; '.join(diff)}")
  latest = None
  if os.path.isdir(ckpt_dir):
    with Checkpoints(ckpt_dir) as ckpt:
      latest = ckpt.latest()
  if latest is None:
    raise FileNotFoundError(f"cannot resume: no finalised checkpoint in {ckpt_dir} "
                            f"(config.checkpoint_every = {config.checkpoint_every})")
  return latest


def check_start(config, workdir: str, *, resume: bool = False, branch_from: str | None = None,
                branch_round: int | None = None) -> int:
  """Checks how a run of ``config`` in ``workdir`` may start; returns the round count to start from.

  A fresh run (empty ``workdir``), ``resume`` (:func:`check_workdir`) or a
  branch from another run (:func:`check_branch`); the options are checked
  together here so the entry point and :func:`run` refuse the same requests.
  """
  if resume and branch_from is not None:
    raise ValueError("resume and branch_from exclude each other (--resume, --branch_from; a branched run resumes "
                     "from its own checkpoints)")
  if branch_round is not None and branch_from is None:
    raise ValueError(f"branch_round={branch_round} needs branch_from (--branch_round={branch_round} needs "
                     "--branch_from: the run to branch from)")
  start = check_workdir(config, workdir, resume=resume)
  return start if branch_from is None else check_branch(config, branch_from, branch_round)


def check_branch(config, source: str, branch_round: int | None = None) -> int:
  """Checks that a new run of ``config`` may start from ``source``'s checkpoint; returns its round.

  A branch reuses the first ``k`` rounds of the run in ``source`` (its
  checkpoint after round ``k`` and its metrics lines 1..k) instead of
  recomputing them. Allowed when ``source`` ran the same experiment (any
  ``k``), or when the method's ``shared_rounds(stored, current)`` certifies
  that the two configs compute the first ``k`` rounds identically (SPARK: the
  ablation rows during the hard-label warm-up). ``branch_round`` (default: the
  latest checkpoint of ``source`` inside the shared prefix) must be a finalised
  checkpoint of ``source`` and leave at least one round to run.
  """
  source = os.path.abspath(source)
  stored, current = _experiment_configs(config, source, "branch")
  diff = _config_diff(stored, current)
  shared = config.rounds
  if diff:
    method = get_method(config.method) if stored.get("method") == current["method"] else None
    shared = method.shared_rounds(stored, current) if method and method.shared_rounds else 0
    if shared < 1:
      raise ValueError(f"cannot branch from {source}: its config differs ({'; '.join(diff)}) and method "
                       f"{config.method!r} does not certify that any round is computed the same under both")
  ckpt_dir = os.path.join(source, CHECKPOINT_DIR)
  steps = []
  if os.path.isdir(ckpt_dir):
    with Checkpoints(ckpt_dir, read_only=True) as ckpt:
      steps = ckpt.steps()
  limit = min(shared, config.rounds - 1)
  if branch_round is None:
    usable = [s for s in steps if s <= limit]
    if not usable:
      raise FileNotFoundError(f"cannot branch from {source}: no finalised checkpoint within the {limit} rounds the "
                              f"two configs share (checkpoints after rounds {steps})")
    return usable[-1]
  validation.check_int("branch_round", branch_round, low=1)
  if branch_round > limit:
    why = f"the two configs compute only rounds 1..{shared} identically" if shared < config.rounds \
        else f"the new run has {config.rounds} rounds"
    raise ValueError(f"cannot branch from {source} after round {branch_round}: {why}"
                     + (f" (changed: {'; '.join(diff)})" if diff else ""))
  if branch_round not in steps:
    raise FileNotFoundError(f"cannot branch from {source} after round {branch_round}: no finalised checkpoint "
                            f"for it (checkpoints after rounds {steps})")
  return branch_round


# ----------------------------------------------------------------------------- the loop


def _strong(x):
  """A committed jax array without weak type, so restored and carried states compile alike."""
  x = jnp.asarray(x)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x
  return jnp.asarray(x, dtype=x.dtype)


def _canonical(state):
  return jax.tree.map(_strong, state)


def _initial_state(algorithm: Algorithm, config):
  """``algorithm.init`` from the config seed; across processes, each keeps only its clients' part."""
  key = jax.random.PRNGKey(config.seed)
  if jax.process_count() == 1:
    return _canonical(algorithm.init(key))
  shardings = distributed.client_shardings(jax.eval_shape(algorithm.init, key), config.data.num_clients,
                                           parallel.current_mesh())
  return _canonical(jax.jit(algorithm.init, out_shardings=shardings)(key))


def _due(round_: int, every: int, rounds: int) -> bool:
  """Whether a 1-based round gets an every-``every`` action (always the last round)."""
  return round_ == rounds or (every > 0 and round_ % every == 0)


def _algorithm_metrics(step_metrics: dict, num_clients: int) -> tuple[dict, dict]:
  """Scalars -> floats; ``[M, ...]`` per-client arrays -> mean/min/max plus the full values under ``clients``."""
  line, clients = {}, {}
  for name, value in distributed.to_host(step_metrics).items():
    if name in _RESERVED:
      raise ValueError(f"algorithm metric {name!r} clashes with a runner metric; reserved: {sorted(_RESERVED)}")
    value = np.asarray(value)
    if value.ndim == 0:
      line[name] = float(value)
    elif value.shape[0] == num_clients:
      line[f"{name}_mean"] = float(np.mean(value))
      line[f"{name}_min"] = float(np.min(value))
      line[f"{name}_max"] = float(np.max(value))
      clients[name] = value.tolist()
    else:
      line[name] = value.tolist()
  return line, clients


def _evaluate(evaluator: metrics_lib.Evaluator, stacked_params, round_: int, config,
              consensus_of: Callable[[Any], Any] | None = None) -> tuple[dict, dict]:
  """The round's evaluation line and per-client arrays; ``consensus_of(params)`` gives the consensus models."""
  line, clients = {}, {}
  if _due(round_, config.eval.every, config.rounds):
    acc, loss, deviation, *extra = distributed.to_host(evaluator.aggregate(stacked_params))
    line.update(test_acc=float(acc), test_loss=float(loss), deviation=float(deviation))
    line.update((name, float(value)) for name, value in zip(evaluator.extra_names, extra))
  if config.eval.clients_every and _due(round_, config.eval.clients_every, config.rounds):
    acc, loss = distributed.to_host(evaluator.clients(stacked_params))
    line.update(client_acc_mean=float(np.mean(acc)), client_acc_min=float(np.min(acc)),
                client_acc_max=float(np.max(acc)), client_loss_mean=float(np.mean(loss)))
    clients["test_acc"] = acc.tolist()
    if consensus_of is not None:
      acc, loss = distributed.to_host(evaluator.clients(consensus_of(stacked_params)))
      line.update(consensus_acc_mean=float(np.mean(acc)), consensus_acc_min=float(np.min(acc)),
                  consensus_acc_max=float(np.max(acc)), consensus_loss_mean=float(np.mean(loss)))
      clients["consensus_acc"] = acc.tolist()
  return line, clients


def _reached_stop(line: dict, config) -> bool:
  """Early stop (``config.eval.stop_at > 0``): this round's aggregated accuracy reached it."""
  return bool(config.eval.stop_at) and line.get("test_acc") is not None and line["test_acc"] >= config.eval.stop_at


def _summarize(config, lines: list[dict], *, num_params: int, selection: dict | None,
               wall_time: float, resumed_from: int | None, branched_from: dict | None) -> dict:
  acc = [line.get("test_acc") for line in lines]
  evaluated = [(a, line["round"]) for a, line in zip(acc, lines) if a is not None]
  best_acc, best_round = max(evaluated, key=lambda p: (p[0], -p[1])) if evaluated else (None, None)
  last_with = lambda key: next((line[key] for line in reversed(lines) if line.get(key) is not None), None)
  step_times = [line["step_time"] for line in lines]
  round_times = [line["step_time"] + line["eval_time"] for line in lines]
  return {
      "method": config.method,
      "seed": config.seed,
      "rounds": config.rounds,
      "rounds_run": len(lines),
      "stopped_early": bool(lines) and len(lines) < config.rounds and _reached_stop(lines[-1], config),
      "num_clients": config.data.num_clients,
      "num_params": num_params,
      "rounds_to_target": {str(float(t)): metrics_lib.rounds_to_target(acc, float(t))
                           for t in config.eval.targets},
      "final_test_acc": last_with("test_acc"),
      "final_test_loss": last_with("test_loss"),
      "final_client_acc_mean": last_with("client_acc_mean"),
      "final_consensus_acc_mean": last_with("consensus_acc_mean"),
      "final_deviation": last_with("deviation"),
      "best_test_acc": best_acc,
      "best_round": best_round,
      "wall_time": wall_time,
      "train_time": float(sum(step_times)),
      "time_per_round": float(np.mean(round_times)),
      # The first step includes jit compilation; later ones are the steady state.
      "step_time_per_round": float(np.mean(step_times[1:] if len(step_times) > 1 else step_times)),
      "resumed_from": resumed_from,
      "branched_from": branched_from,   # {"source": workdir, "round": rounds taken from it} or None
      "selection": selection,
      "config": config,
  }


def run(config, workdir: str, *, resume: bool = False, branch_from: str | None = None,
        branch_round: int | None = None, on_round_end: Callable[[int, dict], None] | None = None) -> dict:
  """Runs the experiment described by ``config`` in ``workdir``; returns the summary.

  Args:
    config: a config built on :func:`ntk_fl.config.base_config`.
    workdir: output directory (created); see the module docstring for its layout.
    resume: continue from the latest checkpoint in ``workdir``.
    branch_from: start a new run in ``workdir`` from the checkpoint of the run in
      this directory after ``branch_round`` rounds, copying its metrics lines
      for those rounds (see :func:`check_branch` for when that is allowed).
    branch_round: the source checkpoint (default: the latest one allowed).
    on_round_end: optional ``fn(round, line)`` called after each round's metrics
      line and checkpoint are written (1-based ``round``); for custom logging or
      early interruption (an exception it raises stops the run there).

  Returns:
    The summary dict written to ``summary.json``.

  Raises:
    ValueError: a bad config value (before any data is loaded), a workdir
      holding another run, resuming with a different config, or a branch the
      method does not certify.
    FileNotFoundError: resuming or branching without a run or checkpoint;
      missing data files.
  """
  started = time.perf_counter()
  validate_config(config)
  # Every step/evaluation is traced inside the mesh, so for_each_client shards clients over it.
  with parallel.use_devices(config.devices):
    return _run(config, workdir, resume=resume, branch_from=branch_from, branch_round=branch_round,
                on_round_end=on_round_end, started=started)


def _read_branch(workdir: str) -> dict | None:
  """Where a branched run took its first rounds from (``BRANCH_FILE``), or ``None``."""
  path = os.path.join(workdir, BRANCH_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def _metrics_up_to(workdir: str, rounds: int, action: str) -> list[dict]:
  """The metrics lines of rounds ``1..rounds`` in ``workdir``."""
  lines = read_metrics(workdir)[:rounds]
  if [line.get("round") for line in lines] != list(range(1, rounds + 1)):
    raise ValueError(f"{os.path.join(workdir, METRICS_FILE)} does not hold rounds 1..{rounds} of the checkpoint; "
                     f"cannot {action}")
  return lines


def _run(config, workdir: str, *, resume: bool, branch_from: str | None, branch_round: int | None,
         on_round_end, started: float) -> dict:
  """:func:`run` after validation, inside the device mesh."""
  workdir = os.path.abspath(workdir)
  start = check_start(config, workdir, resume=resume, branch_from=branch_from, branch_round=branch_round)
  if branch_from is not None:
    branch_from = os.path.abspath(branch_from)

  exp = build_experiment(config)
  algorithm, rounds = exp.algorithm, config.rounds
  if config.eval.selection and algorithm.aggregate != "params":
    # Selection curves average client *weights*; for an ensemble of independent models that is meaningless.
    raise ValueError(f"method {config.method!r} evaluates an ensemble (aggregate = {algorithm.aggregate!r}); "
                     "weight-averaging selection curves do not apply: set config.eval.selection = False")
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  state = _initial_state(algorithm, config)
  num_clients = jax.tree_util.tree_leaves(algorithm.client_params(state))[0].shape[0]
  num_params = sum(math.prod(w.shape[1:]) for w in jax.tree_util.tree_leaves(algorithm.client_params(state)))
  consensus = None
  if config.eval.consensus:
    try:                # traces only: a method without a graph in its round inputs fails here, before any round
      jax.eval_shape(topology.consensus, algorithm.client_params(state), algorithm.round_inputs(0))
    except ValueError as e:
      raise ValueError(f"config.eval.consensus=True scores neighbourhood averages, which method {config.method!r} "
                       f"does not have: {e}") from None
    consensus = jax.jit(topology.consensus)
  keep = tuple(int(r) for r in config.checkpoint_keep)
  ckpt = Checkpoints(os.path.join(workdir, CHECKPOINT_DIR), keep=keep) if config.checkpoint_every or keep else None
  # Every process has checked the workdir (and, resuming, will read its metrics) before process 0 writes to it.
  distributed.barrier("ntk_fl.runner: workdir checked")

  try:
    if resume:
      state = _canonical(ckpt.restore(start, state))
      lines = _metrics_up_to(workdir, start, "resume")
      logging.info("Resuming %s from the checkpoint after round %d", workdir, start)
    elif branch_from is not None:
      with Checkpoints(os.path.join(branch_from, CHECKPOINT_DIR), read_only=True) as source:
        state = _canonical(source.restore(start, state))
      lines = _metrics_up_to(branch_from, start, "branch")
      _write_json(os.path.join(workdir, CONFIG_FILE), config)
      _write_json(os.path.join(workdir, BRANCH_FILE), {"source": branch_from, "round": start})
      if ckpt is not None:
        ckpt.save(start, state)   # the branch resumes from its own workdir, whatever happens to the source
      logging.info("Branching %s from %s after round %d", workdir, branch_from, start)
    else:
      _write_json(os.path.join(workdir, CONFIG_FILE), config)
      lines = []
    # Rewrite (atomically) to exactly the checkpointed rounds, then append.
    _write_atomic(metrics_path, "".join(json.dumps(_jsonable(line), allow_nan=False) + "\n" for line in lines))

    step = algorithm.step   # compiled by the method's factory (see Algorithm); re-jitting would bake
                            # the federation arrays it passes as arguments into the program as constants
    evaluator = metrics_lib.make_evaluator(
        exp.model.apply, exp.dataset.x_test, exp.dataset.y_test,
        batch_size=config.eval.batch_size, chunk_size=config.chunk_size or None, aggregate=algorithm.aggregate)
    primary = distributed.is_primary()      # only process 0 writes files, logs and the progress bar
    bar = tqdm(total=rounds, initial=start, desc=config.method, unit="round", dynamic_ncols=True,
               disable=not primary)
    last_round = start
    with bar, (open(metrics_path, "a") if primary else contextlib.nullcontext()) as metrics_file:
      for r in range(start, rounds):
        if lines and _reached_stop(lines[-1], config):
          break
        round_ = r + 1
        inputs = algorithm.round_inputs(r)
        t0 = time.perf_counter()
        state, step_metrics = step(state, inputs)
        state = _canonical(jax.block_until_ready(state))
        algo_line, algo_clients = _algorithm_metrics(step_metrics, num_clients)
        t1 = time.perf_counter()
        consensus_of = None
        if consensus is not None:      # the models the next round (0-based index r + 1) starts from; its graph
          # is drawn only when _evaluate scores the clients this round (called within this iteration)
          consensus_of = lambda params: consensus(params, algorithm.round_inputs(r + 1))  # pylint: disable=cell-var-from-loop
        eval_line, eval_clients = _evaluate(evaluator, algorithm.client_params(state), round_, config, consensus_of)
        t2 = time.perf_counter()
        line = {"round": round_, "step_time": t1 - t0, "eval_time": t2 - t1, **eval_line, **algo_line,
                "clients": {**eval_clients, **algo_clients}}
        if primary:
          metrics_file.write(json.dumps(_jsonable(line), allow_nan=False) + "\n")
          metrics_file.flush()
        lines.append(_jsonable(line))   # exactly what was logged (NaN -> None), as a resumed run reads it
        if ckpt is not None and ((config.checkpoint_every and _due(round_, config.checkpoint_every, rounds))
                                 or round_ in keep):
          ckpt.save(round_, state)
        postfix = {"s/round": f"{t2 - t0:.2f}"}
        if "test_acc" in line and primary:
          postfix["acc"] = f"{line['test_acc']:.4f}"
          logging.info("round %d: aggregated acc %.4f, step %.2fs, eval %.2fs",
                       round_, line["test_acc"], t1 - t0, t2 - t1)
        bar.set_postfix(postfix)
        bar.update(1)
        last_round = round_
        if on_round_end is not None:
          on_round_end(round_, line)
    if ckpt is not None and config.checkpoint_every and last_round not in ckpt.steps():
      ckpt.save(last_round, state)  # e.g. a resumed run whose last checkpoint was deleted
  finally:
    if ckpt is not None:
      ckpt.close()

  selection = None
  title = f"{config.method} ({config.data.name}, seed {config.seed})"
  if config.eval.selection:
    curves = metrics_lib.selection_curves(
        exp.model.apply, algorithm.client_params(state), exp.dataset.x_test, exp.dataset.y_test,
        seed=config.seed, batch_size=config.eval.batch_size, chunk_size=config.chunk_size or None)
    selection = {k: v.tolist() for k, v in curves.items()}
    if distributed.is_primary():
      plotting.plot_selection_curves(curves, os.path.join(workdir, SELECTION_PLOT), title=title)
  rounds_axis = [line["round"] for line in lines]
  if distributed.is_primary():
    plotting.plot_accuracy(
      rounds_axis, [line.get("test_acc") for line in lines], [line.get("client_acc_mean") for line in lines],
        [line.get("client_acc_min") for line in lines], [line.get("client_acc_max") for line in lines],
        os.path.join(workdir, ACCURACY_PLOT), title=title)

  summary = _jsonable(_summarize(config, lines, num_params=num_params, selection=selection,
                                 wall_time=time.perf_counter() - started,
                                 resumed_from=start if resume else None,
                                 branched_from=_read_branch(workdir)))
  _write_json(os.path.join(workdir, SUMMARY_FILE), summary)
  distributed.barrier("ntk_fl.runner: run written")   # no process exits (and tears the run down) before the files are
  if distributed.is_primary():
    logging.info("Finished %s: %s", workdir, {k: summary[k] for k in ("rounds_to_target", "final_test_acc")})
  return summary
