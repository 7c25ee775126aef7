"""``ntk-fl``: runs one experiment from a config.

  ntk-fl --config=ntk_dfl[:variant] --workdir=DIR
      [--config.rounds=50 --config.data.alpha=0.5 ...] [--resume | --resume_from_step=N]
      [--branch_from=OTHER_WORKDIR [--branch_round=K]]
      [--num_processes=P | --distributed | --num_processes=P --process_id=I --coordinator_address=HOST:PORT]
  ntk-fl --config=ntk_dfl:smoke [--config.key=value ...] --print_config
  ntk-fl --config=ntk_dfl:compressed [--config.key=value ...] --estimate
  ntk-fl --list_configs | --version

``--config`` names a packaged config (``ntk_dfl``, ``spark:iid,alpha0.5``; see
:mod:`ntk_fl.configs`) or a config file (``configs/ntk_dfl.py:smoke``,
``my/sweep.py``). ``--config.key=value`` overrides any config field (an unknown
key is a flags error); ``--print_config`` prints the resolved config, each
field with its meaning (:mod:`ntk_fl.config_docs`), and exits; ``--estimate``
loads the data, prints the run's cost estimate (an NTK method's kernel FLOPs,
peak memory and round time on this device, from one calibrated client step:
``ntk_fl.runner.cost_report``) and exits, running no round and writing nothing;
``--list_configs`` lists the packaged configs and their variants. The config
and the workdir are checked before any data is loaded; a bad value exits
non-zero with one ``error:`` line naming it. The workdir receives
``metrics.jsonl``, ``summary.json``, ``config.json``, the plots (PNG and PDF)
and ``checkpoints/`` (see :mod:`ntk_fl.rundir`); ``--resume`` continues a
killed run from its latest checkpoint with identical results. ``--branch_from``
starts a new run from another run's checkpoint when the two configs provably
share those rounds (e.g. SPARK's ablation rows during the warm-up; see
:func:`ntk_fl.rundir.check_branch`).

Console: one progress bar (round, aggregated accuracy, seconds per round,
ETA), warnings and errors above it, and a closing line with the result. The
full absl log (INFO at the default ``--verbosity=0``; ``--verbosity=1`` adds
DEBUG, ``-1`` keeps warnings only) goes to ``log.txt`` in the workdir;
``--alsologtostderr`` also prints it, ``--logtostderr`` prints it instead of
writing the file (absl's usual meaning of those flags).

Several processes (JAX's multi-controller runtime, :mod:`ntk_fl.distributed`):
``--num_processes=P`` alone starts ``P`` processes on this machine with the
coordinator on localhost, each owning a slice of the clients (a stand-in for
``P`` hosts); ``--distributed`` joins a run whose coordinator, process count and
rank JAX detects (SLURM, Open MPI, ...); ``--process_id`` with
``--num_processes`` and ``--coordinator_address`` names them explicitly (one
command per host). Only process 0 writes metrics, summary, plots, the log and the
console output; every process writes and restores its part of the checkpoints.

In a checkout, ``python experiments/main.py ...`` is the same command.

Subcommands: ``ntk-fl compare RUN_DIR...`` (:mod:`ntk_fl.compare`) tabulates and
plots runs grouped by setting; ``ntk-fl reproduce NAME`` (:mod:`ntk_fl.reproduce`)
runs one of the papers' tables or figures as a resumable queue and renders it.
"""

from __future__ import annotations

import errno
import io
import logging as std_logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
from tqdm.auto import tqdm

from ntk_fl._src import fsutil

__all__ = [
  "LOG_FILE",
  "main",
  "one_line",
  "report_failure",
  "resolve_config_args",
  "shadow_note",
  "unknown_key_message",
]

LOG_FILE = "log.txt"
"""The run's absl log, in its workdir (appended to by ``--resume``)."""

_FLAGS: dict = {}
_ARGV: list = []  # the command line main() was given


def _define_flags() -> None:
  """Registers the command's absl flags once (not at import, so importing this module defines nothing)."""
  if _FLAGS:
    return
  _FLAGS["config"] = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config: a packaged config's name (ntk_dfl, spark:iid, ntk_dfl:smoke) or a config file "
    "(configs/ntk_dfl.py:smoke); text after ':' is the variant list. Any field is overridden "
    "with --config.<key>=value; --print_config lists every field with its meaning, "
    "--list_configs the configs.",
    # A method's own hyperparameter dataclass may have fields the config file lacks (a subclass registered
    # through config.method_module): --config.algorithm.<field> is accepted here and checked by the schema
    # against the method's dataclass; every other override must name a field of the file (_parse_flags).
    lock_config=False,
    accept_new_attributes=True,
  )
  _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "Output directory of the run.")
  _FLAGS["resume"] = flags.DEFINE_bool(
    "resume",
    False,
    "Continue the run in --workdir from its newest good checkpoint (damaged or incomplete "
    "ones are set aside: renamed, never deleted).",
  )
  _FLAGS["resume_from_step"] = flags.DEFINE_integer(
    "resume_from_step",
    None,
    "Continue the run in --workdir from its checkpoint after this many rounds "
    "(implies --resume); later checkpoints are set aside and their rounds recomputed.",
  )
  _FLAGS["branch_from"] = flags.DEFINE_string(
    "branch_from",
    None,
    "Start from the checkpoint of the run in this workdir (its config must equal --config, "
    "or the method must certify the rounds they share).",
  )
  _FLAGS["branch_round"] = flags.DEFINE_integer(
    "branch_round",
    None,
    "The --branch_from checkpoint to start from (default: the latest one allowed).",
  )
  _FLAGS["distributed"] = flags.DEFINE_bool(
    "distributed",
    False,
    "Multi-host: join a multi-process run whose coordinator, process count and rank JAX "
    "detects (SLURM, Open MPI, ...) before anything else, so --config.devices=0 spans every host's devices.",
  )
  _FLAGS["num_processes"] = flags.DEFINE_integer(
    "num_processes",
    1,
    "Processes of the run. Alone: start that many processes on this machine (coordinator "
    "on localhost), each owning a slice of the clients. With --process_id: the run's process count.",
    lower_bound=1,
  )
  _FLAGS["process_id"] = flags.DEFINE_integer(
    "process_id",
    None,
    "This process's rank in a multi-process run (with --num_processes and "
    "--coordinator_address; set by the local launcher).",
    lower_bound=0,
  )
  _FLAGS["coordinator_address"] = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator in a multi-process run."
  )
  _FLAGS["print_config"] = flags.DEFINE_bool(
    "print_config",
    False,
    "Print the resolved --config (after variants and --config.<key> "
    "overrides), each field with its one-line meaning, and exit (no --workdir needed, no data "
    "loaded).",
  )
  _FLAGS["estimate"] = flags.DEFINE_bool(
    "estimate",
    False,
    "Print the run's cost estimate (an NTK method's kernel FLOPs, peak memory and round time on "
    "this device, from one compiled and timed client step) and exit: loads the data, runs no "
    "round, writes nothing (no --workdir needed).",
  )
  _FLAGS["list_configs"] = flags.DEFINE_bool(
    "list_configs", False, "List the packaged configs with their variants and exit."
  )
  _FLAGS["version"] = flags.DEFINE_bool("version", False, "Print the ntk_fl version and exit.")
  # --config and --workdir are required, except for the flags that only print something and exit.
  flags.register_multi_flags_validator(
    ["config", "list_configs", "version"],
    lambda f: f["config"] is not None or f["list_configs"] or f["version"],
    message="--config is required (a packaged config's name or a config file; --list_configs "
    "lists them)",
  )
  flags.register_multi_flags_validator(
    ["workdir", "print_config", "estimate", "list_configs", "version"],
    lambda f: (
      f["workdir"] is not None
      or f["print_config"]
      or f["estimate"]
      or f["list_configs"]
      or f["version"]
    ),
    message="--workdir is required (the run's output directory)",
  )


def resolve_config_args(argv: Sequence[str]) -> list[str]:
  """Rewrites ``--config=NAME[:variant]`` (and ``--config NAME``) to the packaged config file's path.

  A value with a folder or a ``.py`` suffix is a path and is left alone.

  Raises:
    ValueError: the name is no packaged config.
  """
  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  out = list(argv)
  for i, arg in enumerate(out):
    value = arg[len("--config=") :] if arg.startswith("--config=") else None
    note = shadow_note(value) if value else None
    if note:
      sys.stderr.write(f"note: {note}\n")
    if arg.startswith("--config="):
      out[i] = "--config=" + configs.resolve(arg[len("--config=") :])
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = configs.resolve(out[i + 1])
  return out


def shadow_note(spec: str, cwd: str | None = None) -> str | None:
  """Which config runs when a packaged config's name and a file in the working directory look alike.

  A config file is Python code and runs when loaded: ``--config=ntk_dfl`` runs
  the packaged ``ntk_dfl`` even with an ``ntk_dfl.py`` in the working directory,
  and ``--config=ntk_dfl.py`` runs that file, not the packaged one. ``None`` when
  nothing is shadowed.
  """
  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  name = spec.partition(":")[0]
  cwd = cwd or os.getcwd()
  stem = name.removesuffix(".py")
  if stem not in configs.names():
    return None
  local, packaged = os.path.join(cwd, f"{stem}.py"), configs.CONFIG_DIR / f"{stem}.py"
  if name == stem and os.path.isfile(local):
    return (
      f"--config={spec} runs the packaged config {packaged}, not {local} in the current "
      f"directory (--config=./{stem}.py runs that file)"
    )
  if name.endswith(".py") and os.path.isfile(os.path.join(cwd, name)):
    return (
      f"--config={spec} runs the file {os.path.join(cwd, name)} (Python code), not the "
      f"packaged config {stem} (--config={stem} runs that one)"
    )
  return None


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, plus a clean exit for a config name or a ``--config.<key>`` override that names nothing.

  (config_flags reports an unknown key as a bare ``AttributeError`` from inside
  flag parsing, which would otherwise surface as a traceback.)
  """
  try:
    argv = resolve_config_args(argv)
  except ValueError as e:
    sys.exit(f"error: {e}")
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    if "Error whilst parsing config file" in str(
      e
    ):  # config_flags puts the config's traceback in the message
      cause = [line for line in str(e).strip().splitlines() if line.strip()][-1]
      value = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), "")
      sys.exit(f"error: --config={value}: {cause}")
    sys.exit(
      f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags."
    )
  except (AttributeError, KeyError) as e:
    sys.exit(f"error: {unknown_key_message(str(e.args[0] if e.args else e), argv[1:])}")
  _check_override_keys(argv)
  return rest


def _check_override_keys(argv: list[str]) -> None:
  """Exits on a ``--config.<key>`` override outside ``config.algorithm`` that names no field of the file.

  Keys under ``config.algorithm`` are the method's to judge: the schema builds its hyperparameter dataclass
  from the block and names an unknown key with the allowed ones.
  """
  overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
  config = flags.FLAGS["config"].value
  if (
    not any(not o.startswith("--config.algorithm.") for o in overrides)
    or config is None
    or type(config).__name__ == "_ErrorConfig"
  ):
    return
  file_config = _config_before_overrides()
  for override in overrides:
    path = override[len("--config.") :].split(".")
    if path[0] == "algorithm":
      continue
    node = file_config
    for depth, key in enumerate(path):
      if not hasattr(node, "keys") or key not in node:
        import difflib  # pylint: disable=import-outside-toplevel

        close = (
          difflib.get_close_matches(key, list(node.keys()), n=1) if hasattr(node, "keys") else []
        )
        hint = f"; did you mean config.{'.'.join(path[:depth] + close)}?" if close else ""
        sys.exit(f"error: unknown config key config.{'.'.join(path)}{hint}")
      node = node[key]


def unknown_key_message(error: str, args: Sequence[str]) -> str:
  """``unknown config key config.a.lrr; did you mean config.a.lr?`` from config_flags' error.

  ``error`` is the text of the ``KeyError``/``AttributeError`` ml_collections raised
  (the key, quoted, and maybe ``Did you mean "lr" instead of "lrr"?``); ``args`` the
  command line, whose ``--config.<key>`` override names the whole path.
  """
  import re  # pylint: disable=import-outside-toplevel

  names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", error)
  key = names[0] if names else error
  suggestion = re.search(r'Did you mean [\\\'"]*([A-Za-z0-9_]+)', error)
  paths = [a[2:].split("=", 1)[0] for a in args if a.startswith("--config.")]
  named = [p for p in paths if p.split(".")[-1] == key] + [p for p in paths if key in p.split(".")]
  path = named[0] if named else f"config.{key}"
  message = f"unknown config key {path}"
  if suggestion:
    message += f"; did you mean {path.rsplit('.', 1)[0]}.{suggestion.group(1)}?"
  return message


class _QuietLibraries(std_logging.Filter):
  """Drops INFO/DEBUG records of orbax and etils (a dozen lines per checkpoint) and JAX's report
  of each platform it probed and did not find (``Unable to initialize backend 'tpu'``); warnings
  pass."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    noisy = any(part in record.pathname for part in ("/orbax/", "/etils/")) or (
      record.pathname.endswith("xla_bridge.py")
      and str(record.msg).startswith("Unable to initialize backend")
    )
    return record.levelno >= std_logging.WARNING or not noisy


class _LibraryFailuresToTheLog(std_logging.Filter):
  """Keeps orbax's and etils' own error reports (a traceback from a writer thread) off the console.

  They stay in ``log.txt``; the failure they report reaches the command as an
  exception and is printed as its one ``error:`` line.
  """

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno < std_logging.ERROR or not any(
      part in record.pathname for part in ("/orbax/", "/etils/")
    )


def _thread_failure_to_the_log(args) -> None:
  """An exception left in a library's helper thread (after the failure the main thread reports) goes to the log."""
  logging.info(
    "exception in thread %s",
    getattr(args.thread, "name", "?"),
    exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
  )


class _AboveTheBar(std_logging.Handler):
  """Writes records through ``tqdm.write``: printed above the progress bar instead of into it."""

  def emit(self, record: std_logging.LogRecord) -> None:
    try:
      tqdm.write(self.format(record), file=sys.stderr)
    except Exception:  # pylint: disable=broad-except -- logging must never raise
      self.handleError(record)


def _hold_log() -> io.StringIO | None:
  """Keeps the absl log in memory until the workdir is known to be usable; warnings go to the console.

  absl's handler writes to its stream and, when that stream is not stderr, also
  echoes to stderr what ``--alsologtostderr`` or ``--stderrthreshold`` ask for,
  so those flags keep their meaning; ``--logtostderr`` keeps absl's own
  behaviour (everything to stderr, no file). Returns the buffer (None with
  ``--logtostderr``).
  """
  if flags.FLAGS.logtostderr:
    return None
  absl_handler = logging.get_absl_handler()
  buffer = io.StringIO()
  absl_handler.python_handler.stream = buffer
  if not flags.FLAGS.alsologtostderr:
    console = _AboveTheBar(std_logging.WARNING)
    console.setFormatter(absl_handler.python_handler.formatter or logging.PythonFormatter())
    console.addFilter(_QuietLibraries())
    console.addFilter(_LibraryFailuresToTheLog())
    std_logging.getLogger().addHandler(console)
    threading.excepthook = _thread_failure_to_the_log
  return buffer


def _log_to_workdir(buffer: io.StringIO | None, workdir: str) -> None:
  """From now on the absl log goes to ``workdir/log.txt``, starting with what was held in memory."""
  if buffer is None:
    return
  os.makedirs(workdir, exist_ok=True)
  log = fsutil.open_append(os.path.join(workdir, LOG_FILE))  # never through a planted link
  # A record the log file cannot take (a full disk) is dropped, not reported with a traceback on the
  # console: the failure itself reaches the command as an exception and its one error line.
  std_logging.raiseExceptions = False
  log.write(buffer.getvalue())
  log.flush()
  logging.get_absl_handler().python_handler.stream = log


# What ends a run with one line: bad requests and data (ValueError, including unreadable or unsafe data
# files and bad metrics.jsonl), missing or unwritable files and a full disk (OSError), damaged checkpoints,
# divergence. Anything else is a bug and keeps its traceback.
_ONE_LINE_ERRORS = (ValueError, OSError)


def one_line(err: BaseException) -> str:
  """The ``error:`` line of ``err``: its first line, with what to do for a full disk.

  An error whose message is the help (``help_message = True``, e.g.
  :class:`ntk_fl.data.sources.DataNotFoundError`) keeps all its lines.
  """
  # TensorStore (orbax's array writer) reports a full disk as a ValueError with the OS's text.
  if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in str(
    err
  ):
    filename = getattr(err, "filename", None)
    where = f" while writing {filename}" if filename else ""
    return (
      f"disk full{where} (No space left on device); free some space, then continue the run with --resume "
      "(every completed checkpoint and metrics line is intact)"
    )
  lines = [line for line in str(err).strip().splitlines() if line.strip()]
  if getattr(err, "help_message", False) and lines:  # missing data: where it looked, how to get it
    return "\n".join(lines)
  return lines[0] if lines else type(err).__name__


def report_failure(err: BaseException, workdir: str | None, *, verbose: bool) -> str:
  """The one-line message for ``err``; its traceback is appended to ``workdir/log.txt`` (and printed if ``verbose``)."""
  trace = "".join(traceback.format_exception(err))
  message = one_line(err)
  log_path = None
  if workdir:
    try:
      stream = getattr(logging.get_absl_handler().python_handler, "stream", None)
      if stream is not None and stream is not sys.stderr:
        stream.flush()
      os.makedirs(workdir, exist_ok=True)
      log_path = os.path.join(os.path.abspath(workdir), LOG_FILE)
      with fsutil.open_append(log_path) as f:
        f.write(f"error: {message}\n{trace}\n")
    except OSError:  # e.g. the disk is full: the traceback then only goes to stderr on request
      log_path = None
  if verbose:
    sys.stderr.write(trace)
  elif log_path and not getattr(err, "help_message", False):
    message += f" (traceback in {log_path}; --verbosity=1 prints it)"
  return message


def _started(workdir: str, before: set[str] | None) -> bool:
  """Whether ``workdir`` holds a run: one it held before this command (``before``: its entries then,
  ``None`` if it did not exist), or the one this command began (it wrote ``config.json``)."""
  from ntk_fl import rundir  # pylint: disable=import-outside-toplevel

  held_a_run = before is not None and not before <= {rundir.LOCK_FILE}
  return held_a_run or os.path.isfile(os.path.join(workdir, rundir.CONFIG_FILE))


def _undo_start(workdir: str, before: set[str] | None) -> str:
  """Removes what a start that failed before the run began made in ``workdir``; returns its log's text.

  Only what this command made goes (the log, the lock file, an empty
  ``checkpoints/``, and the workdir itself if it did not exist); a workdir that
  existed is left as it was. Nothing is touched unless this process holds the
  workdir's lock (a run refused because another holds it removes nothing).
  """
  from ntk_fl import rundir  # pylint: disable=import-outside-toplevel

  if not rundir.holds(workdir):
    return ""
  made = set(os.listdir(workdir)) - (before or set()) if os.path.isdir(workdir) else set()
  text = ""
  if LOG_FILE in made:
    handler = logging.get_absl_handler().python_handler
    try:
      handler.flush()
      with open(os.path.join(workdir, LOG_FILE), encoding="utf-8", errors="replace") as f:
        text = f.read()
    except (OSError, ValueError):
      pass
  _close_log()
  try:
    if LOG_FILE in made:
      os.remove(os.path.join(workdir, LOG_FILE))
    checkpoints = os.path.join(workdir, rundir.CHECKPOINT_DIR)
    if rundir.CHECKPOINT_DIR in made and all(
      "orbax-checkpoint-tmp" in name for name in os.listdir(checkpoints)
    ):  # no checkpoint was ever finalised: only an empty folder or interrupted writes
      shutil.rmtree(checkpoints)
    rundir.release_workdir(workdir)
    if rundir.LOCK_FILE in made:  # safe: a run that locks a removed file tries again
      os.remove(os.path.join(workdir, rundir.LOCK_FILE))
    if before is None:
      os.rmdir(workdir)  # fails, leaving it, if anything else was put there
  except OSError:
    pass  # best effort: what cannot be removed stays
  return text


def _temp_log(text: str) -> str | None:
  """Writes ``text`` to a new file in the system's temporary folder; its path (``None`` if that fails)."""
  try:
    fd, path = tempfile.mkstemp(prefix="ntk-fl-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
  except OSError:
    return None
  return path


def _report_failed_start(err: BaseException, workdir: str, before, *, verbose: bool) -> str:
  """:func:`report_failure` for a run that failed before it began: nothing is left in ``workdir``.

  The log, with the traceback, is written to a file in the system's temporary
  folder, which the line names (not for an error whose message is the help).
  """
  trace = "".join(traceback.format_exception(err))
  message = one_line(err)
  log = _undo_start(workdir, before)
  if verbose:
    sys.stderr.write(trace)
  if getattr(err, "help_message", False):
    return message
  path = _temp_log(f"{log}error: {message}\n{trace}\n")
  if path and not verbose:
    message += f" (nothing was left in {workdir}; traceback in {path}; --verbosity=1 prints it)"
  return message


def _print_and_exit(config) -> bool:
  """``--version``, ``--list_configs``, ``--print_config``: prints what they ask; True if asked."""
  from ntk_fl import config_docs  # pylint: disable=import-outside-toplevel

  if _FLAGS["version"].value:
    import ntk_fl  # pylint: disable=import-outside-toplevel

    text = f"ntk_fl {ntk_fl.__version__}"
  elif _FLAGS["list_configs"].value:
    text = config_docs.format_configs()
  elif _FLAGS["print_config"].value:
    text = (
      f"# --config={flags.FLAGS['config'].config_filename}\n{config_docs.format_config(config)}"
    )
  else:
    return False
  try:
    print(text, flush=True)
  except BrokenPipeError:  # the reader stopped early (`... --print_config | head`): not an error
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
  return True


def _print_estimate(config) -> None:
  """``--estimate``: the config checked (before any data loads), then the run's cost estimate printed."""
  from ntk_fl import runner, schema  # pylint: disable=import-outside-toplevel

  try:
    settings = schema.validate_config(config, reference=_config_before_overrides())
    text = runner.cost_report(settings)
  except _ONE_LINE_ERRORS as e:
    if logging.get_verbosity() >= 1:
      traceback.print_exc()
    sys.exit(f"error: {one_line(e)}")
  print(text, flush=True)


def _config_before_overrides():
  """The ``--config`` file's ``get_config(variant)`` without the ``--config.<key>`` overrides (the
  schema compares against it to warn about changed settings that have no effect)."""
  from ntk_fl import config as config_lib  # pylint: disable=import-outside-toplevel

  path, _, variant = flags.FLAGS["config"].config_filename.partition(":")
  return config_lib.load_config(path, variant or None)


def _close_log() -> None:
  """Flushes the absl log file (errors ignored) and sends what is logged after this nowhere."""
  handler = logging.get_absl_handler().python_handler
  stream = getattr(handler, "stream", None)
  if stream is None or stream is sys.stderr:
    return
  handler.stream = open(os.devnull, "w", encoding="utf-8")  # pylint: disable=consider-using-with
  for finish in (stream.flush, stream.close):
    try:
      finish()
    except OSError:
      pass


def _closing_line(summary: dict, workdir: str) -> str:
  """One line with the result of a run, for the console (one per replica of a seed-batched run)."""
  if "runs" in summary:
    return "\n".join(
      _closing_line(run, os.path.join(workdir, f"seed{run.get('seed')}")) for run in summary["runs"]
    )
  acc = summary.get("final_test_acc")
  targets = ", ".join(
    f"{float(t):.0%} at round {r}" if r is not None else f"{float(t):.0%} not reached"
    for t, r in (summary.get("rounds_to_target") or {}).items()
  )
  accuracy = "not evaluated" if acc is None else f"{acc:.4f}"
  return (
    f"{summary.get('method')}: {summary.get('rounds_run')} rounds, final aggregated accuracy {accuracy}"
    f"{'; ' + targets if targets else ''}; {summary.get('wall_time', 0.0):.1f} s. Outputs in {workdir}"
  )


def _interrupted(workdir: str) -> str:
  """The line for Ctrl-C: ``--resume`` once the run has started, else the same command again."""
  if any(os.path.isfile(os.path.join(workdir, f)) for f in ("config.json", "replicas.json")):
    return f"interrupted; continue the run with --resume (workdir {workdir})"
  return (
    f"interrupted before the run started (nothing written to {workdir}); run the same command again"
  )


def _interrupt_line() -> str:
  workdir = flags.FLAGS["workdir"].value if flags.FLAGS.is_parsed() else None
  return _interrupted(workdir) if workdir else "interrupted; nothing was started"


def _exit_at_once_on_interrupt() -> None:
  """Until the run holds its workdir, Ctrl-C ends the process at once with one line.

  Nothing has been written by then, and a ``KeyboardInterrupt`` raised while a native module is being
  imported (jaxlib's extension) would surface as an ``ImportError`` traceback instead.
  """

  def handler(signum, frame):  # pylint: disable=unused-argument
    os.write(2, f"\n{_interrupt_line()}\n".encode())
    os._exit(130)  # pylint: disable=protected-access

  signal.signal(signal.SIGINT, handler)


_LEAVING = threading.Lock()
_GRACE_SECONDS = 5.0
"""How long after Ctrl-C the main thread may take to stop the run before the process leaves anyway."""


def _leave(line: str, status: int = 130, *, on_a_new_line: bool = True):
  """Prints ``line``, closes the log, drops the workdir lock and ends the process at once.

  ``os._exit``: no interpreter shutdown, which would wait for (or crash under) an
  XLA computation still running in JAX's threads, and no ``atexit`` handlers,
  which after a failure would try once more what just failed (tensorboardX's
  closes its event file, whose buffer a full disk cannot take: a traceback after
  the error line). Whatever the run writes is closed by then (the metrics file,
  the event file and the checkpoints are closed as the exception unwinds the
  runner) or written atomically. Called by two threads (the main one and the
  interrupt watchdog), it prints once.
  """
  from ntk_fl import rundir  # pylint: disable=import-outside-toplevel

  if not _LEAVING.acquire(blocking=False):  # the other thread is leaving: wait for it
    while True:
      time.sleep(60)
  for stream in (sys.stdout, sys.stderr):  # what was printed before (the progress bar) comes first
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except -- leaving: nothing may stop it
      pass
  try:
    os.write(2, f"{chr(10) if on_a_new_line else ''}{line}\n".encode())
  except OSError:
    pass
  for finish in (_close_log, rundir.release_all):
    try:
      finish()
    except Exception:  # pylint: disable=broad-except
      pass
  os._exit(status)  # pylint: disable=protected-access


def _watch_interrupts(fd: int) -> None:
  """The watchdog: ends the process ``_GRACE_SECONDS`` after a Ctrl-C, or at once on a second one.

  It reads the signal numbers Python's C-level handler writes to its wakeup
  descriptor the moment a signal arrives, so it acts even while the main thread
  waits inside a native call (an XLA computation) and cannot run Python handlers.
  """
  import select  # pylint: disable=import-outside-toplevel

  seen, deadline = 0, None
  while True:
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
      break  # the grace period is over
    seen += os.read(fd, 64).count(signal.SIGINT)
    if seen >= 2:
      break  # a second Ctrl-C: leave now
    if seen and deadline is None:
      deadline = time.monotonic() + _GRACE_SECONDS
  _leave(_interrupt_line())


def _interrupts_raise(*, watchdog: bool = True) -> None:
  """From here on Ctrl-C raises ``KeyboardInterrupt``, which the run's own handlers report.

  With ``watchdog``, a process whose main thread does not end within
  ``_GRACE_SECONDS`` of the Ctrl-C (it waits for a running XLA computation), or
  that gets a second Ctrl-C, leaves anyway with the same line (:func:`_leave`).
  """
  count = [0]

  def handler(signum, frame):  # pylint: disable=unused-argument
    count[0] += 1
    if count[0] == 1:
      raise KeyboardInterrupt
    _leave(_interrupt_line())  # a second Ctrl-C while the first unwinds the run

  signal.signal(signal.SIGINT, handler)
  if watchdog:
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(
      target=_watch_interrupts, args=(read,), name="ntk_fl-interrupts", daemon=True
    ).start()


def _keep_worker_output(relay, workdir: str, num_processes: int, failed: bool) -> str | None:
  """Appends what the processes printed but the console did not show to ``log.txt`` (or, when the
  run left no log, a temporary file if it failed); returns the file's path (``None``: nothing kept)."""
  parts = [
    f"--- console output of process {rank} (not shown) ---\n{text}\n"
    for rank in range(num_processes)
    if (text := relay.kept(rank))
  ]
  if not parts:
    return None
  log_path = os.path.join(os.path.abspath(workdir), LOG_FILE)
  if os.path.isfile(log_path):
    try:
      with fsutil.open_append(log_path) as f:
        f.write("".join(parts))
      return log_path
    except OSError:
      pass
  return _temp_log("".join(parts)) if failed else None


def _launch(command: list[str], workdir: str, num_processes: int) -> int:
  """The local launcher: holds the workdir's lock for its workers; Ctrl-C and failures: one line.

  Only process 0's console output is shown (:class:`ntk_fl.distributed.ConsoleRelay`);
  what the others print, and what the survivors print after a process was killed,
  goes to ``log.txt``.
  """
  from ntk_fl import distributed, rundir  # pylint: disable=import-outside-toplevel

  before = set(os.listdir(workdir)) if os.path.isdir(workdir) else None
  try:
    env, fd = rundir.lock_for_children(workdir)
  except (ValueError, OSError) as e:
    sys.exit(f"error: {one_line(e)}")
  env = {**os.environ, **env}
  if sys.stderr.isatty():  # the progress bar of process 0 writes to a pipe: tell it the width
    env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
  relay = distributed.ConsoleRelay()
  try:
    status = distributed.launch_local(command, num_processes, env=env, pass_fds=(fd,), relay=relay)
  except KeyboardInterrupt:
    _keep_worker_output(relay, workdir, num_processes, failed=True)
    _leave(_interrupted(workdir))
  kept = _keep_worker_output(relay, workdir, num_processes, failed=status != 0)
  if status > 0 and not _started(workdir, before):
    _undo_start(workdir, before)  # process 0 removed its own files; the lock and folder are ours
  if status < 0:
    where = f" (the processes' own messages are in {kept})" if kept else ""
    sys.stderr.write(  # on a line of its own: the progress bar stopped mid-line
      f"\nerror: a process of the run was killed by signal {-status} and the others "
      f"were stopped; {_interrupted(workdir).split('; ', 1)[-1]}{where}\n"
    )
  elif status > 0 and relay.failed and relay.failed[0] != 0:  # its error line was not shown
    text = relay.kept(relay.failed[0])
    if "error: " in text:
      sys.stderr.write("\n" + text[text.rindex("error: ") :].rstrip() + "\n")
  return status


def _join_processes() -> bool:
  """Joins a multi-process run when the flags ask for one; returns whether this process is process 0."""
  from ntk_fl import distributed  # pylint: disable=import-outside-toplevel

  rank, count, address = (
    _FLAGS[k].value for k in ("process_id", "num_processes", "coordinator_address")
  )
  if rank is None and not _FLAGS["distributed"].value:
    return True
  if rank is not None and (rank >= count or not address):
    sys.exit(
      f"error: --process_id={rank} needs --num_processes > {rank} and --coordinator_address=HOST:PORT "
      f"(got --num_processes={count}, --coordinator_address={address!r})"
    )
  distributed.initialize(
    address, count if rank is not None else None, rank
  )  # before any jax call lists devices
  return distributed.is_primary()


def _main(argv: list[str]) -> None:
  from ntk_fl import distributed, rundir, runner, schema  # pylint: disable=import-outside-toplevel
  from ntk_fl.checkpoint import CheckpointDamaged  # pylint: disable=import-outside-toplevel

  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  if (
    _FLAGS["process_id"].value is None
    and _FLAGS["num_processes"].value > 1
    and not _FLAGS["distributed"].value
  ):
    # The local launcher: P copies of this command, each told its rank and the coordinator.
    command = [
      sys.executable,
      "-m",
      "ntk_fl",
      *distributed.strip_flags(_ARGV[1:], ["num_processes"]),
    ]
    _interrupts_raise(watchdog=False)  # no XLA here; the launcher's own handler reports
    status = _launch(command, _FLAGS["workdir"].value, _FLAGS["num_processes"].value)
    sys.exit(status if status >= 0 else 128 - status)
  logging.get_absl_handler().addFilter(_QuietLibraries())
  primary = _join_processes()
  if not primary:
    logging.set_verbosity(logging.WARNING)  # process 0 logs the run; the others only their warnings
  held = (
    _hold_log() if primary else None
  )  # before the first jax call: the backend probe's INFO lines belong in the log file
  config = _FLAGS["config"].value
  if (
    type(config).__name__ == "_ErrorConfig"
  ):  # config_flags' stand-in for a config file it could not load
    value = flags.FLAGS["config"].config_filename
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      sys.exit(
        f"error: --config={value}: no config file {os.path.abspath(path)} (and no packaged config of that "
        "name); give a packaged config's name (e.g. ntk_dfl:smoke) or the path of a config file"
      )
    sys.exit(
      f"error: --config={value}: cannot load the config file: "
      f"{one_line(object.__getattribute__(config, '_error'))}"
    )
  if _print_and_exit(config):
    return
  if _FLAGS["estimate"].value:
    _print_estimate(config)
    return
  workdir = _FLAGS["workdir"].value
  start = dict(
    resume=_FLAGS["resume"].value,
    resume_from_step=_FLAGS["resume_from_step"].value,
    branch_from=_FLAGS["branch_from"].value,
    branch_round=_FLAGS["branch_round"].value,
  )
  verbose = logging.get_verbosity() >= 1
  # What the workdir held before (None: it did not exist): a start that fails leaves it as it was.
  before = set(os.listdir(workdir)) if os.path.isdir(workdir) else None
  try:
    # Everything that can be wrong with the request fails here, before any data is loaded; the config is
    # checked once and travels on as typed settings.
    settings = schema.validate_config(config, reference=_config_before_overrides())
    _interrupts_raise()  # the run begins: Ctrl-C is reported by the handlers below
    rundir.hold_workdir(workdir)  # one run per workdir, held until this process exits
    rundir.check_start(settings, workdir, **start)
  except (*_ONE_LINE_ERRORS, CheckpointDamaged) as e:
    if verbose:
      traceback.print_exc()
    if primary:
      _undo_start(workdir, before)
    sys.exit(f"error: {one_line(e)}")
  except KeyboardInterrupt:
    if primary:
      _undo_start(workdir, before)
    _leave(_interrupted(workdir))
  try:
    _log_to_workdir(held, workdir)
    summary = runner.run(settings, workdir, **start)
  except (
    runner.Diverged
  ) as e:  # an outcome of the experiment, not a failure of the code: no traceback
    sys.exit(f"error: {e}")
  except (*_ONE_LINE_ERRORS, CheckpointDamaged) as e:
    if primary and not _started(workdir, before):
      message = _report_failed_start(e, workdir, before, verbose=verbose)
    else:
      message = report_failure(e, workdir, verbose=verbose)
    # Nothing may fail once more after the line (a full disk: the log's and event file's buffers at exit).
    _leave(f"error: {message}", 1, on_a_new_line=False)
  except KeyboardInterrupt:
    if primary and not _started(workdir, before):
      _undo_start(workdir, before)  # nothing of the run was written: none of it stays
    _leave(_interrupted(workdir))
  if primary:
    print(_closing_line(summary, os.path.abspath(workdir)), flush=True)
    logging.info(
      "rounds to target: %s; final aggregated accuracy: %s; wall time %.1fs",
      summary["rounds_to_target"],
      summary["final_test_acc"],
      summary["wall_time"],
    )
  distributed.shutdown()


SUBCOMMANDS = {"compare": "ntk_fl.compare", "reproduce": "ntk_fl.reproduce"}
"""``ntk-fl NAME ...`` runs ``main(argv)`` of these modules instead of one experiment."""


def _subcommand(name: str):
  import importlib  # pylint: disable=import-outside-toplevel

  return importlib.import_module(SUBCOMMANDS[name]).main


def main(argv: Sequence[str] | None = None) -> None:
  """The ``ntk-fl`` console script (and ``experiments/main.py``, ``python -m ntk_fl``)."""
  argv = list(sys.argv if argv is None else argv)
  _exit_at_once_on_interrupt()
  if len(argv) > 1 and argv[1] in SUBCOMMANDS:  # ntk-fl compare ... / ntk-fl reproduce ...
    sys.exit(_subcommand(argv[1])(argv[2:]))
  _define_flags()
  _ARGV[:] = argv  # the launcher of a multi-process run repeats them for each process
  # --helpshort lists the key flags of the program being run (absl keys them by argv[0]) and prints its
  # __main__ docstring; a console script has neither, so lend it this module's.
  for holder in _FLAGS.values():
    flags.FLAGS.register_key_flag_for_module(argv[0], flags.FLAGS[holder.name])
  main_module = sys.modules.get("__main__")
  if main_module is not None and not (getattr(main_module, "__doc__", None) or "").strip():
    main_module.__doc__ = __doc__
  try:
    app.run(_main, argv=argv, flags_parser=_parse_flags)
  except KeyboardInterrupt:  # before the run's own handler: imports, flag parsing, the checks
    _leave(_interrupt_line())


if __name__ == "__main__":
  main()
