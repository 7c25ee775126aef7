"""Tabulate and plot finished runs (for docs/REPRODUCTION.md).

  .venv/bin/python experiments/summarize_runs.py runs/repro/* --plot docs/figures/ntk_dfl_fmnist.png

Reads each workdir's ``config.json`` / ``metrics.jsonl`` (runs still in progress
are read up to their last completed round) and prints a markdown table: rounds to
80 % / 85 % aggregated test accuracy, the aggregated and mean-client accuracy at
the last round, the mean step time per round (excluding round 1, which includes
compilation) and the total wall time of the logged rounds. Runs that differ only
in their seed are then summarised in a second table (rounds to 85 % per seed,
their mean and range, mean final accuracy). ``--detail`` adds, per run, the
aggregated / mean-client accuracy at a few rounds, the aggregation gap at the
first and last round and, where the run recorded them, the final-averaging
selection curves (paper Fig. 6) at 1 and 5 clients and at their peak.
``--plot`` draws the aggregated (solid) and mean-client (dashed) accuracy
curves of all runs. Runs that log their communication (``bits_cumulative``:
NTK-DFL, SPARK, the baselines, NTK-FL) get a third table -- the cumulative
communication of all clients to 85 % and per round, in GB (10⁹ bytes) -- and
``--plot-comm`` draws aggregated accuracy against that cumulative volume
(SPARK Fig. 12).

``--archive DIR`` copies each run, without its per-client arrays, to
``DIR/<workdir name>/``: ``config.json``, ``summary.json`` (when the run
finished) and ``metrics.jsonl`` with each line's ``clients`` entry dropped (every
scalar this script reads is kept, ≈ 1.3 kB per round instead of ≈ 30 kB at 300
clients). Workdirs under ``runs/`` do not outlive the machine; the archive,
committed under ``docs/runs/``, is what later tables and figures are made from
(this script reads an archived run like any other).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics

from ntk_fl import metrics, rundir
from ntk_fl.rundir import read_run, split_label


DETAIL_ROUNDS = (1, 2, 3, 5, 8, 10, 12, 15, 18, 20, 25, 30, 40, 50, 75, 100, 150, 200)


ARCHIVE_DROPPED = ("clients",)     # per-client arrays of a metrics line: [M] values per round, never read here


def archive(workdir: str, out_root: str) -> str:
  """Copies ``workdir``'s config, summary and per-round scalars to ``out_root/<name>/``; returns that path.

  Written to a temporary name and renamed, so an interrupted archive never leaves
  a half-written run where a finished one is expected.
  """
  name = os.path.basename(os.path.normpath(workdir))
  target = os.path.join(out_root, name)
  staging = target + ".partial"
  shutil.rmtree(staging, ignore_errors=True)
  rundir.copy_run(workdir, staging, drop=ARCHIVE_DROPPED)
  shutil.rmtree(target, ignore_errors=True)
  os.rename(staging, target)
  return target


def _describe(config: dict, with_seed: bool = True) -> str:
  data = config["data"]
  split = split_label(config)
  algo = config.get("algorithm", {})
  extras = []
  if algo.get("lr_decay"):
    extras.append(f"decay {algo['lr_decay']:g}")
  if algo.get("per_round_averaging") is False:
    extras.append("no averaging")
  if algo.get("clients_per_round"):
    extras.append(f"{algo['clients_per_round']} clients/round")
  if config["method"] == "spark":                    # the Table 4 rows and the sketch / compression variants
    if algo.get("momentum") == 0:
      extras.append("no momentum")
    if not algo.get("distill", {}).get("enabled", True):
      extras.append("no distillation")
    sketch = algo.get("projection", {})
    if sketch.get("scheme", "none") != "none":
      extras.append(f"{sketch['scheme']} k={sketch['k_proj']}")
    packing = algo.get("compression", {})
    if packing.get("keep_fraction", 1) < 1 or packing.get("bits", 32) != 32:
      extras.append(f"top {packing['keep_fraction']:g}, {packing['bits']} bits")
  seed = [f"seed {config['seed']}"] if with_seed else []
  return " ".join([config["method"], data["name"], split, *extras, *seed])


def _fmt(value: float | None) -> str:
  """4 decimals, or a dash for a metric the method does not have (server methods have no client models)."""
  return "—" if value is None else f"{value:.4f}"


def last_client_mean(lines: list[dict]) -> tuple[float, int] | None:
  """``(client_acc_mean, round)`` of the last line that has it (clients may be scored every few rounds)."""
  return next(((line["client_acc_mean"], line["round"]) for line in reversed(lines)
               if line.get("client_acc_mean") is not None), None)


def _fmt_client(value: float | None, rounds: list[int], final_round: list[int]) -> str:
  """The mean-client cell; names the round(s) when they are not the runs' last (clients scored every k)."""
  if value is None:
    return "—"
  late = [r for r, last in zip(rounds, final_round) if r != last]
  return _fmt(value) + (f" (round {', '.join(map(str, rounds))})" if late else "")


def table(runs: list[dict]) -> str:
  rows = ["| run | setting | rounds logged | rounds to 80% | rounds to 85% | final aggregated | final mean client "
          "| step s/round | wall time |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for run in runs:
    lines = run["lines"]
    acc = [line.get("test_acc") for line in lines]
    to80, to85 = metrics.rounds_to_target(acc, 0.80), metrics.rounds_to_target(acc, 0.85)
    last = last_client_mean(lines)
    client = _fmt_client(last[0], [last[1]], [lines[-1]["round"]]) if last else "—"
    steps = [line["step_time"] for line in lines[1:]] or [lines[0]["step_time"]]
    wall = sum(line["step_time"] + line.get("eval_time", 0.0) for line in lines)
    rows.append(f"| {run['name']} | {_describe(run['config'])} | {len(lines)} | {to80 or '—'} | {to85 or '—'} | "
                f"{acc[-1]:.4f} | {client} | {sum(steps) / len(steps):.1f} | {wall / 60:.1f} min |")
  return "\n".join(rows)


def seed_table(runs: list[dict]) -> str:
  """Runs grouped by everything but the seed: rounds to 85 % per seed, their mean and range."""
  groups: dict[str, list[dict]] = collections.defaultdict(list)
  for run in runs:
    groups[_describe(run["config"], with_seed=False)].append(run)
  rows = ["| setting | seeds | rounds to 85% per seed | mean (min–max) | mean final aggregated | "
          "mean final mean client |", "|---|---|---|---:|---:|---:|"]
  for setting, members in groups.items():
    members = sorted(members, key=lambda run: run["config"]["seed"])
    reached = [metrics.rounds_to_target([line.get("test_acc") for line in run["lines"]], 0.85) for run in members]
    per_seed = ", ".join(f"{r}" if r else f"— ({len(run['lines'])} rounds)" for r, run in zip(reached, members))
    hits = [r for r in reached if r]
    spread = (f"{statistics.mean(hits):.1f} ({min(hits)}–{max(hits)})" if len(hits) == len(reached)
              else f"{len(hits)} of {len(reached)} reached")
    final = statistics.mean(run["lines"][-1]["test_acc"] for run in members)
    lasts = [last_client_mean(run["lines"]) for run in members]
    client = ("—" if None in lasts else
              _fmt_client(statistics.mean(v for v, _ in lasts), [r for _, r in lasts],
                          [run["lines"][-1]["round"] for run in members]))
    seeds = ", ".join(str(run["config"]["seed"]) for run in members)
    rows.append(f"| {setting} | {seeds} | {per_seed} | {spread} | {final:.4f} | {client} |")
  return "\n".join(rows)


def detail(run: dict) -> str:
  """Accuracy at DETAIL_ROUNDS (and the last round), the aggregation gap and the selection curves of one run."""
  lines = run["lines"]
  shown = [line for line in lines if line["round"] in DETAIL_ROUNDS or line is lines[-1]]
  if all(line.get("client_acc_mean") is not None for line in shown):
    points = [f"{100 * line['test_acc']:.1f}/{100 * line['client_acc_mean']:.1f} ({line['round']})" for line in shown]
    out = [f"{run['name']}: aggregated / mean client by round: " + ", ".join(points)]
  else:                                                  # a server method: one global model, no client models
    points = [f"{100 * line['test_acc']:.1f} ({line['round']})" for line in shown]
    out = [f"{run['name']}: test accuracy by round: " + ", ".join(points)]
  gaps = [100 * (line["test_acc"] - line["client_acc_mean"]) for line in lines
          if line.get("client_acc_mean") is not None]
  if gaps:
    out.append(f"  aggregated − mean client: {gaps[0]:.1f} points at the first round, {gaps[-1]:.1f} at the last")
  consensus = [line for line in lines if line.get("consensus_acc_mean") is not None]   # eval.consensus runs
  if consensus:
    last = consensus[-1]
    out.append(f"  consensus models (one averaging step later) at round {last['round']}: mean "
               f"{100 * last['consensus_acc_mean']:.1f} % ({100 * last['consensus_acc_min']:.1f}–"
               f"{100 * last['consensus_acc_max']:.1f}), {100 * (last['test_acc'] - last['consensus_acc_mean']):.1f} "
               "points under the aggregated model")
  steps = [line["step_time"] for line in lines[1:]][-10:]
  if steps:
    out.append(f"  median step time of the last {len(steps)} rounds: {statistics.median(steps):.0f} s")
  selection = (run["summary"] or {}).get("selection")
  if selection and len(selection["best_to_worst"]) > 1:       # a single global model has nothing to select
    best, rand, worst = (selection[k] for k in ("best_to_worst", "random", "worst_to_best"))
    peak = max(range(len(best)), key=best.__getitem__)
    at5 = min(5, len(best)) - 1
    out.append(f"  selection (test half): best-to-worst {100 * best[0]:.1f} % with 1 client, "
               f"{100 * best[at5]:.1f} % with {at5 + 1}, peak {100 * best[peak]:.1f} % with {peak + 1}, "
               f"all {len(best)}: {100 * best[-1]:.1f} %; random {100 * rand[at5]:.1f} % and worst-to-best "
               f"{100 * worst[at5]:.1f} % with {at5 + 1}")
  return "\n".join(out)


GIGABYTE_BITS = 8e9


def communication_to_target(lines: list[dict], target: float) -> float | None:
  """``bits_cumulative`` at the first round whose aggregated accuracy reaches ``target`` (``None`` if none)."""
  round_reached = metrics.rounds_to_target([line.get("test_acc") for line in lines], target)
  if round_reached is None:
    return None
  return next(line.get("bits_cumulative") for line in lines if line["round"] == round_reached)


def communication_table(runs: list[dict], target: float = 0.85) -> str:
  """Runs that log ``bits_cumulative``: rounds and GB to ``target``, GB per round, GB logged in all."""
  rows = [f"| run | rounds to {target:.0%} | GB to {target:.0%} | GB per round | GB logged |",
          "|---|---:|---:|---:|---:|"]
  for run in runs:
    lines = run["lines"]
    if lines[-1].get("bits_cumulative") is None:
      continue
    reached = metrics.rounds_to_target([line.get("test_acc") for line in lines], target)
    to_target = communication_to_target(lines, target)
    total = lines[-1]["bits_cumulative"]
    rows.append(f"| {run['name']} | {reached or '—'} | "
                f"{'—' if to_target is None else f'{to_target / GIGABYTE_BITS:,.1f}'} | "
                f"{total / len(lines) / GIGABYTE_BITS:,.2f} | {total / GIGABYTE_BITS:,.1f} |")
  return "\n".join(rows) if len(rows) > 2 else ""


def plot_communication(runs: list[dict], path: str) -> None:
  """Aggregated accuracy against cumulative communication (GB, log scale) of the runs that log it."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 4.5))
  ax = fig.add_subplot()
  for k, run in enumerate(runs):
    logged = [line for line in run["lines"] if line.get("bits_cumulative") is not None]
    if logged:
      ax.plot([line["bits_cumulative"] / GIGABYTE_BITS for line in logged], [line["test_acc"] for line in logged],
              color=f"C{k}", marker=".", label=_describe(run["config"]))
  ax.axhline(0.85, color="gray", linewidth=0.8, linestyle=":")
  ax.set_xscale("log")
  ax.set_xlabel("cumulative communication, all clients (GB)")
  ax.set_ylabel("aggregated test accuracy")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  FigureCanvasAgg(fig).print_png(path)


def plot(runs: list[dict], path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 4.5))
  ax = fig.add_subplot()
  for k, run in enumerate(runs):
    rounds = [line["round"] for line in run["lines"]]
    color = f"C{k}"
    ax.plot(rounds, [line["test_acc"] for line in run["lines"]], color=color, label=_describe(run["config"]))
    scored = [line for line in run["lines"] if line.get("client_acc_mean") is not None]   # maybe every k rounds
    ax.plot([line["round"] for line in scored], [line["client_acc_mean"] for line in scored], color=color,
            linestyle="--", alpha=0.7)
  ax.axhline(0.85, color="gray", linewidth=0.8, linestyle=":")
  ax.set_xlabel("communication round")
  ax.set_ylabel("test accuracy")
  ax.set_title("aggregated model (solid) vs mean client (dashed)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  FigureCanvasAgg(fig).print_png(path)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--plot", default="")
  parser.add_argument("--plot-comm", default="", help="accuracy vs cumulative communication (PNG path)")
  parser.add_argument("--detail", action="store_true", help="per-run curve points, gap and selection curves")
  parser.add_argument("--archive", default="", help="copy each run's scalars to ARCHIVE/<workdir name>/")
  args = parser.parse_args()
  runs = [read_run(w) for w in args.workdirs if rundir.is_run(w)]
  runs = [run for run in runs if run["lines"]]          # skip runs that have not finished a round yet
  if not runs:
    raise SystemExit(f"no runs with a {rundir.METRICS_FILE} among the given workdirs")
  print(table(runs))
  print()
  print(seed_table(runs))
  comm = communication_table(runs)
  if comm:
    print()
    print(comm)
  if args.detail:
    for run in runs:
      print()
      print(detail(run))
  if args.plot:
    plot(runs, args.plot)
    print(f"\nplot: {args.plot}")
  if args.plot_comm:
    plot_communication(runs, args.plot_comm)
    print(f"plot: {args.plot_comm}")
  if args.archive:
    for run in runs:
      archive(run["workdir"], args.archive)
    print(f"archived {len(runs)} run(s) to {args.archive}")


if __name__ == "__main__":
  main()
