"""Time per round and peak memory vs number of clients and neighbourhood size (NTK-DFL, DFedAvg).

  .venv/bin/python benchmarks/scaling.py                      # the full sweep (hours on 2 CPU cores)
  .venv/bin/python benchmarks/scaling.py --sweep memory       # 300-client NTK-DFL round, chunk 4 vs 32
  .venv/bin/python benchmarks/scaling.py --sweep clients --clients 30,100 --tau-max 200
  .venv/bin/python benchmarks/scaling.py --sweep footprint --tau-max 100 --rounds 1
  .venv/bin/python benchmarks/scaling.py --table              # table + plot of what is recorded

Sweeps (each configuration in its own subprocess, so ``ru_maxrss`` is that
configuration's peak resident memory):

* ``clients``: M ∈ --clients (30 … 3,000) at κ = 5, both methods;
* ``kappa``:   κ ∈ --kappas (2 … 10) at --kappa-clients clients, both methods;
* ``memory``:  NTK-DFL at --memory-clients clients for each --memory-chunks chunk size;
* ``footprint``: NTK-DFL at M ∈ --footprint-clients (30 … 10,000) clients, the peak
  memory against M (what grows per client) -- with ``--rounds 1`` the timed round
  is the first one and includes compilation (seconds, small next to 1,000+ clients).

A configuration builds the experiment from ``configs/<method>.py`` (Fashion-MNIST,
the authors' fixed-size Dirichlet split, α = 0.1, ≈200 samples per client, MLP
784-100-10), runs round 1 (compiles) and round 2, and records round 2's step time
(the steady state), round 1's, the resident memory before the first step (data
and model) and the peak. Rows append to ``--out``/results.jsonl (a configuration
already there is skipped, so an interrupted sweep resumes); ``--table`` renders
the markdown table and ``scaling.png``. ``--tau-max`` below 800 shortens the
NTK-DFL τ grid (100, 200, …, τ_max) -- the table says so in its τ column.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
METHODS = ("ntk_dfl", "dfedavg")


def _rss_mb() -> float:
  """Current resident set size (Linux /proc), MB."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _commit() -> str:
  """The repository's commit (``+`` if the work tree differs from it), or ``?``."""
  try:
    head = subprocess.run(
      ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    # The sweep's own results file does not count: it changes as rows are appended.
    dirty = subprocess.run(
      [
        "git",
        "-C",
        REPO,
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!benchmarks/scaling",
      ],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    return head + ("+" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "?"


def run_one(spec: dict) -> dict:
  """Builds and times one configuration in this process; returns its result row."""
  import jax  # pylint: disable=import-outside-toplevel
  from ntk_fl import parallel, runner  # pylint: disable=import-outside-toplevel
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  config = load_config(os.path.join(REPO, "configs", f"{spec['method']}.py"))
  config.data.num_clients = spec["clients"]
  config.topology.degree = spec["kappa"]
  config.chunk_size = spec["chunk"]
  if spec.get("samples"):
    config.data.samples_per_client = spec["samples"]
  config.devices = spec["devices"]
  if spec["method"] == "ntk_dfl":
    config.algorithm.taus = tuple(range(100, spec["tau_max"] + 1, 100))
  started = time.perf_counter()
  with parallel.use_devices(config.devices, chunk_size=config.chunk_size):  # what runner.run does
    algorithm = runner.build_experiment(config).algorithm
    state = jax.block_until_ready(algorithm.init(jax.random.key(config.seed)))
    rss_before = _rss_mb()
    times, cpu_times = [], []
    for r in range(spec.get("rounds", 2)):
      inputs = algorithm.round_inputs(r)
      t0, c0 = time.perf_counter(), time.process_time()
      state, _ = jax.block_until_ready(algorithm.step(state, inputs))
      times.append(time.perf_counter() - t0)
      # CPU seconds of all this process's threads: unlike wall time, barely moved by other jobs
      # sharing the cores (a loaded machine's rows stay comparable).
      cpu_times.append(time.process_time() - c0)
  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  return {
    **spec,
    "round_s": times[-1],
    "round_cpu_s": cpu_times[-1],
    "first_round_s": times[0],
    "rss_before_step_mb": rss_before,
    "peak_rss_mb": peak_mb,
    "total_s": time.perf_counter() - started,
    "backend": jax.devices()[0].platform,
    "num_devices": jax.device_count(),
    "load_avg": os.getloadavg()[0],
    "commit": _commit(),
  }


def _specs(args) -> list[dict]:
  base = dict(chunk=args.chunk, tau_max=args.tau_max, devices=args.devices, rounds=args.rounds)
  if args.samples:
    base["samples"] = args.samples
  specs = []
  methods = args.methods.split(",")
  if args.sweep in ("clients", "all"):
    specs += [
      dict(base, sweep="clients", method=m, clients=int(c), kappa=5)
      for c in args.clients.split(",")
      for m in methods
    ]
  if args.sweep in ("kappa", "all"):
    specs += [
      dict(base, sweep="kappa", method=m, clients=args.kappa_clients, kappa=int(k))
      for k in args.kappas.split(",")
      for m in methods
    ]
  if args.sweep in ("memory", "all"):
    specs += [
      dict(
        base, sweep="memory", method="ntk_dfl", clients=args.memory_clients, kappa=5, chunk=int(c)
      )
      for c in args.memory_chunks.split(",")
    ]
  if args.sweep in ("footprint", "all"):
    specs += [
      dict(base, sweep="footprint", method="ntk_dfl", clients=int(c), kappa=5)
      for c in args.footprint_clients.split(",")
    ]
  return specs


def _key(row: dict) -> tuple:
  return (
    *(row[k] for k in ("sweep", "method", "clients", "kappa", "chunk", "tau_max", "devices")),
    row.get("rounds", 2),
    row.get("samples", 0),
  )


def _read(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _fmt(value) -> str:
  return "–" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
  """Markdown table of the recorded rows (one per configuration)."""
  lines = [
    "| sweep | method | clients M | samples/client | κ | τ_max | chunk | devices | s/round "
    "| CPU s/round | ms/client | first round s "
    "| RSS before step MB | peak RSS MB | load avg | rounds | commit |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
  ]
  for r in sorted(
    rows, key=lambda r: (r["sweep"], r["method"], r["clients"], r["kappa"], r["chunk"])
  ):
    tau = r["tau_max"] if r["method"] == "ntk_dfl" else "–"
    lines.append(
      f"| {r['sweep']} | {r['method']} | {r['clients']} | {r.get('samples') or 200} | {r['kappa']} "
      f"| {tau} | {r['chunk']} "
      f"| {r['num_devices'] if r['devices'] == 0 else r['devices']} {r['backend']} "
      f"| {r['round_s']:.2f} | {_fmt(r.get('round_cpu_s'))} | {1000 * r['round_s'] / r['clients']:.1f} "
      f"| {r['first_round_s']:.1f} "
      f"| {r['rss_before_step_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['load_avg']:.1f} "
      f"| {r.get('rounds', 2)} | {r.get('commit', '–')} |"
    )
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for method in METHODS:
    for tau in sorted({r["tau_max"] for r in rows}):
      label = f"{method}" + (f" (τ≤{tau})" if method == "ntk_dfl" else "")
      pts = sorted(
        (r["clients"], r["round_s"])
        for r in rows
        if r["sweep"] == "clients" and r["method"] == method and r["tau_max"] == tau
      )
      if pts:
        axes[0].plot(*zip(*pts), "o-", label=label)
      pts = sorted(
        (r["kappa"], r["round_s"])
        for r in rows
        if r["sweep"] == "kappa" and r["method"] == method and r["tau_max"] == tau
      )
      if pts:
        axes[1].plot(*zip(*pts), "o-", label=label)
  mem = [r for r in rows if r["sweep"] in ("memory", "clients") and r["method"] == "ntk_dfl"]
  for chunk in sorted({r["chunk"] for r in mem}):
    pts = sorted((r["clients"], r["peak_rss_mb"]) for r in mem if r["chunk"] == chunk)
    axes[2].plot(*zip(*pts), "o", label=f"ntk_dfl chunk {chunk}, padded federation")
  footprint = [r for r in rows if r["sweep"] == "footprint"]
  for samples in sorted({r.get("samples") or 200 for r in footprint}):
    pts = sorted(
      (r["clients"], r["peak_rss_mb"]) for r in footprint if (r.get("samples") or 200) == samples
    )
    axes[2].plot(
      *zip(*pts),
      "s-",
      label=f"ntk_dfl chunk 4, samples held once, {samples} per client (footprint)",
    )
  axes[0].set(
    xscale="log",
    yscale="log",
    xlabel="clients M (κ = 5)",
    ylabel="seconds per round",
    title="time vs clients",
  )
  axes[1].set(xlabel="neighbourhood size κ", ylabel="seconds per round", title="time vs κ")
  axes[2].set(xlabel="clients M", ylabel="peak RSS (MB)", title="peak memory")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--sweep", choices=("clients", "kappa", "memory", "footprint", "all"), default="all"
  )
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--clients", default="30,100,300,1000,3000")
  parser.add_argument("--kappas", default="2,4,6,8,10")
  parser.add_argument("--kappa-clients", type=int, default=100)
  parser.add_argument("--memory-clients", type=int, default=300)
  parser.add_argument("--memory-chunks", default="4,32")
  parser.add_argument("--footprint-clients", default="30,300,1000,3000,10000")
  parser.add_argument(
    "--rounds", type=int, default=2, help="rounds per configuration; the last one is timed"
  )
  parser.add_argument(
    "--samples",
    type=int,
    default=0,
    help="samples per client (0 = the config's, ≈200); the neighbourhood holds ≈ (κ+1)× as many",
  )
  parser.add_argument(
    "--chunk", type=int, default=4, help="clients per vmap chunk per device (0 = all)"
  )
  parser.add_argument(
    "--tau-max", type=int, default=800, help="NTK-DFL τ grid 100, 200, ..., τ_max"
  )
  parser.add_argument("--devices", type=int, default=0, help="config.devices (0 = all)")
  parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "scaling"))
  parser.add_argument(
    "--table", action="store_true", help="only render the table and plot of recorded rows"
  )
  parser.add_argument(
    "--one", help=argparse.SUPPRESS
  )  # internal: one configuration (JSON) in this process
  args = parser.parse_args()

  if args.one:
    print(json.dumps(run_one(json.loads(args.one))))
    return
  for method in args.methods.split(","):
    if method not in METHODS:
      raise SystemExit(f"--methods: unknown method {method!r}; choose from {METHODS}")
  os.makedirs(args.out, exist_ok=True)
  results_path = os.path.join(args.out, "results.jsonl")
  if not args.table:
    done = {_key(r) for r in _read(results_path)}
    for spec in _specs(args):
      if _key(spec) in done:
        continue
      print(f"running {spec}", flush=True)
      proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
      )
      if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"configuration {spec} failed (exit {proc.returncode})")
      row = json.loads(proc.stdout.strip().splitlines()[-1])
      with open(results_path, "a") as f:
        f.write(json.dumps(row) + "\n")
      print(f"  {row['round_s']:.2f} s/round, peak RSS {row['peak_rss_mb']:.0f} MB", flush=True)
  rows = _read(results_path)
  if rows:
    plot(rows, os.path.join(args.out, "scaling.png"))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print(table(rows))


if __name__ == "__main__":
  main()
