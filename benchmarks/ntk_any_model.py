"""The empirical NTK of models without a DenseStack, against neural-tangents 0.6.5, back to back.

    python benchmarks/ntk_any_model.py --net cnn --sizes 50 200 --oracle-python /tmp/nt_oracle/bin/python
    python benchmarks/ntk_any_model.py --net mlp --sizes 50 200 600 --full

Networks: the library's CNN on 28x28x1 inputs (``models.cnn``, 333,526 parameters) and the
784-100-10 MLP used *without* its dense-stack declaration. For each ``N`` this library's kernels
run first -- the generic ones (``'jacobian'``, ``'ntvp'``) and the layer-wise ``'structured'``
one through ``flax_apply`` -- then, when ``--oracle-python`` names the neural-tangents
environment (``scripts/nt_oracle/build_references.sh``), ``scripts/nt_oracle/time_kernels.py``
times neural-tangents' implementations 1, 2, 3 on the same network, ``N`` and kernel, in the same
minute; ``--rounds`` repeats the pair and the table reports medians over all runs.

Columns: median wall time after compilation; XLA's planned peak memory (arguments + outputs +
temporaries of the compiled program, ``Compiled.memory_analysis()``; neural-tangents' JAX 0.4.25
reports none on CPU); the FLOPs XLA counts in the compiled program (``Compiled.cost_analysis()``)
and the analytic count of the kernel's contractions (2 per multiply-add, ``d`` parameters,
``C = 10``): ``2·N²·C·d`` traced / ``2·N²·C²·d`` full for the Jacobian contraction,
``2·N²·C·d`` for NTK-vector products, and for the layer-wise kernel the sum over layers of the
route each takes (``ntk_fl._src.layerwise``: ``2·N²·T²·(d_in + C·d_out)`` factorised,
``2·N²·C·d_l`` contracted; traced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp

from _timing import time_calls
from ntk_fl import models, ntk
from ntk_fl._src import layerwise

INPUTS = {"mlp": (784,), "cnn": (28, 28, 1)}
OURS = ("jacobian", "ntvp", "structured")
ORACLE_SCRIPT = os.path.join(
  os.path.dirname(__file__), "..", "scripts", "nt_oracle", "time_kernels.py"
)


def make(net: str) -> models.Model:
  if net == "cnn":
    return models.cnn((28, 28, 1), 10)
  mlp = models.mlp(784, (100,), 10)
  return mlp._replace(dense_stack=None)  # the generic and layer-wise paths only


def analytic_flops(impl: str, model: models.Model, params, n: int, trace_outputs: bool) -> float:
  d = ntk.num_params_of(params)
  c = model.num_classes
  if impl == "jacobian":
    return 2 * n * n * c * d * (1 if trace_outputs else c)
  if impl == "ntvp":
    return 2 * n * n * c * d
  x = jax.ShapeDtypeStruct((1, *model.input_shape), jnp.float32)
  plan = layerwise.make_plan(model.flax_apply, params, x, trace_outputs)
  return layerwise.plan_flops(plan, trace_outputs, n, n)


def measure_ours(
  net: str, n: int, impl: str, trace_outputs: bool, reps: int, warmup: int = 1
) -> dict:
  model = make(net)
  params = model.init(jax.random.PRNGKey(0))
  x = jax.random.uniform(jax.random.PRNGKey(1), (n, *INPUTS[net]))
  fn = jax.jit(
    lambda p, a: ntk.empirical_ntk(
      model.apply,
      p,
      a,
      trace_outputs=trace_outputs,
      implementation=impl,
      flax_apply=model.flax_apply,
    )
  )
  compiled = fn.lower(params, x).compile()
  mem = compiled.memory_analysis()
  peak = (
    None
    if mem is None
    else (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
  )
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  if warmup:  # the first run is the first of the untimed ones
    times = list(time_calls(compiled, params, x, repeats=reps, warmup=warmup - 1).times)
  else:  # the first run after compilation is timed too
    timing = time_calls(compiled, params, x, repeats=reps - 1)
    times = [timing.first_s, *timing.times]
  return {
    "library": "ntk_fl",
    "net": net,
    "n": n,
    "kernel": "traced" if trace_outputs else "full",
    "implementation": impl,
    "times": times,
    "peak_bytes": peak or None,
    "xla_flops": None if not cost else cost.get("flops"),
    "analytic_flops": analytic_flops(impl, model, params, n, trace_outputs),
  }


def measure_oracle(
  python: str, net: str, n: int, impls, trace_outputs: bool, reps: int, warmup: int = 1
) -> list[dict]:
  cmd = [
    python,
    ORACLE_SCRIPT,
    "--net",
    net,
    "--n",
    str(n),
    "--reps",
    str(reps),
    "--warmup",
    str(warmup),
    "--impls",
    *map(str, impls),
  ] + ([] if trace_outputs else ["--full"])
  out = subprocess.run(
    cmd,
    check=True,
    capture_output=True,
    text=True,
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ""},
  )
  return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--net", choices=tuple(INPUTS), default="cnn")
  parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 600])
  parser.add_argument("--impls", nargs="+", default=list(OURS), choices=OURS)
  parser.add_argument("--oracle-impls", type=int, nargs="*", default=[1, 2, 3])
  parser.add_argument(
    "--full", action="store_true", help="full [N, N, C, C] kernel instead of traced"
  )
  parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement")
  parser.add_argument(
    "--warmup",
    type=int,
    default=1,
    help="untimed runs after compilation (0 for the largest cases: the first run is then timed)",
  )
  parser.add_argument("--rounds", type=int, default=1, help="repetitions of the back-to-back pair")
  parser.add_argument(
    "--oracle-python", default=None, help="the neural-tangents environment's python"
  )
  parser.add_argument("--json", default=None, help="also append every measurement to this file")
  args = parser.parse_args(argv)
  trace_outputs = not args.full

  rows: dict = {}
  for n in args.sizes:
    for _ in range(args.rounds):
      results = [
        measure_ours(args.net, n, impl, trace_outputs, args.reps, args.warmup)
        for impl in args.impls
      ]
      if args.oracle_python and args.oracle_impls:
        results += measure_oracle(
          args.oracle_python,
          args.net,
          n,
          args.oracle_impls,
          trace_outputs,
          args.reps,
          args.warmup,
        )
      for r in results:
        key = (r["library"].split()[0], r["n"], str(r["implementation"]))
        entry = rows.setdefault(key, {**r, "times": []})
        entry["times"] += r["times"]
        if args.json:
          with open(args.json, "a") as f:
            f.write(json.dumps(r) + "\n")
      print(json.dumps(results), file=sys.stderr, flush=True)

  print(
    f"{args.net}, {'traced [N, N]' if trace_outputs else 'full [N, N, C, C]'} kernel, float32, "
    f"device {jax.devices()[0].device_kind}; median of {args.rounds}x{args.reps} runs "
    f"after {args.warmup} untimed\n"
  )
  print("| library | impl | N | time (s) | planned peak (MiB) | XLA GFLOP | analytic GFLOP |")
  print("|---|---|---:|---:|---:|---:|---:|")
  fmt = lambda v, scale, spec: "–" if not v else format(v / scale, spec)
  for (lib, n, impl), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
    print(
      f"| {lib} | {impl} | {n} | {statistics.median(r['times']):.3f} | "
      f"{fmt(r.get('peak_bytes'), 2**20, ',.0f')} | {fmt(r.get('xla_flops'), 1e9, ',.1f')} | "
      f"{fmt(r.get('analytic_flops'), 1e9, ',.1f')} |"
    )


if __name__ == "__main__":
  main()
