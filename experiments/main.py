"""Runs one experiment from a config file.

  python experiments/main.py --config=configs/ntk_dfl.py[:variant] --workdir=DIR \
      [--config.rounds=50 --config.data.alpha=0.5 ...] [--resume]
      [--branch_from=OTHER_WORKDIR [--branch_round=K]]
      [--num_processes=P | --distributed | --num_processes=P --process_id=I --coordinator_address=HOST:PORT]

``--config.key=value`` overrides any config field (an unknown key is a flags
error). The config and the workdir are checked before any data is loaded; a bad
value exits non-zero with the message naming it. The workdir receives
``metrics.jsonl``, ``summary.json``, ``config.json``, the PNG plots and
``checkpoints/`` (see :mod:`ntk_fl.rundir`); ``--resume`` continues a killed run
from its latest checkpoint with identical results. ``--branch_from`` starts a
new run from another run's checkpoint when the two configs provably share those
rounds (e.g. SPARK's ablation rows during the warm-up; see
:func:`ntk_fl.rundir.check_branch`).

Several processes (JAX's multi-controller runtime, :mod:`ntk_fl.distributed`):
``--num_processes=P`` alone starts ``P`` processes on this machine with the
coordinator on localhost, each owning a slice of the clients (a stand-in for
``P`` hosts); ``--distributed`` joins a run whose coordinator, process count and
rank JAX detects (SLURM, Open MPI, ...); ``--process_id`` with
``--num_processes`` and ``--coordinator_address`` names them explicitly (one
command per host). Only process 0 writes metrics, summary, plots and logs; every
process writes and restores its part of the checkpoints.
"""
from __future__ import annotations

import logging as std_logging
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from ntk_fl import distributed, rundir, runner, schema

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/ntk_dfl.py or configs/ntk_dfl.py:smoke.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory of the run.")
_RESUME = flags.DEFINE_bool("resume", False, "Continue the run in --workdir from its latest checkpoint.")
_BRANCH_FROM = flags.DEFINE_string(
    "branch_from", None, "Start from the checkpoint of the run in this workdir (its config must equal --config, "
    "or the method must certify the rounds they share).")
_BRANCH_ROUND = flags.DEFINE_integer(
    "branch_round", None, "The --branch_from checkpoint to start from (default: the latest one allowed).")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-host: join a multi-process run whose coordinator, process count and rank JAX "
    "detects (SLURM, Open MPI, ...) before anything else, so --config.devices=0 spans every host's devices.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", 1, "Processes of the run. Alone: start that many processes on this machine (coordinator on "
    "localhost), each owning a slice of the clients. With --process_id: the run's process count.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's rank in a multi-process run (with --num_processes and "
    "--coordinator_address; set by the local launcher).", lower_bound=0)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0's coordinator in a multi-process run.")
flags.mark_flags_as_required(["config", "workdir"])


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, plus a clean exit for a ``--config.<key>`` override naming no config field.

  (config_flags reports an unknown key as a bare ``AttributeError`` from inside
  flag parsing, which would otherwise surface as a traceback.)
  """
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


def main(argv: list[str]) -> None:
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  if _PROCESS_ID.value is None and _NUM_PROCESSES.value > 1 and not _DISTRIBUTED.value:
    # The local launcher: P copies of this command, each told its rank and the coordinator.
    command = [sys.executable, sys.argv[0], *distributed.strip_flags(sys.argv[1:], ["num_processes"])]
    status = distributed.launch_local(command, _NUM_PROCESSES.value)
    sys.exit(status if status >= 0 else 128 - status)
  if _PROCESS_ID.value is not None or _DISTRIBUTED.value:
    if _PROCESS_ID.value is not None and (_PROCESS_ID.value >= _NUM_PROCESSES.value or not _COORDINATOR.value):
      sys.exit(f"error: --process_id={_PROCESS_ID.value} needs --num_processes > {_PROCESS_ID.value} and "
               f"--coordinator_address=HOST:PORT (got {_NUM_PROCESSES.value!r}, {_COORDINATOR.value!r})")
    explicit = _PROCESS_ID.value is not None
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value if explicit else None,
                           _PROCESS_ID.value)   # before any jax call lists devices
    if not distributed.is_primary():
      logging.set_verbosity(logging.WARNING)    # process 0 logs the run
  config = _CONFIG.value
  try:
    # Everything that can be wrong with the request fails here, before any work.
    schema.validate_config(config)
    rundir.check_start(config, _WORKDIR.value, resume=_RESUME.value, branch_from=_BRANCH_FROM.value,
                       branch_round=_BRANCH_ROUND.value)
  except (ValueError, FileNotFoundError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")
  summary = runner.run(config, _WORKDIR.value, resume=_RESUME.value, branch_from=_BRANCH_FROM.value,
                       branch_round=_BRANCH_ROUND.value)
  logging.info("rounds to target: %s; final aggregated accuracy: %s; wall time %.1fs",
               summary["rounds_to_target"], summary["final_test_acc"], summary["wall_time"])
  distributed.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
