"""Paired t-test of one method's runs over a baseline's, matched by data split and seed (SPARK Table 3).

  .venv/bin/python experiments/paired_test.py --method runs/spark/*_s* \\
      --baseline runs/spark_ntk_dfl/*_s* runs/spark_ablation/abl_none_s* [--round 30]

SPARK's Table 3 tests SPARK against NTK-DFL with a two-sided paired t-test on
the "round-29 aggregated accuracy" (0-based: the 30th round) over three shared
seeds per data split. This script reads finished or archived workdirs (as
experiments/summarize_runs.py does), groups both sides by setting (dataset,
number of clients, IID or Dirichlet α), pairs the runs of a group by seed and
prints one markdown row per setting: the seeds, each side's accuracy per seed,
the mean gain in points, its 95 % interval, ``p`` and ``d_z`` (ntk_fl.stats).
A setting with fewer than two shared seeds is listed with its values and no
test. A run that has not logged ``--round`` yet, two runs of one side with the
same setting and seed, or no shared setting at all is an error.
"""

from __future__ import annotations

import argparse
import collections
import sys

from ntk_fl import rundir, stats


def setting_key(config: dict) -> str:
  """What two paired runs must share besides the seed: dataset, clients and split."""
  data = config["data"]
  return f"{data['name']}, {data['num_clients']} clients, {rundir.split_label(config)}"


def accuracy_at(run: dict, round_: int) -> float:
  """Aggregated test accuracy (fraction) the run logged after ``round_`` rounds."""
  for line in run["lines"]:
    if line["round"] == round_ and line.get("test_acc") is not None:
      return float(line["test_acc"])
  logged = run["lines"][-1]["round"] if run["lines"] else 0
  raise ValueError(
    f"{run['workdir']} has no aggregated accuracy for round {round_} (logged through round "
    f"{logged}); pick --round within every run"
  )


def by_setting_and_seed(runs: list[dict], side: str) -> dict[str, dict[int, dict]]:
  """``{setting: {seed: run}}``; two runs of one side in the same cell are an error (which one to pair?)."""
  cells: dict[str, dict[int, dict]] = collections.defaultdict(dict)
  for run in runs:
    key, seed = setting_key(run["config"]), int(run["config"]["seed"])
    if seed in cells[key]:
      raise ValueError(
        f"two {side} runs for {key}, seed {seed}: {cells[key][seed]['workdir']} and "
        f"{run['workdir']}; pass one"
      )
    cells[key][seed] = run
  return cells


def paired_rows(method_runs: list[dict], baseline_runs: list[dict], round_: int) -> list[dict]:
  """One ``{"setting", "seeds", "method", "baseline", "test"}`` per shared setting (accuracies in %).

  ``test`` is a :class:`ntk_fl.stats.PairedTest` in percentage points, or ``None`` with fewer than two shared seeds.
  """
  method, baseline = (
    by_setting_and_seed(method_runs, "--method"),
    by_setting_and_seed(baseline_runs, "--baseline"),
  )
  shared = [key for key in method if key in baseline and set(method[key]) & set(baseline[key])]
  if not shared:
    raise ValueError(
      f"no setting and seed is on both sides: --method has {sorted(method)}, --baseline has "
      f"{sorted(baseline)}"
    )
  rows = []
  for key in shared:
    seeds = sorted(set(method[key]) & set(baseline[key]))
    ours = [100 * accuracy_at(method[key][s], round_) for s in seeds]
    theirs = [100 * accuracy_at(baseline[key][s], round_) for s in seeds]
    test = stats.paired_t_test(ours, theirs) if len(seeds) >= 2 else None
    rows.append({"setting": key, "seeds": seeds, "method": ours, "baseline": theirs, "test": test})
  return rows


def table(rows: list[dict], round_: int) -> str:
  head = [
    f"| setting | seeds | method, round {round_} (%) | baseline (%) | gain (points) | 95 % CI | p | d_z |",
    "|---|---|---|---|---:|---|---:|---:|",
  ]
  for row in rows:
    values = [", ".join(f"{v:.2f}" for v in row[side]) for side in ("method", "baseline")]
    test = row["test"]
    if test is None:
      gain = row["method"][0] - row["baseline"][0]
      cells = f"{gain:+.2f} | needs ≥ 2 shared seeds | — | —"
    else:
      cells = (
        f"{test.gain:+.2f} | [{test.ci_low:.2f}, {test.ci_high:.2f}] | "
        f"{test.p:.2g} | {test.d_z:.2f}"
      )
    head.append(
      f"| {row['setting']} | {', '.join(map(str, row['seeds']))} | {values[0]} | {values[1]} | {cells} |"
    )
  return "\n".join(head)


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--method", nargs="+", required=True, help="workdirs of the method (e.g. SPARK)"
  )
  parser.add_argument(
    "--baseline", nargs="+", required=True, help="workdirs of the baseline (e.g. NTK-DFL)"
  )
  parser.add_argument(
    "--round",
    type=int,
    default=30,
    help="1-based round whose aggregated accuracy is compared "
    "(30 = the paper's 0-based 'round 29')",
  )
  args = parser.parse_args()
  if args.round < 1:
    parser.error(f"--round must be >= 1; got {args.round}")
  read = lambda dirs: [rundir.read_run(d) for d in dirs]  # noqa: E731
  try:
    rows = paired_rows(read(args.method), read(args.baseline), args.round)
  except ValueError as error:
    sys.exit(str(error))
  print(table(rows, args.round))


if __name__ == "__main__":
  main()
