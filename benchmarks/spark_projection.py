"""SPARK Fig. 10: per-round time and peak memory by Jacobian projection scheme, against NTK-DFL.

  .venv/bin/python benchmarks/spark_projection.py [--out DIR]          # 30 clients, κ = 5, chunk 1
  .venv/bin/python benchmarks/spark_projection.py --clients 300 --chunk 0 --out DIR   # a GPU, paper scale

Rows: NTK-DFL; SPARK without projection (the paper's main runs); SPARK with the layer-wise projection
at caps 500, 750 and 1,000 (``configs/spark.py:proj<cap>``, Fig. 9's caps); SPARK with the flattened
projection, k_proj = 10,000 (``:flat10000``). Each row is ``algorithm.step`` of the paper config
(Fashion-MNIST, α = 0.1, τ ∈ {100, …, 800}) with the given client count, degree and chunk, timed in
steady state (the fastest of ``--repeats`` calls after a compile call), in its own process so that its
peak memory is its own: the process's peak resident memory on a CPU (the dataset and XLA's buffers
included), the device's peak bytes in use on a GPU.

The paper's figure also splits the time into stages (Jacobian, projection, kernel, evolution,
back-projection); this benchmark gives the whole step only.

Writes ``spark_projection.json``, ``spark_projection.md`` (the table with the machine) and
``spark_projection.png`` (time and memory bars) to ``--out``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ntk_fl.reproduce import scripted  # noqa: E402

ROWS = (
  ("NTK-DFL", "ntk_dfl", ""),
  ("SPARK, no projection", "spark", ""),
  ("SPARK, layer-wise, cap 500", "spark", "proj500"),
  ("SPARK, layer-wise, cap 750", "spark", "proj750"),
  ("SPARK, layer-wise, cap 1,000", "spark", "proj1000"),
  ("SPARK, flattened, k_proj = 10,000", "spark", "flat10000"),
)


def measure_row(method: str, variant: str, args) -> dict:
  """Times one row in this process; returns ``{"seconds", "peak_mb", "memory"}``."""
  import jax  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import spark_step  # pylint: disable=import-outside-toplevel

  args.variant = ",".join(filter(None, (args.base_variant, variant)))
  seconds = spark_step.time_step(spark_step._config(method, args, {}), args.repeats)  # pylint: disable=protected-access
  device = jax.devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:
    return {"seconds": seconds, "peak_mb": stats["peak_bytes_in_use"] / 2**20, "memory": "device"}
  rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return {"seconds": seconds, "peak_mb": rss_kb / 1024, "memory": "process RSS"}


def markdown(result: dict) -> str:
  s = result["settings"]
  lines = [
    f"{result['machine']}, jax {result['jax']} ({result['backend']}); {s['clients']} clients, "
    f"κ = {s['degree']}, chunk {s['chunk'] or 'all'}, τ ≤ {s['tau_max']}, fastest of {s['repeats']} "
    f"steady-state steps; peak memory: {result['rows'][0]['memory']}.",
    "",
    "| step | s | / NTK-DFL | peak memory (MB) | / NTK-DFL |",
    "|---|---:|---:|---:|---:|",
  ]
  base = result["rows"][0]
  for r in result["rows"]:
    lines.append(
      f"| {r['name']} | {r['seconds']:.2f} | {r['seconds'] / base['seconds']:.2f} | "
      f"{r['peak_mb']:,.0f} | {r['peak_mb'] / base['peak_mb']:.2f} |"
    )
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  names = [r["name"].replace(", ", "\n", 1) for r in result["rows"]]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
  left.bar(names, [r["seconds"] for r in result["rows"]], color="tab:blue")
  left.set_ylabel("seconds per round (step)")
  right.bar(names, [r["peak_mb"] for r in result["rows"]], color="tab:orange")
  right.set_ylabel(f"peak memory, MB ({result['rows'][0]['memory']})")
  for ax in (left, right):
    ax.tick_params(axis="x", labelsize=7, rotation=30)
    ax.grid(alpha=0.3, axis="y")
  fig.suptitle(
    f"SPARK Fig. 10: projection schemes, {result['settings']['clients']} clients", fontsize=10
  )
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", default="runs/spark_projection", help="folder receiving the outputs")
  parser.add_argument("--clients", type=int, default=30)
  parser.add_argument("--degree", type=int, default=5)
  parser.add_argument("--chunk", type=int, default=1, help="clients per vmap chunk (0 = all)")
  parser.add_argument("--tau-max", type=int, default=800)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--max-train", type=int, default=0)
  parser.add_argument(
    "--variant", dest="base_variant", default="", help="config variant tokens added to every row"
  )
  parser.add_argument("--row", type=int, default=-1, help=argparse.SUPPRESS)  # a child's one row
  args = parser.parse_args(argv)
  for name in ("clients", "degree", "tau_max", "repeats"):
    if getattr(args, name) < 1:
      sys.exit(
        f"error: --{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}"
      )
  if args.tau_max % 100:
    sys.exit(f"error: --tau-max must be a multiple of 100 (the τ grid's step), got {args.tau_max}")
  if args.row >= 0:  # the child: one row, its numbers on the last line
    _, method, variant = ROWS[args.row]
    print(json.dumps(measure_row(method, variant, args)))
    return
  rows = []
  forwarded = [
    f"--clients={args.clients}",
    f"--degree={args.degree}",
    f"--chunk={args.chunk}",
    f"--tau-max={args.tau_max}",
    f"--repeats={args.repeats}",
    f"--max-train={args.max_train}",
    f"--variant={args.base_variant}",
  ]
  for index, (name, _, _) in enumerate(ROWS):
    proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), *forwarded, f"--row={index}"],
      capture_output=True,
      text=True,
    )
    if proc.returncode != 0:
      sys.exit(f"error: row {name!r} failed:\n{proc.stderr[-3000:]}")
    rows.append({"name": name, **json.loads(proc.stdout.strip().splitlines()[-1])})
    print(f"{name}: {rows[-1]['seconds']:.2f} s, {rows[-1]['peak_mb']:,.0f} MB", flush=True)
  import jax  # pylint: disable=import-outside-toplevel

  result = {
    "machine": scripted.machine(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "settings": {
      "clients": args.clients,
      "degree": args.degree,
      "chunk": args.chunk,
      "tau_max": args.tau_max,
      "repeats": args.repeats,
      "variant": args.base_variant,
    },
    "rows": rows,
  }
  scripted.write_result(args.out, "spark_projection", result, markdown(result))
  plot(result, os.path.join(args.out, "spark_projection.png"))
  print(markdown(result))


if __name__ == "__main__":
  main()
