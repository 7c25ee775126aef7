"""Tabulate, plot and archive finished runs: a thin wrapper over :mod:`ntk_fl.compare`.

  .venv/bin/python experiments/summarize_runs.py RUN... [--plot STEM.png] [--plot-comm STEM.png]
      [--detail] [--archive DIR]

Prints ``ntk-fl compare``'s tables (runs grouped by their whole config without the
seed, rounds to 85 % and final accuracies as mean ± 95 % interval over seeds,
paired tests where seeds pair, one row per run), then the communication table of
the runs that log ``bits_cumulative``. ``--detail`` adds each run's accuracy at a
few rounds, its aggregation gap and its selection curves; ``--plot`` writes the
curves (PNG and PDF beside it), ``--plot-comm`` accuracy against cumulative
communication. ``--archive DIR`` copies each run's config, summary and per-round
scalars (without the per-client arrays) to ``DIR/<workdir name>/``: workdirs under
``runs/`` do not outlive the machine, the archive under ``docs/runs/`` is what
later tables and figures are made from.
"""

from __future__ import annotations

import argparse
import os

from ntk_fl import compare


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--plot", default="", help="curves (PNG path; a PDF is written beside it)")
  parser.add_argument(
    "--plot-comm", default="", help="accuracy vs cumulative communication (PNG path)"
  )
  parser.add_argument(
    "--detail", action="store_true", help="per-run curve points, gap and selection curves"
  )
  parser.add_argument(
    "--archive", default="", help="copy each run's scalars to ARCHIVE/<workdir name>/"
  )
  args = parser.parse_args()
  try:
    runs = compare.read_runs(args.workdirs)
    groups = compare.group_runs(runs)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(compare.compare_markdown(groups))
  print()
  print(compare.run_table(runs, groups))
  comm = compare.communication_table(runs)
  if comm:
    print()
    print(comm)
  if args.detail:
    for run in runs:
      print()
      print(compare.detail(run))
  if args.plot:
    compare.plot_curves(groups, os.path.splitext(args.plot)[0])
    print(f"\nplot: {args.plot}")
  if args.plot_comm:
    compare.plot_communication(runs, os.path.splitext(args.plot_comm)[0])
    print(f"plot: {args.plot_comm}")
  if args.archive:
    for run in runs:
      compare.archive(run["workdir"], args.archive)
    print(f"archived {len(runs)} run(s) to {args.archive}")


if __name__ == "__main__":
  main()
