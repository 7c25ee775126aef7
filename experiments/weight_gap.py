"""NTK-FL Fig. 9 (App. C): how far NTK evolution's weights drift from true gradient descent as t grows.

Usage::

  python experiments/weight_gap.py [--out runs/weight_gap] [--config ntk_fl] [--seed 0]
      [--round 0] [--t_max 2000] [--every 100] [--max_samples 0]

One NTK-FL round of ``--config`` (default ``configs/ntk_fl.py``: Fashion-MNIST, α = 0.1, 300
clients, 20 a round, MLP 784-100-10, η = 0.01, cross-entropy): the pooled data of round ``--round``'s
participants (the run's own draw, N ≈ 4,000 samples; ``--max_samples`` keeps the first that many) at
the seed's initial weights ``w0``, exactly what the server evolves in that round of a run. From ``w0``,
three weight trajectories, read at ``t = every, 2·every, ..., t_max``:

* ``gd`` -- eq. (24), ``w̃(t)``: ``t`` steps of full-batch gradient descent with step η on the
  network's mean cross-entropy;
* ``linearised`` -- eq. (23), ``w(t)``: ``t`` steps of gradient descent on the network linearised at
  ``w0``, ``f(w0) + J(w0)(w − w0)``: NTK dynamics under the exact kernel ``J Jᵀ``, one JVP and one VJP a
  step, no kernel formed;
* ``ntk_fl`` -- NTK-FL as the library runs it: the output-traced kernel's function-space evolution
  (:func:`ntk_fl.evolve.evolve`) and one VJP (:func:`ntk_fl.evolve.weight_update_vjp`).

At ``t = 1`` all three weights are equal (one gradient step at ``w0``); after it, ``linearised`` differs
from ``gd`` by the network's non-linearity alone (the paper's gap, Lemma 2), ``ntk_fl`` also by the
trace over outputs. Reported per ``t``: ``‖w(t) − w̃(t)‖₁`` (the paper's axis), the same relative to
``‖w̃(t) − w0‖₁``, and each weight's training loss (the network's mean cross-entropy on the pooled data).
The paper's analytic curve (Lemma 2's bound, ``Σ_u γ^(k,u)`` "with the coefficient set to 2") is not
drawn: it belongs to the theory's two-layer network with a fixed second layer, unit-norm inputs and one
output, not this network.

Writes ``weight_gap.json`` (settings and one row per ``t``), ``weight_gap.md`` (the table) and
``weight_gap.png`` (the gaps against ``t``) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ntk_fl import evolve, ntk, runner  # noqa: E402
from ntk_fl.config import load_config  # noqa: E402
from ntk_fl.reproduce import scripted  # noqa: E402


def pooled_round(config, round_index: int, max_samples: int):
  """The model, ``w0`` and round ``round_index``'s pooled data ``(x [N, ...], y [N, C])`` of a run of
  ``config`` (its participants' samples, padding dropped)."""
  exp = runner.build_experiment(config)
  params = exp.algorithm.init(jax.random.key(config.seed)).params
  clients = np.asarray(exp.algorithm.round_inputs(round_index).clients)
  fed = exp.federation
  x, y = fed.samples(np.asarray(fed.index)[clients])
  mask = np.asarray(fed.mask)[clients].astype(bool)
  x, y = np.asarray(x)[mask], np.asarray(y)[mask]
  if max_samples:
    x, y = x[:max_samples], y[:max_samples]
  x = jnp.asarray(x)
  classes = exp.model.apply(params, x[:1]).shape[-1]
  return exp.model, params, x, jax.nn.one_hot(jnp.asarray(y), classes), clients


def _loss(apply_fn, params, x, y):
  return evolve.mean_loss(apply_fn(params, x), y, jnp.ones(x.shape[0], bool))


def gd_trajectory(apply_fn, params, x, y, lr: float, taus: tuple[int, ...]):
  """``w̃(t)`` at every ``t`` of ``taus``: full-batch gradient descent on the network, stacked ``[T]``."""
  grad = jax.jit(jax.grad(lambda p: _loss(apply_fn, p, x, y)))
  return _read_out(lambda p: jax.tree.map(lambda w, g: w - lr * g, p, grad(p)), params, taus)


def linearised_trajectory(apply_fn, params, x, y, lr: float, taus: tuple[int, ...]):
  """``w(t)`` at every ``t`` of ``taus``: gradient descent on the network linearised at ``params``."""
  f0, jvp = jax.linearize(lambda p: apply_fn(p, x), params)
  vjp = jax.linear_transpose(jvp, params)
  n = x.shape[0]

  @jax.jit
  def step(p):
    delta = jax.tree.map(jnp.subtract, p, params)
    logits = f0 + jvp(delta)
    (g,) = vjp((jax.nn.softmax(logits) - y) / n)
    return jax.tree.map(lambda w, gw: w - lr * gw, p, g)

  return _read_out(step, params, taus)


def _read_out(step, params, taus: tuple[int, ...]):
  """Applies ``step`` ``max(taus)`` times from ``params``; the weights after each ``t`` of ``taus``."""
  out, p, done = [], params, 0
  for t in taus:
    for _ in range(t - done):
      p = step(p)
    done = t
    out.append(p)
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *out)


def ntk_fl_trajectory(apply_fn, params, x, y, lr: float, taus: tuple[int, ...], dense_stack=None):
  """NTK-FL's weights at every ``t`` of ``taus``: the traced kernel's evolution and one VJP."""
  kernel = ntk.empirical_ntk(apply_fn, params, x, trace_outputs=True, dense_stack=dense_stack)
  mask = jnp.ones(x.shape[0], bool)
  evolution = evolve.evolve(kernel, apply_fn(params, x), y, mask, lr=lr, taus=taus)
  deltas = evolve.weight_update_vjp(apply_fn, params, x, evolution.residual_sums, lr, x.shape[0])
  return jax.tree.map(lambda w, d: w[None] + d, params, deltas)


def gap_rows(apply_fn, params, x, y, taus, trajectories: dict) -> list[dict]:
  """One row per ``t``: each trajectory's training loss, and the L1 gaps to ``gd``."""
  flat = {name: jax.vmap(lambda p: ravel_pytree(p)[0])(w) for name, w in trajectories.items()}
  w0 = ravel_pytree(params)[0]
  rows = []
  for i, t in enumerate(taus):
    moved = float(jnp.abs(flat["gd"][i] - w0).sum())
    row = {"t": int(t), "gd_moved_l1": moved}
    for name, w in trajectories.items():
      row[f"{name}_loss"] = float(_loss(apply_fn, jax.tree.map(lambda a: a[i], w), x, y))
      if name != "gd":
        gap = float(jnp.abs(flat[name][i] - flat["gd"][i]).sum())
        row[f"{name}_gap_l1"] = gap
        row[f"{name}_gap_relative"] = gap / moved if moved else float("nan")
    rows.append(row)
  return rows


def markdown(result: dict) -> str:
  s = result["settings"]
  lines = [
    f"{s['config']}, seed {s['seed']}, round {s['round']}: {s['samples']} pooled samples of "
    f"{len(s['clients'])} participants, η = {s['lr']}, {s['parameters']:,} parameters.",
    "",
    "| t | ‖w(t) − w̃(t)‖₁ linearised (eq. 23) | relative | NTK-FL (traced kernel) | relative "
    "| ‖w̃(t) − w0‖₁ | loss GD | loss linearised | loss NTK-FL |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["rows"]:
    lines.append(
      f"| {r['t']} | {r['linearised_gap_l1']:.4g} | {r['linearised_gap_relative']:.3f} | "
      f"{r['ntk_fl_gap_l1']:.4g} | {r['ntk_fl_gap_relative']:.3f} | {r['gd_moved_l1']:.4g} | "
      f"{r['gd_loss']:.4f} | {r['linearised_loss']:.4f} | {r['ntk_fl_loss']:.4f} |"
    )
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  t = [r["t"] for r in result["rows"]]
  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
  for name, label in (("linearised", "linearised (eq. 23)"), ("ntk_fl", "NTK-FL, traced kernel")):
    left.plot(t, [r[f"{name}_gap_l1"] for r in result["rows"]], "o-", ms=3, label=label)
    right.plot(t, [r[f"{name}_gap_relative"] for r in result["rows"]], "o-", ms=3, label=label)
  left.set_ylabel("‖w(t) − w̃(t)‖₁")
  right.set_ylabel("‖w(t) − w̃(t)‖₁ / ‖w̃(t) − w0‖₁")
  for ax in (left, right):
    ax.set_xlabel("update steps t")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("NTK weights against gradient descent (NTK-FL Fig. 9)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)


def main(argv=None) -> None:
  # argparse, not absl flags: tests import this module next to other scripts that define absl flags.
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", default="runs/weight_gap", help="folder receiving the outputs")
  parser.add_argument("--config", default="ntk_fl", help="a packaged config (with :variants)")
  parser.add_argument("--seed", type=int, default=0, help="the run seed (weights, participants)")
  parser.add_argument("--round", type=int, default=0, help="the round whose participants pool")
  parser.add_argument("--t_max", type=int, default=2000, help="the last step read out")
  parser.add_argument("--every", type=int, default=100, help="read out every this many steps")
  parser.add_argument(
    "--max_samples", type=int, default=0, help="keep the first this many pooled samples (0: all)"
  )
  args = parser.parse_args(argv)
  for name in ("t_max", "every"):
    if getattr(args, name) < 1:
      sys.exit(f"error: --{name} must be a positive integer, got {getattr(args, name)}")
  if args.t_max % args.every:
    sys.exit(f"error: --t_max ({args.t_max}) must be a multiple of --every ({args.every})")
  if args.max_samples < 0 or args.round < 0:
    sys.exit("error: --max_samples and --round must be >= 0")
  file_part, _, variants = args.config.partition(":")
  try:
    config = load_config(file_part, variants or None)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: --config {args.config!r}: {e}")
  if config.method not in ("ntk_fl", "cp_ntk_fl") or config.algorithm.loss != "ce":
    sys.exit(
      f"error: --config {args.config!r} is {config.method} with loss {config.algorithm.get('loss')}; "
      "the gap is measured for NTK-FL's cross-entropy evolution (ntk_fl, cp_ntk_fl)"
    )
  config.seed = args.seed
  taus = tuple(range(args.every, args.t_max + 1, args.every))
  start = time.perf_counter()
  model, params, x, y, clients = pooled_round(config, args.round, args.max_samples)
  lr = float(config.algorithm.lr)
  trajectories = {
    "gd": gd_trajectory(model.apply, params, x, y, lr, taus),
    "linearised": linearised_trajectory(model.apply, params, x, y, lr, taus),
    "ntk_fl": ntk_fl_trajectory(
      model.apply, params, x, y, lr, taus, dense_stack=getattr(model, "dense_stack", None)
    ),
  }
  result = {
    "settings": {
      "config": args.config,
      "seed": args.seed,
      "round": args.round,
      "clients": clients.tolist(),
      "samples": int(x.shape[0]),
      "lr": lr,
      "parameters": int(ravel_pytree(params)[0].size),
      "taus": list(taus),
    },
    "rows": gap_rows(model.apply, params, x, y, taus, trajectories),
    "seconds": round(time.perf_counter() - start, 1),
  }
  scripted.write_result(args.out, "weight_gap", result, markdown(result))
  plot(result, os.path.join(args.out, "weight_gap.png"))
  print(markdown(result))


if __name__ == "__main__":
  main()
