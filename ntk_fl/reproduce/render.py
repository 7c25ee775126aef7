"""An experiment's result from its runs: a markdown table next to the paper's numbers, and its
figures.

Runs are found by config (:func:`collect`): a run belongs to a variant when its
stored config equals the variant's for one of the seeds, apart from the fields
that do not change a result (:data:`ntk_fl.compare.NEUTRAL_KEYS`). A run folder
named like a variant's run that holds another config is reported with the fields
that differ. What is computed depends on the experiment's ``kind``
(:class:`ntk_fl.reproduce.registry.Experiment`); statistics over seeds are mean ±
95 % t-interval (:func:`ntk_fl.compare.mean_ci`), paired tests
:func:`ntk_fl.stats.paired_t_test`. Accuracies are in %.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence

import numpy as np

from ntk_fl import compare, rundir, stats
from ntk_fl.reproduce.queue import expected_key, index_runs, run_name, runs_in, stored_form
from ntk_fl.reproduce.registry import Experiment, Variant, build_config

__all__ = ["collect", "render", "unfinished", "values_at"]


def collect(
  experiment: Experiment, dirs: Sequence[str], seeds: Sequence[int] | None = None, out: str = ""
) -> tuple[dict[str, compare.Group], list[str]]:
  """``({variant name: Group of its runs}, [what is missing])`` among the run folders ``dirs``.

  Only runs that logged a round count. ``out`` is where the queue would put
  missing runs (named in the missing list).
  """
  index = index_runs(dirs)
  groups, missing = {}, []
  for variant in experiment.variants:
    runs = []
    for seed in experiment.seeds_of(variant, tuple(seeds) if seeds is not None else None):
      found = index.get((expected_key(variant, seed), seed), [])
      run = None
      for workdir in found:
        candidate = rundir.read_run(workdir)
        if candidate["lines"] and (run is None or candidate["summary"] is not None):
          run = candidate
      if run is not None:
        runs.append(run)
        continue
      name = run_name(variant, seed)
      same_name = [d for d in dirs if os.path.basename(os.path.normpath(d)) == name]
      if found:  # before the name check: a run of this config under its own name is just young
        missing.append(f"{name}: started, no round logged yet ({found[0]})")
      elif same_name and os.path.isfile(os.path.join(same_name[0], rundir.CONFIG_FILE)):
        missing.append(
          f"{name}: {same_name[0]} holds another config "
          f"({_difference(variant, seed, same_name[0])})"
        )
      else:
        missing.append(
          f"{name}: not run" + (f" (would be {os.path.join(out, name)})" if out else "")
        )
    if runs:
      groups[variant.name] = compare.Group(variant.display, {}, runs)
  return groups, missing


def _difference(variant: Variant, seed: int, workdir: str) -> str:

  want = dict(compare.flatten(stored_form(build_config(variant, seed))))
  have = dict(compare.flatten(rundir.read_config(workdir)))
  keys = sorted(
    k for k in set(want) | set(have) if k not in compare.NEUTRAL_KEYS and want.get(k) != have.get(k)
  )
  return "; ".join(
    f"{k}: {have.get(k, '<absent>')!r}, expected {want.get(k, '<absent>')!r}" for k in keys[:6]
  )


def values_at(
  group: compare.Group, round_: int | None, key: str = "test_acc", fallback: bool = False
) -> tuple[list[float], int | None]:
  """``(values in %, round)``: ``key`` of every run that logged it at ``round_`` (default: the last
  round all runs logged). With ``fallback``, runs that have not reached ``round_`` yet (still
  running) are read at the last round they all logged instead, and that round is returned."""
  at = round_ if round_ is not None else compare.common_last_round(group.runs, key)
  if at is None:
    return [], None
  out = []
  for run in group.runs:
    value = next((line.get(key) for line in run["lines"] if line["round"] == at), None)
    if value is not None:
      out.append(100 * value)
  if not out and fallback and round_ is not None:
    return values_at(group, None, key)
  return out, at


def _pm(values: Sequence[float], digits: int = 2) -> str:
  if not values:
    return "—"
  mean, half = compare.mean_ci(values)
  return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def _accuracy_cells(group: compare.Group, round_: int | None) -> str:
  agg, at = values_at(group, round_, fallback=True)
  client, _ = values_at(group, at, "client_acc_mean")
  n = len(group.runs)
  partial = f" ({len(agg)} of {n} seeds)" if agg and len(agg) < n else ""
  gap = [a - c for a, c in zip(agg, client)] if len(client) == len(agg) else []
  running = " (running)" if round_ is not None and at is not None and at < round_ else ""
  return f"{at or '—'}{running} | {_pm(agg)}{partial} | {_pm(client)} | {_pm(gap)}"


def _rounds_cells(group: compare.Group, target: float) -> str:
  summary = compare.summarize(group, target)
  per_seed = ", ".join(str(r) if r else f"— ({n})" for r, n in zip(summary.reached, summary.logged))
  return f"{per_seed} | {compare.rounds_cell(summary)}"


def _table(experiment: Experiment, groups: dict[str, compare.Group]) -> list[str]:
  pct = f"{100 * experiment.target:g} %"
  variants = [v for v in experiment.variants if v.name in groups]
  if experiment.kind == "rounds":
    rows = [
      f"| variant | seeds | rounds to {pct} per seed (— (rounds logged): not reached) | ours "
      "(mean ± 95 % CI) | "
      "paper |",
      "|---|---|---|---:|---:|",
    ]
    for v in variants:
      g = groups[v.name]
      rows.append(
        f"| {v.display} | {', '.join(map(str, g.seeds))} | {_rounds_cells(g, experiment.target)} | "
        f"{v.paper or '—'} |"
      )
    return rows
  if experiment.kind == "paired":
    rows = [
      "| method − baseline | seeds | round | method (%) | baseline (%) | gain (points) | 95 % CI "
      "| p | d_z | "
      "paper (gain [CI] p d_z) |",
      "|---|---|---:|---|---|---:|---|---:|---:|---|",
    ]
    for a_name, b_name in experiment.pairs:
      a, b = experiment.variant(a_name), experiment.variant(b_name)
      if a_name not in groups or b_name not in groups:
        rows.append(
          f"| {a.display} − {b.display} | — | — | — | — | — | — | — | — | {a.paper or '—'} |"
        )
        continue
      ga, gb = groups[a_name], groups[b_name]
      seeds = sorted(set(ga.seeds) & set(gb.seeds))
      at = experiment.round
      va = [
        values_at(compare.Group("", {}, [r for r in ga.runs if r["config"]["seed"] == s]), at)[0]
        for s in seeds
      ]
      vb = [
        values_at(compare.Group("", {}, [r for r in gb.runs if r["config"]["seed"] == s]), at)[0]
        for s in seeds
      ]
      keep = [i for i in range(len(seeds)) if va[i] and vb[i]]
      seeds, va, vb = [seeds[i] for i in keep], [va[i][0] for i in keep], [vb[i][0] for i in keep]
      shown = [", ".join(f"{x:.2f}" for x in side) or "—" for side in (va, vb)]
      if len(seeds) >= 2:
        t = stats.paired_t_test(va, vb)
        cells = f"{t.gain:+.2f} | [{t.ci_low:.2f}, {t.ci_high:.2f}] | {t.p:.2g} | {t.d_z:.2f}"
      else:
        cells = (
          f"{va[0] - vb[0]:+.2f} | needs ≥ 2 shared seeds | — | —" if seeds else "— | — | — | —"
        )
      rows.append(
        f"| {a.display} − {b.display} | {', '.join(map(str, seeds)) or '—'} | {at or 'last'} | "
        f"{shown[0]} | "
        f"{shown[1]} | {cells} | {a.paper or '—'} |"
      )
    return rows
  sweep = experiment.kind == "sweep"
  head = "| series | x |" if sweep else "|"
  rows = [
    f"{head} variant | seeds | round | aggregated (%) | mean client (%) | aggregated − client "
    "(points) | "
    f"rounds to {pct} | paper |",
    ("|---|---:|" if sweep else "|") + "---|---|---:|---:|---:|---:|---:|---|",
  ]
  for v in variants:
    g = groups[v.name]
    lead = f"| {v.series or '—'} | {v.x} |" if sweep else "|"
    rows.append(
      f"{lead} {v.display} | {', '.join(map(str, g.seeds))} | "
      f"{_accuracy_cells(g, experiment.round)} | "
      f"{compare.rounds_cell(compare.summarize(g, experiment.target))} | {v.paper or '—'} |"
    )
  return rows


def _short_of_round(group: compare.Group, round_: int | None, at: int | None) -> bool:
  """Whether ``group``'s value was read short of the round the figure is drawn at: before
  ``round_``, or (``round_`` ``None``: each run's last round) while a run is still going."""
  if round_ is not None:
    return at is None or at < round_
  return any(run["summary"] is None for run in group.runs)


def unfinished(groups: dict[str, compare.Group]) -> list[str]:
  """``"<run>: unfinished, round r of R (<workdir>)"`` for every run without a summary (still
  running, or stopped before its last round), in the groups' order."""
  return [
    f"{run['name']}: unfinished, round {run['lines'][-1]['round']} of "
    f"{run['config'].get('rounds', '?')} ({run['workdir']})"
    for group in groups.values()
    for run in group.runs
    if run["summary"] is None
  ]


def _plot_sweep(experiment: Experiment, groups: dict[str, compare.Group], stem: str) -> dict:
  """Aggregated (solid) and mean-client (dashed) accuracy at the round against each variant's
  ``x``.

  Only variants whose runs reached the experiment's round (every run finished, where it has none)
  are drawn; the others are returned under ``drawn[series]["left_off"]`` as ``(display, round)``.
  """
  fig, ax = compare._figure()  # pylint: disable=protected-access
  series: dict[str, list] = {}
  for v in experiment.variants:
    if v.name in groups:
      series.setdefault(v.series or experiment.name, []).append(v)
  drawn = {}
  for k, (name, variants) in enumerate(series.items()):
    points = {
      "x": [],
      "aggregated": [],
      "aggregated_half": [],
      "client": [],
      "client_half": [],
      "left_off": [],
    }
    for v in sorted(variants, key=lambda v: v.x):
      agg, at = values_at(groups[v.name], experiment.round, fallback=True)
      if not agg:
        continue
      if _short_of_round(groups[v.name], experiment.round, at):
        # A point from an earlier round would sit on the fixed-round axis as if it were final.
        points["left_off"].append((v.display, at))
        continue
      client, _ = values_at(groups[v.name], at, "client_acc_mean")
      points["x"].append(v.x)
      for key, values in (("aggregated", agg), ("client", client)):
        mean, half = compare.mean_ci(values) if values else (math.nan, math.nan)
        points[key].append(mean)
        points[key + "_half"].append(0.0 if math.isnan(half) else half)
    drawn[name] = points
    if not points["x"]:
      continue
    ax.errorbar(
      points["x"],
      points["aggregated"],
      yerr=points["aggregated_half"],
      color=f"C{k % 10}",
      marker="o",
      capsize=3,
      label=f"{name}, aggregated",
    )
    if not all(math.isnan(c) for c in points["client"]):
      ax.errorbar(
        points["x"],
        points["client"],
        yerr=points["client_half"],
        color=f"C{k % 10}",
        marker="s",
        linestyle="--",
        capsize=3,
        label=f"{name}, mean client",
      )
  xs = sorted({v.x for v in experiment.variants if v.name in groups})
  if xs and all(isinstance(x, (int, np.integer)) for x in xs):
    ax.set_xticks(xs)
  ax.set_xlabel(experiment.x_label or "x")
  ax.set_ylabel(f"test accuracy at round {experiment.round or 'last'} (%)")
  ax.set_title(textwrap.fill(experiment.title, 80), fontsize=9)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  compare.save_figure(fig, stem)
  return drawn


def _plot_selection(groups: dict[str, compare.Group], stem: str) -> None:
  fig, ax = compare._figure()  # pylint: disable=protected-access
  for k, group in enumerate(groups.values()):
    for run in group.runs:
      selection = (run["summary"] or {}).get("selection")
      if not selection:
        continue
      for order, style in (("best_to_worst", "-"), ("random", ":"), ("worst_to_best", "--")):
        curve = selection[order]
        ax.plot(
          range(1, len(curve) + 1),
          [100 * c for c in curve],
          style,
          color=f"C{k % 10}",
          label=f"{group.label}, seed {run['config']['seed']}, {order.replace('_', ' ')}",
        )
  ax.set_xlabel("clients averaged")
  ax.set_ylabel("test accuracy of the average (%)")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  compare.save_figure(fig, stem)


def render(
  experiment: Experiment,
  dirs: Sequence[str],
  render_dir: str,
  *,
  seeds: Sequence[int] | None = None,
  out: str = "",
  command: str = "",
) -> dict:
  """Writes ``render_dir/<slug>.md`` and the figures; returns ``{"markdown", "files", "missing",
  "groups"}``."""
  slug = experiment.name.replace(":", "_")
  groups, missing = collect(experiment, dirs, seeds, out)
  os.makedirs(render_dir, exist_ok=True)
  files = []
  lines = [f"# {experiment.name}: {experiment.title}", ""]
  if experiment.claim:
    lines += [f"Paper: {experiment.claim}", ""]
  if experiment.needs:
    lines += [f"**Needs {experiment.needs}** before it can run.", ""]
  if experiment.notes:
    lines += [f"Notes: {experiment.notes}", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  if groups:
    lines += _table(experiment, groups)
    ordered = [groups[v.name] for v in experiment.variants if v.name in groups]
    stem = os.path.join(render_dir, slug)
    if experiment.kind == "sweep":
      drawn = _plot_sweep(experiment, groups, stem)
      files += [stem + ".png", stem + ".pdf"]
      left_off = [f"{d} (round {at})" for p in drawn.values() for d, at in p["left_off"]]
      if left_off:
        lines += [
          "",
          "Not on the sweep figure, short of "
          + (f"round {experiment.round}" if experiment.round else "their last round")
          + " (still running, or stopped early): "
          + ", ".join(left_off)
          + ".",
        ]
    if experiment.kind == "selection":
      _plot_selection(groups, stem)
      files += [stem + ".png", stem + ".pdf"]
    if experiment.kind == "communication":
      runs = [run for g in ordered for run in g.runs]
      table = compare.communication_table(runs, experiment.target)
      if table:
        lines += ["", table]
      compare.plot_communication(runs, stem + "_communication", experiment.target)
      files += [stem + "_communication.png", stem + "_communication.pdf"]
    compare.plot_curves(ordered, stem + "_curves", experiment.target, experiment.title)
    files += [stem + "_curves.png", stem + "_curves.pdf"]
  else:
    lines.append("No runs found.")
  if missing:
    lines += ["", "Missing runs:", *[f"- {m}" for m in missing]]
  running = unfinished(groups)
  if running:
    lines += ["", "Unfinished runs (read at their latest round):", *[f"- {r}" for r in running]]
  markdown = "\n".join(lines) + "\n"
  path = os.path.join(render_dir, slug + ".md")
  with open(path, "w") as f:
    f.write(markdown)
  return {"markdown": markdown, "files": [path, *files], "missing": missing, "groups": groups}


def dirs_of(out: str) -> list[str]:
  """The run folders directly under ``out``."""
  return runs_in(out)
