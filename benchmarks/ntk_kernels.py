"""Timing of the empirical-NTK implementations on the papers' 784-100-10 MLP.

    python benchmarks/ntk_kernels.py                      # N in 200 600 1200 2400 4200, traced
    python benchmarks/ntk_kernels.py --sizes 200 1200 --full --reps 3

Prints a markdown table: median wall time of ``--reps`` runs after compilation,
the FLOP count each implementation should need and the achieved GFLOP/s, and
XLA's planned peak memory (arguments + outputs + temporaries of the compiled
program, from ``Compiled.memory_analysis()``; no run needed). Combinations whose
estimated time or memory exceed the budgets are skipped and flagged.

FLOP counts (``d = 79,510`` parameters, ``C = 10``, ``N1 = N2 = N``; one
multiply-add = 2 FLOPs; lower-order terms such as forward passes omitted):

* structured, traced: ``2·N²·(784 + 1 + 100 + 1) + 2·N²·100`` -- the two
  layer-input Grams ``A_l A_lᵀ`` (+1 for the bias, elementwise) and the
  last-hidden-layer output Gram ``(D·‖W_2‖)(D·‖W_2‖)ᵀ``, i.e. ``≈ 2·N²·986``;
* structured, full: the same Grams plus ``2·N²·100·C²`` for
  ``Σ_q M(x_i)[q, a] M(x_j)[q, b]``;
* jacobian: ``2·N²·C·d`` traced, ``2·N²·C²·d`` full (per-leaf contractions);
* ntvp: ``2·N²·C·d`` traced or full (one linearised forward pass over ``N``
  samples per basis cotangent, ``N·C`` of them), plus the transposes.

Run on a quiet machine for reportable numbers: the timings are wall-clock.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from _timing import time_calls
from ntk_fl import models, ntk

IMPLS = ("structured", "jacobian", "ntvp")


def flops(
  impl: str,
  n: int,
  *,
  trace_outputs: bool,
  input_dim: int = 784,
  hidden: int = 100,
  num_classes: int = 10,
) -> float:
  """FLOPs (2 per multiply-add) an implementation needs for the ``n × n`` kernel of the one-hidden-layer MLP."""
  d = input_dim * hidden + hidden + hidden * num_classes + num_classes
  c = num_classes
  if impl == "structured":
    grams = 2 * n * n * ((input_dim + 1) + (hidden + 1))
    return grams + 2 * n * n * (hidden if trace_outputs else hidden * c * c)
  if impl == "jacobian":
    return 2 * n * n * c * d * (1 if trace_outputs else c)
  if impl == "ntvp":
    return 2 * n * n * c * d
  raise ValueError(f"unknown implementation {impl!r}; choose one of {IMPLS}")


def _median_time(fn, *args, reps: int) -> float:
  """Median of ``reps`` calls after a warm-up call (the compile happened in ``lower().compile()``)."""
  return time_calls(fn, *args, repeats=reps).median


def _peak_bytes(compiled) -> float | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # not every backend implements it
    return None
  if stats is None:
    return None
  return float(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--sizes", type=int, nargs="+", default=[200, 600, 1200, 2400, 4200])
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
  parser.add_argument(
    "--full", action="store_true", help="full [N, N, C, C] kernel instead of traced"
  )
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument(
    "--chunk-size", type=int, default=None, help="samples per block (default: automatic)"
  )
  parser.add_argument(
    "--time-budget",
    type=float,
    default=60.0,
    help="skip a combination whose estimated seconds per call exceed this",
  )
  parser.add_argument(
    "--assumed-gflops",
    type=float,
    default=50.0,
    help="throughput used for the time estimate (GFLOP/s)",
  )
  parser.add_argument(
    "--memory-budget-gb",
    type=float,
    default=8.0,
    help="skip a combination whose planned peak memory exceeds this",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  trace_outputs = not args.full

  model = models.mlp(784, (100,), 10, "relu")
  params = model.init(jax.random.key(args.seed))
  print(
    f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; kernel: "
    f"{'traced [N, N]' if trace_outputs else 'full [N, N, C, C]'}; median of {args.reps} runs\n"
  )
  print("| impl | N | GFLOP | time (ms) | GFLOP/s | planned peak (MiB) | note |")
  print("|---|---:|---:|---:|---:|---:|---|")
  for impl in args.impls:
    for n in args.sizes:
      x = jax.random.normal(jax.random.fold_in(jax.random.key(args.seed), n), (n, 784), jnp.float32)
      gflop = flops(impl, n, trace_outputs=trace_outputs) / 1e9
      row = f"| {impl} | {n} | {gflop:,.1f} |"
      estimate = gflop / args.assumed_gflops
      if estimate > args.time_budget:
        print(
          f"{row} – | – | – | skipped: ~{estimate:,.0f} s/call at {args.assumed_gflops:g} GFLOP/s |"
        )
        continue
      fn = jax.jit(
        lambda p, a, impl=impl: ntk.empirical_ntk(
          model.apply,
          p,
          a,
          trace_outputs=trace_outputs,
          implementation=impl,
          dense_stack=model.dense_stack,
          chunk_size=args.chunk_size,
        )
      )
      compiled = fn.lower(params, x).compile()
      peak = _peak_bytes(compiled)
      peak_mib = "–" if peak is None else f"{peak / 2**20:,.0f}"
      if peak is not None and peak > args.memory_budget_gb * 2**30:
        print(f"{row} – | – | {peak_mib} | skipped: over {args.memory_budget_gb:g} GB |")
        continue
      seconds = _median_time(compiled, params, x, reps=args.reps)
      print(f"{row} {seconds * 1e3:,.1f} | {gflop / seconds:,.1f} | {peak_mib} | |", flush=True)


if __name__ == "__main__":
  main()
