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

How a run may start in a workdir (:func:`check_start`): fresh (an empty
workdir; a run is never overwritten silently), ``resume`` (the same config and
a good checkpoint, :func:`check_workdir`: damaged or incomplete checkpoints are
set aside, renamed, and the newest good one is used) or a branch from another run's
checkpoint (:func:`check_branch`): the two configs must be equal, or the
method's ``shared_rounds`` must certify that they compute rounds 1..k
identically (SPARK's ablation rows share the hard-label warm-up).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

from absl import logging
import jax
import numpy as np

from ntk_fl import distributed, settings, validation
from ntk_fl._src.method_modules import method_module_imported
from ntk_fl.algorithms import available, get_method
from ntk_fl.algorithms.base import config_without
from ntk_fl.checkpoint import Checkpoints

__all__ = [
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
    "checkpoint_dir",
    "jsonable",
    "is_run",
    "metrics_line",
    "metrics_up_to",
    "read_branch",
    "read_config",
    "read_run",
    "rebuild_config",
    "copy_run",
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

# Keys that do not change the trajectory (where clients run, which checkpoints are kept, whether the
# consensus models are also scored); resume and branch ignore them.
_RESULT_NEUTRAL_KEYS = ("devices", "checkpoint_keep", "eval.consensus", "on_divergence", "debug_clients")
# Keys added to the schema after runs were stored, each with the value that reproduces those runs: a stored
# config.json without one ran with that value (resume, branch and read_config fill it in).
_ADDED_KEYS = {"data.max_test": 0, "eval.consensus": False, "data.partition_file": "", "on_divergence": "stop",
               "debug_clients": False}


def checkpoint_dir(workdir: str) -> str:
  """Where the run in ``workdir`` keeps its orbax checkpoints."""
  return os.path.join(workdir, CHECKPOINT_DIR)


def jsonable(obj):
  """Plain-python JSON value of ``obj`` (numpy/jax arrays and scalars, tuples, configs and settings).

  Non-finite floats become ``None`` (JSON has no NaN/inf).
  """
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    obj = settings.to_dict(obj)
  elif callable(getattr(obj, "to_dict", None)):     # an ml_collections.ConfigDict
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
      raise ValueError(f"{path}: line {i + 1} is not a metrics record (a JSON object), got {text[:60]!r}")
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
    raise ValueError(f"{os.path.join(workdir, METRICS_FILE)} does not hold rounds 1..{rounds} of the checkpoint; "
                     f"cannot {action}")
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
    return [d for k in sorted(set(old) | set(new))
            for d in _config_diff(old.get(k, "<missing>"), new.get(k, "<missing>"), f"{prefix}{k}.")]
  return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def _stored_config(workdir: str, action: str) -> dict:
  """``workdir``'s ``config.json`` as a JSON dict, keys added to the schema since it was written filled in."""
  config_path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"cannot {action}: {config_path} does not exist (no run was started in {workdir})")
  try:
    with open(config_path) as f:
      stored = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot {action}: {config_path} is not a readable config ({e}); it is the run's record "
                     "of its config: restore it from a copy, or start the run again in an empty workdir") from None
  if not isinstance(stored, dict):
    raise ValueError(f"cannot {action}: {config_path} holds {type(stored).__name__}, not a config object")
  for path, value in _ADDED_KEYS.items():
    *parents, leaf = path.split(".")
    node = stored
    for key in parents:
      node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
      node.setdefault(leaf, value)
  return stored


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
  comes from the registry; with neither, the read is refused.
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
          "register the method before reading the run")
    logging.warning("%s: method %r is registered; not importing its stored method_module %r",
                    path, stored.get("method"), spec)
    stored["method_module"] = ""
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
  return {"name": os.path.basename(os.path.normpath(workdir)), "workdir": workdir, "config": read_config(workdir),
          "lines": read_metrics(workdir), "summary": read_summary(workdir)}


def copy_run(workdir: str, target: str, *, drop: tuple[str, ...] = ()) -> None:
  """Copies the run's ``config.json`` and ``summary.json`` (when finished) verbatim, and its metrics lines
  without the keys ``drop``, into the directory ``target`` (created). Checkpoints and plots are not copied."""
  os.makedirs(target, exist_ok=True)
  for name in (CONFIG_FILE, SUMMARY_FILE):
    if os.path.isfile(os.path.join(workdir, name)):
      shutil.copyfile(os.path.join(workdir, name), os.path.join(target, name))
  write_metrics(target, [{k: v for k, v in line.items() if k not in drop} for line in read_metrics(workdir)])


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
  # Where clients run is not part of the experiment: a run may resume on another device count
  # (results agree up to float rounding), and runs started before these keys existed lack them.
  return config_without(stored, *_RESULT_NEUTRAL_KEYS), config_without(current, *_RESULT_NEUTRAL_KEYS)


def check_writable(workdir: str) -> None:
  """``workdir`` is (or can be made) a directory this process may write: checked before any work.

  Raises:
    ValueError: ``workdir`` or a folder above it is a file, or the nearest existing
      folder is not writable (permissions, a read-only file system).
  """
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir} is a file, not a directory; choose a directory (it is created if missing)")
  existing = workdir
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f"workdir {workdir} cannot be created: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"workdir {workdir} cannot be written: {existing} is not writable by this user "
                     "(or is on a read-only file system)")


def check_workdir(config, workdir: str, *, resume: bool, resume_from_step: int | None = None) -> int:
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
  ckpt_dir = checkpoint_dir(workdir)
  if not resume:
    existing = [n for n in (CONFIG_FILE, METRICS_FILE, CHECKPOINT_DIR) if os.path.exists(os.path.join(workdir, n))]
    if existing:
      raise ValueError(f"workdir {workdir} already holds a run ({', '.join(existing)}); resume it "
                       "(resume=True / --resume) or choose an empty workdir")
    return 0
  stored, current = _experiment_configs(config, workdir, "resume")
  diff = _config_diff(stored, current)
  if diff:
    hint = ""
    if [d.split(":")[0] for d in diff] == ["rounds"] and current["rounds"] > stored["rounds"]:
      hint = (f"; to run more rounds, start a new run from this one's checkpoint: --workdir=NEW_DIR "
              f"--branch_from={workdir} (branch_from=...; allowed where the method certifies the shared rounds)")
    raise ValueError(f"cannot resume {workdir} with a different config; changed: {'; '.join(diff)}{hint}")
  if resume_from_step is not None:
    validation.check_int("resume_from_step", resume_from_step, low=1)
  start = None
  if os.path.isdir(ckpt_dir):
    with Checkpoints(ckpt_dir) as ckpt:
      start = ckpt.recover(upto=resume_from_step)
  if start is None:
    raise FileNotFoundError(f"cannot resume: no finalised checkpoint in {ckpt_dir} "
                            f"(config.checkpoint_every = {config.checkpoint_every})")
  metrics_up_to(workdir, start, "resume")   # the lines the resumed run keeps must be readable: checked now
  return start


def check_start(config, workdir: str, *, resume: bool = False, resume_from_step: int | None = None,
                branch_from: str | None = None, branch_round: int | None = None) -> int:
  """Checks how a run of ``config`` in ``workdir`` may start; returns the round count to start from.

  A fresh run (empty ``workdir``), ``resume`` (:func:`check_workdir`; from
  checkpoint ``resume_from_step`` when given, which implies ``resume``) or a
  branch from another run (:func:`check_branch`); the options are checked
  together here so the entry point and :func:`ntk_fl.runner.run` refuse the same requests.
  """
  resume = resume or resume_from_step is not None
  if resume and branch_from is not None:
    raise ValueError("resume and branch_from exclude each other (--resume, --branch_from; a branched run resumes "
                     "from its own checkpoints)")
  if branch_round is not None and branch_from is None:
    raise ValueError(f"branch_round={branch_round} needs branch_from (--branch_round={branch_round} needs "
                     "--branch_from: the run to branch from)")
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
      raise ValueError(f"cannot branch from {source}: its config differs ({'; '.join(diff)}) and method "
                       f"{config.method!r} does not certify that any round is computed the same under both")
  ckpt_dir = checkpoint_dir(source)
  steps = []
  if os.path.isdir(ckpt_dir):
    with Checkpoints(ckpt_dir, read_only=True) as ckpt:   # another run's: verified, never renamed
      steps, damaged = ckpt.good_steps()
    for step, why in damaged.items():
      logging.warning("cannot branch from checkpoint %s: %s", os.path.join(ckpt_dir, str(step)), why)
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

