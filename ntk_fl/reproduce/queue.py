"""An experiment's runs as a resumable queue.

Each (variant, seed) is one ``ntk-fl`` run in its own process. Before a run is
started the output folder is searched for a run with the same config and seed
(:func:`index_runs`; runs are found by config, not by name, so a run shared by
two experiments is made once):

* a finished run (its ``summary.json`` exists) is skipped;
* an interrupted run with a checkpoint is resumed (``--resume``), identically;
* a folder at the run's name with no checkpoint to resume (killed before its first
  checkpoint, or holding another config) is moved aside to
  ``<name>.unfinished-<time>`` (never deleted) and the run starts over;
* a variant with ``branch_from`` starts from that variant's checkpoint when it has one.

Every run's console goes to ``OUT/<name>_s<seed>.log`` and its full log to
``OUT/<name>_s<seed>/log.txt``. A failed run is reported and the queue goes on.
A run whose rounds are long (:data:`LONG_ROUND_SECONDS` by :func:`ntk_fl.reproduce.costs.estimate`)
checkpoints every round (``--config.checkpoint_every=1``, before ``--extra``), so a machine that goes
costs it at most one round.

With ``replicas = S > 1`` (``ntk-fl reproduce --replicas S``), up to ``S`` consecutive seeds of a
variant that all start afresh run as one seed-batched run (``--config.replicas``) in
``OUT/<name>_s<first>-<last>/``, whose replicas' folders ``seed<k>/`` are found like any run: a
replica interrupted after a checkpoint is resumed on its own (it is a single-seed run's folder).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from ntk_fl import rundir
from ntk_fl.reproduce import costs
from ntk_fl.reproduce.registry import (
  Experiment,
  Variant,
  build_config,
  config_flags,
  override_flags,
)

__all__ = [
  "Job",
  "group_seeds",
  "config_key",
  "index_runs",
  "plan",
  "run_queue",
  "run_name",
  "select_variants",
  "stored_form",
]


def stored_form(config) -> dict:
  """A config as a run stores it in ``config.json`` (JSON types: tuples become lists)."""
  return json.loads(json.dumps(rundir.jsonable(config)))


def config_key(stored: dict) -> tuple:
  """What two runs must share to be the same setting (:data:`ntk_fl.rundir.NEUTRAL_KEYS` and the
  seed left out)."""
  return rundir.setting_key(stored)


def run_name(variant: Variant, seed: int) -> str:
  return f"{variant.name}_s{seed}"


@dataclasses.dataclass
class Job:
  """One run of the queue: ``action`` is ``"skip"``, ``"resume"`` or ``"start"`` (after ``aside``,
  if set)."""

  variant: Variant
  seed: int
  workdir: str
  action: str
  aside: str = ""  # a folder in the way, moved aside before starting
  branch_from: str = ""
  command: list = dataclasses.field(default_factory=list)
  replicas: int = 1  # seeds seed .. seed + replicas - 1 in one seed-batched run
  # costs.estimate of the run, (cpu_s, gpu_s, gpu_measured); None for a method without a cost row
  estimate: tuple | None = None

  @property
  def seeds(self) -> list[int]:
    return list(range(self.seed, self.seed + self.replicas))


def select_variants(experiment: Experiment, patterns: Sequence[str] | None) -> list[Variant]:
  """The variants whose names match one of the shell ``patterns`` (all of them without patterns).

  Raises:
    ValueError: a pattern matches no variant (the message lists the names).
  """
  if not patterns:
    return list(experiment.variants)
  names = [v.name for v in experiment.variants]
  for pattern in patterns:
    if not fnmatch.filter(names, pattern):
      raise ValueError(
        f"--variants pattern {pattern!r} matches no variant of {experiment.name}; its variants: "
        f"{', '.join(names)}"
      )
  return [v for v in experiment.variants if any(fnmatch.fnmatchcase(v.name, p) for p in patterns)]


def _has_checkpoint(workdir: str) -> bool:
  """Whether ``workdir`` holds a finalised checkpoint to resume or branch from (an unfinished save is
  not one: the resume would find nothing and start again from round 0)."""
  return bool(rundir.finalised_steps(workdir))


def index_runs(dirs: Sequence[str]) -> dict[tuple, list[str]]:
  """``{(config key, seed): [workdir, ...]}`` of the started runs among ``dirs`` (folders without a
  readable ``config.json`` are left out)."""
  index: dict[tuple, list[str]] = {}
  for workdir in dirs:
    if not os.path.isfile(os.path.join(workdir, rundir.CONFIG_FILE)):
      continue
    try:
      stored = rundir.read_config(workdir)
    except ValueError:
      continue
    index.setdefault((config_key(stored), int(stored.get("seed", 0))), []).append(workdir)
  return index


ASIDE_MARK = ".unfinished-"
"""Runs moved aside (killed before their first checkpoint) are named ``<run>.unfinished-<time>``."""


def runs_in(out: str) -> list[str]:
  """The folders directly under ``out`` (candidates for runs), sorted, a seed-batched run's folder
  replaced by its replicas' runs; moved-aside runs and half-written archives (``.partial``) are left
  out."""
  if not os.path.isdir(out):
    return []
  folders = sorted(
    os.path.join(out, d)
    for d in os.listdir(out)
    if os.path.isdir(os.path.join(out, d)) and ASIDE_MARK not in d and not d.endswith(".partial")
  )
  return [run for folder in folders for run in (rundir.replica_runs(folder) or [folder])]


def expected_key(variant: Variant, seed: int) -> tuple:
  return config_key(stored_form(build_config(variant, seed)))


def _estimate(stored: dict) -> tuple | None:
  """:func:`ntk_fl.reproduce.costs.estimate` of a stored config; ``None`` for a method without a cost
  row (your own)."""
  return costs.estimate(stored) if stored["method"] in costs.ROUND_SECONDS else None


LONG_ROUND_SECONDS = 30.0
"""Estimated seconds per round (the 2-core CPU's, :func:`ntk_fl.reproduce.costs.estimate`) from which a
queued run checkpoints every round: NTK-DFL and SPARK in the papers' setting (≈ 4 minutes a round on one
core shared with another run, up to 20 for the compressed stacks), whose configs' cadence of 5 rounds
could lose an hour or more to a machine that goes, while a checkpoint costs about a second at the
papers' scale; the gradient baselines' short rounds keep their configs' cadence."""


def _cadence_flags(stored: dict, estimate: tuple | None) -> list[str]:
  """``--config.checkpoint_every=1`` for a run whose rounds are long (:data:`LONG_ROUND_SECONDS`); a
  method without a cost row (your own) keeps its config's cadence."""
  if estimate is None or stored["checkpoint_every"] == 1:
    return []
  return (
    ["--config.checkpoint_every=1"] if estimate[0] / stored["rounds"] >= LONG_ROUND_SECONDS else []
  )


def _pick(candidates: list[str], canonical: str) -> str | None:
  """The run to use among same-config runs: the one at the canonical name, else a finished one, else
  the first."""
  if canonical in candidates:
    return canonical
  finished = [c for c in candidates if rundir.read_summary(c) is not None]
  return (finished or candidates or [None])[0]


def plan(
  experiment: Experiment,
  out: str,
  *,
  seeds: Sequence[int] | None = None,
  patterns: Sequence[str] | None = None,
  python: str = "",
  extra: Sequence[str] = (),
  skip_gpu: bool = False,
  replicas: int = 1,
) -> list[Job]:
  """What the queue would do now, in order (nothing is changed on disk); ``skip_gpu`` leaves out the
  variants registered for a GPU; ``replicas > 1`` groups fresh consecutive seeds (:func:`group_seeds`)."""
  index = index_runs(runs_in(out))
  prefix = shlex.split(python) if python else [sys.executable]
  jobs = []
  chosen = [v for v in select_variants(experiment, patterns) if not (skip_gpu and v.gpu)]
  # Branches after the runs they start from (their checkpoint must exist by then).
  for variant in [v for v in chosen if not v.branch_from] + [v for v in chosen if v.branch_from]:
    for seed in experiment.seeds_of(variant, tuple(seeds) if seeds is not None else None):
      canonical = os.path.join(out, run_name(variant, seed))
      stored = stored_form(build_config(variant, seed))
      found = _pick(index.get((config_key(stored), seed), []), canonical)
      if (
        found
        and found != canonical
        and rundir.read_summary(found) is None
        and not _has_checkpoint(found)
      ):
        found = (
          None  # a same-config folder elsewhere with nothing to resume: start at the run's own name
        )
      job = Job(variant, seed, found or canonical, "start", estimate=_estimate(stored))
      if found and rundir.read_summary(found) is not None:
        job.action = "skip"
      elif found and _has_checkpoint(found):
        job.action = "resume"
      elif os.path.exists(job.workdir):
        job.aside = job.workdir
      if job.action == "start" and variant.branch_from:
        source = experiment.variant(variant.branch_from)
        src = _pick(
          index.get((expected_key(source, seed), seed), []),
          os.path.join(out, run_name(source, seed)),
        )
        if src and _has_checkpoint(src):
          job.branch_from = src
      job.command = [
        *prefix,
        "-m",
        "ntk_fl",
        f"--config={variant.config}",
        f"--config.seed={seed}",
        *override_flags(variant),
        *_cadence_flags(stored, job.estimate),
        f"--workdir={job.workdir}",
        *(["--resume"] if job.action == "resume" else []),
        *([f"--branch_from={job.branch_from}"] if job.branch_from else []),
        *extra,
        *(_resume_flags(job.workdir) if job.action == "resume" else []),
      ]
      jobs.append(job)
  return group_seeds(jobs, out, replicas) if replicas > 1 else jobs


def _resume_flags(workdir: str) -> list[str]:
  """``--config.KEY=VALUE`` for the stored values of the keys a resume must keep but the queue matches
  runs without (:data:`ntk_fl.rundir.NEUTRAL_KEYS` less the seed and what a resume may change,
  :data:`ntk_fl.rundir.RESULT_NEUTRAL_KEYS`): the chunk size (float rounding) of a run found among
  ``--out``'s, which may have been started by hand or by another queue with another value. They come
  last, so a resumed run continues as it was started whatever ``--extra`` says; the checkpoint cadence
  is not among them (``--extra=--config.checkpoint_every=1`` changes it for the rest of a run)."""
  stored = rundir.flatten(rundir.read_config(workdir))
  keep = [k for k in rundir.NEUTRAL_KEYS if k != "seed" and k not in rundir.RESULT_NEUTRAL_KEYS]
  # An absent key or an empty string (no data_dir) is the default: no flag.
  return config_flags((k, stored[k]) for k in keep if stored.get(k) not in (None, ""))


def _fresh(job: Job) -> bool:
  return job.action == "start" and not job.aside and not job.branch_from


def _replicable(variant: Variant) -> bool:
  """Whether ``variant``'s method runs seed-batched (``Method.replicas``; others run seed by seed)."""
  from ntk_fl.algorithms.base import get_method  # pylint: disable=import-outside-toplevel

  try:
    return get_method(build_config(variant, 0).method).replicas
  except ValueError:  # a method of a user's module not imported here: one seed at a time
    return False


def group_seeds(jobs: list[Job], out: str, replicas: int) -> list[Job]:
  """``jobs`` with runs of up to ``replicas`` consecutive fresh seeds of one variant made one job.

  Only variants whose method runs seed-batched are grouped (:func:`_replicable`). A fresh job starts
  from nothing (no folder in the way, no branch source); its group runs the first seed's command with
  ``--config.replicas=<n>`` in ``OUT/<name>_s<first>-<last>`` (moved aside first when a folder of that
  name is left from an interrupted group with nothing to resume).
  """
  grouped: list[Job] = []
  replicable = {v.name: _replicable(v) for v in {j.variant.name: j.variant for j in jobs}.values()}
  for job in jobs:
    last = grouped[-1] if grouped else None
    if (
      last is not None
      and replicable[job.variant.name]
      and _fresh(job)
      and _fresh(last)
      and last.variant.name == job.variant.name
      and job.seed == last.seed + last.replicas
      and last.replicas < replicas
    ):
      last.replicas += 1
      continue
    grouped.append(dataclasses.replace(job))
  for job in grouped:
    if job.replicas > 1:
      old = job.workdir
      job.workdir = os.path.join(out, f"{job.variant.name}_s{job.seed}-{job.seeds[-1]}")
      job.aside = job.workdir if os.path.exists(job.workdir) else ""
      job.command = [
        c.replace(old, job.workdir) if c == f"--workdir={old}" else c for c in job.command
      ] + [f"--config.replicas={job.replicas}"]
  return grouped


def _launch(command: list[str], log_path: str) -> int:
  with open(log_path, "a") as log:
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode


def run_queue(
  experiment: Experiment,
  out: str,
  *,
  seeds: Sequence[int] | None = None,
  patterns: Sequence[str] | None = None,
  python: str = "",
  extra: Sequence[str] = (),
  skip_gpu: bool = False,
  replicas: int = 1,
  launch: Callable[[list[str], str], int] = _launch,
  echo: Callable[[str], None] = print,
) -> list[Job]:
  """Runs the experiment's queue in ``out``; returns the jobs with ``action`` ``"failed"`` where a
  run failed.

  The plan is remade before each run, so runs finished by another queue meanwhile
  (or a source run of a branch) are seen.
  """
  os.makedirs(out, exist_ok=True)
  done: list[Job] = []
  chosen = dict(
    seeds=seeds, patterns=patterns, python=python, extra=extra, skip_gpu=skip_gpu, replicas=replicas
  )
  handled: set[tuple[str, int]] = set()  # (variant, seed) of the runs done or tried
  while True:
    # The next job none of whose seeds was handled yet (a grouped job's seeds are finished runs after it).
    job = next(
      (
        j
        for j in plan(experiment, out, **chosen)
        if not any((j.variant.name, s) in handled for s in j.seeds)
      ),
      None,
    )
    if job is None:
      break
    handled.update((job.variant.name, s) for s in job.seeds)
    if job.action == "skip":
      done.append(job)
      continue
    if job.aside:
      aside = f"{job.aside}{ASIDE_MARK}{int(time.time())}"
      echo(f"{job.aside} has no checkpoint to resume (or holds another config); moved to {aside}")
      os.rename(job.aside, aside)
    echo(
      f"{time.strftime('%F %T')} {job.action} {job.workdir}"
      + (f" (branched from {job.branch_from})" if job.branch_from else "")
    )
    rc = launch(job.command, os.path.normpath(job.workdir) + ".log")
    if rc != 0:
      echo(f"run {job.workdir} failed (exit {rc}; see {os.path.normpath(job.workdir)}.log)")
      job.action = "failed"
    done.append(job)
  return done
