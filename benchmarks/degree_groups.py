"""Time an NTK-DFL round on an Erdős–Rényi graph: neighbourhoods grouped by degree against padded to k_max.

  .venv/bin/python benchmarks/degree_groups.py                     # 100 clients, mean degree 5, chunk 1
  .venv/bin/python benchmarks/degree_groups.py --clients 300 --repeats 1

An Erdős–Rényi graph's degree bound ``k_max`` (derived so that a draw exceeds it with probability 1e-6:
21 at 100 clients of mean degree 5, 22 at 300) lies far above its clients' degrees (mean 5, at most 10-14
in a draw). Padded, every client's neighbourhood holds ``1 + k_max`` slots of 200 samples and its NTK
work grows with their square; grouped (``ntk_fl.topology.degree_slot_groups``, the
default of an uncompressed NTK-DFL round mapped in chunks), each client takes the fewest slots of its
group. Both programs run the same round 0 (real Fashion-MNIST, the paper's MLP and τ grid) at
``config.chunk_size`` clients a chunk; the padded one by making every topology's groups ``(k_max,)``.
Prints the best of ``--repeats`` steady-state step times (after a compiling call), the compile-and-run
time of the first call, the groups and the drawn degrees, and the largest weight difference between the
two rounds.
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

from _timing import time_calls  # noqa: E402

from ntk_fl import runner  # noqa: E402
from ntk_fl import topology  # noqa: E402
from ntk_fl.config import load_config  # noqa: E402


def _round(args, grouped: bool):
  config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "ntk_dfl.py"))
  config.data.num_clients = args.clients
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
  with experiment.device_policy():
    started = time.perf_counter()
    first = jax.block_until_ready(algorithm.step(state, inputs))
    first_s = time.perf_counter() - started
    best = time_calls(algorithm.step, state, inputs, repeats=args.repeats).best
  return best, first_s, algorithm.client_params(first[0]), inputs, experiment


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--clients", type=int, default=100)
  parser.add_argument("--mean-degree", type=float, default=5.0)
  parser.add_argument("--chunk", type=int, default=1, help="clients per vmap chunk (>= 1 to group)")
  parser.add_argument("--repeats", type=int, default=1)
  args = parser.parse_args()

  grouped_s, grouped_first, grouped_params, inputs, experiment = _round(args, grouped=True)
  padded_s, padded_first, padded_params, _, _ = _round(args, grouped=False)
  graphs = experiment.settings.built_topology
  degrees = np.asarray(inputs.neighbor_mask).sum(axis=1)
  groups = topology.degree_slot_groups(graphs)
  diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in zip(jax.tree.leaves(grouped_params), jax.tree.leaves(padded_params))
  )
  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
  ).stdout.strip()
  print(
    f"{args.clients} clients, Erdős–Rényi mean degree {args.mean_degree}, k_max {graphs.k_max}, "
    f"chunk {args.chunk}; groups {groups}"
  )
  print(
    f"round-0 degrees: mean {degrees.mean():.2f}, max {degrees.max()}, "
    f"clients per group {np.bincount(np.searchsorted(groups, degrees), minlength=len(groups)).tolist()}"
  )
  print(
    f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; commit {commit}; "
    f"jax {jax.__version__}"
  )
  print("| round | step (s) | first call, with compilation (s) |")
  print("|---|---:|---:|")
  print(f"| padded to k_max | {padded_s:.1f} | {padded_first:.1f} |")
  print(f"| grouped by degree | {grouped_s:.1f} | {grouped_first:.1f} |")
  print(f"speed-up {padded_s / grouped_s:.2f}x; largest weight difference {diff:.2e}")


if __name__ == "__main__":
  main()
