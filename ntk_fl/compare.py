"""Comparing finished (or running, or archived) runs: ``ntk-fl compare RUN_DIR... [--target 0.85]
[--out DIR]``.

Runs are grouped by their whole stored config (:func:`ntk_fl.rundir.read_config`)
with the seed taken out: two runs are seeds of one setting exactly when every
other field is equal, apart from the fields in :data:`NEUTRAL_KEYS`, which say
where and how a run was executed, not what it computed. Each group is labelled
by the config fields that differ between the groups (``algorithm.lr=0.03``),
so two different settings never share a label. Per group:

* rounds to ``target`` per seed and their mean ± 95 % t-interval over seeds;
* the aggregated and mean-client accuracy at the last round every seed logged,
  mean ± 95 % interval, and their gap (aggregated − mean client);
* the per-round mean curves with the interval as a band (``curves.png`` / ``.pdf``).

Two groups whose seeds overlap in at least two seeds get a paired t-test
(:func:`ntk_fl.stats.paired_t_test`) of their aggregated accuracy at the last
round both logged, pairs matched by seed (SPARK Table 3's protocol).

The per-run tables of ``experiments/summarize_runs.py`` (:func:`run_table`,
:func:`detail`, :func:`communication_table`) and the archive of a run's scalars
(:func:`archive`) live here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import textwrap
from collections.abc import Sequence

import numpy as np
from scipy import stats as scipy_stats

from ntk_fl import metrics, rundir, stats
from ntk_fl.rundir import NEUTRAL_KEYS, flatten, setting_key  # re-exported: grouping's rules

__all__ = [
  "NEUTRAL_KEYS",
  "Group",
  "Summary",
  "archive",
  "communication_table",
  "compare_markdown",
  "curve",
  "detail",
  "flatten",
  "group_runs",
  "main",
  "mean_ci",
  "paired_tests",
  "plot_curves",
  "read_runs",
  "run_table",
  "setting_key",
  "summarize",
  "write_comparison",
]

GIGABYTE_BITS = 8e9
DETAIL_ROUNDS = (1, 2, 3, 5, 8, 10, 12, 15, 18, 20, 25, 30, 40, 50, 75, 100, 150, 200)
ARCHIVE_DROPPED = (
  "clients",
)  # per-client arrays of a metrics line: [M] values per round, never read here


# ----------------------------------------------------------------------------- grouping


@dataclasses.dataclass
class Group:
  """Runs of one setting, sorted by seed; ``label`` names the fields that set it apart from the
  other groups."""

  label: str
  fields: dict  # the differing fields' values of this group (dotted key -> value)
  runs: list  # rundir.read_run dicts, one per seed

  @property
  def seeds(self) -> list[int]:
    return [int(run["config"]["seed"]) for run in self.runs]

  @property
  def config(self) -> dict:
    return self.runs[0]["config"]


def _fmt_value(value) -> str:
  if isinstance(value, float):
    return f"{value:g}"
  if isinstance(value, tuple):
    return "(" + ",".join(_fmt_value(v) for v in value) + ")"
  return str(value)


def describe(config: dict) -> str:
  """``"ntk_dfl fashion_mnist α=0.1"``: method, dataset and split of a stored config."""
  return f"{config['method']} {config['data']['name']} {rundir.split_label(config)}"


def group_runs(runs: Sequence[dict]) -> list[Group]:
  """Groups ``runs`` (:func:`ntk_fl.rundir.read_run` dicts) by config without the seed; first-seen
  order.

  Labels: the dotted fields whose values differ between groups, ``key=value`` joined by ``, ``. When
  the method differs, an ``algorithm.*`` field is named only if it also differs between groups of
  the same method (the methods' hyperparameter blocks differ anyway). A single group is labelled by
  method, dataset and split.

  Raises:
    ValueError: two runs of one setting with the same seed (which one would count?), or no runs.
  """
  if not runs:
    raise ValueError("no runs to compare")
  cells: dict[tuple, list[dict]] = {}
  for run in runs:
    cells.setdefault(setting_key(run["config"]), []).append(run)
  for members in cells.values():
    seen: dict[int, str] = {}
    for run in members:
      seed = int(run["config"]["seed"])
      if seed in seen:
        raise ValueError(
          f"{seen[seed]} and {run['workdir']} are the same setting with the same seed {seed}; "
          "pass one of them"
        )
      seen[seed] = run["workdir"]
    members.sort(key=lambda run: int(run["config"]["seed"]))
  settings = [dict(key) for key in cells]
  keys = sorted(set().union(*settings))
  missing = "<absent>"
  differing = [k for k in keys if len({repr(s.get(k, missing)) for s in settings}) > 1]
  methods_differ = "method" in differing
  groups = []
  for setting, members in zip(settings, cells.values()):
    shown = {}
    for key in differing:
      if methods_differ and key.startswith("algorithm."):
        same_method = [s for s in settings if s.get("method") == setting.get("method")]
        if len({repr(s.get(key, missing)) for s in same_method}) < 2:
          continue
      shown[key] = setting.get(key, missing)
    label = ", ".join(f"{k}={_fmt_value(v)}" for k, v in shown.items()) or describe(
      members[0]["config"]
    )
    groups.append(Group(label, shown, members))
  if len({g.label for g in groups}) < len(groups):  # only algorithm.* fields told two groups apart
    for group, setting in zip(groups, settings):
      group.fields = {k: setting.get(k, missing) for k in differing}
      group.label = ", ".join(f"{k}={_fmt_value(v)}" for k, v in group.fields.items())
  return groups


# ----------------------------------------------------------------------------- statistics


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
  """``(mean, half-width)`` of the two-sided t-interval of the mean; half-width ``nan`` for one
  value."""
  values = np.asarray(values, dtype=np.float64)
  if values.ndim != 1 or values.size == 0:
    raise ValueError(f"mean_ci needs a non-empty 1-D sequence; got shape {values.shape}")
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1); got {confidence}")
  mean = float(values.mean())
  if values.size == 1:
    return mean, math.nan
  sem = float(values.std(ddof=1)) / math.sqrt(values.size)
  return mean, float(scipy_stats.t.ppf(0.5 + confidence / 2, values.size - 1)) * sem


def _value_at(run: dict, round_: int, key: str) -> float | None:
  return next((line.get(key) for line in run["lines"] if line["round"] == round_), None)


def common_last_round(runs: Sequence[dict], key: str = "test_acc") -> int | None:
  """The last round at which every run logged ``key`` (``None`` if there is none)."""
  logged = [{line["round"] for line in run["lines"] if line.get(key) is not None} for run in runs]
  shared = set.intersection(*logged) if logged else set()
  return max(shared) if shared else None


def curve(group: Group, key: str = "test_acc") -> dict:
  """The group's per-round curve of ``key``: ``{"rounds", "mean", "half", "n"}`` (numpy arrays;
  fractions).

  Rounds are those every seed logged ``key`` at; ``half`` is the 95 % t-interval
  half-width over seeds (``nan`` with one seed).
  """
  logged = [
    {line["round"]: line[key] for line in run["lines"] if line.get(key) is not None}
    for run in group.runs
  ]
  rounds = sorted(set.intersection(*(set(d) for d in logged)))
  pairs = [mean_ci([d[r] for d in logged]) for r in rounds]
  return {
    "rounds": np.asarray(rounds, dtype=int),
    "mean": np.asarray([p[0] for p in pairs]),
    "half": np.asarray([p[1] for p in pairs]),
    "n": len(group.runs),
  }


@dataclasses.dataclass
class Summary:
  """One group's numbers (accuracies in %, at ``round``: the last round every seed logged)."""

  label: str
  seeds: list
  reached: list  # rounds to target per seed (None: not reached in the logged rounds)
  logged: list  # rounds logged per seed
  round: int | None
  aggregated: list  # per seed, %
  client: (
    list | None
  )  # per seed, % (None: the method has no client models, or not scored at ``round``)

  @property
  def gap(self) -> list | None:
    return None if self.client is None else [a - c for a, c in zip(self.aggregated, self.client)]


def summarize(group: Group, target: float = 0.85) -> Summary:
  runs = group.runs
  reached = [
    metrics.rounds_to_target([line.get("test_acc") for line in run["lines"]], target)
    for run in runs
  ]
  round_ = common_last_round(runs)
  aggregated = [100 * _value_at(run, round_, "test_acc") for run in runs] if round_ else []
  client_round = common_last_round(runs, "client_acc_mean")
  client = None
  if client_round is not None and client_round == round_:
    client = [100 * _value_at(run, round_, "client_acc_mean") for run in runs]
  return Summary(
    group.label,
    group.seeds,
    reached,
    [len(run["lines"]) for run in runs],
    round_,
    aggregated,
    client,
  )


def _pm(values: Sequence[float] | None, digits: int = 2) -> str:
  """``"85.12 ± 0.31"`` (95 % t-interval), ``"85.12"`` for one value, ``"—"`` for none."""
  if not values:
    return "—"
  mean, half = mean_ci(values)
  return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def rounds_cell(summary: Summary) -> str:
  """Rounds to target: mean ± interval over seeds when every seed reached it, else how many did."""
  hits = [r for r in summary.reached if r is not None]
  if len(hits) == len(summary.reached):
    return _pm(hits, 1)
  return f"{len(hits)} of {len(summary.reached)} reached"


def _by_seed(group: Group, seeds: Sequence[int]) -> list[dict]:
  """The group's runs of ``seeds``, in that order."""
  return [next(r for r in group.runs if int(r["config"]["seed"]) == s) for s in seeds]


def paired_tests(groups: Sequence[Group], round_: int | None = None) -> list[dict]:
  """Paired t-tests of aggregated accuracy (%) for every two groups sharing at least two seeds.

  Returns ``[{"a", "b", "seeds", "round", "a_values", "b_values", "test"}]`` with ``test`` a
  :class:`ntk_fl.stats.PairedTest` of ``a − b`` at ``round_`` (default: the last round both groups
  logged).
  """
  out = []
  for i, a in enumerate(groups):
    for b in groups[i + 1 :]:
      seeds = sorted(set(a.seeds) & set(b.seeds))
      if len(seeds) < 2:
        continue
      ra, rb = (_by_seed(g, seeds) for g in (a, b))
      at = round_ if round_ is not None else common_last_round(ra + rb)
      if at is None:
        continue
      va = [_value_at(run, at, "test_acc") for run in ra]
      vb = [_value_at(run, at, "test_acc") for run in rb]
      if None in va or None in vb:
        raise ValueError(
          f"round {at} is not logged by every run of '{a.label}' and '{b.label}'; pick a round "
          "every run logged"
        )
      va, vb = [100 * v for v in va], [100 * v for v in vb]
      out.append(
        {
          "a": a.label,
          "b": b.label,
          "seeds": seeds,
          "round": at,
          "a_values": va,
          "b_values": vb,
          "test": stats.paired_t_test(va, vb),
        }
      )
  return out


def compare_markdown(
  groups: Sequence[Group], target: float = 0.85, round_: int | None = None
) -> str:
  """The comparison as markdown: one row per group, then the paired tests."""
  pct = f"{100 * target:g} %"
  rows = [
    f"| setting | seeds | rounds logged | rounds to {pct} per seed | rounds to {pct} (mean ± 95 % "
    "CI) | "
    "round | aggregated (%) | mean client (%) | aggregated − client (points) |",
    "|---|---|---|---|---:|---:|---:|---:|---:|",
  ]
  for group in groups:
    s = summarize(group, target)
    per_seed = ", ".join(str(r) if r else "—" for r in s.reached)
    rows.append(
      f"| {s.label} | {', '.join(map(str, s.seeds))} | {', '.join(map(str, s.logged))} | "
      f"{per_seed} | "
      f"{rounds_cell(s)} | {s.round or '—'} | {_pm(s.aggregated)} | {_pm(s.client)} | "
      f"{_pm(s.gap)} |"
    )
  tests = paired_tests(groups, round_)
  if tests:
    rows += [
      "",
      "| a − b (aggregated accuracy, paired by seed) | seeds | round | gain (points) | 95 % CI | "
      "t | p "
      "| d_z |",
      "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for row in tests:
      t = row["test"]
      rows.append(
        f"| {row['a']} − {row['b']} | {', '.join(map(str, row['seeds']))} | {row['round']} | "
        f"{t.gain:+.2f} | [{t.ci_low:.2f}, {t.ci_high:.2f}] | {t.t:.2f} | {t.p:.2g} | {t.d_z:.2f} |"
      )
  return "\n".join(rows)


# ----------------------------------------------------------------------------- figures


def _figure(width: float = 7, height: float = 4.5):
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel

  fig = Figure(figsize=(width, height))
  return fig, fig.add_subplot()


def save_figure(fig, stem: str) -> list[str]:
  """Writes ``stem.png`` (150 dpi) and ``stem.pdf`` (vector); returns the two paths."""
  # pylint: disable-next=import-outside-toplevel
  from matplotlib.backends.backend_agg import FigureCanvasAgg

  os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
  FigureCanvasAgg(fig)  # attaches a canvas; savefig picks the format's backend
  fig.tight_layout()
  # "tight": the whole title and legend inside the image, whatever their length.
  fig.savefig(stem + ".png", dpi=150, bbox_inches="tight")
  fig.savefig(stem + ".pdf", bbox_inches="tight")
  return [stem + ".png", stem + ".pdf"]


def accuracy_band(c: dict) -> tuple[np.ndarray, np.ndarray]:
  """The 95 % band ``(low, high)`` of a :func:`curve` of accuracies, within ``[0, 1]``: the
  t-interval of a few noisy seeds can reach past either end, an accuracy cannot."""
  return np.clip(c["mean"] - c["half"], 0.0, 1.0), np.clip(c["mean"] + c["half"], 0.0, 1.0)


def plot_curves(groups: Sequence[Group], stem: str, target: float = 0.85, title: str = "") -> dict:
  """Mean aggregated (solid) and mean-client (dashed) accuracy per round with 95 % bands; PNG and
  PDF.

  Returns what was drawn: ``{"curves": {label: {"test_acc": curve, "client_acc_mean": curve or
  None}}, "xticks": the round axis' tick positions}``; a curve over several seeds also holds its
  drawn ``"band"`` (:func:`accuracy_band`).
  """
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

  fig, ax = _figure()
  drawn = {}
  for k, group in enumerate(groups):
    color = f"C{k % 10}"
    lines = {}
    for key, style in (("test_acc", "-"), ("client_acc_mean", "--")):
      if not any(line.get(key) is not None for run in group.runs for line in run["lines"]):
        lines[key] = None
        continue
      c = curve(group, key)
      lines[key] = c
      if not c["rounds"].size:
        continue
      label = f"{group.label} (n={c['n']})" if key == "test_acc" else None
      ax.plot(
        c["rounds"],
        100 * c["mean"],
        style,
        color=color,
        label=label,
        marker="." if style == "-" else None,
      )
      if c["n"] > 1:
        low, high = lines[key]["band"] = accuracy_band(c)
        ax.fill_between(
          c["rounds"],
          100 * low,
          100 * high,
          color=color,
          alpha=0.15,
          linewidth=0,
        )
    drawn[group.label] = lines
  ax.axhline(100 * target, color="gray", linewidth=0.8, linestyle=":")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("communication round")
  banded = any(c is not None and c["n"] > 1 for lines in drawn.values() for c in lines.values())
  ax.set_ylabel("test accuracy (%)" + ("; band: 95 % CI over seeds" if banded else ""))
  ax.set_title(
    textwrap.fill(
      title or "aggregated model (solid) and mean client (dashed); mean over seeds, 95 % CI", 72
    )
  )
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  save_figure(fig, stem)
  return {"curves": drawn, "xticks": [float(t) for t in ax.get_xticks()]}


# ----------------------------------------------------------------------------- per-run tables


def last_client_mean(lines: list[dict]) -> tuple[float, int] | None:
  """``(client_acc_mean, round)`` of the last line that has it (clients may be scored every few
  rounds)."""
  return next(
    (
      (line["client_acc_mean"], line["round"])
      for line in reversed(lines)
      if line.get("client_acc_mean") is not None
    ),
    None,
  )


def run_table(runs: Sequence[dict], groups: Sequence[Group] | None = None) -> str:
  """One row per run: rounds to 80 / 85 %, last aggregated and mean-client accuracy, step time, wall
  time."""
  groups = groups if groups is not None else group_runs(runs)
  label = {run["workdir"]: g.label for g in groups for run in g.runs}
  rows = [
    "| run | setting | seed | rounds logged | rounds to 80% | rounds to 85% | final aggregated | "
    "final mean client | step s/round | wall time |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for run in runs:
    lines = run["lines"]
    acc = [line.get("test_acc") for line in lines]
    to80, to85 = metrics.rounds_to_target(acc, 0.80), metrics.rounds_to_target(acc, 0.85)
    last = last_client_mean(lines)
    client = (
      "—"
      if last is None
      else f"{last[0]:.4f}" + (f" (round {last[1]})" if last[1] != lines[-1]["round"] else "")
    )
    steps = [line["step_time"] for line in lines[1:]] or [lines[0]["step_time"]]
    wall = sum(line["step_time"] + line.get("eval_time", 0.0) for line in lines)
    final = "—" if acc[-1] is None else f"{acc[-1]:.4f}"
    rows.append(
      f"| {run['name']} | {label.get(run['workdir'], describe(run['config']))} | "
      f"{run['config']['seed']} "
      f"| {len(lines)} | {to80 or '—'} | {to85 or '—'} | {final} | {client} | "
      f"{sum(steps) / len(steps):.1f} | {wall / 60:.1f} min |"
    )
  return "\n".join(rows)


def detail(run: dict) -> str:
  """Accuracy at DETAIL_ROUNDS (and the last round), the aggregation gap and the selection curves of
  one run."""
  lines = run["lines"]
  shown = [line for line in lines if line["round"] in DETAIL_ROUNDS or line is lines[-1]]
  if all(line.get("client_acc_mean") is not None for line in shown):
    points = [
      f"{100 * line['test_acc']:.1f}/{100 * line['client_acc_mean']:.1f} ({line['round']})"
      for line in shown
    ]
    out = [f"{run['name']}: aggregated / mean client by round: " + ", ".join(points)]
  else:  # a server method: one global model, no client models
    points = [f"{100 * line['test_acc']:.1f} ({line['round']})" for line in shown]
    out = [f"{run['name']}: test accuracy by round: " + ", ".join(points)]
  gaps = [
    100 * (line["test_acc"] - line["client_acc_mean"])
    for line in lines
    if line.get("client_acc_mean") is not None
  ]
  if gaps:
    out.append(
      f"  aggregated − mean client: {gaps[0]:.1f} points at the first round, {gaps[-1]:.1f} at "
      "the last"
    )
  consensus = [
    line for line in lines if line.get("consensus_acc_mean") is not None
  ]  # eval.consensus runs
  if consensus:
    last = consensus[-1]
    out.append(
      f"  consensus models (one averaging step later) at round {last['round']}: mean "
      f"{100 * last['consensus_acc_mean']:.1f} % ({100 * last['consensus_acc_min']:.1f}–"
      f"{100 * last['consensus_acc_max']:.1f}), "
      f"{100 * (last['test_acc'] - last['consensus_acc_mean']):.1f} "
      "points under the aggregated model"
    )
  steps = [line["step_time"] for line in lines[1:]][-10:]
  if steps:
    out.append(
      f"  median step time of the last {len(steps)} rounds: {statistics.median(steps):.0f} s"
    )
  selection = (run["summary"] or {}).get("selection")
  if (
    selection and len(selection["best_to_worst"]) > 1
  ):  # a single global model has nothing to select
    best, rand, worst = (selection[k] for k in ("best_to_worst", "random", "worst_to_best"))
    peak = max(range(len(best)), key=best.__getitem__)
    at5 = min(5, len(best)) - 1
    out.append(
      f"  selection (test half): best-to-worst {100 * best[0]:.1f} % with 1 client, "
      f"{100 * best[at5]:.1f} % with {at5 + 1}, peak {100 * best[peak]:.1f} % with {peak + 1}, "
      f"all {len(best)}: {100 * best[-1]:.1f} %; random {100 * rand[at5]:.1f} % and worst-to-best "
      f"{100 * worst[at5]:.1f} % with {at5 + 1}"
    )
  return "\n".join(out)


def communication_to_target(lines: list[dict], target: float) -> float | None:
  """``bits_cumulative`` at the first round whose aggregated accuracy reaches ``target`` (``None``
  if none)."""
  round_reached = metrics.rounds_to_target([line.get("test_acc") for line in lines], target)
  if round_reached is None:
    return None
  return next(line.get("bits_cumulative") for line in lines if line["round"] == round_reached)


def communication_table(runs: Sequence[dict], target: float = 0.85) -> str:
  """Runs that log ``bits_cumulative``: rounds and GB to ``target``, GB per round, GB logged in
  all."""
  rows = [
    f"| run | rounds to {target:.0%} | GB to {target:.0%} | GB per round | GB logged |",
    "|---|---:|---:|---:|---:|",
  ]
  for run in runs:
    lines = run["lines"]
    if lines[-1].get("bits_cumulative") is None:
      continue
    reached = metrics.rounds_to_target([line.get("test_acc") for line in lines], target)
    to_target = communication_to_target(lines, target)
    total = lines[-1]["bits_cumulative"]
    rows.append(
      f"| {run['name']} | {reached or '—'} | "
      f"{'—' if to_target is None else f'{to_target / GIGABYTE_BITS:,.1f}'} | "
      f"{total / len(lines) / GIGABYTE_BITS:,.2f} | {total / GIGABYTE_BITS:,.1f} |"
    )
  return "\n".join(rows) if len(rows) > 2 else ""


def plot_communication(runs: Sequence[dict], stem: str, target: float = 0.85) -> None:
  """Aggregated accuracy against cumulative communication (GB, log scale) of the runs that log
  it."""
  fig, ax = _figure()
  for k, run in enumerate(runs):
    logged = [line for line in run["lines"] if line.get("bits_cumulative") is not None]
    if logged:
      ax.plot(
        [line["bits_cumulative"] / GIGABYTE_BITS for line in logged],
        [100 * line["test_acc"] for line in logged],
        color=f"C{k % 10}",
        marker=".",
        label=run["name"],
      )
  ax.axhline(100 * target, color="gray", linewidth=0.8, linestyle=":")
  ax.set_xscale("log")
  ax.set_xlabel("cumulative communication, all clients (GB)")
  ax.set_ylabel("aggregated test accuracy (%)")
  ax.grid(alpha=0.3, which="both")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  save_figure(fig, stem)


def archive(workdir: str, out_root: str) -> str:
  """Copies ``workdir``'s config, summary and per-round scalars to ``out_root/<name>/``; returns
  that path.

  The per-client arrays (``clients``) are dropped (≈ 1.3 kB per round instead of
  ≈ 30 kB at 300 clients). Written to a temporary name and renamed, so an
  interrupted archive never leaves a half-written run where a finished one is expected.
  """
  name = os.path.basename(os.path.normpath(workdir))
  target = os.path.join(out_root, name)
  staging = target + ".partial"
  shutil.rmtree(staging, ignore_errors=True)
  rundir.copy_run(workdir, staging, drop=ARCHIVE_DROPPED)
  shutil.rmtree(target, ignore_errors=True)
  os.rename(staging, target)
  return target


# ----------------------------------------------------------------------------- command


def read_runs(workdirs: Sequence[str]) -> list[dict]:
  """The runs among ``workdirs`` that have logged at least one round (others are reported on
  stderr); a seed-batched run's workdir stands for its replicas' runs (``seed<k>/``).

  Raises:
    ValueError: none of them is such a run.
  """
  runs = []
  for workdir in [r for w in workdirs for r in (rundir.replica_runs(w) or [w])]:
    if not rundir.is_run(workdir):
      print(
        f"skipped {workdir}: no {rundir.CONFIG_FILE} and {rundir.METRICS_FILE} (not a run)",
        file=sys.stderr,
      )
      continue
    run = rundir.read_run(workdir)
    if not run["lines"]:
      print(f"skipped {workdir}: no round logged yet", file=sys.stderr)
      continue
    runs.append(run)
  if not runs:
    raise ValueError(f"no run with a logged round among {list(workdirs)}")
  return runs


def write_comparison(
  runs: Sequence[dict],
  out: str,
  *,
  target: float = 0.85,
  round_: int | None = None,
  title: str = "",
) -> tuple[str, list[Group]]:
  """Writes ``out/compare.md`` and ``out/curves.{png,pdf}``; returns the markdown and the groups."""
  groups = group_runs(runs)
  text = compare_markdown(groups, target, round_) + "\n\n" + run_table(runs, groups)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "compare.md"), "w") as f:
    f.write(text + "\n")
  plot_curves(groups, os.path.join(out, "curves"), target, title)
  return text, groups


def main(argv: Sequence[str] | None = None) -> int:
  """``ntk-fl compare RUN_DIR... [--target 0.85] [--round R] [--out DIR]``."""
  parser = argparse.ArgumentParser(
    prog="ntk-fl compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("workdirs", nargs="+", metavar="RUN_DIR")
  parser.add_argument(
    "--target", type=float, default=0.85, help="accuracy target for rounds-to-target, in (0, 1]"
  )
  parser.add_argument(
    "--round",
    type=int,
    default=None,
    help="round of the paired tests (default: the last round both groups logged)",
  )
  parser.add_argument("--out", default="", help="write compare.md and curves.png/.pdf here")
  args = parser.parse_args(argv)
  if not 0 < args.target <= 1:
    parser.error(f"--target must be an accuracy in (0, 1]; got {args.target}")
  if args.round is not None and args.round < 1:
    parser.error(f"--round must be >= 1; got {args.round}")
  try:
    runs = read_runs(args.workdirs)
    if args.out:
      text, _ = write_comparison(runs, args.out, target=args.target, round_=args.round)
    else:
      groups = group_runs(runs)
      text = compare_markdown(groups, args.target, args.round) + "\n\n" + run_table(runs, groups)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(text)
  if args.out:
    print(
      f"\nwritten: {os.path.join(args.out, 'compare.md')}, {os.path.join(args.out, 'curves.png')}, "
      f"{os.path.join(args.out, 'curves.pdf')}"
    )
  return 0
