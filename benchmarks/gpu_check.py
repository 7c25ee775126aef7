"""One command that times the paper-scale workloads on whatever accelerator JAX finds.

  python benchmarks/gpu_check.py                      # the full table: one GPU, a few minutes
  python benchmarks/gpu_check.py --chunks 0,60,10     # other NTK-DFL chunk sizes (0 = all clients at once)
  python benchmarks/gpu_check.py --quick              # seconds-sized cases on the CPU (what CI runs)

Cases, each in a fresh subprocess (so a case's peak device memory is its own, and an out-of-memory case does
not take the others with it), built exactly as ``experiments/main.py`` builds a run:

* ``ntk_dfl`` -- one NTK-DFL round in the paper setting (``configs/ntk_dfl.py``: Fashion-MNIST, 300 clients,
  κ = 5 dynamic graph, neighbourhoods of N ≈ 1,200 samples, τ ∈ {100, …, 800}, Euler CE evolution) at each
  ``--chunks`` value (clients per ``vmap`` chunk);
* ``kernel`` -- the structured output-traced NTK of the 784-100-10 MLP on N = 1,200 and 4,800 inputs;
* ``dfedavg`` -- one DFedAvg round (``configs/dfedavg.py``: 300 clients, 20 local epochs, batch 25);
* ``spark`` -- one SPARK round (``configs/spark.py``: momentum, soft-label targets, 300 clients) at each
  ``--chunks`` value, as NTK-DFL (the config's chunk 1, best on a CPU, serialises the clients on a GPU);
* ``ntk_dfl_cnn`` -- one NTK-DFL round in the paper setting with the library's CNN (``ntk_dfl:cnn``: the
  layer-wise structured kernel) at each ``--cnn_chunks`` value;
* ``replicas_ntk_dfl`` / ``replicas_dfedavg`` -- one round of a seed-batched run (``config.replicas = S``,
  ``replica_chunk = 0``: the S replicas in one ``vmap``) of the paper config at each ``--replicas`` value S;
  the row's ``per replica`` is steady / S, to set against the single-seed round (S = 1).

Columns: ``first`` = the first call (trace + compile + one run); ``steady`` = the median of the following
``--repeats`` calls (``block_until_ready``); ``peak memory`` = the device's ``peak_bytes_in_use`` where the
backend reports it (GPU/TPU), else the subprocess's peak host RSS. ``--quick`` shrinks every case (the
``smoke`` configs, chunk 5, N = 120) so the script's plumbing is exercised in seconds without an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (
  "ntk_dfl",
  "kernel",
  "dfedavg",
  "spark",
  "ntk_dfl_cnn",
  "replicas_ntk_dfl",
  "replicas_dfedavg",
)
DEFAULT_CASES = CASES[:4]


def _parse(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--quick", action="store_true", help="seconds-sized cases (CI, CPU)")
  p.add_argument(
    "--chunks", default="0,60,10", help="NTK-DFL clients per vmap chunk to time (0 = all)"
  )
  p.add_argument("--kernel_sizes", default="1200,4800", help="N for the structured-kernel case")
  p.add_argument("--cnn_chunks", default="10", help="clients per vmap chunk for the CNN round")
  p.add_argument("--replicas", default="1,4", help="seeds per seed-batched run (replicas cases)")
  p.add_argument(
    "--cases", default=",".join(DEFAULT_CASES), help=f"cases to run, from {','.join(CASES)}"
  )
  p.add_argument("--repeats", type=int, default=3, help="steady-state calls after the first")
  p.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per case")
  p.add_argument("--json", default="", help="also write the rows to this JSON file")
  # Internal: run one case in this process and print its result as one JSON line.
  p.add_argument("--run_case", default="", help=argparse.SUPPRESS)
  p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _peak_memory_bytes() -> tuple[int, str]:
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"


def _time_calls(fn, repeats: int) -> tuple[float, float]:
  """(first call, median of ``repeats`` further calls) in seconds; ``fn`` blocks until its result is ready."""
  from _timing import time_calls  # pylint: disable=import-outside-toplevel

  timing = time_calls(fn, repeats=repeats)
  return timing.first_s, timing.median


def _load(method: str, args, variant: str = ""):
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  variants = ",".join(v for v in ("smoke" if args.quick else "", variant) if v)
  return load_config(os.path.join(REPO, "configs", f"{method}.py"), variants or None)


def _round_case(method: str, args) -> dict:
  """Time ``algorithm.step`` of ``configs/<method>.py`` (its ``smoke`` variant with ``--quick``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from ntk_fl import runner  # pylint: disable=import-outside-toplevel

  model = "cnn" if method == "ntk_dfl_cnn" else ""
  method = "ntk_dfl" if model else method
  config = _load(method, args, model)
  if model and args.quick:  # the CNN's smoke run cut to 4 clients of 8 samples: seconds on a CPU
    config.data.num_clients, config.data.samples_per_client = 4, 8
  if method in (
    "ntk_dfl",
    "spark",
  ):  # both at the same chunk: configs/spark.py's chunk 1 (the CPU's best)
    config.chunk_size = args.size  # would run a GPU's 300 clients one after another
  experiment = runner.build_experiment(config)
  algorithm = experiment.algorithm
  holder = {"state": algorithm.init(jax.random.key(config.seed)), "round": 0}

  def one_round():
    state, _ = algorithm.step(holder["state"], algorithm.round_inputs(holder["round"]))
    jax.block_until_ready(state)
    holder["state"], holder["round"] = state, holder["round"] + 1

  with (
    experiment.device_policy()
  ):  # the config's devices and chunk size, read when the step is traced
    first, steady = _time_calls(one_round, args.repeats)
  data = config.data
  setting = f"{data.num_clients} clients, κ = {config.topology.degree}"
  if method in ("ntk_dfl", "spark"):
    setting += f", τ ≤ {max(config.algorithm.taus)}, chunk {config.chunk_size or 'all'}"
  elif method == "dfedavg":
    setting += f", {config.algorithm.epochs} epochs, batch {config.algorithm.batch_size}"
  if model:
    setting += f", model {model}"
  return {"case": f"{method} round", "setting": setting, "first_s": first, "steady_s": steady}


def _replicas_case(method: str, args) -> dict:
  """Time one round of a seed-batched run of ``configs/<method>.py``: S = ``--size`` seeds in one vmap.

  Built as :func:`ntk_fl.runner.run` builds a seed-batched run (:func:`ntk_fl.runner.make_replicated_step`),
  without the run's records: what is timed is the step alone.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from ntk_fl import runner  # pylint: disable=import-outside-toplevel

  num = args.size
  exps = []
  for k in range(num):
    config = _load(method, args)
    config.seed = config.seed + k
    if method == "ntk_dfl":
      config.chunk_size = 0  # every client in one vmap: the GPU's best (see the NTK-DFL rows)
    exps.append(runner.build_experiment(config))
  with exps[0].device_policy():
    replicated = runner.make_replicated_step(exps, replica_chunk=0)
    states = replicated.stack_states(
      [e.algorithm.init(jax.random.key(e.settings.seed)) for e in exps]
    )
    holder = {"states": states, "round": 0}

    def one_round():
      inputs = replicated.stack_inputs([e.algorithm.round_inputs(holder["round"]) for e in exps])
      states, _ = replicated(holder["states"], inputs)
      jax.block_until_ready(states)
      holder["states"], holder["round"] = states, holder["round"] + 1

    first, steady = _time_calls(one_round, args.repeats)
  data = exps[0].settings.data
  return {
    "case": f"{method} seed-batched round",
    "setting": f"{data.num_clients} clients, S = {num} replicas in one vmap; per replica "
    f"{steady / num:.4g} s",
    "first_s": first,
    "steady_s": steady,
  }


def _kernel_case(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  from ntk_fl import models, ntk  # pylint: disable=import-outside-toplevel

  model = models.mlp(784, (100,), 10)
  params = model.init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (args.size, 784))
  kernel_fn = jax.jit(
    lambda p, x: ntk.empirical_ntk(model.apply, p, x, dense_stack=model.dense_stack)
  )
  first, steady = _time_calls(lambda: jax.block_until_ready(kernel_fn(params, x)), args.repeats)
  return {
    "case": "structured NTK",
    "setting": f"N = {args.size}, traced, MLP 784-100-10",
    "first_s": first,
    "steady_s": steady,
  }


def run_case(args) -> dict:
  if args.run_case == "kernel":
    row = _kernel_case(args)
  elif args.run_case.startswith("replicas_"):
    row = _replicas_case(args.run_case[len("replicas_") :], args)
  else:
    row = _round_case(args.run_case, args)
  row["peak_bytes"], row["memory_kind"] = _peak_memory_bytes()
  return row


def _case_commands(args) -> list[tuple[str, int]]:
  chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
  unknown = sorted(set(chosen) - set(CASES))
  if unknown:
    raise SystemExit(f"error: unknown case(s) {unknown}; choose from {CASES}")
  chunks = [int(c) for c in args.chunks.split(",")] if not args.quick else [5]
  sizes = [int(n) for n in args.kernel_sizes.split(",")] if not args.quick else [120]
  cnn_chunks = [int(c) for c in args.cnn_chunks.split(",")] if not args.quick else [5]
  replicas = [int(s) for s in args.replicas.split(",")] if not args.quick else [2]
  commands = []
  for case in chosen:
    if case in ("ntk_dfl", "spark"):
      commands += [(case, c) for c in chunks]
    elif case == "ntk_dfl_cnn":
      commands += [(case, c) for c in cnn_chunks]
    elif case.startswith("replicas_"):
      commands += [(case, s) for s in replicas]
    elif case == "kernel":
      commands += [(case, n) for n in sizes]
    else:
      commands.append((case, 0))
  return commands


def _device_description() -> str:
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.local_devices()[0]
  return (
    f"{getattr(device, 'device_kind', device.platform)} ({jax.default_backend()}, "
    f"{jax.local_device_count()} local device(s)); jax {jax.__version__}; host {platform.machine()}, "
    f"{os.cpu_count()} CPUs"
  )


def main(argv=None) -> int:
  args = _parse(argv)
  if args.run_case:
    print("GPU_CHECK_ROW " + json.dumps(run_case(args)), flush=True)
    return 0
  print(_device_description(), flush=True)
  rows = []
  for case, size in _case_commands(args):
    command = [
      sys.executable,
      os.path.abspath(__file__),
      "--run_case",
      case,
      "--size",
      str(size),
      "--repeats",
      str(args.repeats),
    ] + (["--quick"] if args.quick else [])
    try:
      done = subprocess.run(
        command, capture_output=True, text=True, timeout=args.timeout, check=False
      )
      lines = [l for l in done.stdout.splitlines() if l.startswith("GPU_CHECK_ROW ")]
      if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        row = {
          "case": case,
          "setting": f"size {size}",
          "error": " | ".join(tail) or f"exit {done.returncode}",
        }
      else:
        row = json.loads(lines[-1][len("GPU_CHECK_ROW ") :])
    except subprocess.TimeoutExpired:
      row = {"case": case, "setting": f"size {size}", "error": f"over {args.timeout:.0f} s"}
    rows.append(row)
    print(_format_row(row), flush=True)
  print("\n| case | setting | first call (s) | steady (s) | peak memory |\n|---|---|---|---|---|")
  for row in rows:
    print(_format_row(row))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": _device_description(), "rows": rows}, f, indent=1)
  return 1 if any("error" in row for row in rows) else 0


def _format_row(row: dict) -> str:
  if "error" in row:
    return f"| {row['case']} | {row['setting']} | failed: {row['error']} | | |"
  memory = f"{row['peak_bytes'] / 2**30:.2f} GiB ({row['memory_kind']})"
  return f"| {row['case']} | {row['setting']} | {row['first_s']:.2f} | {row['steady_s']:.4g} | {memory} |"


if __name__ == "__main__":
  sys.exit(main())
