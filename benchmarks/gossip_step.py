"""Benchmark: one gossip (neighbour-averaging) step on a stacked federation of MLPs.

``ntk_fl.gossip.mix`` -- the averaging step of NTK-DFL, SPARK and every gossip
baseline -- on ``--clients`` stacked MLP 784-100-10 parameter pytrees (79,510
parameters each) over a random ``--degree``-regular graph, against the
formulation it replaced, which gathered all ``k`` neighbour slots at once
(an ``[M, k, ...]`` buffer) before the weighted sum. Both are checked to agree
(float32 summation order only) before timing.

  python benchmarks/gossip_step.py                     # M = 300, κ = 5, 10 timed calls
  python benchmarks/gossip_step.py --clients=3000 --repeats=3

Columns: XLA temp = the compiled program's temporary buffers
(``memory_analysis().temp_size_in_bytes``); time = median wall time of a call
(``block_until_ready``) after a compiling call.
"""

from __future__ import annotations

import argparse
import os
import platform

from _timing import time_calls

__all__ = ["main", "mix_gather_all_slots"]


def _parse(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--clients", type=int, default=300)
  p.add_argument("--degree", type=int, default=5)
  p.add_argument("--repeats", type=int, default=10, help="timed calls after the compiling one")
  return p.parse_args(argv)


def mix_gather_all_slots(stacked_params, neighbors, self_weight, neighbor_weights):
  """The previous ``gossip.mix`` (kept here as the benchmark's reference): one ``[M, k, ...]`` gather."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def one(own):
    extra = (1,) * (own.ndim - 1)
    gathered = own[neighbors]  # [M, k, ...]
    weights = neighbor_weights.reshape(*neighbor_weights.shape, *extra)
    return self_weight.reshape(-1, *extra) * own + jnp.sum(weights * gathered, axis=1)

  return jax.tree.map(one, stacked_params)


def _time(fn, args, repeats):
  import jax  # pylint: disable=import-outside-toplevel

  compiled = jax.jit(fn).lower(*args).compile()
  timing = time_calls(compiled, *args, repeats=repeats)  # the first call warms up, untimed here
  return timing.output, compiled.memory_analysis().temp_size_in_bytes, timing.median


def main(argv=None):
  args = _parse(argv)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from ntk_fl import gossip, models, topology  # pylint: disable=import-outside-toplevel

  model = models.mlp(input_dim=784, hidden=(100,), num_classes=10)
  stacked = models.init_clients(model, jax.random.key(0), args.clients, shared=False)
  graph = topology.make_topology("regular", args.clients, seed=0, degree=args.degree).sample(0)
  self_w, nbr_w = topology.mixing_weights(graph, "uniform")
  inputs = (stacked, jnp.asarray(graph.neighbors), jnp.asarray(self_w), jnp.asarray(nbr_w))

  new, new_temp, new_time = _time(gossip.mix, inputs, args.repeats)
  old, old_temp, old_time = _time(mix_gather_all_slots, inputs, args.repeats)
  diff = max(
    float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old))
  )
  if diff > 1e-5:
    raise AssertionError(f"gossip.mix and the gather-all reference differ by {diff}")
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
  print(
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {jax.default_backend()}, "
    f"load average {load:.1f}; M = {args.clients}, κ = {args.degree}, max |difference| {diff:.1e}"
  )
  print("| formulation | XLA temp | time per call |")
  print("|---|---:|---:|")
  print(
    f"| all k slots gathered at once (before) | {old_temp / 2**20:.0f} MiB | {old_time * 1e3:.0f} ms |"
  )
  print(f"| slot by slot (`gossip.mix`) | {new_temp / 2**20:.0f} MiB | {new_time * 1e3:.0f} ms |")
  return {
    "before_s": old_time,
    "after_s": new_time,
    "before_temp": old_temp,
    "after_temp": new_temp,
  }


if __name__ == "__main__":
  main()
