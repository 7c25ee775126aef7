"""Time the exact top-k selection of compressed Jacobian packages: radix select against the former bisection.

  .venv/bin/python benchmarks/topk_select.py                 # one paper-scale NTK-DFL client's packages
  .venv/bin/python benchmarks/topk_select.py --rows 10       # a quarter of the rows

One client of the paper's compressed NTK-DFL round (App. E.3: ``topk0.5,bits6,subsample,proj200`` on the
200-100-10 MLP, κ = 5) receives ``senders = 6`` packages of ``rows = 40`` sub-sampled samples; each package
tensor of the first layer holds ``rows x 10 x 200 x 100`` = 8 M Jacobian entries, 48 M per client. The
entries are standard normal with a fraction set to exactly zero (a ReLU network's Jacobians hold exact
zeros, which tie at the threshold when fewer than ``k`` entries are nonzero).

Timed, steady state (after a compile call), the best of ``--repeats``:

* ``select`` -- ``compression.top_k_by_key`` on the magnitude keys ``[senders, n]`` of the first layer at
  ``keep`` (radix select, two 16-bit histogram passes, and a blocked tie-break);
* ``compress_packages`` -- the whole package compression of all four tensors (top-k + 6-bit quantisation);

each also with the former selection (a 31-pass bisection on the keys and a running count of the ties over
the row, kept below as ``bisection_top_k_by_key``, the one copy of it: tests/test_compression.py checks the
radix select against it), back to back in one process. The masks are compared: the script fails unless they
are identical.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _timing import time_calls  # noqa: E402

from ntk_fl import compression  # noqa: E402


def bisection_top_k_by_key(keys, k):
  """The former ``top_k_by_key``: the threshold by a 31-pass bisection, ties by a running count over the row."""
  keys = jnp.asarray(keys)
  int_type = keys.dtype
  # One k per row (as the former per-package vmap).
  k = jnp.broadcast_to(jnp.asarray(k), keys.shape[:-1])

  def halve(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    enough = jnp.sum(keys >= mid[..., None], axis=-1) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo = jnp.zeros(keys.shape[:-1], int_type)
  hi = jnp.full(keys.shape[:-1], jnp.iinfo(int_type).max, int_type)
  threshold, _ = jax.lax.fori_loop(0, 8 * keys.dtype.itemsize - 1, halve, (lo, hi))
  above = keys > threshold[..., None]
  ties = keys == threshold[..., None]
  room = k[..., None] - jnp.sum(above, axis=-1, keepdims=True)
  return above | (ties & (jnp.cumsum(ties, axis=-1) <= room))


def _timed(fn, *args, repeats):
  """(best of ``repeats`` calls after the compiling one, the output)."""
  timing = time_calls(fn, *args, repeats=repeats)
  return timing.best, timing.output


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--senders", type=int, default=6)
  parser.add_argument("--rows", type=int, default=40, help="sub-sampled samples per package")
  parser.add_argument("--inputs", type=int, default=200, help="d1' (the projected input width)")
  parser.add_argument("--hidden", type=int, default=100)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--keep", type=float, default=0.5)
  parser.add_argument("--bits", type=int, default=6)
  parser.add_argument("--zeros", type=float, default=0.3, help="fraction of exact zeros")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  rng = np.random.default_rng(0)
  n, c = args.senders * args.rows, args.classes
  shapes = [(args.inputs, args.hidden), (args.hidden,), (args.hidden, c), (c,)]
  leaves = []
  for shape in shapes:
    leaf = rng.standard_normal((n, c) + shape, dtype=np.float32)
    leaf[rng.random(leaf.shape) < args.zeros] = 0
    leaves.append(jnp.asarray(leaf))
  mask = jnp.ones(n, bool)
  sent = jnp.arange(args.senders) > 0  # a client's own package is not transmitted
  first = leaves[0].reshape(args.senders, -1)
  keys = compression.magnitude_key(jnp.abs(first))
  k = compression.num_kept(first.shape[1], args.keep)

  radix = compression.top_k_by_key
  results = {}
  for name, select in (("bisection", bisection_top_k_by_key), ("radix", radix)):
    compression.top_k_by_key = select  # compress_packages looks the selection up when it is traced

    def compress(*leaves):  # a new function per selection: jit caches traces by function
      return compression.compress_packages(
        leaves, mask, args.senders, args.keep, args.bits, sent=sent
      )

    try:
      results[name] = (
        _timed(jax.jit(select), keys, k, repeats=args.repeats),
        _timed(jax.jit(compress), *leaves, repeats=args.repeats),
      )
    finally:
      compression.top_k_by_key = radix
  (sel_old, mask_old), (comp_old, out_old) = results["bisection"]
  (sel_new, mask_new), (comp_new, out_new) = results["radix"]
  np.testing.assert_array_equal(np.asarray(mask_old), np.asarray(mask_new))
  for a, b in zip(out_old, out_new):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  commit = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
  ).stdout.strip()
  print(
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} "
    f"({jax.default_backend()}), commit {commit}; {args.senders} packages x {first.shape[1]:,} entries "
    f"(first layer), keep {args.keep}, {args.bits} bits, {args.zeros:.0%} zeros; masks and packages identical\n"
  )
  print("| stage | bisection (s) | radix (s) | speed-up |")
  print("|---|---|---|---|")
  print(f"| select (first layer) | {sel_old:.3f} | {sel_new:.3f} | {sel_old / sel_new:.2f}x |")
  print(
    f"| compress_packages (all tensors) | {comp_old:.3f} | {comp_new:.3f} | {comp_old / comp_new:.2f}x |"
  )


if __name__ == "__main__":
  main()
