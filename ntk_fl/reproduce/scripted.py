"""Experiments made by one script of the source tree (an attack, a toy regression), not by runs.

A table or figure such as NTK-FL Fig. 8 (a reconstruction attack) has no training runs: one script
of ``experiments/`` makes it. Its :class:`~ntk_fl.reproduce.registry.Experiment` carries a
:class:`~ntk_fl.reproduce.registry.Script`, and ``ntk-fl reproduce NAME`` then:

* runs the script once, from the repository root, into ``OUT/<slug>.partial`` (``<slug>``: the name
  with ``:`` as ``_``), its console in ``OUT/<slug>.log``; when it exits 0 with every file of
  ``Script.outputs`` written, the folder becomes ``OUT/<slug>`` with ``script.json`` (the command, the
  commit, the machine, the wall time) beside the outputs -- so a killed script leaves no folder that
  reads as finished, and the next call starts it again;
* skips it when ``OUT/<slug>`` holds every output (finished);
* renders ``RENDER_DIR/<slug>.md`` (the title, the paper's claim, the provenance, the script's own
  markdown table) and copies its figures beside it as ``<slug>_<file>``.

The scripts live in the source tree, not in the installed package: an installation without the
tree beside it says so and stops.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

from ntk_fl.reproduce.queue import ASIDE_MARK
from ntk_fl.reproduce.registry import Experiment

__all__ = [
  "PROVENANCE_FILE",
  "command",
  "machine",
  "output_dir",
  "render",
  "run",
  "script_path",
  "source_root",
  "state",
  "status_table",
  "summary_row",
  "write_result",
]

PROVENANCE_FILE = "script.json"
FINISHED, NOT_STARTED, INCOMPLETE = "finished", "not started", "incomplete"


def source_root() -> str:
  """The repository root the package sits in (``<root>/ntk_fl/``)."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def script_path(experiment: Experiment, root: str | None = None) -> str:
  """The absolute path of ``experiment``'s script.

  Raises:
    ValueError: the script is not in the source tree at ``root`` (an installed wheel has none).
  """
  root = root or source_root()
  path = os.path.join(root, experiment.script.path)
  if not os.path.isfile(path):
    raise ValueError(
      f"{experiment.name} is made by the script {experiment.script.path} of the source tree, which is "
      f"not at {path}: run it from a clone of the repository"
    )
  return path


def output_dir(experiment: Experiment, out: str) -> str:
  """``OUT/<slug>``: where the script's outputs are kept once it has finished."""
  return os.path.join(out, experiment.name.replace(":", "_"))


def state(experiment: Experiment, out: str) -> str:
  """``"finished"`` (every output and the provenance in :func:`output_dir`), ``"incomplete"`` (the
  folder exists without them: edited by hand or written by an older script) or ``"not started"``."""
  folder = output_dir(experiment, out)
  if not os.path.isdir(folder):
    return NOT_STARTED
  wanted = (*experiment.script.outputs, PROVENANCE_FILE)
  return FINISHED if all(os.path.isfile(os.path.join(folder, f)) for f in wanted) else INCOMPLETE


def command(
  experiment: Experiment, folder: str, python: str = "", extra: tuple[str, ...] = ()
) -> list[str]:
  """The script's command line writing into ``folder`` (``python``: the interpreter, possibly behind
  a prefix such as ``taskset -c 1``; ``extra``: flags appended)."""
  interpreter = shlex.split(python) if python else [sys.executable]
  args = [a.replace("{out}", os.path.abspath(folder)) for a in experiment.script.args]
  return [*interpreter, script_path(experiment), *args, *extra]


def _commit(root: str) -> str:
  """The source tree's commit (``-dirty`` with uncommitted changes), or ``""`` outside a git clone."""
  try:
    head = subprocess.run(
      ["git", "-C", root, "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ""
  return head + ("-dirty" if dirty else "")


def machine() -> str:
  """The CPU's model name (Linux) or architecture, and its core count: ``"AMD EPYC, 2 CPU cores"``."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    model = names[0] if names else model
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} CPU cores"


def run(
  experiment: Experiment,
  out: str,
  *,
  python: str = "",
  extra: tuple[str, ...] = (),
  dry_run: bool = False,
) -> str:
  """Runs the script unless it has finished in ``out``; returns ``"skip"``, ``"done"``, ``"failed"``
  or, with ``dry_run``, ``"start"`` (printing the command).

  Raises:
    ValueError: the script is not in the source tree.
  """
  folder = output_dir(experiment, out)
  partial = folder + ".partial"
  cmd = command(experiment, partial, python, extra)
  if state(experiment, out) == FINISHED:
    print(f"skip: {folder} is finished")
    return "skip"
  if dry_run:
    aside = f" (move aside {folder})" if os.path.isdir(folder) else ""
    print(f"start{aside}: {' '.join(shlex.quote(c) for c in cmd)}")
    return "start"
  if os.path.isdir(partial):  # a killed attempt: its files are incomplete
    shutil.rmtree(partial)
  os.makedirs(partial)
  log_path = folder + ".log"
  started = time.time()
  print(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S} start {folder}", flush=True)
  with open(log_path, "a") as log:
    returncode = subprocess.call(cmd, cwd=source_root(), stdout=log, stderr=subprocess.STDOUT)
  seconds = time.time() - started
  missing = [f for f in experiment.script.outputs if not os.path.isfile(os.path.join(partial, f))]
  if returncode != 0 or missing:
    why = f"exit status {returncode}" if returncode else f"it wrote no {', '.join(missing)}"
    print(f"{experiment.name}: the script failed ({why}); its console: {log_path}", file=sys.stderr)
    return "failed"
  provenance = {  # the command as it reads for the kept folder (it wrote into the .partial one)
    "command": " ".join(shlex.quote(c) for c in command(experiment, folder, python, extra)),
    "commit": _commit(source_root()),
    "machine": machine(),
    "seconds": round(seconds, 1),
    "finished": datetime.datetime.now().isoformat(timespec="seconds"),
  }
  with open(os.path.join(partial, PROVENANCE_FILE), "w") as f:
    json.dump(provenance, f, indent=1)
  if os.path.isdir(folder):  # an incomplete folder of an older attempt: kept, moved aside
    os.rename(folder, f"{folder}{ASIDE_MARK}{int(time.time())}")  # as the run queue names them
  os.rename(partial, folder)
  print(f"{experiment.name}: finished in {seconds:.0f} s: {folder}", flush=True)
  return "done"


def write_result(out_dir: str, stem: str, result: dict, table: str, json_default=None) -> None:
  """What a script writes for :func:`render`: ``<stem>.json`` (``result``, everything) and
  ``<stem>.md`` (``table``, the markdown the rendered page shows) in ``out_dir``."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, stem + ".json"), "w") as f:
    json.dump(result, f, indent=1, default=json_default)
  with open(os.path.join(out_dir, stem + ".md"), "w") as f:
    f.write(table)


def render(experiment: Experiment, out: str, render_dir: str) -> dict:
  """Writes ``render_dir/<slug>.md`` and copies the script's figures there as ``<slug>_<file>``;
  returns ``{"markdown", "files"}``.

  Raises:
    ValueError: the script has not finished in ``out``.
  """
  folder = output_dir(experiment, out)
  if state(experiment, out) != FINISHED:
    raise ValueError(
      f"{experiment.name}: {folder} holds no finished output of {experiment.script.path} "
      f"(run `ntk-fl reproduce {experiment.name} --out {out}`)"
    )
  with open(os.path.join(folder, PROVENANCE_FILE)) as f:
    provenance = json.load(f)
  slug = experiment.name.replace(":", "_")
  os.makedirs(render_dir, exist_ok=True)
  lines = [f"# {experiment.name}: {experiment.title}", ""]
  if experiment.claim:
    lines += [f"Paper: {experiment.claim}", ""]
  if experiment.notes:
    lines += [f"Notes: {experiment.notes}", ""]
  lines += [
    f"Made by `{provenance['command']}` (commit {provenance['commit'] or 'unknown'}, "
    f"{provenance['machine']}, {provenance['seconds']:.0f} s, {provenance['finished']}).",
    "",
  ]
  files = []
  for name in experiment.script.outputs:
    source = os.path.join(folder, name)
    if name.endswith(".md"):
      with open(source) as f:
        lines += [f.read().strip(), ""]
    elif name.endswith((".png", ".pdf")):
      target = os.path.join(render_dir, f"{slug}_{name}")
      shutil.copyfile(source, target)
      files.append(target)
      if name.endswith(".png"):
        lines += [f"![{name}]({os.path.basename(target)})", ""]
  markdown = "\n".join(lines)
  path = os.path.join(render_dir, slug + ".md")
  with open(path, "w") as f:
    f.write(markdown)
  return {"markdown": markdown, "files": [path, *files]}


def status_table(experiment: Experiment, out: str) -> str:
  """``--status`` of a script experiment: one markdown row."""
  now = state(experiment, out)
  left = (
    "—" if now == FINISHED else f"{experiment.script.cpu_minutes:.0f} min estimated (2-core CPU)"
  )
  return "\n".join(
    (
      "| output | state | left |",
      "|---|---|---|",
      f"| {output_dir(experiment, out)} | {now} | {left} |",
    )
  )


def summary_row(experiment: Experiment, out: str) -> str:
  """The experiment's row of ``--status`` without a name (:data:`ntk_fl.reproduce.progress.
  SUMMARY_HEADER`'s columns: the script counts as one run, with no GPU estimate)."""
  done = state(experiment, out) == FINISHED
  cpu = "—" if done else f"{experiment.script.cpu_minutes:.0f} min"
  return f"| {experiment.name} | {int(done)} | 0 | {int(not done)} | — | {cpu} | — |"
