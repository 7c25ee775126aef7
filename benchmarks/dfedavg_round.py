"""Benchmark: one 300-client DFedAvg round (20 local epochs, batch 25) on this machine.

The paper setting of ``configs/dfedavg.py``: Fashion-MNIST, 300 clients with
the authors' fixed-size Dirichlet partition (≈200 samples each, α = 0.1), MLP
784-100-10, a new random 5-regular graph every round, lr 0.1. One round =
every client's local training (20 passes over its samples in minibatches of
25: 8 steps per epoch, 160 SGD steps per client, 48,000 in all) + one gossip
step. The round is built exactly as ``experiments/main.py`` builds it
(:func:`ntk_fl.runner.build_experiment`), for each ``--chunk_sizes`` value.

  python benchmarks/dfedavg_round.py                         # chunk sizes 0 (all 300 at once), 100, 30
  python benchmarks/dfedavg_round.py --chunk_sizes=100 --rounds=5 --data=synthetic_shapes
  python benchmarks/dfedavg_round.py --method=dispfl --chunk_sizes=30   # any gossip baseline's config

``--method`` times another decentralised baseline's round (``configs/<method>.py``,
its own epochs and batch size) built the same way.

Columns: compile = the first call (trace + compile + one round); steady =
median wall time of the following rounds (``block_until_ready``); samples/s =
clients · epochs · samples per client / steady. ``--data=synthetic_shapes`` replaces the dataset by
seeded Gaussian inputs of the same shapes (timings do not depend on the
values; use it where Fashion-MNIST is not installed).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

__all__ = ["main"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--chunk_sizes", type=str, default="0,100,30", help="clients per vmap chunk (0 = all)"
  )
  p.add_argument("--rounds", type=int, default=3, help="timed rounds after the compiling one")
  p.add_argument("--data", choices=("fashion_mnist", "synthetic_shapes"), default="fashion_mnist")
  p.add_argument(
    "--method",
    choices=("dfedavg", "dfedavgm", "dpsgd", "dfedsam", "dispfl"),
    default="dfedavg",
    help="which configs/<method>.py to time",
  )
  p.add_argument("--variant", type=str, default="", help="the config's variant, e.g. 'iid' or 'q8'")
  return p.parse_args(argv)


def _config(method: str, variant: str):
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  return load_config(os.path.join(REPO, "configs", f"{method}.py"), variant or None)


def _algorithm(config, data_kind: str):
  import numpy as np  # pylint: disable=import-outside-toplevel
  from ntk_fl import data, models, runner  # pylint: disable=import-outside-toplevel

  if data_kind == "fashion_mnist":
    return runner.build_experiment(config).algorithm
  rng = np.random.default_rng(config.seed)
  m, n = config.data.num_clients, config.data.samples_per_client
  indices = [np.arange(i * n, (i + 1) * n) for i in range(m)]
  federation = data.make_federation(
    rng.standard_normal((m * n, 784), dtype=np.float32),
    rng.integers(0, 10, m * n).astype(np.int32),
    indices,
  )
  model = models.make_model(config.model, (784,), 10)
  return runner.make_algorithm(config, model, federation)


def main(argv=None):
  args = _parse(argv)
  import jax  # pylint: disable=import-outside-toplevel
  from ntk_fl import parallel  # pylint: disable=import-outside-toplevel

  rows = []
  for chunk in (int(c) for c in args.chunk_sizes.split(",")):
    config = _config(args.method, args.variant)
    config.chunk_size = chunk
    algorithm = _algorithm(config, args.data)
    state = algorithm.init(jax.random.key(config.seed))
    step = algorithm.step  # already compiled by the factory
    with parallel.use_devices(config.devices, chunk_size=chunk):  # read when the step is traced
      t0 = time.perf_counter()
      state, _ = step(state, algorithm.round_inputs(0))
      jax.block_until_ready(state)
      compile_s = time.perf_counter() - t0
      times = []
      for r in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        state, metrics = step(state, algorithm.round_inputs(r))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times)
    samples = config.data.num_clients * config.algorithm.epochs * config.data.samples_per_client
    rows.append((chunk, compile_s, steady, samples / steady, float(metrics["loss"].mean())))
    print(
      f"chunk {chunk}: compile+first {compile_s:.1f}s, steady {steady:.2f}s/round "
      f"(rounds {', '.join(f'{t:.2f}' for t in times)})",
      flush=True,
    )
  algo = config.algorithm
  print(
    f"\n{args.method} round, {config.data.num_clients} clients, {algo.epochs} epochs, batch {algo.batch_size} -- "
    f"{platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()}), data {args.data}\n"
  )
  print(
    "| chunk_size | compile + first round (s) | steady round (s) | samples/s | mean local loss |"
  )
  print("|---|---|---|---|---|")
  for chunk, compile_s, steady, rate, loss in rows:
    print(f"| {chunk or 'all'} | {compile_s:.1f} | {steady:.2f} | {rate:,.0f} | {loss:.3f} |")


if __name__ == "__main__":
  main()
