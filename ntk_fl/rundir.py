"""The run directory: the files a run leaves in its workdir, and who may start in one.

This module owns the format; the loop (:mod:`ntk_fl.runner`), :mod:`ntk_fl.compare`,
:mod:`ntk_fl.reproduce` and the analysis scripts (``experiments/summarize_runs.py``,
``paired_test.py``, ``consensus_accuracy.py``) read and write runs only through it.

Workdir layout::

  config.json      the run's config (resume refuses a different one)
  metrics.jsonl    one line per round (1-based ``round``)
  summary.json     rounds to each target, final/best accuracies, timings, selection curves
  accuracy.png     aggregated vs mean-client accuracy (client min-max band)
  loss.png         test and training losses; communication.png: accuracy vs bits sent (if counted)
  selection.png    best-to-worst / random / worst-to-best averaging curves
                   (each figure also as a vector .pdf; :mod:`ntk_fl.plotting`)
  checkpoints/     orbax checkpoints, one directory per saved round count
  branched_from.json  only for a branched run: the source workdir and the round it was taken after
  run.lock         the lock of the run that holds the workdir (pid, host; empty when none does)
  unfinished-<t>/  the files of a run that ``resume`` restarted from round 0 (it had no checkpoint)

How a run may start in a workdir (:func:`check_start`): fresh (an empty
workdir; a run is never overwritten silently), ``resume`` (the same config and
a good checkpoint, :func:`check_workdir`: damaged or incomplete checkpoints are
set aside, renamed, and the newest good one is used; with none, the run starts
again from round 0, its old files moved to ``unfinished-<t>/``) or a branch from
another run's checkpoint (:func:`check_branch`): the two configs must be equal,
or the method's ``shared_rounds`` must certify that they compute rounds 1..k
identically (SPARK's ablation rows share the hard-label warm-up). Only the run
holding the workdir's lock (:func:`hold_workdir`) may start or write in it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shutil

from absl import logging
import jax
import numpy as np

from ntk_fl import distributed, settings, validation
from ntk_fl._src import fsutil
from ntk_fl._src.method_modules import method_module_imported
from ntk_fl.algorithms.base import available, config_without, get_method
from ntk_fl.checkpoint import Checkpoints

__all__ = [
  "NEUTRAL_KEYS",
  "CONFIG_FILE",
  "METRICS_FILE",
  "SUMMARY_FILE",
  "CHECKPOINT_DIR",
  "ACCURACY_PLOT",
  "SELECTION_PLOT",
  "BRANCH_FILE",
  "check_branch",
  "check_start",
  "check_workdir",
  "check_writable",
  "check_links",
  "hold_workdir",
  "release_workdir",
  "release_all",
  "holds",
  "workdir_lock",
  "lock_for_children",
  "run_identity",
  "drop_event_files",
  "stored_identity",
  "written_identities",
  "LOCK_FILE",
  "checkpoint_dir",
  "finalised_steps",
  "jsonable",
  "is_run",
  "metrics_line",
  "metrics_up_to",
  "read_branch",
  "read_config",
  "read_run",
  "rebuild_config",
  "copy_run",
  "flatten",
  "setting_key",
  "split_label",
  "read_metrics",
  "read_summary",
  "write_config",
  "write_branch",
  "write_metrics",
  "write_summary",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "checkpoints"
ACCURACY_PLOT = "accuracy.png"
SELECTION_PLOT = "selection.png"
BRANCH_FILE = "branched_from.json"

NEUTRAL_KEYS = (
  "seed",
  "devices",
  "chunk_size",
  "debug_clients",
  "replicas",
  "replica_chunk",
  "checkpoint_every",
  "checkpoint_keep",
  "on_divergence",
  "eval.consensus",
  "data.data_dir",
  "cost_estimate",
)
"""Config fields that do not make two runs different settings (grouping in :mod:`ntk_fl.compare`, matching
runs to experiments in :mod:`ntk_fl.reproduce`): the seed (what a group is made of), where the clients ran
and in how many vmap chunks or in the debug loop (equal up to float rounding), which checkpoints were kept,
the divergence policy, the extra consensus scoring, where the data files were read from and whether the
cost estimate ran before round 1."""


def flatten(config: dict, prefix: str = "") -> dict:
  """``{"algorithm.lr": 0.01, ...}``: a stored config's leaves by dotted key (lists become
  tuples)."""
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
  return out


def setting_key(config: dict) -> tuple:
  """A stored config without the seed and :data:`NEUTRAL_KEYS`: equal for seeds of one setting."""
  return tuple(sorted((k, v) for k, v in flatten(config).items() if k not in NEUTRAL_KEYS))


# Keys that do not change the trajectory (where clients run, when checkpoints are written and which are
# kept, whether the consensus models are also scored, whether the cost estimate ran); resume and branch
# ignore them.
RESULT_NEUTRAL_KEYS = (
  "devices",
  "checkpoint_every",  # a long run may resume checkpointing more often than it started
  "checkpoint_keep",
  "eval.consensus",
  "on_divergence",
  "debug_clients",
  "replicas",  # a seed-batched run writes each replica as a single-seed run (replicas = 1)
  "replica_chunk",
  "cost_estimate",
)
# Keys added to the schema after runs were stored, each with the value that reproduces those runs: a stored
# config.json without one ran with that value (resume, branch and read_config fill it in).
_ADDED_KEYS = {
  "data.max_test": 0,
  "eval.consensus": False,
  "data.partition_file": "",
  "on_divergence": "stop",
  "debug_clients": False,
  "model.module": "",
  "model.per_sample": False,
  "replicas": 1,
  "replica_chunk": 1,
  "data.keep_per_client": 0,
  "cost_estimate": True,
}


def checkpoint_dir(workdir: str) -> str:
  """Where the run in ``workdir`` keeps its orbax checkpoints."""
  return os.path.join(workdir, CHECKPOINT_DIR)


def finalised_steps(workdir: str) -> list[int]:
  """The rounds of ``workdir``'s finalised checkpoints, ascending (by folder name, without opening them:
  orbax renames a step's folder to its number only once the save is complete)."""
  folder = checkpoint_dir(workdir)
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def jsonable(obj):
  """Plain-python JSON value of ``obj`` (numpy/jax arrays and scalars, tuples, configs and settings).

  Non-finite floats become ``None`` (JSON has no NaN/inf).
  """
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    obj = settings.to_dict(obj)
  elif callable(getattr(obj, "to_dict", None)):  # an ml_collections.ConfigDict
    obj = obj.to_dict()
  if isinstance(obj, dict):
    return {str(k): jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [jsonable(v) for v in obj]
  if isinstance(obj, (jax.Array, np.ndarray, np.generic)):
    return jsonable(np.asarray(obj).tolist())
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else None
  if obj is None or isinstance(obj, (bool, int, str)):
    return obj
  raise TypeError(f"cannot write {type(obj).__name__} to JSON: {obj!r}")


def _write_atomic(path: str, text: str) -> None:
  """Replaces ``path`` by ``text`` in one step; only process 0 writes.

  :func:`ntk_fl._src.fsutil.write_atomic`: an exclusive temporary file (never a
  planted link), ``fsync`` of the file and of the directory after the rename.
  """
  if not distributed.is_primary():
    return
  fsutil.write_atomic(path, text)


def _write_json(path: str, obj) -> None:
  _write_atomic(path, json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n")


def read_metrics(workdir: str) -> list[dict]:
  """The per-round metrics lines of ``workdir/metrics.jsonl`` (a trailing partial line is dropped)."""
  path = os.path.join(workdir, METRICS_FILE)
  lines = []
  try:
    with open(path) as f:
      raw = f.read().split("\n")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not a text file of JSON lines ({e})") from None
  for i, text in enumerate(raw):
    if not text.strip():
      continue
    try:
      line = json.loads(text)
    except json.JSONDecodeError:
      if i == len(raw) - 1:  # the process died mid-write; that round is redone anyway
        break
      raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    if not isinstance(line, dict):
      raise ValueError(
        f"{path}: line {i + 1} is not a metrics record (a JSON object), got {text[:60]!r}"
      )
    lines.append(line)
  return lines


def metrics_line(line: dict) -> str:
  """One ``metrics.jsonl`` line (newline included) of a round's metrics dict; NaN/inf are written as ``null``."""
  return json.dumps(jsonable(line), allow_nan=False) + "\n"


def write_metrics(workdir: str, lines: list[dict]) -> None:
  """Replaces ``workdir/metrics.jsonl`` (atomically) by exactly ``lines``; the loop then appends."""
  _write_atomic(os.path.join(workdir, METRICS_FILE), "".join(metrics_line(line) for line in lines))


def metrics_up_to(workdir: str, rounds: int, action: str) -> list[dict]:
  """The metrics lines of rounds ``1..rounds`` in ``workdir`` (``action`` names the caller in the error)."""
  lines = read_metrics(workdir)[:rounds]
  if [line.get("round") for line in lines] != list(range(1, rounds + 1)):
    raise ValueError(
      f"{os.path.join(workdir, METRICS_FILE)} does not hold rounds 1..{rounds} of the checkpoint; "
      f"cannot {action}"
    )
  return lines


def write_config(workdir: str, config) -> None:
  """Records the run's config as ``workdir/config.json``."""
  _write_json(os.path.join(workdir, CONFIG_FILE), config)


def write_branch(workdir: str, source: str, round_: int) -> None:
  """Records that the run in ``workdir`` took rounds ``1..round_`` from the run in ``source``."""
  _write_json(os.path.join(workdir, BRANCH_FILE), {"source": source, "round": round_})


def read_branch(workdir: str) -> dict | None:
  """Where a branched run took its first rounds from (``{"source", "round"}``), or ``None``."""
  path = os.path.join(workdir, BRANCH_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def write_summary(workdir: str, summary: dict) -> None:
  """Writes ``workdir/summary.json``, the last file a finished run writes."""
  _write_json(os.path.join(workdir, SUMMARY_FILE), summary)


def _config_diff(old, new, prefix: str = "") -> list[str]:
  if isinstance(old, dict) and isinstance(new, dict):
    return [
      d
      for k in sorted(set(old) | set(new))
      for d in _config_diff(old.get(k, "<missing>"), new.get(k, "<missing>"), f"{prefix}{k}.")
    ]
  return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def _stored_config(workdir: str, action: str) -> dict:
  """``workdir``'s ``config.json`` as a JSON dict, keys added to the schema since it was written filled in."""
  config_path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
      f"cannot {action}: {config_path} does not exist (no run was started in {workdir})"
    )
  try:
    with open(config_path) as f:
      stored = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
    e = "nested too deeply" if isinstance(e, RecursionError) else e
    raise ValueError(
      f"cannot {action}: {config_path} is not a readable config ({e}); it is the run's record "
      "of its config: restore it from a copy, or start the run again in an empty workdir"
    ) from None
  if not isinstance(stored, dict):
    raise ValueError(
      f"cannot {action}: {config_path} holds {type(stored).__name__}, not a config object"
    )
  for path, value in _ADDED_KEYS.items():
    *parents, leaf = path.split(".")
    node = stored
    for key in parents:
      node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
      node.setdefault(leaf, value)
  _fill_hyperparameter_defaults(stored)
  return stored


def _fill_hyperparameter_defaults(stored: dict) -> None:
  """Fills the ``algorithm`` block of a stored config with its method's defaulted hyperparameters.

  A method's hyperparameter with a default was added after runs were stored, and its default is the value
  that reproduces them (the run itself is built the same way, :func:`ntk_fl.settings.from_mapping`).
  """
  method, algorithm = stored.get("method"), stored.get("algorithm")
  if not (isinstance(method, str) and isinstance(algorithm, dict)):
    return
  try:
    spec = get_method(method)
  except ValueError:  # a method of a module not imported here: nothing to fill
    return
  for field in dataclasses.fields(spec.hyperparameters):
    if field.compare and field.default is not dataclasses.MISSING:
      algorithm.setdefault(field.name, jsonable(field.default))


def read_config(workdir: str) -> dict:
  """The config the run in ``workdir`` was started with (its ``config.json``), as data: a JSON dict.

  Keys added to the schema since the run was written are filled in with the
  values that reproduce it. Nothing is imported (a stored ``method_module`` is
  just a string here): for tables and comparisons. To rebuild or rescore the
  run, use :func:`rebuild_config` (this read, checked for a stored ``method_module``): the
  package's two readers of a stored config.
  """
  return _stored_config(workdir, "read the run")


def rebuild_config(workdir: str, *, trust_method_module: str | None = None) -> dict:
  """The stored config of ``workdir``, ready for :func:`ntk_fl.schema.validate_config` / ``build_experiment``.

  A run directory is data, and data must not run code: a stored
  ``method_module`` (which :func:`ntk_fl.schema.validate_config` would import,
  executing the file) is kept when the caller names that same module or file in
  ``trust_method_module`` (``--method_module`` of the analysis scripts) or when
  this process has imported it already. Otherwise the run's method must be
  registered (a built-in method, or one the calling script registered itself):
  the stored ``method_module`` is then dropped (with a warning) and the method
  comes from the registry; with neither, the read is refused. A stored
  ``model.module`` (the user's flax module, equally imported) is read only when
  this process has imported that module already.
  ``ml_collections.ConfigDict(rebuild_config(workdir))`` is an editable config of it.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  stored = _stored_config(workdir, "read the run")
  spec = stored.get("method_module") or ""
  trusted = bool(trust_method_module) and _same_module(spec, trust_method_module)
  if spec and not (trusted or method_module_imported(spec)):
    if stored.get("method") not in available():
      raise ValueError(
        f"{path} names method_module {spec!r} for method {stored.get('method')!r}; a run directory is not "
        f"trusted to import code: pass --method_module={spec} (trust_method_module=...) to import it, or "
        "register the method before reading the run"
      )
    logging.warning(
      "%s: method %r is registered; not importing its stored method_module %r",
      path,
      stored.get("method"),
      spec,
    )
    stored["method_module"] = ""
  model_spec = (stored.get("model") or {}).get("module") or ""
  if model_spec:
    from ntk_fl._src import user_model  # pylint: disable=g-import-not-at-top

    if not user_model.imported(model_spec):
      raise ValueError(
        f"{path} names model.module {model_spec!r}; a run directory is not trusted to import "
        "code: import that module in your script first, then read the run"
      )
  return stored


def _same_module(spec: str, trusted: str) -> bool:
  if spec.endswith(".py") or trusted.endswith(".py"):
    return os.path.realpath(spec) == os.path.realpath(trusted)
  return spec == trusted


def read_summary(workdir: str) -> dict | None:
  """``workdir/summary.json`` of a finished run, or ``None`` while the run has not finished."""
  path = os.path.join(workdir, SUMMARY_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def is_run(workdir: str) -> bool:
  """Whether ``workdir`` holds a started run (its ``config.json`` and ``metrics.jsonl``)."""
  return all(os.path.isfile(os.path.join(workdir, name)) for name in (CONFIG_FILE, METRICS_FILE))


def read_run(workdir: str) -> dict:
  """Everything a table needs of the run in ``workdir``, finished, running or archived.

  Returns:
    ``{"name", "workdir", "config", "lines", "summary"}``: the workdir's base
    name, the path, :func:`read_config`, :func:`read_metrics` (a running run's
    half-written last line is left out) and :func:`read_summary` (``None`` while
    the run has not finished).
  """
  return {
    "name": os.path.basename(os.path.normpath(workdir)),
    "workdir": workdir,
    "config": read_config(workdir),
    "lines": read_metrics(workdir),
    "summary": read_summary(workdir),
  }


def copy_run(workdir: str, target: str, *, drop: tuple[str, ...] = ()) -> None:
  """Copies the run's ``config.json`` and ``summary.json`` (when finished) verbatim, and its metrics lines
  without the keys ``drop``, into the directory ``target`` (created). Checkpoints and plots are not copied."""
  os.makedirs(target, exist_ok=True)
  for name in (CONFIG_FILE, SUMMARY_FILE):
    if os.path.isfile(os.path.join(workdir, name)):
      shutil.copyfile(os.path.join(workdir, name), os.path.join(target, name))
  write_metrics(
    target, [{k: v for k, v in line.items() if k not in drop} for line in read_metrics(workdir)]
  )


def split_label(config: dict) -> str:
  """A stored config's data split: ``"IID"``, ``"α=0.1"``, ``"2 labels/client"``, ``"contiguous"`` or a map's name.

  The authors' shipped maps read ``"authors α=0.1 d0"`` / ``"authors IID d0"``; any other
  index map is labelled by its file name.
  """
  data = config["data"]
  partition = data["partition"]
  if partition == "iid":
    return "IID"
  if partition == "contiguous":
    return "contiguous"
  if partition == "shards":
    return f"{data['classes_per_client']} labels/client"
  if partition == "index_map":
    name = os.path.basename(data.get("partition_file", ""))
    level, _, draw = name.removeprefix("fmnist_").rpartition("_")
    if name.startswith("fmnist_") and draw.isdigit():
      return f"authors {'IID' if level == 'iid' else 'α=' + level.removeprefix('alpha')} d{draw}"
    return name
  return f"α={data['alpha']:g}"


def _experiment_configs(config, workdir: str, action: str) -> tuple[dict, dict]:
  """``workdir``'s stored config and ``config`` as JSON dicts, without the placement keys."""
  stored = _stored_config(workdir, action)
  current = json.loads(json.dumps(jsonable(config)))
  _fill_hyperparameter_defaults(
    current
  )  # a config written without a defaulted key means its default
  # Where clients run is not part of the experiment: a run may resume on another device count
  # (results agree up to float rounding), and runs started before these keys existed lack them.
  return config_without(stored, *RESULT_NEUTRAL_KEYS), config_without(current, *RESULT_NEUTRAL_KEYS)


def check_writable(workdir: str) -> None:
  """``workdir`` is (or can be made) a directory this process may write: checked before any work.

  Raises:
    ValueError: ``workdir`` or a folder above it is a file, or the nearest existing
      folder is not writable (permissions, a read-only file system).
  """
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(
      f"workdir {workdir} is a file, not a directory; choose a directory (it is created if missing)"
    )
  existing = workdir
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"workdir {workdir} cannot be created: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(
      f"workdir {workdir} cannot be written: {existing} is not writable by this user "
      "(or is on a read-only file system)"
    )


# ----------------------------------------------------------------------------- one run per workdir

LOCK_FILE = fsutil.LOCK_FILE
# "<fd>:<workdir>": the local launcher's lock, inherited by its workers.
_LOCK_ENV = "NTK_FL_WORKDIR_LOCK"
_HELD: dict[str, fsutil.WorkdirLock] = {}


def hold_workdir(workdir: str, *, primary: bool | None = None) -> fsutil.WorkdirLock | None:
  """Locks ``workdir`` for this process until it exits (or :func:`release_workdir`); reentrant.

  Only the process that owns the run writes in its workdir: a second run refuses
  with :class:`ntk_fl._src.fsutil.WorkdirBusy` naming the holder's pid and host.
  The workers of a local multi-process run share their launcher's lock
  (inherited descriptor); of a multi-host run, process 0 holds it (``primary``:
  whether this is process 0, asked of JAX when ``None``; the others get ``None``).
  The record of a killed run is taken over with a warning when its process is
  provably dead (:meth:`ntk_fl._src.fsutil.WorkdirLock.acquire`).
  """
  path = os.path.abspath(workdir)
  if path in _HELD:
    return _HELD[path]
  fd, _, locked = os.environ.get(_LOCK_ENV, "").partition(":")
  if locked != path and not (distributed.is_primary() if primary is None else primary):
    return None
  check_writable(path)
  lock = fsutil.WorkdirLock(path, fd=int(fd) if fd and locked == path else None).acquire()
  if lock.taken_over:
    logging.warning(
      "workdir %s: the run recorded in %s (pid %s on this host, started %s) ended "
      "without releasing it (it was killed); this run takes the lock over",
      path,
      lock.path,
      lock.taken_over.get("pid"),
      lock.taken_over.get("started"),
    )
  _HELD[path] = lock
  atexit.register(release_workdir, path)
  return lock


def release_workdir(workdir: str) -> None:
  """Drops this process's lock on ``workdir`` (no-op when it holds none)."""
  lock = _HELD.pop(os.path.abspath(workdir), None)
  if lock is not None:
    lock.release()


def release_all() -> None:
  """Drops every workdir lock this process holds (before it leaves without running ``atexit``)."""
  for path in list(_HELD):
    release_workdir(path)


def holds(workdir: str) -> bool:
  """Whether this process holds ``workdir``'s lock (its own or its launcher's)."""
  return os.path.abspath(workdir) in _HELD


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """``with workdir_lock(w):`` -- :func:`hold_workdir` for the block (kept if held before it)."""
  path = os.path.abspath(workdir)
  held = path in _HELD
  lock = hold_workdir(path)
  held = held or lock is None
  try:
    yield lock
  finally:
    if not held:
      release_workdir(path)


def lock_for_children(workdir: str) -> tuple[dict, int]:
  """``(environment, fd)`` that let child processes share this process's lock on ``workdir``."""
  lock = hold_workdir(workdir, primary=True)
  os.set_inheritable(lock.fd, True)
  return {_LOCK_ENV: f"{lock.fd}:{lock.workdir}"}, lock.fd


# The files a run writes; a link at one of these names would send the run's writes elsewhere.
_RUN_NAMES = (
  "config.json",
  "metrics.jsonl",
  "summary.json",
  "branched_from.json",
  "log.txt",
  "accuracy.png",
  "selection.png",
  "checkpoints",
  LOCK_FILE,
)


def check_links(workdir: str, *, fresh: bool) -> None:
  """Refuses links where a run writes: any in a fresh run's workdir, else at a run file's name."""
  if not os.path.isdir(workdir):
    return
  names = sorted(os.listdir(workdir)) if fresh else _RUN_NAMES
  links = [n for n in names if os.path.islink(os.path.join(workdir, n))]
  if links:
    raise ValueError(
      f"workdir {workdir} holds symbolic links ({', '.join(links)}); a run writes "
      "only its own files: remove the links, or choose an empty workdir"
    )


# Keys of RESULT_NEUTRAL_KEYS that were part of a run's identity when older versions of the package
# recorded it in their checkpoints (:func:`written_identities`).
_FORMERLY_IDENTIFYING_KEYS = ("checkpoint_every",)


def run_identity(config, *, _identifying: tuple[str, ...] = ()) -> str:
  """SHA-256 of a run's experiment config (its seed included; placement keys left out), as hex.

  The same for a ``config.json`` read back (``dict``) and the config it was
  written from: checkpoints are tied to their run by it (:class:`ntk_fl.checkpoint.Checkpoints`).
  ``_identifying``: result-neutral keys hashed all the same, as an older version did.
  """
  plain = config if isinstance(config, dict) else json.loads(json.dumps(jsonable(config)))
  plain = config_without(plain, *(k for k in RESULT_NEUTRAL_KEYS if k not in _identifying))
  return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def written_identities(workdir: str) -> list[str]:
  """The identities an older version of the package may have tied ``workdir``'s checkpoints to: the
  :func:`run_identity` of its ``config.json`` exactly as written (keys added to the schema since left
  out), and the same with the keys that were then part of the identity (the checkpoint cadence); empty
  without a readable ``config.json``.

  The current config of such a run (its added keys at the values that reproduce it, another cadence)
  hashes differently, so a resume or a branch accepts these too (``Checkpoints(also_accept=...)``).
  """
  try:
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      written = json.load(f)
  except (OSError, ValueError, RecursionError):
    return []
  if not isinstance(written, dict):
    return []
  return [run_identity(written), run_identity(written, _identifying=_FORMERLY_IDENTIFYING_KEYS)]


def stored_identity(workdir: str) -> str:
  """:func:`run_identity` of the run stored in ``workdir`` (its ``config.json``)."""
  return run_identity(_stored_config(workdir, "read the run"))


def drop_event_files(workdir: str) -> None:
  """Removes ``workdir``'s TensorBoard event files (a resumed run rewrites them from metrics)."""
  if distributed.is_primary():
    for name in os.listdir(workdir):
      if name.startswith("events.out.tfevents") and not os.path.islink(os.path.join(workdir, name)):
        os.remove(os.path.join(workdir, name))


# Outputs of a run that resume moves aside when it has nothing to resume from.
_RESTART_NAMES = (
  "config.json",
  "metrics.jsonl",
  "summary.json",
  "branched_from.json",
  "accuracy.png",
  "selection.png",
)


def _move_unfinished_aside(workdir: str) -> str | None:
  """Moves a started run's outputs (no usable checkpoint) to ``workdir/unfinished-<UTC time>/``."""
  names = [
    n for n in os.listdir(workdir) if n in _RESTART_NAMES or n.startswith("events.out.tfevents")
  ]
  if not names:
    return None
  stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
  target = os.path.join(workdir, f"unfinished-{stamp}")
  if distributed.is_primary():
    os.makedirs(target)
    for name in names:
      os.rename(os.path.join(workdir, name), os.path.join(target, name))
    fsutil.fsync_dir(workdir)
  return target


def check_workdir(
  config, workdir: str, *, resume: bool, resume_from_step: int | None = None
) -> int:
  """Checks ``workdir`` before any work; returns the round count to start from.

  A fresh run refuses a workdir that already holds a run (never overwrites one
  silently). ``resume`` needs the same config (``config.json``) and a good
  checkpoint: damaged or incomplete checkpoints are set aside (renamed, see
  :meth:`ntk_fl.checkpoint.Checkpoints.recover`) and the newest good one is
  used, or checkpoint ``resume_from_step`` when given (later ones are set aside:
  the resumed run recomputes those rounds).
  """
  workdir = os.path.abspath(workdir)
  check_writable(workdir)
  check_links(workdir, fresh=not resume)
  ckpt_dir = checkpoint_dir(workdir)
  if not resume:
    existing = [
      n
      for n in (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR)
      if os.path.exists(os.path.join(workdir, n))
    ]
    if existing:
      raise ValueError(
        f"workdir {workdir} already holds a run ({', '.join(existing)}); continue "
        "it with --resume (resume=True; with no checkpoint yet it restarts from "
        "round 0, the old files moved aside) or choose an empty workdir"
      )
    return 0
  if not os.path.exists(os.path.join(workdir, CONFIG_FILE)) and not finalised_steps(workdir):
    moved = _move_unfinished_aside(workdir) if os.path.isdir(workdir) else None
    logging.warning(
      "nothing to resume in %s (no %s): starting the run from round 0%s",
      workdir,
      CONFIG_FILE,
      f"; its earlier files were moved to {moved}" if moved else "",
    )
    return 0
  stored, current = _experiment_configs(config, workdir, "resume")
  diff = _config_diff(stored, current)
  if diff:
    hint = ""
    if [d.split(":")[0] for d in diff] == ["rounds"] and current["rounds"] > stored["rounds"]:
      hint = (
        f"; to run more rounds, start a new run from this one's checkpoint: --workdir=NEW_DIR "
        f"--branch_from={workdir} (branch_from=...; allowed where the method certifies the shared rounds)"
      )
    raise ValueError(
      f"cannot resume {workdir} with a different config; changed: {'; '.join(diff)}{hint}"
    )
  if resume_from_step is not None:
    validation.check_int("resume_from_step", resume_from_step, low=1)
  start = None
  if os.path.isdir(ckpt_dir):
    with Checkpoints(
      ckpt_dir, identity=run_identity(config), also_accept=written_identities(workdir)
    ) as ckpt:
      start = ckpt.recover(upto=resume_from_step)
      held = _metrics_rounds(workdir)
      if start is not None and start > held and resume_from_step is None:
        # metrics lines were lost after the checkpoint was written: resume from one they cover
        older = [s for s in ckpt.steps() if s <= held]
        logging.warning(
          "%s holds rounds 1..%d only, not 1..%d of the newest checkpoint; resuming from %s",
          os.path.join(workdir, METRICS_FILE),
          held,
          start,
          f"checkpoint {older[-1]}" if older else "round 0",
        )
        start = ckpt.recover(upto=older[-1]) if older else None
  if start is None:
    if resume_from_step is not None:
      raise FileNotFoundError(
        f"cannot resume from round {resume_from_step}: no finalised checkpoint in {ckpt_dir}"
      )
    moved = _move_unfinished_aside(workdir)
    logging.warning(
      "nothing to resume in %s: no good checkpoint in %s (config.checkpoint_every = "
      "%d); starting the run from round 0 in place; its earlier files were moved "
      "to %s",
      workdir,
      ckpt_dir,
      config.checkpoint_every,
      moved,
    )
    return 0
  metrics_up_to(
    workdir, start, "resume"
  )  # the lines the resumed run keeps must be readable: checked now
  return start


def _metrics_rounds(workdir: str) -> int:
  """How many leading rounds ``1, 2, ...`` ``workdir/metrics.jsonl`` holds (0 without the file)."""
  if not os.path.isfile(os.path.join(workdir, METRICS_FILE)):
    return 0
  held = 0
  for line in read_metrics(workdir):
    if line.get("round") != held + 1:
      break
    held += 1
  return held


REPLICAS_FILE = "replicas.json"
"""A seed-batched run's record in its workdir: ``{"seed", "replicas", "runs"}`` (the replicas' folders)."""


def replica_dir(workdir: str, seed: int) -> str:
  """The run directory of seed ``seed``'s replica in a seed-batched run's ``workdir``."""
  return os.path.join(workdir, f"seed{seed}")


def check_replicas_workdir(config, workdir: str, *, resume: bool) -> None:
  """The workdir of a seed-batched run (``config.replicas > 1``) itself: no single-seed run in it, and
  its :data:`REPLICAS_FILE` (if any) from the same first seed and replica count; the replicas' folders
  are checked as runs of their own (:func:`check_workdir`)."""
  workdir = os.path.abspath(workdir)
  check_writable(workdir)
  record = os.path.join(workdir, REPLICAS_FILE)
  if os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    raise ValueError(
      f"workdir {workdir} holds a single-seed run (config.json); a seed-batched run "
      f"(config.replicas = {config.replicas}) needs an empty workdir or its own earlier one"
    )
  if os.path.isfile(record):
    try:
      with open(record) as f:
        stored = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(
        f"{record} is not a readable record of a seed-batched run ({e}); its replicas are the "
        "seed<k>/ folders beside it: resume each as a single-seed run, or choose an empty workdir"
      ) from None
    if not isinstance(stored, dict):
      stored = {}
    if not resume:
      raise ValueError(
        f"workdir {workdir} already holds a seed-batched run ({REPLICAS_FILE}); continue it "
        "with --resume or choose an empty workdir"
      )
    if (stored.get("seed"), stored.get("replicas")) != (config.seed, config.replicas):
      raise ValueError(
        f"cannot resume {workdir} with a different config; changed: seed, replicas: "
        f"{stored.get('seed')!r}, {stored.get('replicas')!r} -> {config.seed!r}, {config.replicas!r}"
      )


def _check_replicas_start(
  config, workdir: str, *, resume: bool, resume_from_step: int | None
) -> int:
  """:func:`check_start` of a seed-batched run: its workdir, then each replica's folder as a run (held
  while it is checked: resume may set checkpoints aside). Returns the fewest rounds any replica starts
  from (each resumes from its own checkpoint)."""
  check_replicas_workdir(config, workdir, resume=resume)
  starts = []
  for k in range(config.replicas):
    # Replica k's settings as far as the checks read them (the schema builds its topology: runner).
    run = dataclasses.replace(config, seed=config.seed + k, replicas=1)
    folder = replica_dir(os.path.abspath(workdir), run.seed)
    with workdir_lock(folder):
      starts.append(check_workdir(run, folder, resume=resume, resume_from_step=resume_from_step))
  return min(starts)


def write_replicas(workdir: str, config) -> None:
  """Writes a seed-batched run's :data:`REPLICAS_FILE` (its first seed, replica count and folders)."""
  runs = [os.path.basename(replica_dir(workdir, config.seed + k)) for k in range(config.replicas)]
  if distributed.is_primary():
    _write_json(
      os.path.join(workdir, REPLICAS_FILE),
      {"seed": config.seed, "replicas": config.replicas, "runs": runs},
    )


def replica_runs(workdir: str) -> list[str]:
  """The replicas' run directories of the seed-batched run in ``workdir`` (``[]`` if it holds none)."""
  record = os.path.join(workdir, REPLICAS_FILE)
  if not os.path.isfile(record):
    return []
  try:
    with open(record) as f:
      runs = json.load(f).get("runs", [])
  except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
    return []
  return [
    os.path.join(workdir, r)
    for r in runs
    if isinstance(r, str) and os.path.isdir(os.path.join(workdir, r))
  ]


def check_start(
  config,
  workdir: str,
  *,
  resume: bool = False,
  resume_from_step: int | None = None,
  branch_from: str | None = None,
  branch_round: int | None = None,
) -> int:
  """Checks how a run of ``config`` in ``workdir`` may start; returns the round count to start from.

  A fresh run (empty ``workdir``), ``resume`` (:func:`check_workdir`; from
  checkpoint ``resume_from_step`` when given, which implies ``resume``) or a
  branch from another run (:func:`check_branch`); the options are checked
  together here so the entry point and :func:`ntk_fl.runner.run` refuse the same requests.
  """
  resume = resume or resume_from_step is not None
  data_dir = config.data.data_dir
  if data_dir and not os.path.isdir(os.path.expanduser(data_dir)):  # now, not after the data load
    raise ValueError(
      f"config.data.data_dir = {data_dir!r} is not a directory; give the folder "
      "that holds the data set's files, or '' to search the default places"
    )
  if resume and branch_from is not None:
    raise ValueError(
      "resume and branch_from exclude each other (--resume, --branch_from; a branched run resumes "
      "from its own checkpoints)"
    )
  if branch_round is not None and branch_from is None:
    raise ValueError(
      f"branch_round={branch_round} needs branch_from (--branch_round={branch_round} needs "
      "--branch_from: the run to branch from)"
    )
  if getattr(config, "replicas", 1) > 1:
    if branch_from is not None:
      raise ValueError(
        f"config.replicas = {config.replicas}: a seed-batched run cannot branch (branch_from); "
        "branch each seed's run on its own"
      )
    return _check_replicas_start(config, workdir, resume=resume, resume_from_step=resume_from_step)
  start = check_workdir(config, workdir, resume=resume, resume_from_step=resume_from_step)
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
      raise ValueError(
        f"cannot branch from {source}: its config differs ({'; '.join(diff)}) and method "
        f"{config.method!r} does not certify that any round is computed the same under both"
      )
  ckpt_dir = checkpoint_dir(source)
  steps = []
  if os.path.isdir(ckpt_dir):
    # Another run's: verified against its own identity, never renamed.
    with Checkpoints(
      ckpt_dir,
      read_only=True,
      identity=run_identity(stored),
      also_accept=written_identities(source),
    ) as ckpt:
      steps, damaged = ckpt.good_steps()
    for step, why in damaged.items():
      logging.warning(
        "cannot branch from checkpoint %s: %s", os.path.join(ckpt_dir, str(step)), why
      )
  limit = min(shared, config.rounds - 1)
  if branch_round is None:
    usable = [s for s in steps if s <= limit]
    if not usable:
      raise FileNotFoundError(
        f"cannot branch from {source}: no finalised checkpoint within the {limit} rounds the "
        f"two configs share (checkpoints after rounds {steps})"
      )
    return usable[-1]
  validation.check_int("branch_round", branch_round, low=1)
  if branch_round > limit:
    why = (
      f"the two configs compute only rounds 1..{shared} identically"
      if shared < config.rounds
      else f"the new run has {config.rounds} rounds"
    )
    raise ValueError(
      f"cannot branch from {source} after round {branch_round}: {why}"
      + (f" (changed: {'; '.join(diff)})" if diff else "")
    )
  if branch_round not in steps:
    raise FileNotFoundError(
      f"cannot branch from {source} after round {branch_round}: no finalised checkpoint "
      f"for it (checkpoints after rounds {steps})"
    )
  return branch_round
