"""Benchmark: one full NTK client update (kernel + evolution + VJP + τ selection).

The NTK-DFL setting: a neighbourhood of N = 1,200 samples, MLP 784-100-10
(79,510 parameters, Kaiming-normal init), cross-entropy, τ grid 100..800.
Every configuration runs in a fresh subprocess so its peak resident memory
(``ru_maxrss``) is its own; the parent prints a markdown table.

  python benchmarks/client_update.py                       # Euler, 1/4/8 clients vmapped + ODE x1
  python benchmarks/client_update.py --clients 1 --no-ode --data fashion_mnist

Columns: compile = lower + compile of the jitted (vmapped) update; steady =
median wall time of a call after warm-up; per client = steady / clients;
breakdown (one client) = the kernel, the evolution and the rest (VJP + τ
selection) timed as separate jitted functions; RSS = peak resident set of the
process, and the increase over the process's peak before the update was
compiled (imports, data and parameters already resident).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

__all__ = ["main"]


def _parse(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--n", type=int, default=1200, help="samples per client neighbourhood")
  p.add_argument("--taus", type=str, default="100,200,300,400,500,600,700,800")
  p.add_argument("--clients", type=str, default="1,4,8", help="comma-separated client batch sizes")
  p.add_argument("--no-ode", action="store_true", help="skip the ODE-solver configuration")
  p.add_argument("--lr", type=float, default=0.01)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument(
    "--data",
    choices=("random", "fashion_mnist"),
    default="random",
    help="random N(0,1) pixels (already normalised) or real Fashion-MNIST rows",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _data(args, num_clients):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  n = args.n
  if args.data == "fashion_mnist":
    from ntk_fl import data  # pylint: disable=import-outside-toplevel

    ds = data.load("fashion_mnist", seed=args.seed)
    rng = np.random.default_rng(args.seed)
    idx = rng.choice(ds.x_train.shape[0], size=(num_clients, n), replace=False)
    x, labels = jnp.asarray(ds.x_train[idx]), jnp.asarray(ds.y_train[idx])
  else:
    kx, ky = jax.random.split(jax.random.key(args.seed))
    x = jax.random.normal(kx, (num_clients, n, 784), jnp.float32)
    labels = jax.random.randint(ky, (num_clients, n), 0, 10)
  return x, jax.nn.one_hot(labels, 10), jnp.ones((num_clients, n), bool)


def _time(fn, *args, repeats):
  """Median of ``repeats`` calls after a warm-up call."""
  from _timing import time_calls  # pylint: disable=import-outside-toplevel

  return time_calls(fn, *args, repeats=repeats).median


def _worker(args, spec):
  """Runs one configuration in this process and prints a JSON line."""
  import functools  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from ntk_fl import evolve, models, ntk  # pylint: disable=import-outside-toplevel
  from ntk_fl.parallel import for_each_client  # pylint: disable=import-outside-toplevel

  num_clients, solver = spec["clients"], spec["solver"]
  taus = tuple(int(t) for t in args.taus.split(","))
  model = models.mlp()
  keys = jax.random.split(jax.random.key(args.seed + 1), num_clients)
  params = jax.vmap(model.init)(keys)
  x, y, mask = _data(args, num_clients)
  jax.block_until_ready((params, x, y, mask))
  rss_before = _rss_mb()

  one = functools.partial(
    evolve.ntk_update,
    model.apply,
    lr=args.lr,
    taus=taus,
    solver=solver,
    dense_stack=model.dense_stack,
  )
  update = jax.jit(for_each_client(lambda p, xi, yi, mi: one(p, xi, yi, mi)))
  start = time.perf_counter()
  compiled = update.lower(params, x, y, mask).compile()
  compile_s = time.perf_counter() - start
  steady_s = _time(compiled, params, x, y, mask, repeats=args.repeats)
  out = {
    "clients": num_clients,
    "solver": solver,
    "compile_s": compile_s,
    "steady_s": steady_s,
    "rss_mb": _rss_mb(),
    "rss_before_mb": rss_before,
    "tau": jax.device_get(compiled(params, x, y, mask)[1]["tau"]).tolist(),
  }

  if num_clients == 1:  # Where the time goes.
    p0 = jax.tree_util.tree_map(lambda a: a[0], params)
    x0, y0, m0 = x[0], y[0], mask[0]
    kernel_fn = jax.jit(
      lambda p, xi: ntk.empirical_ntk(model.apply, p, xi, dense_stack=model.dense_stack)
    )
    k = jax.block_until_ready(kernel_fn(p0, x0))  # compiles it
    f0 = model.apply(p0, x0)
    evolve_fn = jax.jit(functools.partial(evolve.evolve, lr=args.lr, taus=taus, solver=solver))
    out["kernel_s"] = _time(kernel_fn, p0, x0, repeats=args.repeats)
    out["evolve_s"] = _time(evolve_fn, k, f0, y0, m0, repeats=args.repeats)
  print(json.dumps(out), flush=True)


def _row(r):
  per_client = r["steady_s"] / r["clients"]
  breakdown = (
    f"{r['kernel_s'] * 1e3:.0f} / {r['evolve_s'] * 1e3:.0f} / "
    f"{max(r['steady_s'] - r['kernel_s'] - r['evolve_s'], 0) * 1e3:.0f}"
    if "kernel_s" in r
    else ""
  )
  return (
    f"| {r['solver']} | {r['clients']} | {r['compile_s']:.1f} | {r['steady_s']:.3f} | "
    f"{per_client:.3f} | {breakdown} | {r['rss_mb']:.0f} | "
    f"{r['rss_mb'] - r['rss_before_mb']:.0f} |"
  )


def main(argv=None):
  args = _parse(argv)
  if args.worker is not None:
    _worker(args, json.loads(args.worker))
    return
  specs = [{"clients": int(m), "solver": "euler"} for m in args.clients.split(",")]
  if not args.no_ode:
    specs.append({"clients": 1, "solver": "ode"})
  passthrough = [
    f"--n={args.n}",
    f"--taus={args.taus}",
    f"--lr={args.lr}",
    f"--repeats={args.repeats}",
    f"--data={args.data}",
    f"--seed={args.seed}",
  ]
  import jax  # pylint: disable=import-outside-toplevel

  print(
    f"NTK client update: N={args.n}, MLP 784-100-10, CE, taus={args.taus}, lr={args.lr}, "
    f"data={args.data}, backend={jax.default_backend()}, host CPUs={os.cpu_count()}\n"
  )
  print(
    "| solver | clients | compile s | steady s | s / client | kernel / evolve / rest ms "
    "(1 client) | peak RSS MB | RSS increase MB |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for spec in specs:
    proc = subprocess.run(
      [sys.executable, __file__, *passthrough, "--worker", json.dumps(spec)],
      capture_output=True,
      text=True,
      check=False,
    )
    if proc.returncode != 0:
      print(f"| {spec['solver']} | {spec['clients']} | failed: {proc.stderr.strip()[-300:]} |")
      continue
    print(_row(json.loads(proc.stdout.strip().splitlines()[-1])), flush=True)


if __name__ == "__main__":
  main()
