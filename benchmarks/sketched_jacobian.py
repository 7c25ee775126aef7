"""Timing of SPARK's flattened Jacobian sketch ``J̃ = J P`` on the papers' 784-100-10 MLP.

    python benchmarks/sketched_jacobian.py                       # N in 40 240, k_proj = 10,000
    python benchmarks/sketched_jacobian.py --sizes 240 1200 --reps 3

One neighbourhood's sketched Jacobian ``[N, C, d_proj]`` (the flattened scheme
sketches only ``dense_0``'s 78,400-entry kernel at ``k_proj = 10,000``; the
other tensors are smaller than the cap and stay as they are), two ways:

* ``lifted``: per-sample ``jacrev`` of the lifted network ``g(u) = f(w̄ + P u)``
  (``projected_kernel='generic'``): every one of the ``N·C`` output rows is
  pulled back through ``P``, ``2·N·C·78,400·10,000`` FLOPs;
* ``factored``: :func:`ntk_fl.projection.sketched_dense_jacobian`, which
  contracts each sample's layer input with ``P`` first,
  ``2·N·78,400·10,000`` FLOPs, ``C = 10`` times fewer.

``N = 240`` is one neighbourhood of the full compression stack (a clique of 6
clients × 200 samples / sub-sampling 5); ``N = 1200`` one κ = 5 neighbourhood
without sub-sampling (``flat10000``). Prints a markdown table: median wall time
of ``--reps`` runs after compilation, the FLOP count and the achieved GFLOP/s,
and the largest difference between the two results (they must agree).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _timing import time_calls

from ntk_fl import models, projection

METHODS = ("factored", "lifted")


def flops(
  method: str, n: int, *, num_classes: int = 10, size: int = 784 * 100, k_proj: int = 10_000
) -> float:
  """FLOPs (2 per multiply-add) of the flattened sketch of ``dense_0``'s kernel for ``n`` samples."""
  per_row = 2 * size * k_proj
  return n * per_row * (num_classes if method == "lifted" else 1)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--sizes", type=int, nargs="+", default=[40, 240])
  parser.add_argument("--k-proj", type=int, default=10_000)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  args = parser.parse_args(argv)

  model = models.mlp(input_dim=784, hidden=(100,), num_classes=10)
  params = model.init(jax.random.key(0))
  plan = projection.make_plan(params, "flattened", args.k_proj)
  mats = projection.sample_matrices(plan, seed=0)

  @jax.jit
  def factored(params, mats, x):
    return projection.sketched_dense_jacobian(plan, mats, model.dense_stack, params, x)

  @jax.jit
  def lifted(params, mats, x):
    g, u0 = projection.lift(model.apply, params, plan, mats)
    one = lambda xi: jax.jacrev(lambda u: g(u, xi[None])[0])(u0)
    return jax.lax.map(
      one, x, batch_size=8
    )  # 8 samples at a time: the [8, C, ...] cotangents stay small

  fns = {"factored": factored, "lifted": lifted}
  print(f"devices: {jax.devices()}")
  print("| N | method | time (s) | GFLOP | GFLOP/s | max abs diff vs factored |")
  print("|---|---|---|---|---|---|")
  for n in args.sizes:
    x = jax.random.normal(jax.random.key(n), (n, 784))
    reference = None
    for method in args.methods:
      # A warm-up call (the compile happened in lower().compile()), then the median of reps.
      seconds = time_calls(fns[method], params, mats, x, repeats=args.reps).median
      out = fns[method](params, mats, x)
      if method == "factored":
        reference, diff = out, 0.0
      else:
        diff = (
          max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(out), reference))
          if reference is not None
          else float("nan")
        )
      gflop = flops(method, n, k_proj=args.k_proj) / 1e9
      print(
        f"| {n} | {method} | {seconds:.2f} | {gflop:.0f} | {gflop / seconds:.1f} | {diff:.1e} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
