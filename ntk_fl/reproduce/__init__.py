"""The papers' tables and figures, one command each: ``ntk-fl reproduce NAME [--out DIR]``.

  ntk-fl reproduce --list          every experiment: runs, estimated CPU and GPU time, status
  ntk-fl reproduce ntk_dfl:fig9 [--out runs/reproduce] [--seeds 0 1] [--variants 'fig9_*_k2']
        [--skip_gpu] [--python 'taskset -c 1 python'] [--extra=--config.chunk_size=0] [--replicas S]
        [--dry_run]
  ntk-fl reproduce ntk_dfl:fig9 --out DIR --render_only [--render_dir FIGDIR]
  ntk-fl reproduce [ntk_dfl:fig9] --out DIR --status   where the runs stand, the time left
  ntk-fl reproduce ntk_dfl:fig9 --runs RUN_DIR... --render_dir FIGDIR

An experiment (:mod:`ntk_fl.reproduce.experiments`) runs as a resumable queue
(:mod:`ntk_fl.reproduce.queue`: finished runs skipped, interrupted ones resumed,
runs killed before their first checkpoint moved aside) in ``--out`` (default
``runs/reproduce``, shared by all experiments, so a run two experiments share is
made once), then is rendered (:mod:`ntk_fl.reproduce.render`) to
``--render_dir`` (default ``OUT/results``): ``<name>.md`` with the table beside
the paper's numbers, and the figures as PNG and PDF. ``--render_only`` renders
what ``--out`` (or ``--runs``) holds without running anything, by default to
``runs/results`` (never into a folder of runs it only reads); runs are matched
by config, so runs made by hand or by another queue are found whatever their
names. ``--archive DIR`` copies the rendered finished runs' scalars to
``DIR/<run name>/`` (unfinished ones are named and left out).
``--replicas S`` runs up to ``S`` consecutive fresh seeds of a variant as one seed-batched run
(``--config.replicas``; its replicas' folders are found like any other run).

An experiment made by a script of the source tree instead of runs (an attack, a toy regression;
``Experiment.script``) runs as a queue of one (:mod:`ntk_fl.reproduce.scripted`): ``--python``,
``--extra``, ``--status``, ``--dry_run`` and ``--render_only`` apply to it, the flags about runs do not.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from ntk_fl.reproduce import costs
from ntk_fl.reproduce.experiments import EXPERIMENTS
from ntk_fl.reproduce.registry import Experiment, Variant, build_config

__all__ = ["EXPERIMENTS", "Experiment", "Variant", "estimate", "list_table", "main"]

DEFAULT_OUT = "runs/reproduce"


def estimate(experiment: Experiment, seeds: Sequence[int] | None = None) -> dict:
  """``{"runs", "cpu_h", "gpu_h", "gpu_measured", "gpu_runs"}`` of the experiment (distinct runs
  counted once).

  ``gpu_measured`` is False when a method's GPU time is scaled from its family's CPU/GPU ratio.
  """
  from ntk_fl.reproduce.queue import stored_form  # pylint: disable=import-outside-toplevel

  seen = {}
  for variant in experiment.variants:
    for seed in experiment.seeds_of(variant, tuple(seeds) if seeds is not None else None):
      config = stored_form(build_config(variant, seed))
      key = (variant.name, seed)
      seen[key] = (config, variant.gpu)
  cpu = gpu = 0.0
  measured = True
  for config, _ in seen.values():
    c, g, m = costs.estimate(config)
    cpu, gpu, measured = cpu + c, gpu + g, measured and m
  return {
    "runs": len(seen),
    "cpu_h": cpu / 3600,
    "gpu_h": gpu / 3600,
    "gpu_measured": measured,
    "gpu_runs": sum(1 for _, for_gpu in seen.values() if for_gpu),
  }


def _hours(h: float) -> str:
  if h * 60 < 1:
    return "< 1 min"
  return f"{h * 60:.0f} min" if h < 1 else f"{h:.1f} h"


def list_table() -> str:
  """Every experiment as a markdown row: runs, estimated time on the 2-core CPU and on one H100,
  status."""
  rows = [
    "| experiment | what | runs | CPU (2-core AMD EPYC) | GPU (one H100) | status |",
    "|---|---|---:|---:|---:|---|",
  ]
  for name, experiment in EXPERIMENTS.items():
    if name.startswith("smoke:"):
      continue
    if experiment.script is not None:
      minutes = _hours(experiment.script.cpu_minutes / 60)
      rows.append(
        f"| {name} | {experiment.title} | script | {minutes} | — | registered: "
        f"{experiment.script.path} |"
      )
      continue
    if not experiment.variants:
      rows.append(f"| {name} | {experiment.title} | — | — | — | needs {experiment.needs} |")
      continue
    e = estimate(experiment)
    status = f"needs {experiment.needs}" if experiment.needs else "registered"
    if e["gpu_runs"]:
      status += f"; {e['gpu_runs']} run(s) meant for a GPU"
    gpu = _hours(e["gpu_h"]) + ("" if e["gpu_measured"] else " ≈")
    rows.append(
      f"| {name} | {experiment.title} | {e['runs']} | {_hours(e['cpu_h'])} | {gpu} | {status} |"
    )
  return "\n".join(rows)


def _status_table(out: str, seeds: Sequence[int] | None) -> str:
  """One markdown row per experiment with runs: how its runs in ``out`` stand (:mod:`.progress`)."""
  from ntk_fl.reproduce import progress, scripted  # pylint: disable=import-outside-toplevel

  rows = [progress.SUMMARY_HEADER]
  for name, experiment in EXPERIMENTS.items():
    if experiment.script is not None:
      rows.append(scripted.summary_row(experiment, out))
      continue
    if name.startswith("smoke:") or not experiment.variants or experiment.needs:
      continue
    rows.append(progress.summary_row(name, progress.experiment_progress(experiment, out, seeds)))
  return "\n".join(rows)


def _script_main(experiment: Experiment, args: argparse.Namespace, render_dir: str) -> int:
  """``ntk-fl reproduce NAME`` for an experiment made by a script (:mod:`.scripted`)."""
  from ntk_fl.reproduce import scripted  # pylint: disable=import-outside-toplevel

  unused = {
    "--seeds": args.seeds,
    "--variants": args.variants,
    "--runs": args.runs,
    "--skip_gpu": args.skip_gpu or None,
    "--archive": args.archive or None,
    "--replicas": None if args.replicas == 1 else args.replicas,
  }
  given = [flag for flag, value in unused.items() if value is not None]
  if given:
    print(
      f"error: {experiment.name} is made by the script {experiment.script.path}, not by runs: "
      f"{', '.join(given)} do not apply (--out, --python, --extra, --render_dir, --render_only, "
      "--status and --dry_run do)",
      file=sys.stderr,
    )
    return 2
  if args.status:
    print(scripted.status_table(experiment, args.out))
    return 0
  try:
    if not args.render_only:
      action = scripted.run(
        experiment,
        args.out,
        python=args.python,
        extra=tuple(shlex.split(args.extra)),
        dry_run=args.dry_run,
      )
      if action == "failed":
        return 1
      if args.dry_run:
        return 0
    result = scripted.render(experiment, args.out, render_dir)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(result["markdown"])
  print("written: " + ", ".join(result["files"]))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """``ntk-fl reproduce``; returns the exit status (1 when a run failed, 2 for a bad request)."""
  from ntk_fl.reproduce import progress, queue, render  # pylint: disable=import-outside-toplevel
  from ntk_fl import compare, rundir  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(
    prog="ntk-fl reproduce",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "name", nargs="?", help="the experiment, e.g. ntk_dfl:fig9 (--list shows them)"
  )
  parser.add_argument(
    "--list", action="store_true", help="list every experiment with its runs and estimated time"
  )
  parser.add_argument(
    "--status",
    action="store_true",
    help="where the experiment's runs in --out stand (finished, partial, not started) and the time "
    "they still need; without a name, one line per experiment",
  )
  parser.add_argument(
    "--seeds", type=int, nargs="+", default=None, help="seeds (default: the experiment's)"
  )
  parser.add_argument("--out", default=DEFAULT_OUT, help="where the runs are (and are made)")
  parser.add_argument(
    "--runs", nargs="+", default=None, help="render from these run folders (implies --render_only)"
  )
  parser.add_argument(
    "--render_only", action="store_true", help="render what the runs hold; run nothing"
  )
  parser.add_argument(
    "--render_dir",
    default="",
    help="where the table and figures go (default OUT/results; runs/results with --render_only or "
    "--runs)",
  )
  parser.add_argument(
    "--variants",
    nargs="+",
    default=None,
    help="run only the variants matching these shell patterns (e.g. 'dfedavg_*')",
  )
  parser.add_argument(
    "--python",
    default="",
    help="the command that runs python for each run (default: this "
    "interpreter), e.g. 'taskset -c 1 .venv/bin/python'",
  )
  parser.add_argument(
    "--extra",
    default="",
    help="flags added to every run, e.g. '--config.chunk_size=0' (or to a script experiment's "
    "command)",
  )
  parser.add_argument(
    "--skip_gpu",
    action="store_true",
    help="leave out the variants registered for a GPU (a CPU queue)",
  )
  parser.add_argument(
    "--replicas",
    type=int,
    default=1,
    help="run up to this many consecutive fresh seeds of a variant as one seed-batched run "
    "(--config.replicas; pays where compilation dominates, or on a GPU)",
  )
  parser.add_argument(
    "--dry_run", action="store_true", help="print what the queue would do, run nothing"
  )
  parser.add_argument(
    "--archive", default="", help="copy the rendered finished runs' scalars to ARCHIVE/<run name>/"
  )
  args = parser.parse_args(argv)
  if args.replicas < 1:
    parser.error(f"--replicas must be an integer >= 1, got {args.replicas}")
  if args.list:
    print(list_table())
    print(
      "\nEstimates: per-round costs of ntk_fl.reproduce.costs.ROUND_SECONDS x rounds (an upper "
      "bound for runs "
      "stopped at a target); ≈: GPU time scaled from the method family's measured CPU/GPU ratio."
    )
    return 0
  if args.status and not os.path.isdir(args.out):
    print(
      f"error: --out {args.out!r} is not a folder of runs (--status reads one)", file=sys.stderr
    )
    return 2
  if args.status and not args.name:
    print(_status_table(args.out, args.seeds))
    return 0
  if not args.name:
    parser.error("name an experiment (ntk-fl reproduce --list shows them)")
  if args.name not in EXPERIMENTS:
    close = [n for n in EXPERIMENTS if n.split(":")[0] == args.name.split(":")[0]] or list(
      EXPERIMENTS
    )
    print(f"error: unknown experiment {args.name!r}; known: {', '.join(close)}", file=sys.stderr)
    return 2
  experiment = EXPERIMENTS[args.name]
  # Rendering someone else's runs (--render_only, --runs) never writes into their folder by default.
  reading_only = args.render_only or args.runs is not None
  render_dir = args.render_dir or ("runs/results" if reading_only else f"{args.out}/results")
  if experiment.script is not None:
    return _script_main(experiment, args, render_dir)
  if args.status:
    if not experiment.variants:
      print(f"{args.name} has no runs: it needs {experiment.needs}")
      return 0
    print(progress.run_table(progress.experiment_progress(experiment, args.out, args.seeds)))
    return 0
  try:
    if args.runs is None and not args.render_only:
      if experiment.needs:
        print(
          f"error: {args.name} needs {experiment.needs}; it is registered but cannot run yet",
          file=sys.stderr,
        )
        return 2
      if not experiment.variants:
        print(f"error: {args.name} has no runs", file=sys.stderr)
        return 2
      extra = shlex.split(args.extra)
      if args.dry_run:
        for job in queue.plan(
          experiment,
          args.out,
          seeds=args.seeds,
          patterns=args.variants,
          python=args.python,
          extra=extra,
          skip_gpu=args.skip_gpu,
          replicas=args.replicas,
        ):
          aside = f" (move aside {job.aside})" if job.aside else ""
          print(f"{job.action}{aside}: {' '.join(shlex.quote(c) for c in job.command)}")
        return 0
      jobs = queue.run_queue(
        experiment,
        args.out,
        seeds=args.seeds,
        patterns=args.variants,
        python=args.python,
        extra=extra,
        skip_gpu=args.skip_gpu,
        replicas=args.replicas,
      )
      failed = [job for job in jobs if job.action == "failed"]
    else:
      failed = []
    dirs = (
      [r for d in args.runs for r in (rundir.replica_runs(d) or [d])]
      if args.runs is not None
      else queue.runs_in(args.out)
    )
    command = f"ntk-fl reproduce {args.name}" + (
      f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else ""
    )
    result = render.render(
      experiment, dirs, render_dir, seeds=args.seeds, out=args.out, command=command
    )
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(result["markdown"])
  print("written: " + ", ".join(result["files"]))
  if args.archive:
    runs = [run for group in result["groups"].values() for run in group.runs]
    finished = [run for run in runs if run["summary"] is not None]
    left = [run["name"] for run in runs if run["summary"] is None]
    for run in finished:
      compare.archive(run["workdir"], args.archive)
    print(f"archived {len(finished)} finished run(s) to {args.archive}")
    if left:  # an archived partial run would read as final in the docs
      print("not archived (unfinished): " + ", ".join(left))
  if failed:
    print(
      f"{len(failed)} run(s) failed: {', '.join(job.workdir for job in failed)}", file=sys.stderr
    )
    return 1
  return 0
