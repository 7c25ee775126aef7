"""Tabulate and plot finished runs (for docs/REPRODUCTION.md).

  .venv/bin/python experiments/summarize_runs.py runs/repro/* --plot docs/figures/ntk_dfl_fmnist.png

Reads each workdir's ``config.json`` / ``metrics.jsonl`` (runs still in progress
are read up to their last completed round) and prints a markdown table: rounds to
80 % / 85 % aggregated test accuracy, the aggregated and mean-client accuracy at
the last round, the mean step time per round (excluding round 1, which includes
compilation) and the total wall time of the logged rounds. ``--plot`` draws the
aggregated (solid) and mean-client (dashed) accuracy curves of all runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ntk_fl import metrics  # noqa: E402


def read_run(workdir: str) -> dict:
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return {"name": os.path.basename(os.path.normpath(workdir)), "config": config, "lines": lines}


def _describe(config: dict) -> str:
  data = config["data"]
  split = "IID" if data["partition"] == "iid" else f"α={data['alpha']:g}"
  algo = config.get("algorithm", {})
  extras = []
  if algo.get("lr_decay"):
    extras.append(f"decay {algo['lr_decay']:g}")
  if algo.get("per_round_averaging") is False:
    extras.append("no averaging")
  return " ".join([config["method"], data["name"], split, *extras, f"seed {config['seed']}"])


def table(runs: list[dict]) -> str:
  rows = ["| run | setting | rounds logged | rounds to 80% | rounds to 85% | final aggregated | final mean client "
          "| step s/round | wall time |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for run in runs:
    lines = run["lines"]
    acc = [line.get("test_acc") for line in lines]
    to80, to85 = metrics.rounds_to_target(acc, 0.80), metrics.rounds_to_target(acc, 0.85)
    client = next((line["client_acc_mean"] for line in reversed(lines) if line.get("client_acc_mean") is not None),
                  None)
    steps = [line["step_time"] for line in lines[1:]] or [lines[0]["step_time"]]
    wall = sum(line["step_time"] + line.get("eval_time", 0.0) for line in lines)
    rows.append(f"| {run['name']} | {_describe(run['config'])} | {len(lines)} | {to80 or '—'} | {to85 or '—'} | "
                f"{acc[-1]:.4f} | {client:.4f} | {sum(steps) / len(steps):.1f} | {wall / 60:.1f} min |")
  return "\n".join(rows)


def plot(runs: list[dict], path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(7, 4.5))
  ax = fig.add_subplot()
  for k, run in enumerate(runs):
    rounds = [line["round"] for line in run["lines"]]
    color = f"C{k}"
    ax.plot(rounds, [line["test_acc"] for line in run["lines"]], color=color, label=_describe(run["config"]))
    client = [line.get("client_acc_mean") for line in run["lines"]]
    ax.plot(rounds, client, color=color, linestyle="--", alpha=0.7)
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
  args = parser.parse_args()
  runs = [read_run(w) for w in args.workdirs if os.path.isfile(os.path.join(w, "metrics.jsonl"))]
  runs = [run for run in runs if run["lines"]]          # skip runs that have not finished a round yet
  if not runs:
    sys.exit("no runs with a metrics.jsonl among the given workdirs")
  print(table(runs))
  if args.plot:
    plot(runs, args.plot)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
  main()
