"""SPARK's step against NTK-DFL's at the same size, and SPARK's step with its parts switched off.

  .venv/bin/python benchmarks/spark_step.py                        # 60 clients, κ = 5, chunk 1, real FMNIST
  .venv/bin/python benchmarks/spark_step.py --clients 300 --chunk 0 --repeats 3

Each row times ``algorithm.step`` (the whole round without evaluation; steady state: the fastest of
``--repeats`` calls after a compile call) of ``configs/<method>.py`` (paper setting) with the given
client count, degree, chunk size and τ grid, on the same data, graph and seed. The SPARK rows switch
off one part at a time (``--config``-style overrides), so the difference to the first SPARK row is what
that part costs:

* ``spark``                      the paper setting (momentum 0.9 Nesterov, distillation targets);
* ``spark momentum=0``           no momentum;
* ``spark distill off``          hard-label targets;
* ``spark share_cliques off``    (only on a clustered topology);

Prints a markdown table with the machine; paste it into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ntk_fl import runner  # noqa: E402
from ntk_fl.config import load_config  # noqa: E402


def _config(method: str, args, overrides: dict):
  config = load_config(method, args.variant or None)
  config.data.num_clients = args.clients
  config.topology.degree = args.degree
  config.chunk_size = args.chunk
  config.algorithm.taus = tuple(range(100, args.tau_max + 1, 100))
  if args.max_train:
    config.data.max_train = args.max_train
  config.update_from_flattened_dict(overrides)
  return config


def time_step(config, repeats: int) -> float:
  """Fastest of ``repeats`` steady-state calls of the config's ``algorithm.step`` (after one compile call)."""
  exp = runner.build_experiment(config)
  algorithm = exp.algorithm
  with exp.device_policy():
    state = algorithm.init(jax.random.key(config.seed))
    state, _ = algorithm.step(state, algorithm.round_inputs(0))
    jax.block_until_ready(state)
    times = []
    for r in range(1, repeats + 1):
      start = time.perf_counter()
      state, _ = algorithm.step(state, algorithm.round_inputs(r))
      jax.block_until_ready(state)
      times.append(time.perf_counter() - start)
  return min(times)


ROWS = (
  ("ntk_dfl", "ntk_dfl", {}),
  ("spark", "spark", {}),
  ("spark momentum=0", "spark", {"algorithm.momentum": 0.0}),
  ("spark distill off", "spark", {"algorithm.distill.enabled": False}),
)


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--clients", type=int, default=60)
  parser.add_argument("--degree", type=int, default=5)
  parser.add_argument("--chunk", type=int, default=1, help="clients per vmap chunk (0 = all)")
  parser.add_argument("--tau-max", type=int, default=800)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument(
    "--variant", default="", help="config variant tokens for both methods, e.g. 'iid'"
  )
  parser.add_argument("--max-train", type=int, default=0)
  parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
  args = parser.parse_args(argv)
  wanted = set(filter(None, args.rows.split(",")))
  print(
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} "
    f"({jax.default_backend()}); {args.clients} clients, κ = {args.degree}, chunk {args.chunk or 'all'}, "
    f"τ ≤ {args.tau_max}"
  )
  print("| step | s |\n|---|---:|")
  base = None
  for name, method, overrides in ROWS:
    if wanted and name not in wanted:
      continue
    seconds = time_step(_config(method, args, overrides), args.repeats)
    base = seconds if name == "ntk_dfl" else base
    ratio = f" ({seconds / base:.2f}x NTK-DFL)" if base and name != "ntk_dfl" else ""
    print(f"| {name} | {seconds:.2f}{ratio} |", flush=True)
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
  main()
