"""Where one NTK-DFL client update's time, FLOPs and bytes go: compressed (App. E.3) against uncompressed.

  .venv/bin/python benchmarks/ntk_dfl_compressed_stages.py --clients 30
  .venv/bin/python benchmarks/ntk_dfl_compressed_stages.py --clients 30 --variant topk0.5,bits6,subsample

Builds the round of ``configs/ntk_dfl.py`` with the variant (default ``compressed``: top-k 0.5, 6 bits,
m2 = 5, d1' = 200) and the uncompressed paper round, takes client 0's inputs of round 0 (its averaged
weights and neighbourhood, as the round hands them to the client update) and jit-compiles every stage of
the client update separately, each on the previous stage's materialised output:

* compressed: Jacobian formation (``per_sample_jacobian``), top-k selection (``top_k_by_key`` of every
  sent package), quantisation, the kernel from the compressed Jacobian (``jacobian_kernel``), the Euler
  evolution, the weight updates from the explicit Jacobian, the τ scoring;
* uncompressed: the structured (matrix-free) kernel, the evolution, the VJP updates and scoring;
* both: the whole client update, and the whole round (all clients, steady state).

``--ab`` times only the whole compressed client update by the routes before 129b874 (``jax.jacrev``
Jacobian, one vmapped scatter per histogram pass) and the current ones, alternately, and checks their
outputs agree bit for bit.

For each stage: steady-state seconds (best of ``--repeats`` after a compile call), XLA's
``cost_analysis()`` FLOPs and bytes accessed, and ``memory_analysis()`` temporaries. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _timing import time_calls  # noqa: E402
from ntk_fl import compression, evolve, jacobians, ntk, runner  # noqa: E402
from ntk_fl.algorithms import ntk_dfl  # noqa: E402
from ntk_fl._src import ntk_step  # noqa: E402
from ntk_fl._src.kernels import dense_stack_jacobian  # noqa: E402


def _config(variant, args):
  from ntk_fl.config import load_config  # pylint: disable=import-outside-toplevel

  config = load_config(
    os.path.join(os.path.dirname(__file__), "..", "configs", "ntk_dfl.py"), variant
  )
  config.data.num_clients = args.clients
  config.topology.degree = args.degree
  config.chunk_size = args.chunk
  config.algorithm.taus = tuple(range(100, args.tau_max + 1, 100))
  return config


def _build(variant, args):
  """``(experiment, core, model)``: the round's core and the (projected) model its client update uses."""
  captured = {}
  make_round, make_update = ntk_dfl.make_neighbourhood_round, ntk_dfl.make_client_update

  def capture_round(*a, **k):
    captured["core"] = make_round(*a, **k)
    return captured["core"]

  def capture_update(model, hparams, **k):
    captured["model"], captured["hparams"] = model, hparams
    captured["slots"] = k.get("neighbourhood_slots")
    return make_update(model, hparams, **k)

  ntk_dfl.make_neighbourhood_round, ntk_dfl.make_client_update = capture_round, capture_update
  try:
    experiment = runner.build_experiment(_config(variant, args))
  finally:
    ntk_dfl.make_neighbourhood_round, ntk_dfl.make_client_update = make_round, make_update
  return experiment, captured


def _client_inputs(experiment, captured, client):
  algorithm = experiment.algorithm
  state = algorithm.init(jax.random.key(experiment.settings.seed))
  inputs = algorithm.round_inputs(0)
  core = captured["core"]
  with experiment.device_policy():
    (stacked, _), _ = jax.jit(
      lambda s, i, d: core.run(s.params, i, d, lambda p, x, t, m, lr: ((p, x, t, m, lr), {}))
    )(state, inputs, core.data)
  return state, inputs, jax.tree.map(lambda a: a[client], stacked)


def _measure(name, fn, *args, repeats):
  compiled = jax.jit(fn).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  memory = compiled.memory_analysis()
  timing = time_calls(compiled, *args, repeats=repeats)  # the first call warms up, untimed here
  row = (
    name,
    timing.best,
    float(cost.get("flops", 0.0)),
    float(cost.get("bytes accessed", 0.0)),
    memory.temp_size_in_bytes if memory is not None else 0,
  )
  print(
    f"  {name}: {row[1]:.3f} s, {row[2] / 1e9:.2f} GFLOP, {row[3] / 1e9:.2f} GB, temp {row[4] / 2**30:.3f} GiB",
    flush=True,
  )
  return row, timing.output


def _evolve_stage(taus):
  """The client's Euler cross-entropy evolution over the τ candidates, as a stage function."""
  return lambda kernel, f0, hard, mask, lr: evolve.evolve(
    kernel, f0, hard, mask, lr=lr, taus=taus, loss="ce", solver="euler"
  )


def _score_stage(model):
  """The τ scoring as a stage function: every candidate network's mean loss on the masked inputs."""
  return lambda params, deltas, xs, hard, mask: jax.vmap(
    lambda d: evolve.mean_loss(model.apply(jax.tree.map(jnp.add, params, d), xs), hard, mask)
  )(deltas)


def _compressed_rows(captured, client_inputs, repeats):
  model, hparams, slots = captured["model"], captured["hparams"], captured["slots"]
  params, x, hard, mask, lr = client_inputs
  x, hard, mask = x[0], hard[0], mask[0]
  keep, bits = float(hparams.sparsify_keep), int(hparams.quantize_bits)
  taus = tuple(hparams.taus)
  rows = []

  def jac_stage(params, x, mask):  # the route the client update takes
    xs = jnp.where(mask[:, None], x, 0)
    jac = None if model.dense_stack is None else dense_stack_jacobian(model.dense_stack, params, xs)
    if jac is None:
      jac = jacobians.per_sample_jacobian(model.apply, params, xs)
    return jax.tree.leaves(jac)

  route = "jacrev per sample" if model.dense_stack is None else "dense-stack factors"
  row, leaves = _measure(
    f"Jacobian formation ({route})", jac_stage, params, x, mask, repeats=repeats
  )
  rows.append(row)
  sent = jnp.arange(slots) > 0
  if keep < 1:
    row, topk_only = _measure(
      "top-k selection (+ padding zeroed)",
      lambda leaves, mask: compression.compress_packages(leaves, mask, slots, keep, 32, sent=sent),
      leaves,
      mask,
      repeats=repeats,
    )
    rows.append(row)
  if bits != compression.FLOAT_BITS:
    row, _ = _measure(
      f"{bits}-bit quantisation (alone, + padding zeroed)",
      lambda leaves, mask: compression.compress_packages(leaves, mask, slots, 1.0, bits, sent=sent),
      leaves,
      mask,
      repeats=repeats,
    )
    rows.append(row)
  row, packed = _measure(
    "package compression, whole (top-k + quantisation)",
    lambda leaves, mask: compression.compress_packages(leaves, mask, slots, keep, bits, sent=sent),
    leaves,
    mask,
    repeats=repeats,
  )
  rows.append(row)
  row, kernel = _measure(
    "kernel from the compressed Jacobian",
    lambda packed: jacobians.jacobian_kernel(list(packed)),
    packed,
    repeats=repeats,
  )
  rows.append(row)
  treedef = jax.tree.structure(params)
  update = (
    "weight updates Jᵀ S_τ from the compressed Jacobian",
    lambda sums, lr, norm, packed: ntk_step.weight_update_from_jacobian(
      jax.tree.unflatten(treedef, list(packed)), sums, lr, norm
    ),
    (packed,),
  )
  xs = jnp.where(mask[:, None], x, 0)
  return rows + _evolve_update_score_rows(
    model, taus, kernel, params, xs, hard, mask, lr, update, repeats
  )


def _uncompressed_rows(captured, client_inputs, repeats):
  model, hparams = captured["model"], captured["hparams"]
  params, x, hard, mask, lr = client_inputs
  x, hard, mask = x[0], hard[0], mask[0]
  taus = tuple(hparams.taus)
  rows = []
  xs = jnp.where(mask[:, None], x, 0)
  row, kernel = _measure(
    "structured kernel (matrix-free)",
    lambda p, xs: ntk.empirical_ntk(model.apply, p, xs, dense_stack=model.dense_stack),
    params,
    xs,
    repeats=repeats,
  )
  rows.append(row)
  update = (
    "weight updates (one VJP, T cotangents)",
    lambda sums, lr, norm, p, xs: ntk_step.weight_update_vjp(model.apply, p, xs, sums, lr, norm),
    (params, xs),
  )
  return rows + _evolve_update_score_rows(
    model, taus, kernel, params, xs, hard, mask, lr, update, repeats
  )


def _evolve_update_score_rows(model, taus, kernel, params, xs, hard, mask, lr, update, repeats):
  """The stages after the kernel, shared by both settings: the Euler evolution from ``kernel``
  ``[N, N]`` (or ``[N, N, C, C]``), the weight updates, the τ scoring. ``update``: ``(label, fn,
  args)``, ``fn(residual_sums, lr, norm, *args)`` giving the T candidate weight updates."""
  label, update_fn, update_args = update
  rows = []
  row, evo = _measure(
    "Euler CE evolution",
    _evolve_stage(taus),
    kernel,
    model.apply(params, xs),
    hard,
    mask,
    lr,
    repeats=repeats,
  )
  rows.append(row)
  norm = jnp.maximum(mask.sum(), 1)
  row, deltas = _measure(
    label, update_fn, evo.residual_sums, lr, norm, *update_args, repeats=repeats
  )
  rows.append(row)
  row, _ = _measure(
    "τ scoring (T candidate networks)",
    _score_stage(model),
    params,
    deltas,
    xs,
    hard,
    mask,
    repeats=repeats,
  )
  rows.append(row)
  return rows


def _whole(experiment, client_fn, client_inputs, state, inputs, repeats, whole_round):
  rows = []
  row, _ = _measure("**whole client update**", client_fn, *client_inputs, repeats=repeats)
  rows.append(row)
  if whole_round:
    with experiment.device_policy():
      row, _ = _measure(
        f"**whole round, all clients** ({experiment.federation.mask.shape[0]})",
        lambda s, i: experiment.algorithm.step(s, i),
        state,
        inputs,
        repeats=1,
      )
    rows.append(row)
  return rows


def _former_histogram(rows, shift, width, prefix):
  """The radix select's histogram pass before 129b874: one vmapped scatter over whole rows."""
  bins = 1 << width
  digit = ((rows >> shift) & (bins - 1)).astype(jnp.int32)
  match = rows >= 0
  if prefix is not None:
    match = match & ((rows >> (shift + width)) == prefix[:, None])
  scatter = lambda d: jnp.zeros(bins, jnp.int32).at[d].add(1, mode="drop")
  return jax.vmap(scatter)(jnp.where(match, digit, bins))


def _ab(args):
  """The whole compressed client update by the former routes (``jacrev`` Jacobian, whole-row histogram)
  and the current ones, compiled once each and called alternately; checks that they agree bit for bit."""
  experiment, captured = _build(args.variant, args)
  _, _, client_inputs = _client_inputs(experiment, captured, args.client)
  current = (compression._digit_histogram, ntk_dfl.dense_stack_jacobian)
  former = (_former_histogram, lambda *a: None)
  compiled = {}
  for name, (histogram, jacobian) in (("former", former), ("current", current)):
    compression._digit_histogram, ntk_dfl.dense_stack_jacobian = histogram, jacobian
    fn = ntk_dfl.make_client_update(
      captured["model"], captured["hparams"], neighbourhood_slots=captured["slots"]
    )
    compiled[name] = jax.jit(fn).lower(*client_inputs).compile()
  compression._digit_histogram, ntk_dfl.dense_stack_jacobian = current
  times, outputs = {name: [] for name in compiled}, {}
  for _ in range(args.repeats):
    for name, fn in compiled.items():
      outputs[name] = jax.block_until_ready(fn(*client_inputs))
      start = time.perf_counter()
      jax.block_until_ready(fn(*client_inputs))
      times[name].append(time.perf_counter() - start)
  same = all(
    bool(
      jnp.all(
        jax.lax.bitcast_convert_type(a, jnp.int32) == jax.lax.bitcast_convert_type(b, jnp.int32)
      )
    )
    for a, b in zip(jax.tree.leaves(outputs["former"]), jax.tree.leaves(outputs["current"]))
  )
  for name, seconds in times.items():
    print(f"{name}: " + " / ".join(f"{t:.2f}" for t in seconds) + " s")
  print(f"bit-identical: {same}")


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--clients", type=int, default=30)
  parser.add_argument("--degree", type=int, default=5)
  parser.add_argument("--chunk", type=int, default=1)
  parser.add_argument("--tau-max", type=int, default=800)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--variant", default="compressed")
  parser.add_argument("--client", type=int, default=0)
  parser.add_argument("--skip-uncompressed", action="store_true")
  parser.add_argument("--skip-round", action="store_true", help="do not time the whole rounds")
  parser.add_argument(
    "--ab", action="store_true", help="only the whole client update, former routes against current"
  )
  args = parser.parse_args()
  if args.ab:
    return _ab(args)

  tables = []
  settings = [(args.variant, _compressed_rows)]
  if not args.skip_uncompressed:
    settings.append(("", _uncompressed_rows))
  for variant, stage_rows in settings:
    print(f"ntk_dfl:{variant or 'paper'}", flush=True)
    experiment, captured = _build(variant, args)
    state, inputs, client_inputs = _client_inputs(experiment, captured, args.client)
    rows = stage_rows(captured, client_inputs, args.repeats)
    client_fn = ntk_dfl.make_client_update(
      captured["model"], captured["hparams"], neighbourhood_slots=captured["slots"]
    )
    rows += _whole(
      experiment, client_fn, client_inputs, state, inputs, args.repeats, not args.skip_round
    )
    n = client_inputs[1].shape[-2]
    tables.append((variant or "paper", n, rows))
    del experiment, captured, state, inputs, client_inputs

  peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(
    f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}; "
    f"{args.clients} clients, κ={args.degree}, τ ≤ {args.tau_max}, chunk {args.chunk}; peak RSS {peak_mb:.0f} MB"
  )
  for variant, n, rows in tables:
    print(f"\nntk_dfl:{variant}, client {args.client}, N = {n} per neighbourhood\n")
    print("| stage | s | GFLOP | GB accessed | temp GiB |\n|---|---:|---:|---:|---:|")
    for name, seconds, flops, nbytes, temp in rows:
      print(
        f"| {name} | {seconds:.3f} | {flops / 1e9:.2f} | {nbytes / 1e9:.2f} | {temp / 2**30:.3f} |"
      )


if __name__ == "__main__":
  main()
