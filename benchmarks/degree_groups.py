"""Time an NTK-DFL (or SPARK) round on an Erdős–Rényi graph: neighbourhoods grouped by degree against padded.

  .venv/bin/python benchmarks/degree_groups.py                     # 30 clients, mean degree 5, chunk 1
  .venv/bin/python benchmarks/degree_groups.py --clients 300 --grouped-only
  .venv/bin/python benchmarks/degree_groups.py --method spark --samples-per-client 50

An Erdős–Rényi graph's degree bound ``k_max`` (derived so that a draw exceeds it with probability 1e-6:
18 at 30 clients of mean degree 5, 22 at 300) lies far above its clients' degrees (mean 5, at most 10-14
in a draw). Padded, every client's neighbourhood holds ``1 + k_max`` slots of 200 samples and its NTK
work grows with their square; grouped (``ntk_fl.topology.degree_slot_groups``, the default of an
uncompressed NTK-DFL round mapped in chunks), each client takes the fewest slots of its group. Both
programs run the same round 0 (real Fashion-MNIST, 200 samples per client as in the paper's partition
unless ``--samples-per-client`` says otherwise, the paper's MLP and τ grid; ``--method spark``: SPARK's
paper config, sketch, momentum and distillation included) at ``config.chunk_size`` clients a chunk; the
padded one by making every
topology's groups ``(k_max,)``. Prints each program's compile time (its first call less its best) and its
best of ``--repeats`` timed calls after the first, the groups and the drawn degrees, and the largest
weight difference between the two rounds.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ntk_fl import runner  # noqa: E402
from ntk_fl import topology  # noqa: E402
from ntk_fl.config import load_config  # noqa: E402


def _round(args, grouped: bool):
  """``(compile_s, step_times, client params after round 0, round-0 inputs, experiment)``; ``compile_s`` is
  the first call's time less the best timed one."""
  config = load_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", f"{args.method}.py")
  )
  config.data.num_clients = args.clients
  # The paper's client size (200) by default, whatever the number of clients.
  config.data.samples_per_client = args.samples_per_client
  config.topology.name = "erdos_renyi"
  config.topology.mean_degree = args.mean_degree
  config.chunk_size = args.chunk
  groups = topology.degree_slot_groups
  if not grouped:  # every neighbourhood padded to k_max, as before grouping
    topology.degree_slot_groups = lambda graphs: (graphs.k_max,)
  try:
    experiment = runner.build_experiment(config)
  finally:
    topology.degree_slot_groups = groups
  algorithm = experiment.algorithm
  state = algorithm.init(jax.random.key(config.seed))
  inputs = algorithm.round_inputs(0)
  with experiment.device_policy():  # read when the step is traced
    started = time.perf_counter()
    out = jax.block_until_ready(algorithm.step(state, inputs))
    first_s = time.perf_counter() - started
    times = []
    for _ in range(args.repeats):
      started = time.perf_counter()
      jax.block_until_ready(algorithm.step(state, inputs))
      times.append(time.perf_counter() - started)
  compile_s = first_s - min(times) if times else float("nan")
  return compile_s, times, algorithm.client_params(out[0]), inputs, experiment


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--method", choices=("ntk_dfl", "spark"), default="ntk_dfl")
  parser.add_argument("--clients", type=int, default=30)
  parser.add_argument("--samples-per-client", type=int, default=200)
  parser.add_argument("--mean-degree", type=float, default=5.0)
  parser.add_argument("--chunk", type=int, default=1, help="clients per vmap chunk (>= 1 to group)")
  parser.add_argument("--repeats", type=int, default=1, help="timed calls after the compiling one")
  parser.add_argument(
    "--grouped-only", action="store_true", help="skip the padded round (its cost grows fastest)"
  )
  args = parser.parse_args()

  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
  ).stdout.strip()
  results = {"grouped by degree": _round(args, grouped=True)}
  graphs, inputs = (
    results["grouped by degree"][4].settings.built_topology,
    results["grouped by degree"][3],
  )
  degrees = np.asarray(inputs.neighbor_mask).sum(axis=1)
  groups = topology.degree_slot_groups(graphs)
  per_group = np.bincount(np.searchsorted(groups, degrees), minlength=len(groups)).tolist()
  print(
    f"{args.method}: {args.clients} clients of {args.samples_per_client} samples, "
    f"Erdős–Rényi mean degree {args.mean_degree}, k_max {graphs.k_max}, "
    f"chunk {args.chunk}; groups {groups}; round-0 degrees: mean {degrees.mean():.2f}, "
    f"max {degrees.max()}, clients per group {per_group}"
  )
  print(
    f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; commit {commit}; "
    f"jax {jax.__version__}"
  )
  print("| round 0 | compile (s) | step, best (s) |\n|---|---:|---:|")
  compile_s, times, grouped_params, _, _ = results["grouped by degree"]
  print(f"| grouped by degree | {compile_s:.1f} | {min(times):.1f} |", flush=True)
  if args.grouped_only:
    return
  compile_s, padded_times, padded_params, _, _ = _round(args, grouped=False)
  print(f"| padded to k_max | {compile_s:.1f} | {min(padded_times):.1f} |")
  diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(grouped_params), jax.tree.leaves(padded_params))
  )
  print(f"speed-up {min(padded_times) / min(times):.2f}x; largest weight difference {diff:.2e}")


if __name__ == "__main__":
  main()
