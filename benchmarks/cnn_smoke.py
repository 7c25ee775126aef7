"""Wall time of each NTK method's smoke run with the CNN against its smoke run with the MLP.

  .venv/bin/python benchmarks/cnn_smoke.py                       # ntk_dfl ntk_fl cp_ntk_fl spark fed_ensemble
  .venv/bin/python benchmarks/cnn_smoke.py ntk_dfl spark         # some of them

Every run is ``python -m ntk_fl --config=<method>:smoke[,cnn]`` in a fresh process and a fresh workdir
(data load, compilation, every round, evaluation and checkpoints included: what a user waits for), MLP
and CNN of a method back to back. The target: the CNN run within 3x the MLP run. Prints a markdown
table with the machine and commit; paste it into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("ntk_dfl", "ntk_fl", "cp_ntk_fl", "spark", "fed_ensemble")


def wall_time(method: str, variant: str) -> float:
  """Seconds of one CLI run of ``method:variant`` (raises with its stderr when it fails)."""
  with tempfile.TemporaryDirectory(prefix=f"cnn-smoke-{method}-") as workdir:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    done = subprocess.run(
      [sys.executable, "-m", "ntk_fl", f"--config={method}:{variant}", f"--workdir={workdir}/run"],
      capture_output=True,
      text=True,
      env=env,
      check=False,
    )
    seconds = time.perf_counter() - start
  if done.returncode:
    raise RuntimeError(f"{method}:{variant} failed: {done.stderr.strip().splitlines()[-1:]}")
  return seconds


def main(argv: list[str]) -> None:
  methods = argv or list(METHODS)
  commit = subprocess.run(
    ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
  ).stdout.strip()
  print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, commit {commit}")
  print("| method | MLP smoke (s) | CNN smoke (s) | CNN / MLP |\n|---|---:|---:|---:|")
  for method in methods:
    mlp = wall_time(method, "smoke")
    cnn = wall_time(method, "smoke,cnn")
    print(f"| {method} | {mlp:.1f} | {cnn:.1f} | {cnn / mlp:.2f} |", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
