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

In a checkout, ``python experiments/main.py ...`` is the same command.
"""
from __future__ import annotations

import logging as std_logging
import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

__all__ = ["main", "resolve_config_args"]

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


def _main(argv: list[str]) -> None:
  import jax  # pylint: disable=import-outside-toplevel

  from ntk_fl import rundir, runner, schema  # pylint: disable=import-outside-toplevel

  logging.get_absl_handler().addFilter(_QuietLibraries())
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
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  summary = runner.run(settings, workdir, **start)
  logging.info("rounds to target: %s; final aggregated accuracy: %s; wall time %.1fs",
               summary["rounds_to_target"], summary["final_test_acc"], summary["wall_time"])


def main(argv: Sequence[str] | None = None) -> None:
  """The ``ntk-fl`` console script (and ``experiments/main.py``)."""
  _define_flags()
  app.run(_main, argv=list(sys.argv if argv is None else argv), flags_parser=_parse_flags)


if __name__ == "__main__":
  main()
