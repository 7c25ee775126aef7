"""``ntk-fl``: runs one experiment from a config.

  ntk-fl --config=ntk_dfl[:variant] --workdir=DIR \
      [--config.rounds=50 --config.data.alpha=0.5 ...] [--resume] [--distributed]
      [--branch_from=OTHER_WORKDIR [--branch_round=K]]

``--config`` names a packaged config (``ntk_dfl``, ``spark:iid,alpha0.5``; see
:mod:`ntk_fl.configs`) or a config file (``configs/ntk_dfl.py:smoke``,
``my/sweep.py``). ``--config.key=value`` overrides any config field (an unknown
key is a flags error). The config and the workdir are checked before any data is
loaded; a bad value exits non-zero with one ``error:`` line naming it. The
workdir receives ``metrics.jsonl``, ``summary.json``, ``config.json``, the PNG
plots and ``checkpoints/`` (see :mod:`ntk_fl.rundir`); ``--resume`` continues a
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

In a checkout, ``python experiments/main.py ...`` is the same command.
"""
from __future__ import annotations

import io
import logging as std_logging
import os
import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags
from tqdm.auto import tqdm

__all__ = ["LOG_FILE", "main", "resolve_config_args"]

LOG_FILE = "log.txt"
"""The run's absl log, in its workdir (appended to by ``--resume``)."""

_FLAGS: dict = {}


def _define_flags() -> None:
  """Registers the command's absl flags once (not at import, so importing this module defines nothing)."""
  if _FLAGS:
    return
  _FLAGS["config"] = config_flags.DEFINE_config_file(
      "config", None, "Config: a packaged config's name (ntk_dfl, spark:iid, ntk_dfl:smoke) or a config file "
      "(configs/ntk_dfl.py:smoke); text after ':' is the variant list.", lock_config=True)
  _FLAGS["workdir"] = flags.DEFINE_string("workdir", None, "Output directory of the run.")
  _FLAGS["resume"] = flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its latest checkpoint.")
  _FLAGS["branch_from"] = flags.DEFINE_string(
      "branch_from", None, "Start from the checkpoint of the run in this workdir (its config must equal --config, "
      "or the method must certify the rounds they share).")
  _FLAGS["branch_round"] = flags.DEFINE_integer(
      "branch_round", None, "The --branch_from checkpoint to start from (default: the latest one allowed).")
  _FLAGS["distributed"] = flags.DEFINE_bool(
      "distributed", False, "Multi-host: call jax.distributed.initialize() before anything else, so "
      "--config.devices=0 spans every host's devices.")
  flags.mark_flags_as_required(["config", "workdir"])


def resolve_config_args(argv: Sequence[str]) -> list[str]:
  """Rewrites ``--config=NAME[:variant]`` (and ``--config NAME``) to the packaged config file's path.

  A value with a folder or a ``.py`` suffix is a path and is left alone.

  Raises:
    ValueError: the name is no packaged config.
  """
  from ntk_fl import configs  # pylint: disable=import-outside-toplevel

  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith("--config="):
      out[i] = "--config=" + configs.resolve(arg[len("--config="):])
    elif arg == "--config" and i + 1 < len(out):
      out[i + 1] = configs.resolve(out[i + 1])
  return out


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
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  except (AttributeError, KeyError) as e:
    key = str(e.args[0] if e.args else e).strip("'\"")
    overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    sys.exit(f"error: unknown config key {key!r} in the overrides {overrides}; "
             "every --config.<key> must name a field of the config file")


class _QuietLibraries(std_logging.Filter):
  """Drops INFO/DEBUG records of orbax and etils (a dozen lines per checkpoint); warnings pass."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    noisy = any(part in record.pathname for part in ("/orbax/", "/etils/"))
    return record.levelno >= std_logging.WARNING or not noisy


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
    std_logging.getLogger().addHandler(console)
  return buffer


def _log_to_workdir(buffer: io.StringIO | None, workdir: str) -> None:
  """From now on the absl log goes to ``workdir/log.txt``, starting with what was held in memory."""
  if buffer is None:
    return
  os.makedirs(workdir, exist_ok=True)
  log = open(os.path.join(workdir, LOG_FILE), "a", encoding="utf-8")  # pylint: disable=consider-using-with
  log.write(buffer.getvalue())
  log.flush()
  logging.get_absl_handler().python_handler.stream = log


def _closing_line(summary: dict, workdir: str) -> str:
  """One line with the result of a run, for the console."""
  acc = summary.get("final_test_acc")
  targets = ", ".join(f"{float(t):.0%} at round {r}" if r is not None else f"{float(t):.0%} not reached"
                      for t, r in (summary.get("rounds_to_target") or {}).items())
  accuracy = "not evaluated" if acc is None else f"{acc:.4f}"
  return (f"{summary.get('method')}: {summary.get('rounds_run')} rounds, final aggregated accuracy {accuracy}"
          f"{'; ' + targets if targets else ''}; {summary.get('wall_time', 0.0):.1f} s. Outputs in {workdir}")


def _main(argv: list[str]) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  from ntk_fl import rundir, runner, schema  # pylint: disable=import-outside-toplevel

  logging.get_absl_handler().addFilter(_QuietLibraries())
  held = _hold_log()   # before the first jax call: the backend probe's INFO lines belong in the log file
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  if _FLAGS["distributed"].value:
    jax.distributed.initialize()   # before any jax call lists devices
  config = _FLAGS["config"].value
  workdir = _FLAGS["workdir"].value
  start = dict(resume=_FLAGS["resume"].value, branch_from=_FLAGS["branch_from"].value,
               branch_round=_FLAGS["branch_round"].value)
  try:
    # Everything that can be wrong with the request fails here, before any work; the config is checked once
    # and travels on as typed settings.
    settings = schema.validate_config(config)
    rundir.check_start(settings, workdir, **start)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  _log_to_workdir(held, workdir)
  summary = runner.run(settings, workdir, **start)
  print(_closing_line(summary, os.path.abspath(workdir)), flush=True)
  logging.info("rounds to target: %s; final aggregated accuracy: %s; wall time %.1fs",
               summary["rounds_to_target"], summary["final_test_acc"], summary["wall_time"])


def main(argv: Sequence[str] | None = None) -> None:
  """The ``ntk-fl`` console script (and ``experiments/main.py``)."""
  _define_flags()
  app.run(_main, argv=list(sys.argv if argv is None else argv), flags_parser=_parse_flags)


if __name__ == "__main__":
  main()
