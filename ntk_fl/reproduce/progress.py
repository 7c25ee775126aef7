"""Where an experiment's runs stand in an output folder, and how long the rest will take.

``ntk-fl reproduce NAME --status [--out DIR]`` lists each run of ``NAME`` (found by config, as the
queue finds them, :func:`ntk_fl.reproduce.queue.plan`): finished, partial (the round its newest
checkpoint holds, which is where a resume starts) or not started, and the time it still needs:

* a partial run: its rounds left times the median of its own recorded rounds (``step_time +
  eval_time`` of ``metrics.jsonl``; the median leaves out the first round's compilation), so on the
  machine and under the load it ran on;
* a run not started: the estimate of :func:`ntk_fl.reproduce.costs.estimate` (the 2-core CPU, or one
  H100 for a variant registered for a GPU).

Both are upper bounds for a run that stops at a target accuracy (``eval.stop_at``).
``ntk-fl reproduce --status`` without a name gives one line per experiment with runs in ``DIR``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from ntk_fl import rundir
from ntk_fl.reproduce.queue import plan
from ntk_fl.reproduce.registry import Experiment, build_config

__all__ = ["RunProgress", "experiment_progress", "run_table", "summary_row"]

FINISHED, DIVERGED, PARTIAL, NOT_STARTED = "finished", "diverged", "partial", "not started"


@dataclasses.dataclass(frozen=True)
class RunProgress:
  """One run of an experiment in an output folder.

  Attributes:
    name: the run's folder name (``<variant>_s<seed>`` where the queue made it).
    state: ``"finished"``, ``"diverged"`` (finished early, its ``summary.json`` says so), ``"partial"``
      or ``"not started"``.
    workdir: the run's folder (found by config; the canonical name where there is none yet).
    rounds: the rounds the run is configured for.
    held: rounds done: all of a finished run's, a partial run's newest checkpoint (where a resume
      starts), 0 otherwise.
    accuracy: the aggregated test accuracy of the last recorded round, or ``None``.
    round_seconds: the median seconds of the run's recorded rounds, or ``None`` before any.
    left_seconds: the time the run still needs (0 when finished; ``None`` for a run not started of a
      method without a cost row in :data:`ntk_fl.reproduce.costs.ROUND_SECONDS`).
    measured: whether ``left_seconds`` comes from the run's own rounds (else from the estimate).
    gpu: whether the variant is registered for a GPU (its estimate is then one H100's).
  """

  name: str
  state: str
  workdir: str
  rounds: int
  held: int
  accuracy: float | None
  round_seconds: float | None
  left_seconds: float | None
  measured: bool
  gpu: bool


def _progress(job, rounds: int) -> RunProgress:
  # A found run's folder, or the queue's own name (run_name) where it would start.
  name = os.path.basename(job.workdir)
  estimate = job.estimate
  lines = rundir.read_metrics(job.workdir) if job.action in ("skip", "resume") else []
  seconds = [
    line["step_time"] + line.get("eval_time", 0.0) for line in lines if "step_time" in line
  ]
  median = float(np.median(seconds)) if seconds else None
  accuracy = lines[-1].get("test_acc") if lines else None
  if job.action == "skip":
    summary = rundir.read_summary(job.workdir) or {}
    state = DIVERGED if summary.get("status") == DIVERGED else FINISHED
    held, left, measured = len(lines), 0.0, True
  elif job.action == "resume":
    held = max(rundir.finalised_steps(job.workdir), default=0)
    state, measured = PARTIAL, median is not None
    estimated = None if estimate is None else estimate[1 if job.variant.gpu else 0] / rounds
    per_round = median if measured else estimated
    left = None if per_round is None else (rounds - held) * per_round
  else:
    state, held, measured = NOT_STARTED, 0, False
    left = None if estimate is None else estimate[1 if job.variant.gpu else 0]
  return RunProgress(
    name=name,
    state=state,
    workdir=job.workdir,
    rounds=rounds,
    held=held,
    accuracy=accuracy,
    round_seconds=median,
    left_seconds=None if left is None else float(left),
    measured=measured,
    gpu=job.variant.gpu,
  )


def experiment_progress(
  experiment: Experiment, out: str, seeds: Sequence[int] | None = None
) -> list[RunProgress]:
  """Every run of ``experiment`` (each variant and seed, distinct runs once) as found in ``out``."""
  return [
    _progress(job, int(build_config(job.variant, job.seed).rounds))
    for job in plan(experiment, out, seeds=seeds)
  ]


def _duration(seconds: float) -> str:
  if seconds <= 0:
    return "—"
  hours = seconds / 3600
  return f"{seconds / 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


def run_table(progress: Sequence[RunProgress]) -> str:
  """A markdown table of ``progress``, one row per run."""
  rows = [
    "| run | state | rounds | aggregated (%) | s/round (median) | left |",
    "|---|---|---:|---:|---:|---|",
  ]
  for p in progress:
    accuracy = "—" if p.accuracy is None else f"{100 * p.accuracy:.2f}"
    median = (
      "—" if p.round_seconds is None else f"{p.round_seconds:,.{1 if p.round_seconds < 10 else 0}f}"
    )
    if p.state in (FINISHED, DIVERGED):
      left = "—"
    elif p.left_seconds is None:
      left = "no estimate (a method without a cost row)"
    elif p.measured:
      left = f"{_duration(p.left_seconds)} at its own pace"
    else:
      left = f"{_duration(p.left_seconds)} estimated ({'one H100' if p.gpu else '2-core CPU'})"
    rows.append(
      f"| {p.name} | {p.state} | {p.held} / {p.rounds} | {accuracy} | {median} | {left} |"
    )
  return "\n".join(rows)


def summary_row(name: str, progress: Sequence[RunProgress]) -> str:
  """One markdown row for an experiment: its runs by state and the time they still need."""
  count = {s: sum(1 for p in progress if p.state == s) for s in (FINISHED, PARTIAL, NOT_STARTED)}
  count[FINISHED] += sum(1 for p in progress if p.state == DIVERGED)
  measured = sum(p.left_seconds for p in progress if p.state == PARTIAL and p.measured)
  cpu = sum(p.left_seconds or 0.0 for p in progress if not p.measured and not p.gpu)
  gpu = sum(p.left_seconds or 0.0 for p in progress if not p.measured and p.gpu)
  partial = ", ".join(f"{p.name} {p.held}/{p.rounds}" for p in progress if p.state == PARTIAL)
  return (
    f"| {name} | {count[FINISHED]} | {count[PARTIAL]}{f' ({partial})' if partial else ''} | "
    f"{count[NOT_STARTED]} | {_duration(measured)} | {_duration(cpu)} | {_duration(gpu)} |"
  )


SUMMARY_HEADER = (
  "| experiment | finished | partial | not started | partial runs left (their own pace) | "
  "rest, 2-core CPU estimate | rest, one H100 estimate |\n|---|---:|---|---:|---:|---:|---:|"
)
